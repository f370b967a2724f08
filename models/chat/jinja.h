// A Jinja2 subset interpreter for chat templates: lexer -> AST -> tree-walking evaluator.
//
// Semantics follow Jinja2 as Hugging Face transformers configures it for chat templates
// (trim_blocks, lstrip_blocks, loop controls, Python-style values, `tojson` as json.dumps with
// ensure_ascii=False). Supported:
//   {{ expr }}, {% if/elif/else/endif %}, {% for x[, y] in expr [if cond] %}...{% else %}
//   {% endfor %} with loop.index/index0/revindex/revindex0/first/last/length/previtem/nextitem,
//   {% set x = expr %}, {% set ns.attr = expr %}, {% set x %}...{% endset %},
//   {% break %}, {% continue %}, {% raw %}, {% generation %}, {# comments #}, whitespace
//   control (-, +); literals (strings, ints, floats, lists, dicts, tuples, true/false/none);
//   + - * / // % **, ~, comparisons, and/or/not, in/not in, `a if b else c`, indexing and
//   slicing (incl. [::-1]), attribute access (dict keys), `is` tests, filters, string/dict
//   methods and the globals raise_exception, namespace, range, strftime_now.
// Anything else (macros, include/extends, call blocks, unknown filters/tests/methods) is a
// clear InvalidArgument that names the construct and its line:column.
//
// Thread-safety: a parsed Template is immutable; Render may run concurrently.
#pragma once

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "engine/base/status.h"

namespace kiln::models::jinja {

struct Node;

class Template {
 public:
  // Parses `source`. `name` prefixes error messages ("chat_template:3:14: ...").
  static StatusOr<std::unique_ptr<Template>> Parse(std::string_view source,
                                                   std::string name = "template");
  ~Template();

  // Renders with the top-level variables in `context` (a JSON object; key order is kept, as
  // Python dicts keep it). Errors: InvalidArgument for runtime errors (type errors, undefined
  // attributes of undefined values, unsupported filters) and for raise_exception(), whose
  // message is passed through.
  StatusOr<std::string> Render(const nlohmann::ordered_json& context) const;

 private:
  Template() = default;
  std::string name_;
  std::unique_ptr<Node> root_;
};

}  // namespace kiln::models::jinja
