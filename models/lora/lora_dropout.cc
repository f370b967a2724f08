#include "models/lora/lora_dropout.h"

#include <cmath>

namespace kiln::models {
namespace {

constexpr int64_t kA1 = 48271, kC1 = 12345, kA2 = 69621, kC2 = 54321;

int64_t Threshold(double p) { return std::llround(p * static_cast<double>(kDropoutModulus)); }

}  // namespace

int64_t LoraDropoutStepSeed(uint64_t seed, int64_t step, int64_t micro_batch) {
  // splitmix64's finaliser over the three numbers: nearby steps get unrelated seeds.
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(step) * 0xBF58476D1CE4E5B9ull +
               static_cast<uint64_t>(micro_batch) * 0x94D049BB133111EBull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<int64_t>(z % static_cast<uint64_t>(kDropoutModulus));
}

int64_t LoraDropoutModuleId(std::string_view stem) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char c : stem) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return static_cast<int64_t>(h % static_cast<uint64_t>(kDropoutModulus));
}

bool LoraDropoutKeep(int64_t step_seed, int64_t module_id, int64_t n, double p) {
  const int64_t P = kDropoutModulus;
  const int64_t s = (step_seed + module_id) % P;
  const int64_t h1 = ((n % P) * kA1 + s) % P;
  const int64_t h2 = (h1 * h1 + kC1) % P;
  const int64_t h3 = (h2 * kA2 + s) % P;
  const int64_t h4 = (h3 * h3 + kC2) % P;
  return h4 >= Threshold(p);
}

Expr LoraDropoutMaskExpr(const Expr& step_seed, int64_t module_id, const Expr& n, double p) {
  const Expr P = Expr::Int(kDropoutModulus);
  const Expr s = Mod(step_seed + Expr::Int(module_id), P);
  const Expr h1 = Mod(Mod(n, P) * Expr::Int(kA1) + s, P);
  const Expr h2 = Mod(h1 * h1 + Expr::Int(kC1), P);
  const Expr h3 = Mod(h2 * Expr::Int(kA2) + s, P);
  const Expr h4 = Mod(h3 * h3 + Expr::Int(kC2), P);
  return Select(Ge(h4, Expr::Int(Threshold(p))), Expr::Const(1.0 / (1.0 - p)), Expr::Const(0.0));
}

}  // namespace kiln::models
