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
  bool lenient() const { return lenient_; }

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
//   frequency_penalty, seed, stop (string or list), stop_token_ids, ignore_eos, min_tokens,
//   logit_bias, and structured output: response_format ({type: text | json_object |
//   json_schema, json_schema: {name, schema, strict}}), grammar (GBNF) or regex — at most one,
//   compiled here (models/grammar/constraint.h), so a schema that does not compile is a 400.
// Type errors name the field; ranges are checked when the request is submitted.
// max_tokens and logprobs differ between the APIs and are read by the caller.
// `raw_object`, when given, is the JSON text of the object `fields` reads: a JSON Schema's
// properties are then generated in the order the client wrote them (nlohmann::json sorts
// keys), as OpenAI does; without it they come in sorted order.
Status ReadSamplingFields(const JsonFields& fields, models::SamplingParams* params,
                          std::string_view raw_object = {});

}  // namespace kiln::llm
