#include "models/grammar/json_schema.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "models/grammar/grammar.h"
#include "nlohmann/json.hpp"

namespace kiln::grammar {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;
using Json = nlohmann::ordered_json;

// The schema's grammar; it must translate and parse.
std::optional<Grammar> Compile(const std::string& schema, JsonSchemaOptions options = {},
                               std::string* gbnf_out = nullptr) {
  StatusOr<JsonSchemaGrammar> g = JsonSchemaToGbnf(Json::parse(schema), options);
  EXPECT_TRUE(g.ok()) << schema << ": " << g.status();
  if (!g.ok()) return std::nullopt;
  if (gbnf_out != nullptr) *gbnf_out = g->gbnf;
  StatusOr<Grammar> parsed = Grammar::ParseGbnf(g->gbnf);
  EXPECT_TRUE(parsed.ok()) << schema << "\n" << g->gbnf << parsed.status();
  if (!parsed.ok()) return std::nullopt;
  return *std::move(parsed);
}

std::string Error(const std::string& schema, JsonSchemaOptions options = {}) {
  StatusOr<JsonSchemaGrammar> g = JsonSchemaToGbnf(Json::parse(schema), options);
  EXPECT_FALSE(g.ok()) << schema << " gave\n" << (g.ok() ? g->gbnf : "");
  if (g.ok()) return "";
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument) << schema;
  return std::string(StatusMessage(g.status()));
}

struct Case {
  std::string schema;
  std::vector<std::string> match, no_match;
};

void Check(const Case& c, JsonSchemaOptions options = {}) {
  std::string gbnf;
  const std::optional<Grammar> g = Compile(c.schema, options, &gbnf);
  if (!g) return;
  for (const std::string& s : c.match) {
    EXPECT_TRUE(g->Matches(s)) << c.schema << "\nshould match: " << s << "\n" << gbnf;
  }
  for (const std::string& s : c.no_match) {
    EXPECT_FALSE(g->Matches(s)) << c.schema << "\nshould not match: " << s << "\n" << gbnf;
  }
}

TEST(JsonSchemaTest, Primitives) {
  const Case cases[] = {
      {R"({"type": "string"})",
       {R"("abc")", R"("")", R"("a\"b")", R"("\u00e9\n\/")", "\"\xC3\xA9\xE6\x97\xA5\""},
       {"abc", R"("a)", R"("a"b")", R"("\x")", "\"a\nb\"", R"( "a")", R"("a" )", "\"\x7F\""}},
      {R"({"type": "integer"})",
       {"0", "-5", "123", "1234567890123456789"},
       {"01", "1.0", "1e3", "+1", "", "-", "12345678901234567890"}},
      {R"({"type": "number"})",
       {"0", "-1.5", "1e10", "2.5E-3", "1.0", "-0.001e+5"},
       {".5", "1.", "01", "1e", "NaN", "1e1234"}},
      {R"({"type": "boolean"})", {"true", "false"}, {"True", "1", ""}},
      {R"({"type": "null"})", {"null"}, {"nil", ""}},
      {R"({"type": ["string", "null"]})", {R"("a")", "null"}, {"1", "true"}},
      {R"({"type": ["integer", "number"]})", {"1", "1.5"}, {R"("1")"}},
      {R"({})",
       {"1", R"("a")", R"({"a": [1, 2, {"b": null}], "c": true})", "[]", "{ }", "[\n  1,\n  2\n]"},
       {"", "{", "[1,]", R"({"a" 1})", "{} "}},
      {"true", {"null", "[[]]"}, {"nul"}},
      {R"({"title": "T", "description": "d", "$schema": "https://json-schema.org/draft/2020-12/schema",
           "$id": "x", "$comment": "c", "default": 1, "examples": [1], "type": "integer"})",
       {"1"},
       {R"("1")"}},
  };
  for (const Case& c : cases) Check(c);
}

