#include "server/finetune/forms.h"

#include <algorithm>
#include <charconv>

#include "engine/base/ascii.h"

namespace kiln::finetune {
namespace {

constexpr size_t kMaxPartHeaderBytes = 8 << 10;

std::string_view TrimWs(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// RFC 7230 tchar.
bool TokenChar(char c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Percent-decodes `s` (`+` as a space when `plus_is_space`). False on a bad escape.
bool PercentDecode(std::string_view s, bool plus_is_space, std::string* out) {
  out->clear();
  out->reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%') {
      if (i + 2 >= s.size()) return false;
      const int hi = HexValue(s[i + 1]), lo = HexValue(s[i + 2]);
      if (hi < 0 || lo < 0) return false;
      out->push_back(static_cast<char>(hi * 16 + lo));
      i += 2;
    } else if (s[i] == '+' && plus_is_space) {
      out->push_back(' ');
    } else {
      out->push_back(s[i]);
    }
  }
  return true;
}

// A header value's `; name=value` parameters after the first item: names lowercased, values
// unquoted (quoted-string with backslash escapes) or tokens. `what` names the header in errors.
StatusOr<std::vector<std::pair<std::string, std::string>>> HeaderParams(std::string_view s,
                                                                        std::string_view what) {
  std::vector<std::pair<std::string, std::string>> out;
  size_t i = 0;
  auto skip_ws = [&] {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
  };
  while (true) {
    skip_ws();
    if (i == s.size()) return out;
    if (s[i] != ';') return InvalidArgument(what, ": expected ';' before `", s.substr(i), "`");
    ++i;
    skip_ws();
    if (i == s.size()) return out;  // a trailing ';' is tolerated, as browsers send none
    const size_t name_start = i;
    while (i < s.size() && TokenChar(s[i])) ++i;
    if (i == name_start) return InvalidArgument(what, ": a parameter has no name");
    std::string name(s.substr(name_start, i - name_start));
    for (char& c : name) c = AsciiLower(c);
    skip_ws();
    if (i == s.size() || s[i] != '=') {
      return InvalidArgument(what, ": parameter `", name, "` has no value");
    }
    ++i;
    skip_ws();
    std::string value;
    if (i < s.size() && s[i] == '"') {
      ++i;
      bool closed = false;
      while (i < s.size()) {
        const char c = s[i++];
        if (c == '"') {
          closed = true;
          break;
        }
        if (c == '\\') {
          if (i == s.size()) break;
          value.push_back(s[i++]);
        } else {
          value.push_back(c);
        }
      }
      if (!closed) return InvalidArgument(what, ": the quoted value of `", name, "` is not closed");
    } else {
      const size_t start = i;
      while (i < s.size() && TokenChar(s[i])) ++i;
      if (i == start) return InvalidArgument(what, ": parameter `", name, "` has an empty value");
      value = std::string(s.substr(start, i - start));
    }
    for (const auto& [n, v] : out) {
      if (n == name) return InvalidArgument(what, ": parameter `", name, "` is repeated");
    }
    out.emplace_back(std::move(name), std::move(value));
  }
}

// RFC 5987 ext-value: charset'lang'pct-encoded. Only UTF-8 (and its ASCII subset).
StatusOr<std::string> ExtValue(std::string_view v) {
  const size_t q1 = v.find('\'');
  const size_t q2 = q1 == std::string_view::npos ? q1 : v.find('\'', q1 + 1);
  if (q2 == std::string_view::npos) {
    return InvalidArgument("Content-Disposition: `filename*` is not charset'language'value");
  }
  const std::string_view charset = v.substr(0, q1);
  if (!EqualsIgnoreCase(charset, "utf-8") && !EqualsIgnoreCase(charset, "us-ascii")) {
    return InvalidArgument("Content-Disposition: `filename*` has charset `", charset,
                           "`; only UTF-8 is supported");
  }
  std::string out;
  if (!PercentDecode(v.substr(q2 + 1), /*plus_is_space=*/false, &out)) {
    return InvalidArgument("Content-Disposition: `filename*` has a bad percent escape");
  }
  return out;
}

// One part's header block (without the final empty line) into `part`.
Status ParsePartHeaders(std::string_view block, int index, MultipartPart* part) {
  const std::string where = StrCat("multipart part ", index);
  bool disposition = false;
  while (!block.empty()) {
    size_t eol = block.find("\r\n");
    std::string_view line = block.substr(0, eol);
    block = eol == std::string_view::npos ? std::string_view() : block.substr(eol + 2);
    if (line.find('\n') != std::string_view::npos || line.find('\r') != std::string_view::npos) {
      return InvalidArgument(where, ": header lines must end with CRLF");
    }
    if (!line.empty() && (line[0] == ' ' || line[0] == '\t')) {
      return InvalidArgument(where, ": folded header lines are not allowed");
    }
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0) {
      return InvalidArgument(where, ": malformed header line `", line, "`");
    }
    const std::string_view name = line.substr(0, colon);
    const std::string_view value = TrimWs(line.substr(colon + 1));
    if (EqualsIgnoreCase(name, "Content-Disposition")) {
      if (disposition) return InvalidArgument(where, ": Content-Disposition is repeated");
      disposition = true;
      const size_t semi = value.find(';');
      const std::string_view type = TrimWs(value.substr(0, semi));
      if (!EqualsIgnoreCase(type, "form-data")) {
        return InvalidArgument(where, ": Content-Disposition is `", type,
                               "`; multipart/form-data parts must be `form-data`");
      }
      KILN_ASSIGN_OR_RETURN(
          auto params,
          HeaderParams(semi == std::string_view::npos ? std::string_view() : value.substr(semi),
                       where + ": Content-Disposition"));
      bool has_name = false;
      std::optional<std::string> ext_filename;
      for (auto& [k, v] : params) {
        if (k == "name") {
          part->name = std::move(v);
          has_name = true;
        } else if (k == "filename") {
          part->filename = std::move(v);
        } else if (k == "filename*") {
          KILN_ASSIGN_OR_RETURN(ext_filename, ExtValue(v));
        }
      }
      if (!has_name) return InvalidArgument(where, ": Content-Disposition has no `name`");
      if (ext_filename) part->filename = std::move(ext_filename);
    } else if (EqualsIgnoreCase(name, "Content-Type")) {
      part->content_type = std::string(value);
    }
    // Other headers (Content-Transfer-Encoding is deprecated by RFC 7578) are ignored.
  }
  if (!disposition) return InvalidArgument(where, ": no Content-Disposition header");
  return OkStatus();
}

}  // namespace

