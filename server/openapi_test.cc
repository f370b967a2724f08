// docs/openapi.json against the route table (server/http_routes.cc), both ways, and against
// the embedded copy kilnd serves; plus the document's structure (OpenAPI 3.1, every $ref
// resolves). tests/system/test_openapi.py validates it fully and fuzzes the server from it.
#include "server/openapi.h"

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "config/config.h"
#include "engine/testing/source_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/http_routes.h"

namespace kiln {
namespace {

using nlohmann::json;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string OpenApiPath() { return std::string(TestSourceDir()) + "/docs/openapi.json"; }

json Document() {
  json doc = json::parse(ReadFile(OpenApiPath()), nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(doc.is_discarded()) << OpenApiPath() << " is not valid JSON";
  return doc;
}

std::string Upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

constexpr const char* kMethods[] = {"get",     "put",  "post",  "delete",
                                    "options", "head", "patch", "trace"};

TEST(OpenApiTest, EmbeddedDocumentIsTheCheckedInFile) {
  // Not EXPECT_EQ: a difference would print both documents whole.
  EXPECT_TRUE(OpenApiJson() == ReadFile(OpenApiPath()))
      << "kilnd serves a stale copy of docs/openapi.json: rebuild (CMake re-embeds it)";
}

TEST(OpenApiTest, IsOpenApi31) {
  const json doc = Document();
  EXPECT_EQ(doc.value("openapi", ""), "3.1.0");
  EXPECT_TRUE(doc["info"].contains("title") && doc["info"].contains("version"));
  const json& bearer = doc["components"]["securitySchemes"]["bearer"];
  EXPECT_EQ(bearer.value("type", ""), "http");
  EXPECT_EQ(bearer.value("scheme", ""), "bearer");
}

// Every {"$ref": "#/..."} names something in the document.
void CheckRefs(const json& doc, const json& node, const std::string& where) {
  if (node.is_object()) {
    if (auto it = node.find("$ref"); it != node.end()) {
      ASSERT_TRUE(it->is_string()) << where;
      const std::string ref = it->get<std::string>();
      ASSERT_EQ(ref.rfind("#/", 0), 0u) << where << ": only local references: " << ref;
      EXPECT_TRUE(doc.contains(json::json_pointer(ref.substr(1))))
          << where << ": $ref " << ref << " does not resolve";
    }
    for (const auto& [key, value] : node.items()) CheckRefs(doc, value, where + "/" + key);
  } else if (node.is_array()) {
    for (size_t i = 0; i < node.size(); ++i) {
      CheckRefs(doc, node[i], where + "/" + std::to_string(i));
    }
  }
}

TEST(OpenApiTest, EveryRefResolves) {
  const json doc = Document();
  CheckRefs(doc, doc, "");
}

TEST(OpenApiTest, DocumentsExactlyTheRouteTable) {
  const json doc = Document();
  std::set<std::string> documented, routed;
  for (const auto& [path, item] : doc["paths"].items()) {
    for (const char* m : kMethods) {
      if (item.contains(m)) documented.insert(Upper(m) + " " + path);
    }
  }
  for (const HttpRoute& r : HttpRoutes()) {
    routed.insert(std::string(r.method) + " " + std::string(r.path));
  }
  for (const std::string& r : routed) {
    EXPECT_TRUE(documented.count(r)) << r << " is served (server/http_routes.cc) but not in "
                                     << "docs/openapi.json";
  }
  for (const std::string& d : documented) {
    EXPECT_TRUE(routed.count(d)) << d << " is in docs/openapi.json but not in the route table";
  }
}

// An operation needs the bearer key unless its route's class is open by default
// (server.auth.open); x-kiln-access-class names the class.
TEST(OpenApiTest, SecurityFollowsTheAccessClass) {
  const json doc = Document();
  const std::vector<std::string> open = config::AuthConfig().open;
  const json bearer = json::array({{{"bearer", json::array()}}});
  EXPECT_EQ(doc["security"], bearer) << "the default: a key";
  for (const HttpRoute& r : HttpRoutes()) {
    const std::string name = std::string(r.method) + " " + std::string(r.path);
    const json& item = doc["paths"][std::string(r.path)];
    std::string method(r.method);
    std::transform(method.begin(), method.end(), method.begin(), ::tolower);
    if (!item.contains(method)) continue;  // DocumentsExactlyTheRouteTable says so
    const json& op = item[method];
    const std::string cls(RouteClassName(r.access));
    EXPECT_EQ(op.value("x-kiln-access-class", ""), cls) << name;
    const bool is_open = std::find(open.begin(), open.end(), cls) != open.end();
    ASSERT_TRUE(op.contains("security")) << name << ": say its security explicitly";
    EXPECT_EQ(op["security"], is_open ? json::array() : bearer) << name << " (class " << cls << ")";
    const json& responses = op["responses"];
    EXPECT_EQ(responses.contains("401") && responses.contains("403"), !is_open)
        << name << ": 401 and 403 are documented exactly where a key is needed";
    // The metrics listener is a server of its own.
    const bool metrics_port = r.port == RoutePort::kMetrics;
    EXPECT_EQ(item.contains("servers"), metrics_port) << name;
  }
}

// Path parameters are declared for every `{name}` in the template, and only those.
TEST(OpenApiTest, PathParametersMatchTheTemplates) {
  const json doc = Document();
  for (const auto& [path, item] : doc["paths"].items()) {
    std::set<std::string> in_template;
    for (size_t p = path.find('{'); p != std::string::npos; p = path.find('{', p + 1)) {
      in_template.insert(path.substr(p + 1, path.find('}', p) - p - 1));
    }
    for (const char* m : kMethods) {
      if (!item.contains(m)) continue;
      std::set<std::string> declared;
      for (json param : item[m].value("parameters", json::array())) {
        if (param.contains("$ref")) {
          param = doc[json::json_pointer(param["$ref"].get<std::string>().substr(1))];
        }
        if (param.value("in", "") == "path") declared.insert(param.value("name", ""));
      }
      EXPECT_EQ(declared, in_template) << m << " " << path;
    }
  }
}

}  // namespace
}  // namespace kiln
