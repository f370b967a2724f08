#include "scheduler/llm/speculative.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "scheduler/llm/generate_request.h"

namespace kiln {

StatusOr<SpeculationSettings> ResolveSpeculation(
    const config::SpeculativeConfig& model, const std::optional<models::SpeculativeParams>& asked,
    std::string_view model_name, std::string_view draft_model) {
  const bool has_draft_model = !draft_model.empty();
  SpeculationSettings s;
  std::string_view method = model.method;
  int32_t k = model.num_tokens, lo = model.prompt_lookup_min, hi = model.prompt_lookup_max;
  if (asked) {
    const bool draft = asked->method == "draft";
    if (asked->method != "none" && asked->method != "ngram" && !(draft && has_draft_model)) {
      return WithParam(
          InvalidArgument(
              "`speculative.method` is \"", ValidUtf8(asked->method), "\"; ",
              draft ? absl::StrCat("model '", std::string(model_name),
                                   "' has no draft model (its "
                                   "scheduler.speculative.draft_model is not set); use "
                                   "\"ngram\" or \"none\"")
                    : std::string(has_draft_model ? "it must be \"ngram\", \"draft\" or \"none\""
                                                  : "it must be \"ngram\" or \"none\"")),
          "speculative.method");
    }
    if (!asked->model.empty() && (!draft || asked->model != draft_model)) {
      return WithParam(
          InvalidArgument(
              "`speculative.model` is \"", ValidUtf8(asked->model), "\"; ",
              !draft ? std::string("it goes with method \"draft\"")
                     : absl::StrCat("model '", std::string(model_name), "' drafts with \"",
                                    std::string(draft_model), "\" (omit the field for it)")),
          "speculative.model");
    }
    method = asked->method;
    auto check = [](int32_t v, int32_t max, std::string_view name) -> Status {
      if (v >= 0 && v <= max) return OkStatus();
      return WithParam(InvalidArgument("`speculative.", name, "` is ", v, "; it must be in [1, ",
                                       max, "] (0 or absent: the model's setting)"),
                       absl::StrCat("speculative.", std::string(name)));
    };
    KILN_RETURN_IF_ERROR(check(asked->num_tokens, kMaxSpeculativeTokens, "num_tokens"));
    KILN_RETURN_IF_ERROR(
        check(asked->prompt_lookup_min, kMaxSpeculativeTokens, "prompt_lookup_min"));
    KILN_RETURN_IF_ERROR(
        check(asked->prompt_lookup_max, kMaxSpeculativeTokens, "prompt_lookup_max"));
    if (asked->num_tokens > 0) k = asked->num_tokens;
    if (asked->prompt_lookup_min > 0) lo = asked->prompt_lookup_min;
    if (asked->prompt_lookup_max > 0) hi = asked->prompt_lookup_max;
    if (lo > hi) {
      return WithParam(
          InvalidArgument("`speculative.prompt_lookup_min` (", lo,
                          ") is larger than `speculative.prompt_lookup_max` (", hi, ")"),
          "speculative.prompt_lookup_min");
    }
  }
  if (method == "none") return s;
  s.method =
      method == "draft" ? SpeculationSettings::Method::kDraft : SpeculationSettings::Method::kNgram;
  s.adaptive = model.adaptive;
  s.num_tokens = std::clamp(k, 1, kMaxSpeculativeTokens);
  s.lookup_min = std::max(1, lo);
  s.lookup_max = std::max(s.lookup_min, hi);
  return s;
}

void AcceptanceEstimate::Observe(int32_t drafted, int32_t accepted) {
  constexpr double kDecay = 0.8;  // per verification: the last ~5 steps weigh most
  accepted_ = kDecay * accepted_ + accepted;
  rejected_ = kDecay * rejected_ + (accepted < drafted ? 1 : 0);
}

void AcceptanceEstimate::Idle() {
  constexpr double kForget = 0.97;
  accepted_ *= kForget;
  rejected_ *= kForget;
}

int32_t ChooseDraftLength(double rate, int32_t max_draft, const StepCostModel& cost, int32_t rows,
                          double tokens, double per_draft, double fixed) {
  rows = std::max(rows, 1);
  const double base = cost.Relative(rows);
  int32_t best = 0;
  double best_value = tokens / base;  // no drafts
  double expected = tokens, p = 1.0;
  for (int32_t k = 1; k <= max_draft; ++k) {
    p *= rate;
    expected += p;  // + rate + rate^2 + ... : the drafts' expected accepted tokens
    const double value = expected / (cost.Relative(rows + k) + per_draft * k + fixed);
    if (value > best_value) {
      best_value = value;
      best = k;
    }
  }
  return best;
}

void ProposeNgram(std::span<const int32_t> tokens, const SpeculationSettings& settings,
                  int32_t max_draft, std::vector<int32_t>* draft) {
  draft->clear();
  const auto L = static_cast<int64_t>(tokens.size());
  if (max_draft <= 0) return;
  for (int64_t n = std::min<int64_t>(settings.lookup_max, L - 1); n >= settings.lookup_min; --n) {
    const std::span<const int32_t> suffix = tokens.subspan(static_cast<size_t>(L - n));
    // The most recent earlier occurrence: starts i < L - n, scanning backwards.
    for (int64_t i = L - n - 1; i >= 0; --i) {
      if (tokens[static_cast<size_t>(i)] != suffix[0] ||
          !std::equal(suffix.begin(), suffix.end(), tokens.begin() + i)) {
        continue;
      }
      const int64_t from = i + n, to = std::min(L, from + max_draft);
      draft->assign(tokens.begin() + from, tokens.begin() + to);
      return;
    }
  }
}

}  // namespace kiln