StatusOr<std::string> MultipartBoundary(std::string_view content_type) {
  const size_t semi = content_type.find(';');
  const std::string_view type = TrimWs(content_type.substr(0, semi));
  if (!EqualsIgnoreCase(type, "multipart/form-data")) {
    return InvalidArgument("Content-Type is `", type.empty() ? "(none)" : type,
                           "`; upload files as multipart/form-data");
  }
  if (semi == std::string_view::npos) {
    return InvalidArgument("Content-Type multipart/form-data has no boundary parameter");
  }
  KILN_ASSIGN_OR_RETURN(auto params, HeaderParams(content_type.substr(semi), "Content-Type"));
  for (const auto& [k, v] : params) {
    if (k != "boundary") continue;
    if (v.empty() || v.size() > 70) {
      return InvalidArgument("Content-Type: the boundary is ", v.size(),
                             " characters; allowed: 1 to 70");
    }
    if (v.back() == ' ') return InvalidArgument("Content-Type: the boundary ends with a space");
    return v;
  }
  return InvalidArgument("Content-Type multipart/form-data has no boundary parameter");
}

StatusOr<std::vector<MultipartPart>> ParseMultipart(std::string_view body,
                                                    std::string_view boundary, int max_parts) {
  const std::string dash = StrCat("--", boundary);
  const std::string delimiter = StrCat("\r\n", dash);
  // The first delimiter: at the very start, or after a preamble ending in CRLF.
  size_t pos = 0;
  if (body.substr(0, dash.size()) != dash) {
    pos = body.find(delimiter);
    if (pos == std::string_view::npos) {
      return InvalidArgument("the multipart body has no boundary `", dash,
                             "` (does it match the Content-Type's boundary?)");
    }
    pos += 2;
  }
  std::vector<MultipartPart> parts;
  while (true) {
    pos += dash.size();                             // at the end of a `--boundary`
    if (body.substr(pos, 2) == "--") return parts;  // the close delimiter; epilogue ignored
    while (pos < body.size() && (body[pos] == ' ' || body[pos] == '\t')) ++pos;
    if (body.substr(pos, 2) != "\r\n") {
      if (pos >= body.size()) {
        return InvalidArgument("the multipart body ends before the closing boundary `", dash,
                               "--`");
      }
      return InvalidArgument("multipart boundary `", dash, "` must be followed by CRLF or `--`");
    }
    pos += 2;
    if (static_cast<int>(parts.size()) == max_parts) {
      return InvalidArgument("the multipart body has more than ", max_parts, " parts");
    }
    const int index = static_cast<int>(parts.size()) + 1;
    MultipartPart part;
    // Headers end with an empty line; a part without headers starts with it.
    size_t header_end;
    if (body.substr(pos, 2) == "\r\n") {
      header_end = pos;
    } else {
      header_end = body.find("\r\n\r\n", pos);
      if (header_end == std::string_view::npos || header_end - pos > kMaxPartHeaderBytes) {
        return InvalidArgument("multipart part ", index,
                               header_end == std::string_view::npos
                                   ? ": its headers do not end with an empty line (CRLF CRLF)"
                                   : ": its headers are longer than 8 KiB");
      }
      header_end += 2;  // the block keeps its last line's CRLF
    }
    KILN_RETURN_IF_ERROR(ParsePartHeaders(body.substr(pos, header_end - pos), index, &part));
    pos = header_end + 2;
    const size_t end = body.find(delimiter, pos);
    if (end == std::string_view::npos) {
      return InvalidArgument("multipart part ", index, " (`", part.name,
                             "`) is not followed by a boundary: the body ends before the "
                             "closing boundary `",
                             dash, "--`");
    }
    part.body = body.substr(pos, end - pos);
    parts.push_back(std::move(part));
    pos = end + 2;
  }
}