TEST(JsonSchemaTest, Objects) {
  const Case cases[] = {
      // Required and optional properties, in the schema's order.
      {R"({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
           "email": {"type": "string"}}, "required": ["name"]})",
       {R"({"name":"a"})", R"({"name":"a","age":3})", R"({"name":"a","email":"x"})",
        R"({"name":"a","age":3,"email":"x"})", R"({ "name" : "a" , "age" : 3 })",
        "{\n  \"name\": \"a\",\n  \"age\": 3\n}"},
       {"{}", R"({"age":3})", R"({"age":3,"name":"a"})", R"({"name":"a","name":"b"})",
        R"({"name":"a","other":1})", R"({"name":1})", R"({"name":"a",})", R"({"name":"a"} )",
        R"({  "name":"a"})", R"( {"name":"a"})"}},
      // All optional.
      {R"({"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})",
       {"{}", R"({"a":1})", R"({"b":2})", R"({"a":1,"b":2})", "{ }"},
       {R"({"b":2,"a":1})", R"({,"b":2})", R"({"a":1,})", R"({"c":1})"}},
      // Optional properties before and after the required one.
      {R"({"properties": {"a": {}, "b": {}, "c": {}}, "required": ["b"]})",
       {R"({"b":1})", R"({"a":1,"b":2})", R"({"b":1,"c":2})", R"({"a":[],"b":{},"c":"3"})"},
       {R"({"a":1})", R"({"a":1,"c":3})", "{}", R"({"c":1,"b":2})"}},
      // Many optional properties: any subset, in order.
      {R"({"properties": {"p1": {"const": 1}, "p2": {"const": 2}, "p3": {"const": 3},
           "p4": {"const": 4}}})",
       {"{}", R"({"p2":2,"p4":4})", R"({"p1":1,"p3":3})", R"({"p4":4})",
        R"({"p1":1,"p2":2,"p3":3,"p4":4})"},
       {R"({"p4":4,"p1":1})", R"({"p2":2,"p2":2})"}},
      // Additional properties after the declared ones, with other names.
      {R"({"properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": true})",
       {R"({"a":1})", R"({"a":1,"b":"x"})", R"({"a":1,"b":2,"ab":[]})", R"({"a":1,"a2":null})",
        R"({"a":1,"":2})", R"({"a":1,"\u0061":2})"},
       {R"({"a":1,"a":2})", R"({"b":1,"a":1})", R"({"b":1})"}},
      {R"({"type": "object", "additionalProperties": {"type": "integer"}})",
       {"{}", R"({"x":1,"y":2})", R"({"x":1, "x":2})"},
       {R"({"x":"a"})", R"({"x":1,})"}},
      {R"({"properties": {"ab": {"type": "integer"}, "ac": {"type": "integer"}},
           "additionalProperties": {"type": "string"}})",
       {R"({"ab":1})", R"({"a":"x"})", R"({"abc":"x"})", R"({"ac":1,"b":"y","ad":"z"})",
        R"({"x":"1","y":"2"})"},
       {R"({"ab":"x"})", R"({"a":1})", R"({"ac":"x"})", R"({"x":"1","ab":1})"}},
      // A bare object: any object.
      {R"({"type": "object"})", {"{}", R"({"a":{"b":[1]}})"}, {"[]", "null"}},
      {R"({"type": "object", "additionalProperties": false})", {"{}", "{ }"}, {R"({"a":1})"}},
      // Required without a property schema: any value.
      {R"({"type": "object", "required": ["id"]})",
       {R"({"id":1})", R"({"id":"x","more":2})"},
       {"{}", R"({"more":2})"}},
      {R"({"properties": {"a": false, "b": {"type": "integer"}}})",
       {"{}", R"({"b":1})"},
       {R"({"a":1})"}},
      // Property names that are not rule names.
      {R"({"properties": {"first name": {"type": "string"}, "a/b~c": {"type": "integer"},
           "日本": {"type": "boolean"}, "say \"hi\"": {"type": "null"}, "": {"const": 0}},
           "required": ["first name", "a/b~c", "日本", "say \"hi\"", ""]})",
       {R"({"first name":"x","a/b~c":1,"日本":true,"say \"hi\"":null,"":0})"},
       {R"({"first-name":"x","a/b~c":1,"日本":true,"say \"hi\"":null,"":0})"}},
      // Nesting.
      {R"({"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object",
           "properties": {"id": {"type": "integer"}, "tags": {"type": "array",
           "items": {"type": "string"}}}, "required": ["id"], "additionalProperties": false}}},
           "required": ["items"]})",
       {R"({"items":[{"id":1},{"id":2,"tags":["a","b"]}]})", R"({"items":[]})"},
       {R"({"items":[{"id":1,"x":2}]})", R"({"items":[{"tags":[]}]})"}},
  };
  for (const Case& c : cases) Check(c);
}

TEST(JsonSchemaTest, Arrays) {
  const Case cases[] = {
      {R"({"type": "array", "items": {"type": "integer"}})",
       {"[]", "[1]", "[1, 2,3]", "[\n  1,\n  2\n]", "[ ]"},
       {"[1,]", R"(["a"])", "[,1]", "[", "[1 2]"}},
      {R"({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3})",
       {"[true]", "[true,false,true]"},
       {"[]", "[true,true,true,true]"}},
      {R"({"type": "array", "minItems": 2})", {R"([1,"a"])", "[[],{},null]"}, {"[1]", "[]"}},
      {R"({"type": "array", "maxItems": 0})", {"[]"}, {"[1]"}},
      {R"({"type": "array", "items": false})", {"[]"}, {"[1]"}},
      // Tuples.
      {R"({"prefixItems": [{"type": "string"}, {"type": "integer"}]})",
       {R"(["a",1])", R"([ "a" , 1 ])"},
       {R"(["a"])", R"(["a",1,2])", R"([1,"a"])", "[]"}},
      {R"({"prefixItems": [{"type": "string"}], "items": {"type": "integer"}, "minItems": 1})",
       {R"(["a"])", R"(["a",1,2])"},
       {"[]", R"(["a","b"])"}},
      {R"({"prefixItems": [{"const": 1}, {"const": 2}], "minItems": 0})",
       {"[]", "[1]", "[1,2]"},
       {"[2]", "[1,2,3]"}},
      {R"({"prefixItems": [{"const": 1}, {"const": 2}, {"const": 3}], "items": true,
           "maxItems": 2})",
       {"[1,2]"},
       {"[1,2,3]", "[1]"}},
      {R"({"prefixItems": [{"const": 1}, false], "items": true, "minItems": 1})",
       {"[1]"},
       {"[1,2]", "[1,false]"}},
      // Draft 4-2019 tuples: items as an array, additionalItems for the rest.
      {R"({"items": [{"type": "integer"}], "additionalItems": {"type": "string"}})",
       {"[1]", R"([1,"a","b"])"},
       {R"(["a"])", "[1,2]"}},
      {R"({"items": [{"type": "integer"}, {"type": "null"}]})",
       {"[1,null]"},
       {"[1]", "[1,null,2]"}},
  };
  for (const Case& c : cases) Check(c);
}

