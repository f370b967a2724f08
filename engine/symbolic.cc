#include "engine/symbolic.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "engine/base/status.h"

namespace kiln {
namespace {

int Exponent(uint64_t mono, int sym) { return static_cast<int>((mono >> (8 * sym)) & 0xFF); }

}  // namespace

Dim::Dim(int64_t c) {
  if (c != 0) terms_.push_back({0, c});
}

Dim Dim::Symbol(int index) {
  KILN_CHECK(index >= 0 && index < kMaxSymbols, "symbol index out of range");
  Dim d;
  d.terms_.push_back({uint64_t{1} << (8 * index), 1});
  return d;
}

int64_t Dim::constant() const {
  KILN_CHECK(is_constant(), "Dim::constant() on a symbolic dim");
  return terms_.empty() ? 0 : terms_[0].coef;
}

std::optional<int64_t> Dim::TryConstant() const {
  if (!is_constant()) return std::nullopt;
  return constant();
}

bool Dim::DependsOn(int symbol) const { return (SymbolMask() >> symbol) & 1; }

uint32_t Dim::SymbolMask() const {
  uint32_t mask = 0;
  for (const Term& t : terms_) {
    for (int s = 0; s < kMaxSymbols; ++s) {
      if (Exponent(t.mono, s)) mask |= 1u << s;
    }
  }
  return mask;
}

int64_t Dim::Eval(std::span<const int64_t> values) const {
  int64_t sum = 0;
  for (const Term& t : terms_) {
    int64_t v = t.coef;
    for (uint64_t m = t.mono, s = 0; m != 0; m >>= 8, ++s) {
      for (int e = static_cast<int>(m & 0xFF); e > 0; --e) {
        KILN_CHECK(s < values.size(), "Dim::Eval: symbol without a value");
        v *= values[s];
      }
    }
    sum += v;
  }
  return sum;
}

bool Dim::IsMonotone() const {
  for (const Term& t : terms_) {
    if (t.mono != 0 && t.coef < 0) return false;
  }
  return true;
}

std::optional<Dim> Dim::DivExact(const Dim& d) const {
  if (d.terms_.size() != 1) return std::nullopt;
  const Term& q = d.terms_[0];
  Dim r;
  for (const Term& t : terms_) {
    if (t.coef % q.coef != 0) return std::nullopt;
    uint64_t mono = 0;
    for (int s = 0; s < kMaxSymbols; ++s) {
      const int e = Exponent(t.mono, s) - Exponent(q.mono, s);
      if (e < 0) return std::nullopt;
      mono |= static_cast<uint64_t>(e) << (8 * s);
    }
    r.terms_.push_back({mono, t.coef / q.coef});
  }
  // Division by one monomial keeps distinct monomials distinct and order preserved.
  return r;
}

std::string Dim::ToString(std::span<const std::string> names) const {
  if (terms_.empty()) return "0";
  std::string out;
  // Highest-degree terms first reads naturally ("2*T + 1").
  std::vector<const Term*> order;
  for (const Term& t : terms_) order.push_back(&t);
  auto degree = [](uint64_t mono) {
    int d = 0;
    for (int s = 0; s < kMaxSymbols; ++s) d += Exponent(mono, s);
    return d;
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](const Term* a, const Term* b) { return degree(a->mono) > degree(b->mono); });
  for (const Term* it : order) {
    int64_t c = it->coef;
    if (!out.empty()) {
      absl::StrAppend(&out, c < 0 ? " - " : " + ");
      c = c < 0 ? -c : c;
    }
    std::string mono;
    for (int s = 0; s < kMaxSymbols; ++s) {
      const int e = Exponent(it->mono, s);
      if (e == 0) continue;
      if (!mono.empty()) mono += "*";
      mono += s < static_cast<int>(names.size()) ? names[s] : absl::StrCat("s", s);
      if (e > 1) absl::StrAppend(&mono, "^", e);
    }
    if (mono.empty()) {
      absl::StrAppend(&out, c);
    } else if (c == 1) {
      out += mono;
    } else if (c == -1) {
      absl::StrAppend(&out, "-", mono);
    } else {
      absl::StrAppend(&out, c, "*", mono);
    }
  }
  return out;
}

Dim operator+(const Dim& a, const Dim& b) {
  Dim r;
  size_t i = 0, j = 0;
  while (i < a.terms_.size() || j < b.terms_.size()) {
    if (j == b.terms_.size() || (i < a.terms_.size() && a.terms_[i].mono < b.terms_[j].mono)) {
      r.terms_.push_back(a.terms_[i++]);
    } else if (i == a.terms_.size() || b.terms_[j].mono < a.terms_[i].mono) {
      r.terms_.push_back(b.terms_[j++]);
    } else {
      const int64_t c = a.terms_[i].coef + b.terms_[j].coef;
      if (c != 0) r.terms_.push_back({a.terms_[i].mono, c});
      ++i;
      ++j;
    }
  }
  return r;
}

Dim operator-(const Dim& a) {
  Dim r = a;
  for (auto& t : r.terms_) t.coef = -t.coef;
  return r;
}

Dim operator-(const Dim& a, const Dim& b) { return a + (-b); }

Dim operator*(const Dim& a, const Dim& b) {
  Dim r;
  for (const auto& x : a.terms_) {
    for (const auto& y : b.terms_) {
      Dim t;
      // Exponents add per symbol; each stays < 256 for any shape a model can build.
      t.terms_.push_back({x.mono + y.mono, x.coef * y.coef});
      r = r + t;
    }
  }
  return r;
}

bool operator==(const Dim& a, const Dim& b) {
  if (a.terms_.size() != b.terms_.size()) return false;
  for (size_t i = 0; i < a.terms_.size(); ++i) {
    if (a.terms_[i].mono != b.terms_[i].mono || a.terms_[i].coef != b.terms_[i].coef) return false;
  }
  return true;
}

Dim NumElements(const SymShape& shape) {
  Dim n = 1;
  for (const Dim& d : shape) n = n * d;
  return n;
}

std::string ShapeString(const SymShape& shape, std::span<const std::string> names) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ",";
    out += shape[i].ToString(names);
  }
  return out + "]";
}

std::vector<int64_t> EvalShape(const SymShape& shape, std::span<const int64_t> values) {
  std::vector<int64_t> r(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) r[i] = shape[i].Eval(values);
  return r;
}

}  // namespace kiln
