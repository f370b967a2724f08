// Every HTTP route kilnd serves, in one table: the method, the path template and the access
// class that decides which API-key scope it needs (server.auth). The table is the authority:
// the HTTP front end answers 404 for a path no entry matches, the auth layer takes a route's
// class from here, and docs/openapi.json must list exactly these routes (a test checks both
// ways).
//
// Path templates are segments separated by '/'; a segment `{name}` matches one non-empty
// segment. The versioned KServe forms (`/v2/models/{model}/versions/{version}/...`) are
// entries of their own. HEAD is matched as GET.
//
// Thread-safety: the table is constant; the functions are pure.
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace kiln {

// Who may call a route (config/config.h: server.auth). kHealth and kMetrics are open by
// default (server.auth.open); kOpenApi needs any valid key unless opened; the others need a
// key with the scope of the same name ("inference", "fine_tuning", "admin") unless opened.
enum class RouteClass { kHealth, kMetrics, kOpenApi, kInference, kFineTuning, kAdmin };

// "health", "metrics", "openapi", "inference", "fine_tuning", "admin": the spelling of
// server.auth.open and of key scopes.
std::string_view RouteClassName(RouteClass c);

// Which listener serves the route.
enum class RoutePort { kHttp, kMetrics };

struct HttpRoute {
  std::string_view method;  // "GET", "POST", "DELETE"
  std::string_view path;    // template, e.g. "/v1/files/{file_id}/content"
  RouteClass access;
  RoutePort port = RoutePort::kHttp;
};

// The whole table, in a stable order (grouped by API).
std::span<const HttpRoute> HttpRoutes();

// Whether `path` (percent-decoded, without the query) matches `templ`.
bool MatchRoutePath(std::string_view templ, std::string_view path);

// The route of `method` (HEAD counts as GET) and `path` on `port`; nullptr if none.
const HttpRoute* FindHttpRoute(RoutePort port, std::string_view method, std::string_view path);

// The methods the routes of `path` on `port` take, as a 405's Allow header lists them
// ("GET, HEAD", "POST", "GET, DELETE, HEAD": HEAD wherever GET is); empty if no route has
// this path.
std::string AllowedMethods(RoutePort port, std::string_view path);

// Whether any route on `port` has this path, whatever its method (for 405 vs 404 and for the
// access class of a request with a wrong method: the path's first route).
const HttpRoute* FindHttpRoutePath(RoutePort port, std::string_view path);

}  // namespace kiln
