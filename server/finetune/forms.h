// What the file and fine-tuning routes read off the wire besides JSON: multipart/form-data
// bodies (POST /v1/files, RFC 7578 over RFC 2046's framing) and query strings
// (?after=...&limit=...&metadata[k]=v).
//
// Both parsers are strict: a malformed body or query is an InvalidArgument that says what is
// wrong and where, never a best guess. Neither allocates a copy of a part's contents: parts
// point into the body they were parsed from.
//
// Thread-safety: free functions without state.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/base/status.h"

namespace kiln::finetune {

// ---- multipart/form-data ----

// The `boundary` parameter of a `multipart/form-data` Content-Type header value (media type
// and parameter names case-insensitive, the value a token or a quoted string, 1 to 70
// characters as RFC 2046 allows). InvalidArgument for another media type or a missing or
// malformed boundary.
StatusOr<std::string> MultipartBoundary(std::string_view content_type);

struct MultipartPart {
  std::string name;                     // Content-Disposition's `name`
  std::optional<std::string> filename;  // `filename*` (RFC 5987, UTF-8) or `filename`
  std::string content_type;             // the part's Content-Type; empty when absent
  std::string_view body;                // the part's bytes: a view into the parsed body
};

// Splits `body` into its parts. The framing is RFC 2046's with CRLF line ends only: an
// optional preamble, `--boundary` (optionally followed by spaces or tabs) CRLF, each part's
// headers ending with an empty line, its contents up to CRLF `--boundary`, and the close
// delimiter `--boundary--`; what follows it (the epilogue) is ignored. Every part needs a
// `Content-Disposition: form-data` header with a `name`. At most `max_parts` parts, each with
// at most 8 KiB of headers. Errors are InvalidArgument naming the problem ("part 2 has no
// Content-Disposition header", "the body ends before the closing boundary").
// The returned views point into `body`, which must outlive them.
StatusOr<std::vector<MultipartPart>> ParseMultipart(std::string_view body,
                                                    std::string_view boundary, int max_parts = 16);

// ---- query strings ----

// `a=1&b=x%20y&c` -> {a: 1, b: "x y", c: ""}: percent-decoded, `+` as a space, in order.
// InvalidArgument for a bad percent escape or an empty key.
StatusOr<std::vector<std::pair<std::string, std::string>>> ParseQuery(std::string_view query);

// The query of a list route: `after` (an id, empty: from the newest), `limit` (an integer
// >= 1; pages hold at most kMaxPageSize items, `has_more` tells the client to ask again),
// `metadata[key]=value` filters (where allowed) and `purpose` (where allowed). Unknown keys,
// repeated keys, and bad values are InvalidArgument with the key as param.
struct ListQuery {
  std::string after;
  int limit = 20;
  std::map<std::string, std::string> metadata;
  std::string purpose;
};
inline constexpr int kMaxPageSize = 100;

struct ListQueryOptions {
  int default_limit = 20;
  int max_limit = 100;  // larger values are refused, naming this bound
  bool metadata = false;
  bool purpose = false;
  bool order = false;  // accept `order=desc` (the only order the store lists in)
};
StatusOr<ListQuery> ParseListQuery(std::string_view query, const ListQueryOptions& options);

}  // namespace kiln::finetune
