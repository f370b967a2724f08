// Structured output's host-side cost on SmolLM2's real vocabulary (49,152 tokens): compiling
// each test constraint, building the vocabulary trie, the first masks, and the per-token work
// of a generation (mask + advance) cold and with the masks cached. The serving ITL with and
// without a schema is tests/bench/structured_output_bench.py; this says where the time goes.
//
//   build/tests/bench/grammar_bench [--tokens 200] [--walks 20]
// Needs the default model (scripts/fetch-default-model.sh) or KILN_MODELS_DIR.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "models/gguf/gguf.h"
#include "models/grammar/constraint.h"
#include "models/grammar/token_mask.h"
#include "models/tokenizer/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;
using kiln::grammar::Constraint;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// The benchmark's nested schema: objects in objects, an array of objects, enums, integer and
// number ranges, string lengths, a pattern and an optional property.
constexpr const char* kNestedSchema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
    "address": {
      "type": "object",
      "properties": {
        "street": {"type": "string"},
        "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}
      },
      "required": ["street", "city"],
      "additionalProperties": false
    },
    "orders": {
      "type": "array",
      "items": {
        "type": "object",
        "properties": {
          "id": {"type": "integer"},
          "status": {"enum": ["open", "shipped", "delivered"]},
          "total": {"type": "number", "minimum": 0}
        },
        "required": ["id", "status", "total"],
        "additionalProperties": false
      },
      "maxItems": 5
    },
    "vip": {"type": "boolean"}
  },
  "required": ["name", "age", "address", "orders"],
  "additionalProperties": false
})";

struct Case {
  const char* name;
  Constraint constraint;
};

}  // namespace

int main(int argc, char** argv) {
  int tokens = 200, walks = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--tokens") tokens = std::atoi(argv[i + 1]);
    if (a == "--walks") walks = std::atoi(argv[i + 1]);
  }
  const char* dir = std::getenv("KILN_MODELS_DIR");
  const std::string path =
      std::string(dir ? dir : ".kiln/models") + "/SmolLM2-135M-Instruct.Q4_1.gguf";
  auto gguf = kiln::models::GgufFile::Open(path);
  if (!gguf.ok()) {
    std::fprintf(stderr, "%s (run scripts/fetch-default-model.sh)\n",
                 std::string(kiln::StatusMessage(gguf.status())).c_str());
    return 1;
  }
  auto tok = kiln::models::Tokenizer::FromGguf(**gguf);
  if (!tok.ok()) return 1;
  const kiln::models::Tokenizer& t = **tok;

  auto t0 = Clock::now();
  const int32_t n = t.vocab_size();
  std::vector<std::string> bytes(n);
  std::vector<bool> never(n);
  for (int32_t i = 0; i < n; ++i) {
    bytes[i] = std::string(t.TokenBytes(i));
    never[i] = t.IsSpecial(i);
  }
  auto vocab = std::make_shared<const kiln::grammar::TokenVocabulary>(
      std::move(bytes), never, std::vector<int32_t>{t.eos_id()});
  std::printf("vocabulary: %d tokens, trie built in %.1f ms\n\n", n, Ms(t0, Clock::now()));

  const Case cases[] = {
      {"nested JSON schema", {Constraint::Kind::kJsonSchema, kNestedSchema, true}},
      {"json_object", {Constraint::Kind::kJsonObject, "", false}},
      {"regex (ISO date + time)",
       {Constraint::Kind::kRegex, "[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z", false}},
      {"GBNF arithmetic",
       {Constraint::Kind::kGbnf,
        "root ::= expr\nexpr ::= term ([-+*/] term)*\nterm ::= [0-9]+ | \"(\" expr \")\"", false}},
  };
  std::printf("%-26s %10s %9s %11s %12s %12s %12s %7s %7s %9s\n", "constraint", "compile ms",
              "mask0 ms", "precomp ms", "cold us/tok", "warm us/tok", "warm p99 us", "states",
              "masks", "ms/mask");
  for (const Case& c : cases) {
    auto a = Clock::now();
    auto g = kiln::grammar::CompileConstraint(c.constraint);
    auto b = Clock::now();
    if (!g.ok()) {
      std::printf("%-26s failed: %s\n", c.name,
                  std::string(kiln::StatusMessage(g.status())).c_str());
      continue;
    }
    auto tg = std::make_shared<kiln::grammar::TokenGrammar>(*g, vocab);
    auto c0 = Clock::now();
    (void)tg->Mask(tg->initial_state());
    auto c1 = Clock::now();
    // A fresh grammar for the precompute figure (the one above has its first mask cached).
    auto tg2 = std::make_shared<kiln::grammar::TokenGrammar>(*g, vocab);
    auto p0 = Clock::now();
    (void)tg2->Precompute(3, 64);
    auto p1 = Clock::now();

    // Random walks: pick uniformly among allowed tokens, preferring to finish after `tokens`.
    std::vector<double> cold, warm;
    std::vector<uint32_t> mask(vocab->words());
    for (int w = 0; w < walks; ++w) {
      std::mt19937 rng(1000 + w % 4);  // walks repeat seeds: later ones revisit states (warm)
      kiln::grammar::TokenMatcher m(tg);
      for (int k = 0; k < tokens; ++k) {
        const auto s0 = Clock::now();
        if (!m.FillMask(mask).ok()) break;
        const auto s1 = Clock::now();
        std::vector<int32_t> allowed;
        for (int32_t i = 0; i < vocab->size(); ++i) {
          if ((mask[i >> 5] >> (i & 31)) & 1u) allowed.push_back(i);
        }
        if (allowed.empty()) break;
        const int32_t pick = allowed[rng() % allowed.size()];
        const auto s2 = Clock::now();
        if (!m.Accept(pick).ok() || m.complete() || m.ended()) break;
        const double us =
            std::chrono::duration<double, std::micro>((s1 - s0) + (Clock::now() - s2)).count();
        (w < 4 ? cold : warm).push_back(us);
      }
    }
    auto mean = [](const std::vector<double>& v) {
      double s = 0;
      for (double x : v) s += x;
      return v.empty() ? 0.0 : s / static_cast<double>(v.size());
    };
    std::sort(warm.begin(), warm.end());
    const double p99 = warm.empty() ? 0.0 : warm[static_cast<size_t>(0.99 * (warm.size() - 1))];
    const auto st = tg->stats();
    std::printf("%-26s %10.2f %9.2f %11.1f %12.1f %12.1f %12.1f %7lld %7lld %9.2f\n", c.name,
                Ms(a, b), Ms(c0, c1), Ms(p0, p1), mean(cold), mean(warm), p99,
                static_cast<long long>(st.states), static_cast<long long>(st.masks),
                st.masks ? 1e3 * st.mask_seconds / static_cast<double>(st.masks) : 0.0);
  }
  std::printf(
      "\ncold: the first walks (masks computed as states are first reached); warm: walks that\n"
      "revisit them. us/tok: the mask (a cached one is copied) and the matcher's advance.\n"
      "ms/mask: the mean time to compute one state's mask over the whole vocabulary.\n");
  return 0;
}