TEST(JsonSchemaTest, EnumConstAndCombinations) {
  const Case cases[] = {
      {R"({"enum": ["red", "green", 1, null, {"a": [1, 2]}, true, "say \"hi\"\n"]})",
       {R"("red")", "1", "null", R"({"a":[1,2]})", "true", R"("say \"hi\"\n")"},
       {R"("blue")", R"({"a": [1,2]})", "2", "false"}},
      {R"({"type": "string", "enum": ["a", 1]})", {R"("a")"}, {"1"}},
      {R"({"type": "integer", "enum": [1, 2.0, 2.5, "3"]})", {"1", "2.0"}, {"2.5", R"("3")"}},
      {R"({"const": "fixed"})", {R"("fixed")"}, {R"("other")"}},
      {R"({"const": {"b": 1, "a": [true]}})", {R"({"b":1,"a":[true]})"}, {R"({"a":[true],"b":1})"}},
      {R"({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]})",
       {"1", R"("ab")"},
       {R"("abc")", "true"}},
      {R"({"oneOf": [{"type": "null"}, {"type": "boolean"}, false]})", {"null", "false"}, {"0"}},
      // Sibling keywords apply to each alternative.
      {R"({"anyOf": [{"required": ["a"]}, {"required": ["b"]}], "type": "object",
           "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})",
       {R"({"a":1})", R"({"b":2})", R"({"a":1,"b":2})"},
       {"{}", R"({"a":"x"})"}},
      {R"({"anyOf": [{"$ref": "#/$defs/x"}, {"type": "null"}], "default": null,
           "description": "pydantic's Optional", "$defs": {"x": {"type": "integer"}}})",
       {"1", "null"},
       {R"("1")"}},
      // An alternative with no type in common with the siblings drops out.
      {R"({"type": ["string", "null"], "anyOf": [{"type": "string", "maxLength": 1},
           {"type": "integer"}, {"type": ["number", "null"]}]})",
       {R"("a")", "null"},
       {"1", R"("ab")"}},
      {R"({"type": "number", "anyOf": [{"type": "integer", "minimum": 5}]})", {"5"}, {"5.5", "4"}},
      {R"({"allOf": [{"type": "integer"}], "title": "wrapped"})", {"5"}, {"5.5"}},
      {R"({"$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer"}},
           "required": ["a"]}}, "allOf": [{"$ref": "#/$defs/base"},
           {"properties": {"b": {"type": "string"}}, "required": ["b"]}]})",
       {R"({"a":1,"b":"x"})"},
       {R"({"b":"x"})", R"({"a":1})", R"({"b":"x","a":1})"}},
  };
  for (const Case& c : cases) Check(c);
}

TEST(JsonSchemaTest, Strings) {
  const Case cases[] = {
      {R"({"type": "string", "minLength": 2, "maxLength": 3})",
       {R"("ab")", R"("abc")", R"("a\n")", "\"\xE6\x97\xA5\xE6\x9C\xAC\"", R"("\u00e9\u00e9")"},
       {R"("a")", R"("abcd")", R"("\n")"}},
      {R"({"type": "string", "minLength": 1})", {R"("a")", R"("abcdefgh")"}, {R"("")"}},
      {R"({"type": "string", "maxLength": 0})", {R"("")"}, {R"("a")"}},
      {R"({"type": "string", "pattern": "^[a-z]+-\\d{2}$"})",
       {R"("abc-12")"},
       {R"("abc-1")", R"("ABC-12")", R"(" abc-12")"}},
      {R"({"type": "string", "pattern": "foo"})",
       {R"("foo")", R"("xfooy")", R"("a\"foo\n")"},
       {R"("fo")", R"("f\"oo")"}},
      {R"({"type": "string", "pattern": "^\\(\\d{3}\\) \\d{3}-\\d{4}$"})",
       {R"("(555) 123-4567")"},
       {R"("555-123-4567")"}},
      {R"({"type": "string", "format": "date"})",
       {R"("2024-02-29")", R"("1999-12-31")"},
       {R"("2024-13-01")", R"("2024-2-1")", R"("2024-00-10")", R"("2024-01-32")"}},
      {R"({"type": "string", "format": "time"})",
       {R"("12:34:56Z")", R"("23:59:60.123+05:30")", R"("00:00:00-23:59")"},
       {R"("24:00:00Z")", R"("12:34:56")", R"("12:60:00Z")"}},
      {R"({"type": "string", "format": "date-time"})",
       {R"("2024-01-01T00:00:00Z")", R"("2024-01-01t00:00:00.5-01:00")"},
       {R"("2024-01-01 00:00:00Z")", R"("2024-01-01")"}},
      {R"({"type": "string", "format": "uuid"})",
       {R"("123e4567-e89b-12d3-a456-426614174000")", R"("123E4567-E89B-12D3-A456-426614174000")"},
       {R"("123e4567e89b12d3a456426614174000")", R"("123e4567-e89b-12d3-a456-42661417400")"}},
      {R"({"type": "string", "format": "email"})", {R"("anything")"}, {"1"}},
  };
  for (const Case& c : cases) Check(c);
}

TEST(JsonSchemaTest, References) {
  const Case cases[] = {
      {R"({"$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer"},
           "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
           "required": ["value", "next"]}}, "$ref": "#/$defs/node"})",
       {R"({"value":1,"next":null})", R"({"value":1,"next":{"value":2,"next":null}})"},
       {R"({"value":1})", R"({"value":1,"next":{"value":2}})"}},
      {R"({"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}})",
       {"{}", R"({"children":[{},{"children":[]}]})"},
       {R"({"children":[1]})"}},
      {R"({"definitions": {"x": {"type": "integer"}}, "type": "array",
           "items": {"$ref": "#/definitions/x"}})",
       {"[1,2]"},
       {R"(["a"])"}},
      {R"({"properties": {"a": {"type": "string"}, "b": {"$ref": "#/properties/a"}},
           "required": ["a", "b"]})",
       {R"({"a":"x","b":"y"})"},
       {R"({"a":"x","b":1})"}},
      {R"({"$defs": {"a/b": {"const": 1}, "c%d": {"const": 2}},
           "prefixItems": [{"$ref": "#/$defs/a~1b"}, {"$ref": "#/$defs/c%25d"}]})",
       {"[1,2]"},
       {"[2,1]"}},
      // Mutual recursion through arrays.
      {R"({"$defs": {"tree": {"type": "array", "items": {"$ref": "#/$defs/leaf"}},
           "leaf": {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/tree"}]}},
           "$ref": "#/$defs/tree"})",
       {"[]", "[1,[2,[3,[]]]]"},
       {"1", "[[\"x\"]]"}},
  };
  for (const Case& c : cases) Check(c);
}

