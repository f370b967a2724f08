#include "models/chat/jinja.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kiln::models::jinja {
namespace {

using json = nlohmann::ordered_json;
using ::testing::HasSubstr;

std::string R(std::string_view src, const json& ctx = json::object()) {
  auto t = Template::Parse(src, "t");
  if (!t.ok()) return "PARSE ERROR: " + std::string(StatusMessage(t.status()));
  auto out = (*t)->Render(ctx);
  if (!out.ok()) return "RENDER ERROR: " + std::string(StatusMessage(out.status()));
  return *out;
}

TEST(JinjaTest, OutputAndLiterals) {
  EXPECT_EQ(R("a{{ 1 + 2 }}b"), "a3b");
  EXPECT_EQ(R("{{ 'x' ~ 1 ~ none ~ true }}"), "x1NoneTrue");
  EXPECT_EQ(R("{{ [1, 'a', none, 1.5] }}"), "[1, 'a', None, 1.5]");
  EXPECT_EQ(R("{{ {'a': 1, \"b\": [true]} }}"), "{'a': 1, 'b': [True]}");
  EXPECT_EQ(R("{{ 'it\\'s' }}|{{ \"say \\\"hi\\\"\" }}|{{ 'a\\nb' }}"), "it's|say \"hi\"|a\nb");
  EXPECT_EQ(R("{{ 'a' 'b' }}"), "ab");
  EXPECT_EQ(R("{{ '\\u00e9\\x41\\ud800' }}"),
            "\xC3\xA9"
            "A"
            "\xEF\xBF\xBD");
  EXPECT_EQ(R("{{ undefined_thing }}"), "");
  EXPECT_EQ(R("{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }}"),
            "3 -4 1 2 3.5 1024");
  EXPECT_EQ(R("{{ 0.1 + 0.2 }} {{ 1e20 }} {{ 3.0 }}"), "0.30000000000000004 1e+20 3.0");
  EXPECT_EQ(R("{{ 'ab' * 3 }}"), "ababab");
}

TEST(JinjaTest, Precedence) {
  EXPECT_EQ(R("{{ 1 + 2 * 3 }}"), "7");
  EXPECT_EQ(R("{{ 'a' + ' b ' | trim + 'c' }}"), "abc");  // filters bind tighter than +
  EXPECT_EQ(R("{{ not 1 == 2 }}"), "True");
  EXPECT_EQ(R("{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }}"), "True False");
  EXPECT_EQ(R("{{ 'yes' if 1 else 'no' }} {{ 'yes' if 0 else 'no' }}"), "yes no");
  EXPECT_EQ(R("{{ x is defined and x > 1 }}", {{"x", 2}}), "True");
  EXPECT_EQ(R("{{ none or 'd' }} {{ 0 and 1 }}"), "d 0");
  EXPECT_EQ(R("{{ -x | abs }}", {{"x", 3}}), "3");
}

TEST(JinjaTest, IfForSet) {
  json ctx = {{"xs", {"a", "b", "c"}}};
  EXPECT_EQ(
      R("{% for x in xs %}{{ loop.index0 }}{{ x }}{% if not loop.last %},{% endif %}{% endfor %}",
        ctx),
      "0a,1b,2c");
  EXPECT_EQ(R("{% for x in xs %}{{ loop.index }}/{{ loop.length }}{{ loop.first }}{{ "
              "loop.revindex0 }} {% endfor %}",
              ctx),
            "1/3True2 2/3False1 3/3False0 ");
  EXPECT_EQ(R("{% for x in xs if x != 'b' %}{{ x }}{{ loop.length }}{% endfor %}", ctx), "a2c2");
  EXPECT_EQ(R("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(R("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}"),
            "a=1;b=2;");
  EXPECT_EQ(R("{% for x in xs %}{% if x == 'b' %}{% continue %}{% endif %}{% if x == 'c' %}{% "
              "break %}{% endif %}{{ x }}{% endfor %}",
              ctx),
            "a");
  EXPECT_EQ(R("{% if 0 %}a{% elif 1 %}b{% else %}c{% endif %}"), "b");
  // Loop scoping: assignments inside a loop do not leak; namespaces do.
  EXPECT_EQ(R("{% set n = 0 %}{% for x in xs %}{% set n = n + 1 %}{% endfor %}{{ n }}", ctx), "0");
  EXPECT_EQ(R("{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + 1 %}{% endfor "
              "%}{{ ns.n }}",
              ctx),
            "3");
  EXPECT_EQ(R("{% if 1 %}{% set y = 5 %}{% endif %}{{ y }}"), "5");
  EXPECT_EQ(R("{% set a, b = 1, 2 %}{{ b }}{{ a }}"), "21");
  EXPECT_EQ(R("{% set blk %}x{{ 1 }}y{% endset %}[{{ blk }}]"), "[x1y]");
  EXPECT_EQ(R("{% for i in range(3) %}{{ i }}{% endfor %}{% for i in range(5, 1, -2) %}{{ i }}{% "
              "endfor %}"),
            "01253");
}

TEST(JinjaTest, WhitespaceControl) {
  // trim_blocks and lstrip_blocks, as transformers configures Jinja.
  EXPECT_EQ(R("  {% if 1 %}\n    x\n  {% endif %}\n"), "    x\n");
  EXPECT_EQ(R("a  {%- if 1 -%}  b  {%- endif -%}  c"), "abc");
  EXPECT_EQ(R("a {{- ' b ' -}} c"), "a b c");
  EXPECT_EQ(R("a {{ 'b' }}\nc"), "a b\nc");         // no trim after }}
  EXPECT_EQ(R("x {% if 1 %}y{% endif %}"), "x y");  // tag not at line start: no lstrip
  EXPECT_EQ(R("  {%+ if 1 %}y{% endif %}"), "  y");
  EXPECT_EQ(R("a{# comment #}\nb {#- c -#} d"), "abd");
  EXPECT_EQ(R("{% raw %}{{ not }}{% endraw %}"), "{{ not }}");
}

TEST(JinjaTest, FiltersTestsMethods) {
  json ctx = {
      {"m", {{"role", "user"}, {"content", " Hi There "}}},
      {"ms", json::array({{{"role", "user"}}, {{"role", "assistant"}}, {{"role", "user"}}})}};
  EXPECT_EQ(R("{{ m.content | trim | upper }}|{{ m['content'].strip().lower() }}", ctx),
            "HI THERE|hi there");
  EXPECT_EQ(R("{{ m.content | length }} {{ ms | length }} {{ 'héllo' | length }}", ctx), "10 3 5");
  EXPECT_EQ(R("{{ ms | selectattr('role', 'equalto', 'user') | list | length }}", ctx), "2");
  EXPECT_EQ(R("{{ ms | map(attribute='role') | join(', ') }}", ctx), "user, assistant, user");
  EXPECT_EQ(R("{{ [3, 1] | first }}{{ [3, 1] | last }}{{ 'abc' | first }}"), "31a");
  EXPECT_EQ(R("{{ x | default('d') }}{{ '' | default('e', true) }}"), "de");
  EXPECT_EQ(R("{{ 'a-b-c'.split('-') }} {{ 'a  b'.split() }} {{ 'a-b-c'.split('-', 1) }}"),
            "['a', 'b', 'c'] ['a', 'b'] ['a', 'b-c']");
  EXPECT_EQ(
      R("{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith('bc') }}{{ 'aXbX' | replace('X', '-') }}"),
      "TrueTruea-b-");
  EXPECT_EQ(R("{{ [1, 2, 3, 4][::-1] }} {{ 'hello'[1:3] }} {{ [1, 2, 3][-1] }} {{ 'hello'[-3:] }}"),
            "[4, 3, 2, 1] el 3 llo");
  EXPECT_EQ(R("{{ {'b': 'ü', 'a': [1, 2.5, none, true]} | tojson }}"),
            "{\"b\": \"ü\", \"a\": [1, 2.5, null, true]}");
  EXPECT_EQ(R("{{ {'a': {'b': 1}} | tojson(indent=2) }}"), "{\n  \"a\": {\n    \"b\": 1\n  }\n}");
  EXPECT_EQ(R("{{ 'a\"\\n' | tojson }}"), "\"a\\\"\\n\"");
  EXPECT_EQ(
      R("{{ 3 is odd }}{{ x is none }}{{ none is none }}{{ 'a' is string }}{{ 1 is not string }}"),
      "TrueFalseTrueTrueTrue");
  EXPECT_EQ(R("{{ 'b' in 'abc' }}{{ 2 in [1, 2] }}{{ 'k' in {'k': 1} }}{{ 3 not in [1] }}"),
            "TrueTrueTrueTrue");
  EXPECT_EQ(R("{{ {'a': 1}.get('a') }}{{ {'a': 1}.get('z', 9) }}{{ {'a': 1}.keys() | list }}"),
            "19['a']");
  EXPECT_EQ(R("{{ m == {'role': 'user', 'content': ' Hi There '} }}", ctx), "True");
}

TEST(JinjaTest, ErrorsNameConstructAndPosition) {
  EXPECT_THAT(R("ab\n  {% macro f() %}{% endmacro %}"),
              HasSubstr("PARSE ERROR: t:2:6: unsupported tag 'macro'"));
  EXPECT_THAT(R("{{ x | frobnicate }}", {{"x", 1}}),
              HasSubstr("t:1:8: unsupported filter 'frobnicate'"));
  EXPECT_THAT(R("{{ x is weird }}"), HasSubstr("unsupported test 'weird'"));
  EXPECT_THAT(R("{% if 1 %}"), HasSubstr("{% if %} without {% endif %}"));
  EXPECT_THAT(R("{% endfor %}"), HasSubstr("unexpected {% endfor %}"));
  EXPECT_THAT(R("{{ 1 + }}"), HasSubstr("expected an expression"));
  EXPECT_THAT(R("{{ 'abc }}"), HasSubstr("unterminated"));
  // Found by jinja_fuzz: a \u escape without hex digits threw std::invalid_argument.
  EXPECT_THAT(R("{{ '\\uZZZZ' }}"), HasSubstr("invalid \\u escape"));
  EXPECT_THAT(R("{{ '\\u12' }}"), HasSubstr("invalid \\u escape"));
  EXPECT_THAT(R("{{ raise_exception('Bad role: ' ~ 3) }}"),
              HasSubstr("template error: Bad role: 3"));
  EXPECT_THAT(R("{{ 1 + 'a' }}"), HasSubstr("unsupported operand types for +: 'int' and 'str'"));
  // Found by jinja_fuzz: 64-bit integer overflow was undefined behaviour; it is an error.
  EXPECT_THAT(R("{{ 55 ** 5555 }}"), HasSubstr("t:1:7: integer overflow in '**'"));
  EXPECT_THAT(R("{{ 9223372036854775807 + 1 }}"), HasSubstr("integer overflow in '+'"));
  EXPECT_THAT(R("{{ -9223372036854775807 - 2 }}"), HasSubstr("integer overflow in '-'"));
  EXPECT_THAT(R("{{ 4294967296 * 4294967296 }}"), HasSubstr("integer overflow in '*'"));
  EXPECT_THAT(R("{% set m = -9223372036854775807 - 1 %}{{ m // -1 }}"),
              HasSubstr("integer overflow in '//'"));
  EXPECT_THAT(R("{% set m = -9223372036854775807 - 1 %}{{ -m }}"), HasSubstr("integer overflow"));
  EXPECT_EQ(R("{% set m = -9223372036854775807 - 1 %}{{ m % -1 }} {{ m }}"),
            "0 -9223372036854775808");
  EXPECT_EQ(R("{{ 1 ** 100000000000 }} {{ (-1) ** 3 }} {{ 0 ** 0 }} {{ 0 ** 5 }} {{ 2 ** 62 }}"),
            "1 -1 1 0 4611686018427387904");
  EXPECT_THAT(R("{{ nope.attr }}"), HasSubstr("'nope' is undefined"));
  EXPECT_THAT(R("{% set x = 1 %}{% set x.a = 2 %}"), HasSubstr("only namespace() objects"));
  EXPECT_THAT(R("{{ [1].pop() }}"), HasSubstr("unsupported method 'list.pop()'"));
  EXPECT_THAT(R("{% include 'x' %}"), HasSubstr("unsupported tag 'include'"));
  // Hostile nesting is an error, not a stack overflow.
  EXPECT_THAT(R("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}"),
              HasSubstr("nested too deeply"));
  std::string deep;
  for (int i = 0; i < 300; ++i) deep += "{% if 1 %}";
  EXPECT_THAT(R(deep), HasSubstr("nested too deeply"));
  json nested = json::array();
  for (int i = 0; i < 100; ++i) nested = json::array({nested});
  EXPECT_THAT(R("{{ x }}", {{"x", nested}}), HasSubstr("nested deeper than 64"));
}

TEST(JinjaTest, StrftimeNow) {
  std::string year = R("{{ strftime_now('%Y') }}");
  ASSERT_EQ(year.size(), 4u);
  EXPECT_GE(std::stoi(year), 2024);
}

}  // namespace
}  // namespace kiln::models::jinja
