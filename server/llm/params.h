// Request parameters of the LLM front ends: reading typed fields out of a JSON body with
// errors that name the field (WithParam, so the OpenAI front end can fill its error's
// `param`), and the sampling keys the OpenAI API and vLLM/Triton's `sampling_parameters` share.
//
// Thread-safety: pure functions; JsonFields only reads the object it was given.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/json_parse.h"  // ParseJsonObject, for the front ends
#include "nlohmann/json.hpp"
#include "scheduler/generation.h"

namespace kiln::llm {

// Typed access to the members of one JSON object. A member that is absent or null reads as
// "not given". Errors are InvalidArgument naming `prefix + key`, e.g.
//   "`max_tokens` must be an integer, got a string"
// With `lenient` set, numbers and booleans may also arrive as strings ("16", "0.5", "true"),
// as clients of Triton's vLLM backend send them inside `sampling_parameters`.
class JsonFields {
 public:
  // REQUIRES: `object` is a JSON object and outlives this.
  JsonFields(const nlohmann::json& object, std::string prefix = "", bool lenient = false);

  bool Has(std::string_view key) const;
  // Whether the member is there at all, null included (to tell "null" from "missing").
  bool Present(std::string_view key) const;
  std::string Name(std::string_view key) const { return prefix_ + std::string(key); }

  // Whole numbers only (2.0 is accepted, 2.5 is not), in the int64 range.
  StatusOr<std::optional<int64_t>> Int(std::string_view key) const;
  StatusOr<std::optional<double>> Number(std::string_view key) const;
  StatusOr<std::optional<bool>> Bool(std::string_view key) const;
  StatusOr<std::optional<std::string>> String(std::string_view key) const;
  // A string or a list of strings (OpenAI's `stop`).
  StatusOr<std::optional<std::vector<std::string>>> Strings(std::string_view key) const;
  // A list of integers.
  StatusOr<std::optional<std::vector<int64_t>>> Ints(std::string_view key) const;

  const nlohmann::json* Get(std::string_view key) const;  // nullptr when absent or null

 private:
  const nlohmann::json& object_;
  std::string prefix_;
  bool lenient_;
};

// Reads the sampling keys shared by OpenAI's API (with vLLM's extensions) and Triton's
// `sampling_parameters` into `params`, leaving keys that are not given at their defaults:
//   temperature, top_p, top_k (-1 or 0: off), min_p, repetition_penalty, presence_penalty,
//   frequency_penalty, seed, stop (string or list), stop_token_ids, ignore_eos, min_tokens.
// Type errors name the field; ranges are checked when the request is submitted.
// max_tokens and logprobs differ between the APIs and are read by the caller.
Status ReadSamplingFields(const JsonFields& fields, models::SamplingParams* params);

}  // namespace kiln::llm