// Schemas as pydantic and OpenAI's structured-output examples write them.
TEST(JsonSchemaTest, RealWorldSchemas) {
  Check({R"({"$defs": {
      "Address": {"properties": {"street": {"title": "Street", "type": "string"},
                                 "zip": {"anyOf": [{"type": "string"}, {"type": "null"}],
                                         "default": null, "title": "Zip"}},
                  "required": ["street"], "title": "Address", "type": "object"},
      "Role": {"enum": ["admin", "user"], "title": "Role", "type": "string"}},
    "properties": {
      "name": {"title": "Name", "type": "string", "minLength": 1},
      "role": {"$ref": "#/$defs/Role"},
      "address": {"$ref": "#/$defs/Address"},
      "friends": {"items": {"type": "integer"}, "title": "Friends", "type": "array"},
      "score": {"exclusiveMinimum": 0, "maximum": 100, "title": "Score", "type": "number"}},
    "required": ["name", "role", "address"], "title": "User", "type": "object"})",
         {R"({"name": "Ann", "role": "admin", "address": {"street": "Main", "zip": null},
              "friends": [1, 2], "score": 99.5})",
          R"({"name":"B","role":"user","address":{"street":"x","zip":"123"},"score":100})"},
         {R"({"name": "", "role": "admin", "address": {"street": "Main"}})",
          R"({"name": "A", "role": "root", "address": {"street": "Main"}})",
          R"({"name": "A", "role": "user", "address": {"street": "Main"}, "score": 0})",
          R"({"name": "A", "role": "user", "address": {"street": "Main"}, "score": 100.5})"}});
  Check({R"({"type": "object", "properties": {
      "steps": {"type": "array", "items": {"type": "object", "properties": {
          "explanation": {"type": "string"}, "output": {"type": "string"}},
          "required": ["explanation", "output"], "additionalProperties": false}},
      "final_answer": {"type": "string"}},
    "required": ["steps", "final_answer"], "additionalProperties": false})",
         {"{\n  \"steps\": [\n    {\n      \"explanation\": \"a\",\n      \"output\": "
          "\"b\"\n    }\n  ],\n  \"final_answer\": \"c\"\n}",
          R"({"steps":[],"final_answer":"c"})"},
         {R"({"steps":[{"explanation":"a"}],"final_answer":"c"})",
          "{\n" + std::string(21, ' ') + "\"steps\": [], \"final_answer\": \"c\"}"}},
        {.strict = true});
}

// Integers: every value in a window, against the bounds.
TEST(JsonSchemaTest, IntegerRangesAreExact) {
  struct Range {
    std::string keywords;
    std::optional<int64_t> lo, hi;  // inclusive
  };
  const Range ranges[] = {
      {R"("minimum": -5, "maximum": 12)", -5, 12},
      {R"("minimum": 0, "maximum": 0)", 0, 0},
      {R"("minimum": 1, "maximum": 9)", 1, 9},
      {R"("minimum": 7, "maximum": 123)", 7, 123},
      {R"("minimum": -123, "maximum": -7)", -123, -7},
      {R"("minimum": -1000, "maximum": 1000)", -1000, 1000},
      {R"("minimum": 10, "maximum": 99)", 10, 99},
      {R"("minimum": 100, "maximum": 100)", 100, 100},
      {R"("minimum": 99, "maximum": 1001)", 99, 1001},
      {R"("minimum": 123, "maximum": 1234)", 123, 1234},
      {R"("minimum": 15)", 15, std::nullopt},
      {R"("minimum": 0)", 0, std::nullopt},
      {R"("minimum": -50)", -50, std::nullopt},
      {R"("maximum": -3)", std::nullopt, -3},
      {R"("maximum": 0)", std::nullopt, 0},
      {R"("maximum": 250)", std::nullopt, 250},
      {R"("exclusiveMinimum": 5, "exclusiveMaximum": 10)", 6, 9},
      {R"("exclusiveMinimum": -1, "maximum": 1)", 0, 1},
      {R"("minimum": 1.5, "maximum": 7.9)", 2, 7},
      {R"("minimum": -7.9, "maximum": -1.5)", -7, -2},
      {R"("exclusiveMinimum": 2.5, "exclusiveMaximum": 3.5)", 3, 3},
      {R"("minimum": 3, "exclusiveMinimum": 3)", 4, std::nullopt},
      {R"("minimum": 3, "exclusiveMinimum": true)", 4, std::nullopt},
      {R"("maximum": 1e3)", std::nullopt, 1000},
      {R"("minimum": 5, "minimum2": 0)", 5, std::nullopt},
  };
  for (const Range& r : ranges) {
    const std::string schema = "{\"type\": \"integer\", " + r.keywords + "}";
    std::string gbnf;
    const std::optional<Grammar> g = Compile(schema, {}, &gbnf);
    if (!g) continue;
    for (int64_t n = -1500; n <= 1500; ++n) {
      const bool in = (!r.lo || n >= *r.lo) && (!r.hi || n <= *r.hi);
      ASSERT_EQ(g->Matches(std::to_string(n)), in) << schema << " on " << n << "\n" << gbnf;
    }
    EXPECT_FALSE(g->Matches("-0")) << schema;
    EXPECT_FALSE(g->Matches("007")) << schema;
    EXPECT_FALSE(g->Matches("5.0")) << schema;
    if (!r.hi) {
      EXPECT_TRUE(g->Matches("9999999999999999999")) << schema;
      EXPECT_FALSE(g->Matches("10000000000000000000")) << schema;
    }
    if (!r.lo) {
      EXPECT_TRUE(g->Matches("-9999999999999999999")) << schema;
    }
  }
}

