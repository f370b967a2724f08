// What a step of the continuous batcher costs on this device, learnt from the steps it runs.
//
// Two uses:
//  - speculative decoding (speculative.h): a decode step's time by its rows says what a
//    drafted row costs everyone in the step;
//  - the ITL target (scheduler.target_itl_ms): a decode step's time and what one prompt token
//    adds to it say how many prompt tokens a step that also decodes may carry before the
//    running streams' inter-token latency passes the target.
//
// Thread-safety: none; the batcher's loop thread owns it.
#pragma once

#include <array>
#include <cstdint>

namespace kiln {

// Decode-only step time by rows (exponential moving averages per row count). Rows never seen
// are interpolated between measured ones, or past the largest measured (or before any) a
// prior of a quarter of a one-row step per further row (a CPU-like figure, so drafting starts
// modestly until measured). And the seconds one prompt token adds to a step that decodes
// (from steps that carry both: their time less the decode-only time of their decoded rows,
// per prompt token).
class StepCostModel {
 public:
  // A decode-only step of `rows` rows took `seconds`.
  void Observe(int32_t rows, double seconds);
  // A step that decoded `decode_rows` rows and computed `prompt_tokens` prompt tokens took
  // `seconds`. Ignored before a decode-only step has been measured, and for steps with fewer
  // than kMinPromptTokens prompt tokens (too little signal) or no decoded row.
  void ObserveMixed(int32_t decode_rows, int32_t prompt_tokens, double seconds);

  // t(rows) / t(1), at least 1; the prior (1 + (rows - 1) / 4) before a one-row step is measured.
  double Relative(int32_t rows) const;
  // t(1) as measured; 0 before any one-row step.
  double OneRowSeconds() const { return seconds_[1]; }
  // t(rows) in seconds: measured, interpolated, or extrapolated from the largest measured row
  // count by the prior; 0 before any decode-only step.
  double DecodeSeconds(int32_t rows) const;
  // What one prompt token adds to a step that decodes; 0 before any such step was measured.
  double PromptTokenSeconds() const { return prompt_token_seconds_; }

  // The prompt tokens a step that decodes `decode_rows` rows may carry: the prompt time that
  // still fits in `target_seconds`, and never less than kPromptShare of the decodes' own time,
  // so that prompts keep pace with the streams they replace as the decodes approach or pass the
  // target (a step takes at most the target or 1.5x its decodes alone, whichever is longer);
  // at least `floor` (a prompt always advances). 0 the first time it is asked for a row count
  // never decoded alone: that decode-only step measures it (a guessed time, too low, makes
  // prompt tokens look dear and keeps every step mixed, so that the guess is never corrected).
  // Asked again before a measurement came (the step failed, or carried drafted rows, which it
  // is observed by), the guess is used: prompts are held back once per row count at most. -1
  // while nothing is measured yet, for which the caller keeps its static cap.
  int32_t PromptTokensWithin(int32_t decode_rows, double target_seconds, int32_t floor);

  // The least share of a mixed step's decode time its prompt tokens may take.
  static constexpr double kPromptShare = 0.5;
  static constexpr int32_t kMinPromptTokens = 4;

 private:
  static constexpr int32_t kRows = 64;  // rows tracked: [1, kRows]
  std::array<double, kRows + 1> seconds_{};
  double prompt_token_seconds_ = 0;
  bool mixed_seen_ = false;               // prompt_token_seconds_ measured
  std::array<bool, kRows + 1> probed_{};  // a decode-only step was asked for this row count
};

}  // namespace kiln