StatusOr<std::vector<std::pair<std::string, std::string>>> ParseQuery(std::string_view query) {
  std::vector<std::pair<std::string, std::string>> out;
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view item = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (item.empty()) continue;  // `a=1&&b=2`
    const size_t eq = item.find('=');
    std::string key, value;
    if (!PercentDecode(item.substr(0, eq), true, &key) ||
        (eq != std::string_view::npos && !PercentDecode(item.substr(eq + 1), true, &value))) {
      return InvalidArgument("the query string has a bad percent escape in `", item, "`");
    }
    if (key.empty()) return InvalidArgument("the query string has an item without a name");
    out.emplace_back(std::move(key), std::move(value));
  }
  return out;
}

StatusOr<ListQuery> ParseListQuery(std::string_view query, const ListQueryOptions& options) {
  KILN_ASSIGN_OR_RETURN(auto items, ParseQuery(query));
  ListQuery q;
  q.limit = options.default_limit;
  std::vector<std::string> seen;
  for (auto& [key, value] : items) {
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
      return WithParam(InvalidArgument("query parameter `", key, "` is repeated"), key);
    }
    seen.push_back(key);
    if (key == "after") {
      q.after = std::move(value);
    } else if (key == "limit") {
      int n = 0;
      auto [p, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
      if (ec != std::errc() || p != value.data() + value.size() || n < 1 || n > options.max_limit) {
        return WithParam(InvalidArgument("`limit` is \"", value,
                                         "\"; allowed: an integer from 1 to ", options.max_limit),
                         "limit");
      }
      q.limit = n;
    } else if (options.purpose && key == "purpose") {
      q.purpose = std::move(value);
    } else if (options.order && key == "order") {
      if (value != "desc") {
        return WithParam(InvalidArgument("`order` is \"", value,
                                         "\"; this server lists newest first only (\"desc\")"),
                         "order");
      }
    } else if (options.metadata && key.size() > 10 && key.compare(0, 9, "metadata[") == 0 &&
               key.back() == ']') {
      q.metadata[key.substr(9, key.size() - 10)] = std::move(value);
    } else {
      std::string allowed = "after, limit";
      if (options.purpose) allowed += ", purpose";
      if (options.order) allowed += ", order";
      if (options.metadata) allowed += ", metadata[<key>]";
      return WithParam(InvalidArgument("unknown query parameter `", key, "`; allowed: ", allowed),
                       key);
    }
  }
  return q;
}

}  // namespace kiln::finetune