TEST(JsonSchemaTest, IntegerRangesWithManyDigits) {
  const Case cases[] = {
      {R"({"type": "integer", "minimum": 123456789012, "maximum": 123456789123})",
       {"123456789012", "123456789099", "123456789123"},
       {"123456789011", "123456789124", "123456789200"}},
      // Beyond 64 bits JSON numbers are doubles: 1e22 is exact.
      {R"({"type": "integer", "minimum": 1e22})",
       {"10000000000000000000000", "99999999999999999999999"},
       {"9999999999999999999999", "100000000000000000000000"}},
      {R"({"type": "integer", "minimum": -9223372036854775808, "maximum": 9223372036854775807})",
       {"-9223372036854775808", "9223372036854775807", "0"},
       {"-9223372036854775809", "9223372036854775808"}},
  };
  for (const Case& c : cases) Check(c);
}

// Numbers: every multiple of 0.001 in a window, in each spelling (up to 4 fraction digits and
// trailing zeros), against the bounds.
TEST(JsonSchemaTest, NumberRangesAreExact) {
  struct Range {
    std::string keywords;
    std::optional<int64_t> lo, hi;  // in thousandths
    bool lo_inclusive = true, hi_inclusive = true;
  };
  const Range ranges[] = {
      {R"("minimum": 1.5)", 1500, std::nullopt},
      {R"("exclusiveMinimum": 1.5)", 1500, std::nullopt, false},
      {R"("maximum": -0.25)", std::nullopt, -250},
      {R"("exclusiveMaximum": -0.25)", std::nullopt, -250, true, false},
      {R"("minimum": -1.25, "maximum": 2.5)", -1250, 2500},
      {R"("exclusiveMinimum": 0, "exclusiveMaximum": 1)", 0, 1000, false, false},
      {R"("minimum": 0.05, "maximum": 0.5)", 50, 500},
      {R"("minimum": -3, "maximum": -1.75)", -3000, -1750},
      {R"("minimum": 1.01, "maximum": 1.09)", 1010, 1090},
      {R"("minimum": 1.001, "exclusiveMaximum": 1.002)", 1001, 1002, true, false},
      {R"("minimum": 0, "maximum": 0)", 0, 0},
      {R"("minimum": -0.5, "exclusiveMaximum": 0)", -500, 0, true, false},
      {R"("exclusiveMinimum": 0)", 0, std::nullopt, false},
      {R"("maximum": 0)", std::nullopt, 0},
      {R"("minimum": 2, "maximum": 3)", 2000, 3000},
      {R"("minimum": 9.99, "maximum": 10.01)", 9990, 10010},
      {R"("minimum": 0.125, "maximum": 0.125)", 125, 125},
      {R"("minimum": 1e-2, "maximum": 2E1)", 10, 20000},
  };
  // n thousandths written with `digits` fraction digits (0..4), if it can be.
  auto spell = [](int64_t n, int digits) -> std::optional<std::string> {
    static const int64_t kPow[] = {1000, 100, 10, 1};
    if (digits <= 3 && n % kPow[digits] != 0) return std::nullopt;
    const int64_t a = n < 0 ? -n : n;
    char text[48];
    snprintf(text, sizeof(text), "%s%lld.%03lld0", n < 0 ? "-" : "",
             static_cast<long long>(a / 1000), static_cast<long long>(a % 1000));
    std::string s = text;
    const size_t point = s.find('.');
    return s.substr(0, digits == 0 ? point : point + 1 + digits);
  };
  for (const Range& r : ranges) {
    const std::string schema = "{\"type\": \"number\", " + r.keywords + "}";
    std::string gbnf;
    const std::optional<Grammar> g = Compile(schema, {}, &gbnf);
    if (!g) continue;
    for (int64_t n = -3500; n <= 11000; n += (n > -2000 && n < 3000) || (n > 9000) ? 1 : 7) {
      const bool in = (!r.lo || n > *r.lo || (n == *r.lo && r.lo_inclusive)) &&
                      (!r.hi || n < *r.hi || (n == *r.hi && r.hi_inclusive));
      for (int digits = 0; digits <= 4; ++digits) {
        const std::optional<std::string> s = spell(n, digits);
        if (!s) continue;
        ASSERT_EQ(g->Matches(*s), in) << schema << " on " << *s << "\n" << gbnf;
      }
    }
    EXPECT_FALSE(g->Matches("1e0")) << schema;  // no exponent with bounds
    EXPECT_FALSE(g->Matches(".5")) << schema;
    EXPECT_FALSE(g->Matches("01.5")) << schema;
  }
}

TEST(JsonSchemaTest, PropertyOrderFollowsTheJsonType) {
  const std::string schema =
      R"({"properties": {"b": {"const": 1}, "a": {"const": 2}}, "required": ["b", "a"]})";
  StatusOr<JsonSchemaGrammar> ordered = JsonSchemaToGbnf(Json::parse(schema));
  StatusOr<JsonSchemaGrammar> sorted = JsonSchemaToGbnf(nlohmann::json::parse(schema));
  ASSERT_TRUE(ordered.ok() && sorted.ok());
  StatusOr<Grammar> g1 = Grammar::ParseGbnf(ordered->gbnf), g2 = Grammar::ParseGbnf(sorted->gbnf);
  ASSERT_TRUE(g1.ok() && g2.ok());
  EXPECT_TRUE(g1->Matches(R"({"b":1,"a":2})"));
  EXPECT_FALSE(g1->Matches(R"({"a":2,"b":1})"));
  EXPECT_TRUE(g2->Matches(R"({"a":2,"b":1})"));
}

