#include "server/llm/params.h"

#include <absl/strings/str_cat.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

#include "scheduler/output_format.h"

namespace kiln::llm {
namespace {

using nlohmann::json;

std::string Trimmed(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

// Whole-string numeric parses for lenient fields.
std::optional<double> ParseDouble(const std::string& s) {
  const std::string t = Trimmed(s);
  double v = 0;
  auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (t.empty() || ec != std::errc() || p != t.data() + t.size()) return std::nullopt;
  return v;
}

// Structured output: OpenAI's response_format, or Kiln's `grammar` (GBNF) or `regex`; at most
// one of them. The grammar is compiled here, so a bad schema is the request's 400.
Status ReadOutputConstraint(const JsonFields& f, models::SamplingParams* p,
                            std::string_view raw_object) {
  using grammar::Constraint;
  std::optional<Constraint> c;
  std::string field;  // the client's field the constraint came from
  auto set = [&](Constraint next, std::string name) -> Status {
    if (c) {
      return WithParam(InvalidArgument("`", name, "` and `", field,
                                       "` both constrain the output; give at most one"),
                       name);
    }
    c = std::move(next);
    field = std::move(name);
    return OkStatus();
  };
  if (const json* rf = f.Get("response_format")) {
    const std::string name = f.Name("response_format");
    auto member = [&](const char* key) -> const json* {
      if (!rf->is_object()) return nullptr;
      const auto it = rf->find(key);
      return it == rf->end() ? nullptr : &*it;
    };
    const json* type = member("type");
    if (type == nullptr || !type->is_string()) {
      return WithParam(InvalidArgument("`", name,
                                       "` must be an object with a string `type`: \"text\", "
                                       "\"json_object\" or \"json_schema\""),
                       name);
    }
    const std::string& t = type->get_ref<const std::string&>();
    if (t != "text" && t != "json_object" && t != "json_schema") {
      return WithParam(InvalidArgument("`", name, ".type` is \"", ValidUtf8(t),
                                       "\"; it must be \"text\", \"json_object\" or "
                                       "\"json_schema\""),
                       name);
    }
    // `json_schema` is checked whenever it is sent (the schema is needed only for its type).
    const json* js = member("json_schema");
    if (js != nullptr && !js->is_null() && !js->is_object()) {
      return WithParam(
          InvalidArgument("`", name, ".json_schema` must be an object with the `schema`"), name);
    }
    const bool has_js = js != nullptr && js->is_object();
    const json kEmpty = json::object();
    JsonFields sf(has_js ? *js : kEmpty, name + ".json_schema.", f.lenient());
    KILN_ASSIGN_OR_RETURN(auto schema_name, sf.String("name"));
    if (schema_name && !models::IsOpenAiName(*schema_name)) {
      return WithParam(InvalidArgument("`", sf.Name("name"),
                                       "` must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -"),
                       name);
    }
    KILN_ASSIGN_OR_RETURN(auto description, sf.String("description"));
    KILN_ASSIGN_OR_RETURN(auto strict, sf.Bool("strict"));
    const json* schema = sf.Get("schema");
    if ((schema != nullptr || t == "json_schema") && (schema == nullptr || !schema->is_object())) {
      return WithParam(
          InvalidArgument("`", sf.Name("schema"), "` must be a JSON Schema (an object)"), name);
    }
    if (t == "json_object") {
      KILN_RETURN_IF_ERROR(set({Constraint::Kind::kJsonObject, "", false}, name));
    } else if (t == "json_schema") {
      // The schema's text with the client's key order, when the raw body has it.
      std::string text = schema->dump();
      if (!raw_object.empty()) {
        const auto ordered = nlohmann::ordered_json::parse(raw_object, nullptr, false);
        if (ordered.is_object() && ordered.contains("response_format")) {
          const auto& o = ordered["response_format"];
          if (o.is_object() && o.contains("json_schema") && o["json_schema"].is_object() &&
              o["json_schema"].contains("schema")) {
            text = o["json_schema"]["schema"].dump();
          }
        }
      }
      KILN_RETURN_IF_ERROR(
          set({Constraint::Kind::kJsonSchema, std::move(text), strict.value_or(false)}, name));
      field = sf.Name("schema");
    }
  }
  KILN_ASSIGN_OR_RETURN(auto gbnf, f.String("grammar"));
  if (gbnf) KILN_RETURN_IF_ERROR(set({Constraint::Kind::kGbnf, *gbnf, false}, f.Name("grammar")));
  KILN_ASSIGN_OR_RETURN(auto regex, f.String("regex"));
  if (regex) KILN_RETURN_IF_ERROR(set({Constraint::Kind::kRegex, *regex, false}, f.Name("regex")));
  p->grammar = nullptr;
  if (!c) return OkStatus();
  StatusOr<std::shared_ptr<const grammar::Grammar>> g = grammar::CompileConstraint(*c);
  if (!g.ok()) {
    // The param is the top-level field (OpenAI's `param` for response_format errors).
    const std::string param = field.substr(0, field.find('.'));
    return WithParam(
        Status(g.status().code(), absl::StrCat("`", field, "`: ", g.status().message())), param);
  }
  p->grammar = *std::move(g);
  return OkStatus();
}

}  // namespace

JsonFields::JsonFields(const json& object, std::string prefix, bool lenient)
    : object_(object), prefix_(std::move(prefix)), lenient_(lenient) {}

const json* JsonFields::Get(std::string_view key) const {
  auto it = object_.find(std::string(key));
  if (it == object_.end() || it->is_null()) return nullptr;
  return &*it;
}

bool JsonFields::Has(std::string_view key) const { return Get(key) != nullptr; }

bool JsonFields::Present(std::string_view key) const {
  return object_.find(std::string(key)) != object_.end();
}

StatusOr<std::optional<int64_t>> JsonFields::Int(std::string_view key) const {
  const json* v = Get(key);
  if (!v) return std::nullopt;
  auto bad = [&] {
    return WithParam(InvalidArgument("`", Name(key), "` must be an integer, got ", JsonTypeName(*v),
                                     v->is_primitive() ? StrCat(" ", v->dump()) : std::string()),
                     Name(key));
  };
  // nlohmann counts unsigned numbers as integers too: look at those first.
  if (v->is_number_unsigned()) {
    // Above int64: certainly out of every range; report the number as given.
    if (v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return WithParam(InvalidArgument("`", Name(key), "` is ", v->dump(), ", which is too large"),
                       Name(key));
    }
    return static_cast<int64_t>(v->get<uint64_t>());
  }
  if (v->is_number_integer()) return v->get<int64_t>();
  std::optional<double> d;
  if (v->is_number_float()) d = v->get<double>();
  if (lenient_ && v->is_string()) d = ParseDouble(v->get<std::string>());
  if (!d) return bad();
  if (!std::isfinite(*d) || std::trunc(*d) != *d) return bad();
  if (std::fabs(*d) >= 9.2e18) {
    return WithParam(InvalidArgument("`", Name(key), "` is ", v->dump(), ", which is too large"),
                     Name(key));
  }
  return static_cast<int64_t>(*d);
}

StatusOr<std::optional<double>> JsonFields::Number(std::string_view key) const {
  const json* v = Get(key);
  if (!v) return std::nullopt;
  if (v->is_number()) return v->get<double>();
  if (lenient_ && v->is_string()) {
    if (auto d = ParseDouble(v->get<std::string>())) return *d;
  }
  return WithParam(InvalidArgument("`", Name(key), "` must be a number, got ", JsonTypeName(*v),
                                   v->is_string() ? StrCat(" ", v->dump()) : std::string()),
                   Name(key));
}

StatusOr<std::optional<bool>> JsonFields::Bool(std::string_view key) const {
  const json* v = Get(key);
  if (!v) return std::nullopt;
  if (v->is_boolean()) return v->get<bool>();
  if (lenient_ && v->is_string()) {
    const std::string s = Trimmed(v->get<std::string>());
    if (s == "true" || s == "True" || s == "1") return true;
    if (s == "false" || s == "False" || s == "0") return false;
  }
  return WithParam(
      InvalidArgument("`", Name(key), "` must be true or false, got ", JsonTypeName(*v)),
      Name(key));
}

StatusOr<std::optional<std::string>> JsonFields::String(std::string_view key) const {
  const json* v = Get(key);
  if (!v) return std::nullopt;
  if (v->is_string()) return v->get<std::string>();
  return WithParam(InvalidArgument("`", Name(key), "` must be a string, got ", JsonTypeName(*v)),
                   Name(key));
}

StatusOr<std::optional<std::vector<std::string>>> JsonFields::Strings(std::string_view key) const {
  const json* v = Get(key);
  if (!v) return std::nullopt;
  if (v->is_string()) return std::vector<std::string>{v->get<std::string>()};
  if (v->is_array()) {
    std::vector<std::string> out;
    for (size_t i = 0; i < v->size(); ++i) {
      if (!(*v)[i].is_string()) {
        return WithParam(InvalidArgument("`", Name(key), "[", i, "]` must be a string, got ",
                                         JsonTypeName((*v)[i])),
                         Name(key));
      }
      out.push_back((*v)[i].get<std::string>());
    }
    return out;
  }
  return WithParam(InvalidArgument("`", Name(key), "` must be a string or a list of strings, got ",
                                   JsonTypeName(*v)),
                   Name(key));
}

StatusOr<std::optional<std::vector<int64_t>>> JsonFields::Ints(std::string_view key) const {
  const json* v = Get(key);
  if (!v) return std::nullopt;
  if (!v->is_array()) {
    return WithParam(
        InvalidArgument("`", Name(key), "` must be a list of integers, got ", JsonTypeName(*v)),
        Name(key));
  }
  std::vector<int64_t> out;
  for (size_t i = 0; i < v->size(); ++i) {
    const json& e = (*v)[i];
    if (e.is_number_unsigned()) {
      out.push_back(static_cast<int64_t>(
          std::min<uint64_t>(e.get<uint64_t>(), std::numeric_limits<int64_t>::max())));
    } else if (e.is_number_integer()) {
      out.push_back(e.get<int64_t>());
    } else {
      return WithParam(
          InvalidArgument("`", Name(key), "[", i, "]` must be an integer, got ", JsonTypeName(e)),
          Name(key));
    }
  }
  return out;
}

Status ReadSamplingFields(const JsonFields& f, models::SamplingParams* p,
                          std::string_view raw_object) {
  auto read_float = [&](std::string_view key, float* out) -> Status {
    KILN_ASSIGN_OR_RETURN(auto v, f.Number(key));
    if (v) *out = static_cast<float>(*v);
    return OkStatus();
  };
  KILN_RETURN_IF_ERROR(read_float("temperature", &p->temperature));
  KILN_RETURN_IF_ERROR(read_float("top_p", &p->top_p));
  KILN_RETURN_IF_ERROR(read_float("min_p", &p->min_p));
  KILN_RETURN_IF_ERROR(read_float("repetition_penalty", &p->repetition_penalty));
  KILN_RETURN_IF_ERROR(read_float("presence_penalty", &p->presence_penalty));
  KILN_RETURN_IF_ERROR(read_float("frequency_penalty", &p->frequency_penalty));
  KILN_ASSIGN_OR_RETURN(auto top_k, f.Int("top_k"));
  if (top_k) {
    // vLLM spells "off" as -1; Kiln as 0.
    if (*top_k < -1 || *top_k > std::numeric_limits<int32_t>::max()) {
      return WithParam(InvalidArgument("`", f.Name("top_k"), "` is ", *top_k,
                                       "; it must be >= 0 (0 or -1 = off)"),
                       f.Name("top_k"));
    }
    p->top_k = *top_k == -1 ? 0 : static_cast<int32_t>(*top_k);
  }
  KILN_ASSIGN_OR_RETURN(auto seed, f.Int("seed"));
  // OpenAI's seed is any 64-bit integer; the sampler takes its bit pattern.
  if (seed) p->seed = static_cast<uint64_t>(*seed);
  KILN_ASSIGN_OR_RETURN(auto stop, f.Strings("stop"));
  if (stop) p->stop = std::move(*stop);
  KILN_ASSIGN_OR_RETURN(auto stop_ids, f.Ints("stop_token_ids"));
  if (stop_ids) {
    p->stop_token_ids.clear();
    for (int64_t id : *stop_ids) {
      if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
        return WithParam(InvalidArgument("`", f.Name("stop_token_ids"), "` contains ", id,
                                         ", which is not a token id"),
                         f.Name("stop_token_ids"));
      }
      p->stop_token_ids.push_back(static_cast<int32_t>(id));
    }
  }
  if (const json* bias = f.Get("logit_bias")) {
    // OpenAI's shape: {"<token id>": bias, ...} (the ids as strings: JSON keys).
    const std::string name = f.Name("logit_bias");
    if (!bias->is_object()) {
      return WithParam(InvalidArgument("`", name,
                                       "` must be an object mapping token ids to "
                                       "biases, got ",
                                       JsonTypeName(*bias)),
                       name);
    }
    p->logit_bias.clear();
    for (const auto& [key, value] : bias->items()) {
      int64_t id = -1;
      const bool digits =
          !key.empty() && key.size() <= 10 &&
          std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (digits) id = std::stoll(key);
      if (!digits || id > std::numeric_limits<int32_t>::max()) {
        return WithParam(InvalidArgument("`", name, "` has the key \"", ValidUtf8(key),
                                         "\"; keys must be token ids (\"50256\")"),
                         name);
      }
      if (!value.is_number()) {
        return WithParam(InvalidArgument("`", name, "[\"", key, "\"]` must be a number, got ",
                                         JsonTypeName(value)),
                         name);
      }
      // Beyond float's range is out of [-100, 100] anyway (ValidateSamplingParams says so).
      const double v = value.get<double>();
      p->logit_bias.emplace_back(static_cast<int32_t>(id), std::abs(v) < 1e30
                                                               ? static_cast<float>(v)
                                                               : std::copysign(HUGE_VALF, v));
    }
  }
  if (const json* spec = f.Get("speculative")) {
    // Kiln's: {"method": "ngram" | "draft" | "none", "num_tokens": K, "prompt_lookup_min": n,
    // "prompt_lookup_max": n, "model": draft model}; ranges and the draft model are checked by
    // the batcher, which knows the model's.
    const std::string name = f.Name("speculative");
    if (!spec->is_object()) {
      return WithParam(InvalidArgument("`", name,
                                       "` must be an object such as {\"method\": \"ngram\", "
                                       "\"num_tokens\": 4}, got ",
                                       JsonTypeName(*spec)),
                       name);
    }
    static constexpr std::string_view kKeys[] = {"method", "num_tokens", "prompt_lookup_min",
                                                 "prompt_lookup_max", "model"};
    for (const auto& [key, value] : spec->items()) {
      if (std::find(std::begin(kKeys), std::end(kKeys), key) == std::end(kKeys)) {
        return WithParam(InvalidArgument("`", name, "` has an unknown key \"", ValidUtf8(key),
                                         "\"; it takes method, num_tokens, prompt_lookup_min, "
                                         "prompt_lookup_max and model"),
                         absl::StrCat(name, ".", ValidUtf8(key)));
      }
    }
    const JsonFields sf(*spec, name + ".", f.lenient());
    models::SpeculativeParams sp;
    KILN_ASSIGN_OR_RETURN(auto method, sf.String("method"));
    if (!method) {
      return WithParam(
          InvalidArgument("`", name, ".method` is missing: \"ngram\", \"draft\" or \"none\""),
          name + ".method");
    }
    sp.method = *std::move(method);
    auto read_int = [&](std::string_view key, int32_t* out) -> Status {
      KILN_ASSIGN_OR_RETURN(auto v, sf.Int(key));
      // Saturated: the batcher's range check names the field and the allowed range.
      if (v) *out = static_cast<int32_t>(std::clamp<int64_t>(*v, -(1 << 20), 1 << 20));
      return OkStatus();
    };
    KILN_RETURN_IF_ERROR(read_int("num_tokens", &sp.num_tokens));
    KILN_RETURN_IF_ERROR(read_int("prompt_lookup_min", &sp.prompt_lookup_min));
    KILN_RETURN_IF_ERROR(read_int("prompt_lookup_max", &sp.prompt_lookup_max));
    KILN_ASSIGN_OR_RETURN(auto model, sf.String("model"));
    if (model) sp.model = *std::move(model);
    p->speculative = std::move(sp);
  }
  KILN_ASSIGN_OR_RETURN(auto ignore_eos, f.Bool("ignore_eos"));
  if (ignore_eos) p->ignore_eos = *ignore_eos;
  KILN_ASSIGN_OR_RETURN(auto min_tokens, f.Int("min_tokens"));
  if (min_tokens) {
    if (*min_tokens < 0 || *min_tokens > std::numeric_limits<int32_t>::max()) {
      return WithParam(InvalidArgument("`", f.Name("min_tokens"), "` is ", *min_tokens,
                                       "; it must be >= 0 and at most max_tokens"),
                       f.Name("min_tokens"));
    }
    p->min_tokens = static_cast<int32_t>(*min_tokens);
  }
  return ReadOutputConstraint(f, p, raw_object);
}

}  // namespace kiln::llm
