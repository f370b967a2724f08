#include "engine/base/json_parse.h"

#include <string>
#include <vector>

namespace kiln {
namespace {

using nlohmann::json;

// Parser messages quote what they read; a long token (a megabyte string with a bad byte at
// its end, a number of 5000 digits) is cut so that the error stays readable.
constexpr size_t kMaxQuoted = 48;

std::string Clip(std::string_view s) {
  if (s.size() <= kMaxQuoted) return std::string(s);
  return StrCat(s.substr(0, kMaxQuoted), "...");
}

// nlohmann's message without its id ("[json.exception.parse_error.101] parse error at ...")
// and with the token after "last read: '" clipped.
std::string ParserMessage(std::string_view what) {
  if (size_t p = what.find("] "); p != std::string_view::npos) what.remove_prefix(p + 2);
  constexpr std::string_view kLastRead = "; last read: '";
  const size_t at = what.find(kLastRead);
  if (at == std::string_view::npos) return std::string(what);
  std::string_view token = what.substr(at + kLastRead.size());
  if (token.ends_with('\'')) token.remove_suffix(1);
  return StrCat(what.substr(0, at), kLastRead, Clip(token), "'");
}

// Builds the document as nlohmann's own DOM parser would (a repeated key: the last wins) and
// keeps the path of the value being read, so that an error can name its field. Events arrive
// in document order; only the open containers are on the stack. `Json` is nlohmann::json or
// ordered_json.
template <typename Json>
class PathSax {
 public:
  explicit PathSax(Json* root) : root_(root) {}

  bool null() { return Add(nullptr); }
  bool boolean(bool v) { return Add(v); }
  bool number_integer(typename Json::number_integer_t v) { return Add(v); }
  bool number_unsigned(typename Json::number_unsigned_t v) { return Add(v); }
  bool number_float(typename Json::number_float_t v, const typename Json::string_t&) {
    return Add(v);
  }
  bool string(typename Json::string_t& v) { return Add(std::move(v)); }
  bool binary(typename Json::binary_t& v) { return Add(Json::binary(std::move(v))); }
  bool start_object(size_t) { return Open(Json::object()); }
  bool start_array(size_t) { return Open(Json::array()); }
  bool key(typename Json::string_t& k) {
    Frame& f = open_.back();
    f.key = std::move(k);
    f.awaiting_value = true;
    return true;
  }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }

  bool parse_error(size_t, const std::string& last_token, const nlohmann::json::exception& e) {
    error_ = true;
    overflow_ = e.id == 406;  // out_of_range.406: "number overflow parsing '1e400'"
    token_ = Clip(last_token);
    message_ = ParserMessage(e.what());
    path_ = Path();
    return false;
  }

  bool error() const { return error_; }
  bool overflow() const { return overflow_; }
  bool too_deep() const { return too_deep_; }
  const std::string& token() const { return token_; }
  const std::string& message() const { return message_; }
  // The field the error is in, "" when it is not inside an object's member.
  const std::string& path() const { return path_; }

 private:
  struct Frame {
    Json* value;
    std::string key;              // objects: the member being read
    size_t next = 0;              // arrays: the index of the next element
    bool awaiting_value = false;  // objects: a key was read, its value not yet
  };

  // Where a new value goes: the root, the end of the open array or the open object's key.
  Json* Slot() {
    if (open_.empty()) return root_;
    Frame& f = open_.back();
    if (f.value->is_array()) {
      ++f.next;
      f.value->push_back(nullptr);
      return &f.value->back();
    }
    f.awaiting_value = false;
    return &(*f.value)[f.key];
  }
  bool Add(Json v) {
    *Slot() = std::move(v);
    return true;
  }
  // A container stays put while open: its parent only grows after it is closed.
  bool Open(Json v) {
    if (open_.size() >= static_cast<size_t>(kMaxJsonDepth)) {
      error_ = too_deep_ = true;
      path_ = Path();
      return false;  // stops the parser
    }
    Json* slot = Slot();
    *slot = std::move(v);
    open_.push_back(Frame{.value = slot, .key = {}});
    return true;
  }
  bool Close() {
    open_.pop_back();
    return true;
  }

  // `messages[0].content`: the open containers' members, down to the value that failed. An
  // array names the element being read; an object its key if the error is in its value.
  std::string Path() const {
    if (open_.empty() || !open_.front().value->is_object()) return "";
    std::string path;
    for (size_t i = 0; i < open_.size(); ++i) {
      const Frame& f = open_[i];
      const bool innermost = i + 1 == open_.size();
      if (f.value->is_array()) {
        path += StrCat("[", innermost ? f.next : f.next - 1, "]");
      } else if (!innermost || f.awaiting_value) {
        path += StrCat(path.empty() ? "" : ".", Clip(f.key));
      }
    }
    return path.size() > 2 * kMaxQuoted ? StrCat(path.substr(0, 2 * kMaxQuoted), "...") : path;
  }

  Json* const root_;
  std::vector<Frame> open_;
  bool error_ = false;
  bool overflow_ = false;
  bool too_deep_ = false;
  std::string token_, message_, path_;
};

template <typename Json>
StatusOr<Json> ParseObject(std::string_view text, std::string_view what,
                           std::string_view field_prefix) {
  Json doc;
  PathSax<Json> sax(&doc);
  Json::sax_parse(text.begin(), text.end(), &sax, nlohmann::json::input_format_t::json,
                  /*strict=*/true);
  if (sax.error()) {
    const std::string field = sax.path().empty() ? "" : StrCat(field_prefix, sax.path());
    if (sax.too_deep()) {
      const std::string deep =
          StrCat("nests arrays and objects deeper than ", kMaxJsonDepth, " levels");
      if (field.empty()) {
        return InvalidArgument(what.empty() ? "the document" : what, " ", deep);
      }
      return WithParam(InvalidArgument("`", field, "` ", deep), field);
    }
    if (sax.overflow()) {
      const std::string range =
          StrCat("number out of range: ", sax.token(), " is beyond a double's ±1.8e308");
      if (field.empty()) return InvalidArgument(what, what.empty() ? "" : ": ", range);
      return WithParam(InvalidArgument("`", field, "`: ", range), field);
    }
    const std::string invalid =
        what.empty() ? "not valid JSON: " : StrCat(what, " is not valid JSON: ");
    if (field.empty()) return InvalidArgument(invalid, sax.message());
    return WithParam(InvalidArgument(invalid, "`", field, "`: ", sax.message()), field);
  }
  if (!doc.is_object()) {
    return InvalidArgument(what.empty() ? "expected" : StrCat(what, " must be"),
                           " a JSON object, got ", JsonTypeName(nlohmann::json(doc.type())));
  }
  return doc;
}

}  // namespace

StatusOr<json> ParseJsonObject(std::string_view text, std::string_view what,
                               std::string_view field_prefix) {
  return ParseObject<json>(text, what, field_prefix);
}

StatusOr<nlohmann::ordered_json> ParseOrderedJsonObject(std::string_view text,
                                                        std::string_view what,
                                                        std::string_view field_prefix) {
  return ParseObject<nlohmann::ordered_json>(text, what, field_prefix);
}

std::string_view JsonTypeName(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::object:
      return "an object";
    case json::value_t::array:
      return "a list";
    case json::value_t::string:
      return "a string";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "an integer";
    case json::value_t::number_float:
      return "a number";
    default:
      return "an unsupported value";
  }
}

}  // namespace kiln