TEST(JsonSchemaTest, GrammarShape) {
  StatusOr<JsonSchemaGrammar> g = JsonSchemaToGbnf(Json::parse(
      R"({"type": "object", "properties": {"x": {"type": "integer", "minimum": 0}}, "required": ["x"]})"));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT(g->gbnf, testing::StartsWith("root ::= \"{\" space root-x-kv space \"}\"\n"));
  EXPECT_THAT(g->gbnf, HasSubstr("\nspace ::= | \" \" | \"\\n\" [ \\t]{0,20}\n"));
  EXPECT_THAT(g->ignored, IsEmpty());
  // Rule names are [a-zA-Z0-9-]+.
  for (size_t start = 0; start < g->gbnf.size();) {
    const size_t end = g->gbnf.find(" ::= ", start);
    ASSERT_NE(end, std::string::npos);
    const std::string name = g->gbnf.substr(start, end - start);
    EXPECT_THAT(name, testing::MatchesRegex("[a-zA-Z0-9-]+"));
    start = g->gbnf.find('\n', end) + 1;
  }
}

TEST(JsonSchemaTest, JsonObject) {
  StatusOr<Grammar> g = Grammar::ParseGbnf(JsonObjectGbnf());
  ASSERT_TRUE(g.ok()) << g.status() << "\n" << JsonObjectGbnf();
  for (const char* s : {"{}", R"({"a":1})", R"({"a": {"b": [1, "x", null, true, 2.5e3]}})",
                        "{\n  \"k\": \"v\"\n}"}) {
    EXPECT_TRUE(g->Matches(s)) << s;
  }
  for (const char* s : {"[]", "1", R"("a")", "{", R"({"a":1} )", R"({"a":1,})", "null"}) {
    EXPECT_FALSE(g->Matches(s)) << s;
  }
}

TEST(JsonSchemaTest, IgnoredKeywords) {
  StatusOr<JsonSchemaGrammar> g = JsonSchemaToGbnf(Json::parse(R"({
      "type": "object", "patternProperties": {"^x": {}},
      "properties": {"a": {"type": "string", "format": "email"},
                     "b": {"type": "integer", "multipleOf": 2},
                     "c": {"type": "string", "pattern": "^a+$", "maxLength": 3},
                     "d": {"$ref": "#/$defs/d", "minimum": 1},
                     "e": {"type": "string", "minLength": 100000}},
      "required": ["a"], "$defs": {"d": {"type": "integer"}}})"));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT(g->ignored,
              UnorderedElementsAre("(root): patternProperties", "/properties/a: format",
                                   "/properties/b: multipleOf", "/properties/c: maxLength",
                                   "/properties/d: minimum", "/properties/e: minLength"));
  // Keywords inside an alternative that merges with its siblings are reported there.
  StatusOr<JsonSchemaGrammar> merged = JsonSchemaToGbnf(
      Json::parse(R"({"type": "integer", "anyOf": [{"multipleOf": 2}], "not": {}})"));
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_THAT(merged->ignored, UnorderedElementsAre("(root): not", "/anyOf/0: multipleOf"));
  StatusOr<Grammar> parsed = Grammar::ParseGbnf(g->gbnf);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->Matches(R"({"a":"not an email","b":3,"c":"aaaa","d":0,"e":""})"));
  EXPECT_FALSE(parsed->Matches(R"({"a":"x","c":"ab"})"));
}

TEST(JsonSchemaTest, StrictMode) {
  const JsonSchemaOptions strict{.strict = true};
  EXPECT_THAT(Error(R"({"type": "string", "format": "email"})", strict),
              AllOf(HasSubstr("json_schema (root)"), HasSubstr("`format`"), HasSubstr("email")));
  EXPECT_THAT(Error(R"({"properties": {"n": {"type": "integer", "multipleOf": 3}}})", strict),
              AllOf(HasSubstr("json_schema /properties/n"), HasSubstr("`multipleOf`")));
  EXPECT_THAT(Error(R"({"type": "object", "x-custom": 1})", strict), HasSubstr("`x-custom`"));
  EXPECT_THAT(Error(R"({"type": "string", "pattern": "a", "minLength": 2})", strict),
              HasSubstr("`minLength`"));
  // additionalProperties absent is false.
  Check({R"({"type": "object"})", {"{}"}, {R"({"a":1})"}}, strict);
  Check({R"({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
            "additionalProperties": false})",
         {R"({"a":1})"},
         {R"({"a":1,"b":2})"}},
        strict);
}

