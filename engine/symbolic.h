// Symbolic dimensions: sizes that are known only when a compiled Program runs.
//
// A graph declares symbols (e.g. `T`, tokens in the step; `S`, sequences), each with a range
// [min, max]. A Dim is an integer polynomial over those symbols — `T`, `4096`, `T*32`,
// `T - 1`, `T*T` — kept in a canonical form, so equal sizes compare equal however they were
// written (`T*H == H*T`). The memory planner sizes buffers at the symbols' upper bounds and a
// Program evaluates every Dim once per run from the bound symbol values.
//
// Value type; thread-compatible.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"

namespace kiln {

// Symbols per graph are indexed 0..kMaxSymbols-1.
inline constexpr int kMaxSymbols = 8;

class Dim {
 public:
  Dim() = default;  // the constant 0
  // Implicit on purpose: shapes read naturally as {T, 4096}.
  Dim(int64_t c);                               // NOLINT(google-explicit-constructor)
  Dim(int c) : Dim(static_cast<int64_t>(c)) {}  // NOLINT(google-explicit-constructor)
  static Dim Symbol(int index);

  bool is_constant() const { return terms_.empty() || (terms_.size() == 1 && terms_[0].mono == 0); }
  // REQUIRES: is_constant().
  int64_t constant() const;
  // The constant if is_constant(), else nullopt.
  std::optional<int64_t> TryConstant() const;
  bool DependsOn(int symbol) const;
  // Bit i set if symbol i appears.
  uint32_t SymbolMask() const;

  // Evaluates at `values[i]` for symbol i. REQUIRES: values covers every symbol used.
  int64_t Eval(std::span<const int64_t> values) const;
  // True if every non-constant term has a non-negative coefficient: the value then never
  // decreases as a symbol grows (for symbol values >= 0), so evaluating at the symbols' upper
  // bounds gives an upper bound. Buffer sizes must be monotone.
  bool IsMonotone() const;

  // Exact division: `*this / d` if every coefficient divides evenly and `d` is a single term
  // (e.g. (T*H*64) / (H*64) = T). Otherwise nullopt.
  std::optional<Dim> DivExact(const Dim& d) const;

  // "T", "4096", "2*T + 1", "T*S", "T^2"; `names[i]` names symbol i (missing: "s<i>").
  std::string ToString(std::span<const std::string> names = {}) const;

  friend Dim operator+(const Dim& a, const Dim& b);
  friend Dim operator-(const Dim& a, const Dim& b);
  friend Dim operator*(const Dim& a, const Dim& b);
  friend Dim operator-(const Dim& a);
  Dim& operator+=(const Dim& b) { return *this = *this + b; }
  Dim& operator*=(const Dim& b) { return *this = *this * b; }
  friend bool operator==(const Dim& a, const Dim& b);
  friend bool operator!=(const Dim& a, const Dim& b) { return !(a == b); }

  template <typename H>
  friend H AbslHashValue(H h, const Dim& d) {
    for (const Term& t : d.terms_) h = H::combine(std::move(h), t.mono, t.coef);
    return H::combine(std::move(h), d.terms_.size());
  }

 private:
  // A monomial packs one 8-bit exponent per symbol; terms are sorted by monomial and never
  // have a zero coefficient (the constant 0 has no terms).
  struct Term {
    uint64_t mono;
    int64_t coef;
  };
  absl::InlinedVector<Term, 1> terms_;
};

using SymShape = std::vector<Dim>;

// Product of the dims (1 for rank 0).
Dim NumElements(const SymShape& shape);
// "[T,4096]"
std::string ShapeString(const SymShape& shape, std::span<const std::string> names = {});
// Evaluates every dim. REQUIRES: values covers every symbol used.
std::vector<int64_t> EvalShape(const SymShape& shape, std::span<const int64_t> values);

}  // namespace kiln
