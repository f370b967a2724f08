#include "models/grammar/constraint.h"

#include <absl/synchronization/mutex.h>

#include <list>
#include <tuple>

#include "models/grammar/json_schema.h"
#include "models/grammar/regex_gbnf.h"
#include "nlohmann/json.hpp"

namespace kiln::grammar {

namespace {

StatusOr<std::shared_ptr<const Grammar>> Compile(const Constraint& c) {
  std::string gbnf;
  switch (c.kind) {
    case Constraint::Kind::kJsonObject:
      gbnf = JsonObjectGbnf();
      break;
    case Constraint::Kind::kJsonSchema: {
      // ordered_json: properties are generated in the order the client wrote them.
      const nlohmann::ordered_json schema =
          nlohmann::ordered_json::parse(c.text, nullptr, /*allow_exceptions=*/false);
      if (schema.is_discarded()) return InvalidArgument("the JSON Schema is not valid JSON");
      KILN_ASSIGN_OR_RETURN(JsonSchemaGrammar g, JsonSchemaToGbnf(schema, {.strict = c.strict}));
      gbnf = std::move(g.gbnf);
      break;
    }
    case Constraint::Kind::kGbnf:
      gbnf = c.text;
      break;
    case Constraint::Kind::kRegex: {
      KILN_ASSIGN_OR_RETURN(gbnf, RegexToGbnf(c.text, "root"));
      break;
    }
  }
  StatusOr<Grammar> g = Grammar::ParseGbnf(gbnf);
  if (!g.ok()) {
    // A user's GBNF reports its own errors; a generated one failing is Kiln's bug.
    if (c.kind == Constraint::Kind::kGbnf) return g.status();
    return Internal("the grammar generated for this ",
                    c.kind == Constraint::Kind::kRegex ? "regex" : "schema", " does not parse (",
                    StatusMessage(g.status()), ")");
  }
  return std::make_shared<const Grammar>(*std::move(g));
}

struct Cache {
  using Key = std::tuple<Constraint::Kind, bool, std::string>;
  absl::Mutex mu;
  std::list<std::pair<Key, std::shared_ptr<const Grammar>>> entries
      ABSL_GUARDED_BY(mu);  // MRU first
};

}  // namespace

StatusOr<std::shared_ptr<const Grammar>> CompileConstraint(const Constraint& constraint) {
  if (constraint.text.size() > kMaxConstraintBytes) {
    return InvalidArgument("the ",
                           constraint.kind == Constraint::Kind::kJsonSchema ? "JSON Schema"
                           : constraint.kind == Constraint::Kind::kRegex    ? "regex"
                                                                            : "grammar",
                           " is ", constraint.text.size(), " bytes; at most ", kMaxConstraintBytes,
                           " are allowed");
  }
  static Cache* cache = new Cache;
  const Cache::Key key{constraint.kind, constraint.strict, constraint.text};
  {
    absl::MutexLock lock(&cache->mu);
    for (auto it = cache->entries.begin(); it != cache->entries.end(); ++it) {
      if (it->first == key) {
        cache->entries.splice(cache->entries.begin(), cache->entries, it);
        return it->second;
      }
    }
  }
  KILN_ASSIGN_OR_RETURN(std::shared_ptr<const Grammar> g, Compile(constraint));
  if (constraint.text.size() > kMaxCachedConstraintBytes) return g;  // not worth its memory
  absl::MutexLock lock(&cache->mu);
  cache->entries.emplace_front(key, g);
  if (cache->entries.size() > kConstraintCacheSize) cache->entries.pop_back();
  return g;
}

}  // namespace kiln::grammar