TEST(JsonSchemaTest, Errors) {
  const std::pair<std::string, std::vector<std::string>> cases[] = {
      {"5", {"json_schema (root): a schema must be an object or a boolean"}},
      {"false", {"json_schema (root): the schema `false` allows no value"}},
      {R"({"type": "strin"})", {"json_schema /type: unknown type \"strin\""}},
      {R"({"type": []})", {"json_schema /type: must be a type name"}},
      {R"({"properties": {"age": {"type": "integer", "minimum": "5"}}})",
       {"json_schema /properties/age/minimum: must be a number"}},
      {R"({"type": "array", "minItems": 3, "maxItems": 2})",
       {"json_schema (root): minItems 3 is above maxItems 2"}},
      {R"({"prefixItems": [{}, {}], "minItems": 3})", {"minItems 3", "at most 2"}},
      {R"({"type": "array", "minItems": -1})", {"json_schema /minItems: must be a non-negative"}},
      {R"({"type": "string", "minLength": 1.5})",
       {"json_schema /minLength: must be a non-negative"}},
      {R"({"type": "string", "minLength": 3, "maxLength": 2})",
       {"minLength 3 is above maxLength 2"}},
      {R"({"$ref": "#/$defs/missing"})",
       {"json_schema /$ref: `#/$defs/missing` does not resolve", "no `$defs`"}},
      {R"({"$defs": {}, "items": {"$ref": "#/$defs/missing"}})",
       {"json_schema /items/$ref:", "no `missing` in /$defs"}},
      {R"({"$ref": "https://example.com/s.json"})",
       {"json_schema /$ref:", "outside this document"}},
      {R"({"$ref": "#anchor"})", {"json_schema /$ref:", "not a JSON pointer"}},
      {R"({"$ref": 5})", {"json_schema /$ref: must be a string"}},
      {R"({"$defs": {"a": {"type": "nope"}}, "properties": {"x": {"$ref": "#/$defs/a"}}})",
       {"json_schema /$defs/a/type: unknown type"}},
      {R"({"type": "string", "pattern": 5})", {"json_schema /pattern: must be a string"}},
      {R"j({"type": "string", "pattern": "(?=x)"})j",
       {"json_schema /pattern: regex: lookahead `(?=` at position 0"}},
      {R"({"properties": {"p": {"type": "string", "pattern": "a{5000}"}}})",
       {"json_schema /properties/p/pattern:", "above 1000"}},
      {R"({"type": "integer", "minimum": 5, "maximum": 3})",
       {"json_schema (root): no number satisfies minimum 5", "maximum 3"}},
      {R"({"type": "number", "exclusiveMinimum": 1, "maximum": 1})", {"no number satisfies"}},
      {R"({"type": "integer", "minimum": 1.2, "maximum": 1.8})", {"no integer satisfies"}},
      {R"({"properties": {"a": false}, "required": ["a"]})",
       {"json_schema /properties/a: the property is required"}},
      {R"({"anyOf": []})", {"json_schema /anyOf: must be a non-empty array"}},
      {R"({"oneOf": [false]})", {"json_schema /oneOf: every alternative is `false`"}},
      {R"({"allOf": 1})", {"json_schema /allOf: must be a non-empty array"}},
      {R"({"allOf": [false]})", {"json_schema /allOf/0: the schema `false`"}},
      {R"({"allOf": [{"type": "string"}, {"type": "integer"}]})",
       {"json_schema /allOf/1: no type is allowed by every schema"}},
      {R"({"enum": []})", {"json_schema /enum: must be a non-empty array"}},
      {R"({"type": "string", "enum": [1]})", {"no `enum` value"}},
      {R"({"properties": []})", {"json_schema /properties: must be an object"}},
      {R"({"required": "a"})", {"json_schema /required: must be an array"}},
      {R"({"type": "object", "additionalProperties": 1})",
       {"json_schema /additionalProperties: must be a boolean or a schema"}},
      {R"({"items": 1})", {"json_schema /items: must be a schema"}},
      {R"({"properties": {"a": {"items": [1]}}})",
       {"json_schema /properties/a/items/0: a schema must be an object or a boolean"}},
  };
  for (const auto& [schema, parts] : cases) {
    const std::string message = Error(schema);
    for (const std::string& part : parts) EXPECT_THAT(message, HasSubstr(part)) << schema;
  }
}

// A recursion that consumes nothing is left to the grammar parser, which names it: a rule that
// matches nothing (only the recursion), or left recursion (beside an alternative that ends).
TEST(JsonSchemaTest, EmptyRecursionIsRefusedByTheParser) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
           "$ref": "#/$defs/a"})",
       "matches nothing"},
      {R"({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}},
           "$ref": "#/$defs/a"})",
       "left recursion"},
  };
  for (const auto& [schema, message] : cases) {
    StatusOr<JsonSchemaGrammar> g = JsonSchemaToGbnf(Json::parse(schema));
    ASSERT_TRUE(g.ok()) << g.status();
    StatusOr<Grammar> parsed = Grammar::ParseGbnf(g->gbnf);
    ASSERT_FALSE(parsed.ok()) << schema;
    EXPECT_THAT(std::string(StatusMessage(parsed.status())), HasSubstr(message)) << schema;
  }
}

// `$defs/d_k` with properties a and b, both {"allOf": [{"$ref": "#/$defs/d_{k+1}"}]}: such an
// allOf was merged inline at every use, translating d_41 2^41 times. It is now that reference,
// one rule per definition.
Json AllOfChain(const std::string& extra_part) {
  Json defs = Json::object();
  for (int k = 0; k <= 40; ++k) {
    const Json prop =
        Json::parse(StrCat(R"({"allOf": [{"$ref": "#/$defs/d_)", k + 1, R"("})", extra_part, "]}"));
    defs[StrCat("d_", k)] = {{"type", "object"}, {"properties", {{"a", prop}, {"b", prop}}}};
  }
  defs["d_41"] = {{"type", "object"}};
  return {{"$defs", defs}, {"$ref", "#/$defs/d_0"}};
}

TEST(JsonSchemaTest, AllOfOfOneRefIsTranslatedOnce) {
  StatusOr<JsonSchemaGrammar> g = JsonSchemaToGbnf(AllOfChain(""));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_LT(g->gbnf.size(), 20000u);
  Check({AllOfChain("").dump(),
         {"{}", R"({"a":{"b":{}}})", R"({"a":{},"b":{"a":{"a":{}}}})"},
         {R"({"a":1})", R"({"b":{},"a":{}})"}});
  // With annotations beside it, and a `true` part, it is still that reference.
  Check({R"({"$defs": {"x": {"type": "integer"}}, "properties": {"p": {"description": "d",
            "allOf": [{"$ref": "#/$defs/x", "title": "t"}, true]}}, "required": ["p"]})",
         {R"({"p":1})"},
         {R"({"p":"1"})"}});
}

// An allOf that really merges is translated at each use: the chain above with one more part
// would be 2^41 translations. The visit budget stops it.
TEST(JsonSchemaTest, MergedAllOfExpansionHitsTheVisitBudget) {
  StatusOr<JsonSchemaGrammar> g = JsonSchemaToGbnf(AllOfChain(R"(, {"type": "object"})"));
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(StatusMessage(g.status())),
              AllOf(HasSubstr("the schema is too complex"), HasSubstr("more than 100000")));
}

TEST(JsonSchemaTest, GrammarSizeBudget) {
  const Json large = {{"enum", {std::string(kMaxSchemaGbnfBytes, 'x')}}};
  StatusOr<JsonSchemaGrammar> g = JsonSchemaToGbnf(large);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(StatusMessage(g.status())),
              AllOf(HasSubstr("the schema is too complex"), HasSubstr("4194304 bytes")));
  // A regex over its own limits names the place.
  EXPECT_THAT(Error(Json{{"pattern", std::string(20000, 'a')}}.dump()),
              AllOf(HasSubstr("json_schema /pattern: regex:"), HasSubstr("at most 16384")));
}

// Many properties: rule names were found by trying "-2", "-3", ... one by one, and the inline
// tail of the members was rebuilt per property (both quadratic); `required` was looked up one
// property at a time.
TEST(JsonSchemaTest, ManyPropertiesTranslateInLinearTime) {
  constexpr int kProperties = 5000;
  Json optional = Json::object(), required_props = Json::object();
  Json required = Json::array();
  for (int i = 0; i < kProperties; ++i) {
    optional[StrCat("p", i)] = {{"type", "integer"}};
    required_props[StrCat("p", i)] = {{"type", "integer"}};
    required.push_back(StrCat("p", i));
  }
  for (const Json& schema :
       {Json{{"type", "object"}, {"properties", optional}}, Json{{"type", "object"},
                                                                 {"properties", required_props},
                                                                 {"required", required},
                                                                 {"additionalProperties", true}}}) {
    StatusOr<JsonSchemaGrammar> g = JsonSchemaToGbnf(schema);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_LT(g->gbnf.size(), 200u * kProperties);
  }
}

// A pattern's helper rules get names no other rule has.
TEST(JsonSchemaTest, PatternHelperRulesGetFreshNames) {
  std::string gbnf;
  const std::string a(30, 'a'), b(30, 'b'), c(30, 'c');
  const std::string pattern = StrCat("^((", a, ")?(", b, ")?(", c, ")?d?){2}$");
  const Json schema = {
      {"type", "object"},
      {"properties",
       {{"p-pattern-1",
         {{"type", "object"}, {"properties", {{"x", {{"type", "integer"}}}}}, {"required", {"x"}}}},
        {"p", {{"type", "string"}, {"pattern", pattern}}}}},
      {"required", {"p-pattern-1", "p"}}};
  const std::optional<Grammar> g = Compile(schema.dump(), {}, &gbnf);
  ASSERT_TRUE(g);
  EXPECT_THAT(gbnf, AllOf(HasSubstr("\nroot-p-pattern-1 ::= \"{\""),
                          HasSubstr("\nroot-p-pattern-1-2 ::= ")));
  EXPECT_TRUE(g->Matches(StrCat(R"({"p-pattern-1":{"x":1},"p":")", a, c, "d", b, "\"}")));
  EXPECT_TRUE(g->Matches(R"({"p-pattern-1":{"x":1},"p":""})"));
  EXPECT_FALSE(g->Matches(R"({"p-pattern-1":{"x":1},"p":"ccc"})"));
}

// A long property name beside additionalProperties: the keys that are not it were written by
// recursion per character, nesting (copying) the text of the rest of the name at each level:
// quadratic, and a stack overflow for a name of some 10^5 characters.
TEST(JsonSchemaTest, LongPropertyNameBesideAdditionalProperties) {
  const std::string name(1500, 'k');
  std::string gbnf;
  const std::optional<Grammar> g = Compile(
      Json{{"properties", {{name, {{"type", "integer"}}}}}, {"additionalProperties", true}}.dump(),
      {}, &gbnf);
  ASSERT_TRUE(g);
  EXPECT_LT(gbnf.size(), 200u * name.size());
  EXPECT_TRUE(g->Matches(StrCat("{\"", name, "\":1}")));
  EXPECT_TRUE(g->Matches(StrCat("{\"", name.substr(1), "\":\"x\"}")));
  EXPECT_FALSE(g->Matches(StrCat("{\"", name, "\":\"x\"}")));
  EXPECT_THAT(Error(Json{{"properties", {{std::string(60000, 'k'), Json::object()}}},
                         {"additionalProperties", true}}
                        .dump()),
              HasSubstr("the schema is too complex"));
}

// Optional prefixItems: each nested the text of the items after it (quadratic).
TEST(JsonSchemaTest, ManyPrefixItemsTranslateInLinearTime) {
  constexpr int kItems = 8000;
  Json items = Json::array();
  for (int i = 0; i < kItems; ++i) items.push_back({{"type", "integer"}});
  StatusOr<JsonSchemaGrammar> g = JsonSchemaToGbnf(Json{{"prefixItems", items}, {"minItems", 1}});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_LT(g->gbnf.size(), 50u * kItems);
  Check({R"({"prefixItems": [{"type": "integer"}, {"type": "string"}, {"type": "null"}],
             "minItems": 1, "items": {"type": "boolean"}, "maxItems": 5})",
         {"[1]", R"([1,"a"])", R"([1,"a",null,true])", R"([1,"a",null,true,false])"},
         {"[]", R"([1,null])", R"([1,"a",null,true,false,true])"}});
}

}  // namespace
}  // namespace kiln::grammar
