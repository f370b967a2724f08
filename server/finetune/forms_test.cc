#include "server/finetune/forms.h"

#include <gtest/gtest.h>

namespace kiln::finetune {
namespace {

std::string Body(std::string_view boundary, std::initializer_list<std::string> parts,
                 std::string_view preamble = "", std::string_view epilogue = "") {
  std::string b(preamble);
  if (!preamble.empty()) b += "\r\n";
  for (const std::string& p : parts) b += StrCat("--", boundary, "\r\n", p, "\r\n");
  b += StrCat("--", boundary, "--", epilogue);
  return b;
}

std::string Field(std::string_view name, std::string_view value) {
  return StrCat("Content-Disposition: form-data; name=\"", name, "\"\r\n\r\n", value);
}

TEST(MultipartBoundary, TokenQuotedAndCaseInsensitive) {
  EXPECT_EQ(*MultipartBoundary("multipart/form-data; boundary=abc123"), "abc123");
  EXPECT_EQ(*MultipartBoundary("Multipart/Form-Data;BOUNDARY=\"a b:c\""), "a b:c");
  EXPECT_EQ(*MultipartBoundary("multipart/form-data; charset=utf-8; boundary=x"), "x");
}

TEST(MultipartBoundary, RefusesOtherTypesAndBadBoundaries) {
  EXPECT_NE(MultipartBoundary("application/json").status().message().find("multipart/form-data"),
            absl::string_view::npos);
  EXPECT_FALSE(MultipartBoundary("multipart/form-data").ok());
  EXPECT_FALSE(MultipartBoundary("multipart/form-data; boundary=").ok());
  EXPECT_FALSE(MultipartBoundary("multipart/form-data; boundary=\"unclosed").ok());
  EXPECT_FALSE(MultipartBoundary("multipart/form-data; boundary=" + std::string(71, 'a')).ok());
  EXPECT_TRUE(MultipartBoundary("multipart/form-data; boundary=" + std::string(70, 'a')).ok());
}

TEST(Multipart, FieldsAndFileAsTheOpenAiSdkSendsThem) {
  const std::string body =
      Body("bd", {Field("purpose", "fine-tune"),
                  "Content-Disposition: form-data; name=\"file\"; filename=\"train.jsonl\"\r\n"
                  "Content-Type: application/octet-stream\r\n\r\n{\"a\": 1}\r\n{\"b\": 2}\r\n"});
  auto parts = ParseMultipart(body, "bd");
  ASSERT_TRUE(parts.ok()) << parts.status();
  ASSERT_EQ(parts->size(), 2u);
  EXPECT_EQ((*parts)[0].name, "purpose");
  EXPECT_EQ((*parts)[0].body, "fine-tune");
  EXPECT_FALSE((*parts)[0].filename.has_value());
  EXPECT_EQ((*parts)[1].name, "file");
  EXPECT_EQ((*parts)[1].filename, "train.jsonl");
  EXPECT_EQ((*parts)[1].content_type, "application/octet-stream");
  // The contents keep their own CRLFs; only the one before the delimiter is framing.
  EXPECT_EQ((*parts)[1].body, "{\"a\": 1}\r\n{\"b\": 2}\r\n");
}

TEST(Multipart, PreambleEpilogueEmptyPartAndBoundaryLookalikes) {
  // "--bd" inside the contents, not after CRLF, is data; so is "\r\n--b" (a shorter prefix).
  const std::string body = Body("bd", {Field("a", "x--bd y\r\n--b z"), Field("empty", "")},
                                "this is a preamble", "\r\nepilogue --bd");
  auto parts = ParseMultipart(body, "bd");
  ASSERT_TRUE(parts.ok()) << parts.status();
  ASSERT_EQ(parts->size(), 2u);
  EXPECT_EQ((*parts)[0].body, "x--bd y\r\n--b z");
  EXPECT_EQ((*parts)[1].body, "");
}

TEST(Multipart, QuotedParamsEscapesAndExtendedFilename) {
  const std::string body = Body(
      "b", {"content-disposition: FORM-DATA; name=file; filename=\"a \\\"q\\\"; b.jsonl\"\r\n\r\nx",
            "Content-Disposition: form-data; name=\"f2\"; filename=\"fallback.txt\"; "
            "filename*=UTF-8''caf%C3%A9.jsonl\r\n\r\ny"});
  auto parts = ParseMultipart(body, "b");
  ASSERT_TRUE(parts.ok()) << parts.status();
  EXPECT_EQ((*parts)[0].name, "file");
  EXPECT_EQ((*parts)[0].filename, "a \"q\"; b.jsonl");
  EXPECT_EQ((*parts)[1].filename, "caf\xC3\xA9.jsonl");
}

TEST(Multipart, TransportPaddingAfterTheBoundaryIsAllowed) {
  const std::string body = "--b \t\r\n" + Field("a", "1") + "\r\n--b--";
  auto parts = ParseMultipart(body, "b");
  ASSERT_TRUE(parts.ok()) << parts.status();
  EXPECT_EQ((*parts)[0].body, "1");
}

// Each malformed body is refused with a message that says what is wrong.
TEST(Multipart, MalformedBodiesAreRefusedWithAReason) {
  struct Case {
    std::string body;
    std::string says;
  };
  const Case cases[] = {
      {"no boundary here", "has no boundary"},
      {"--b\r\n" + Field("a", "1"), "ends before the closing boundary"},
      {"--b\r\n" + Field("a", "1") + "\r\n--b", "ends before the closing boundary"},
      {"--bx\r\n" + Field("a", "1") + "\r\n--b--", "followed by CRLF"},
      {"--c\r\n" + Field("a", "1") + "\r\n--c--", "has no boundary"},
      {"--b\r\nContent-Disposition: form-data; name=\"a\"\r\n", "do not end with an empty line"},
      {"--b\nContent-Disposition: form-data; name=\"a\"\n\n1\n--b--", "followed by CRLF"},
      {"--b\r\nX-A: 1\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n--b--",
       "must end with CRLF"},
      {"--b\r\nContent-Type: text/plain\r\n\r\n1\r\n--b--", "no Content-Disposition"},
      {"--b\r\n\r\n1\r\n--b--", "no Content-Disposition"},
      {"--b\r\nContent-Disposition: attachment; name=\"a\"\r\n\r\n1\r\n--b--", "`form-data`"},
      {"--b\r\nContent-Disposition: form-data; filename=\"x\"\r\n\r\n1\r\n--b--", "no `name`"},
      {"--b\r\nContent-Disposition: form-data; name=\"a\r\n\r\n1\r\n--b--", "not closed"},
      {"--b\r\nContent-Disposition: form-data; name=\"a\"; name=\"b\"\r\n\r\n1\r\n--b--",
       "repeated"},
      {"--b\r\nContent-Disposition: form-data; name\r\n\r\n1\r\n--b--", "has no value"},
      {"--b\r\nContent-Disposition: form-data name=\"a\"\r\n\r\n1\r\n--b--", "`form-data`"},
      {"--b\r\n folded: x\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n--b--", "folded"},
      {"--b\r\nno colon\r\n\r\n1\r\n--b--", "malformed header line"},
      {"--b\r\nContent-Disposition: form-data; name=a; filename*=latin1''x\r\n\r\n1\r\n--b--",
       "only UTF-8"},
      {"--b\r\nContent-Disposition: form-data; name=a\r\n" + std::string(9000, 'x') +
           ": y\r\n\r\n1\r\n--b--",
       "longer than 8 KiB"},
  };
  for (const Case& c : cases) {
    auto parts = ParseMultipart(c.body, "b");
    ASSERT_FALSE(parts.ok()) << c.body;
    EXPECT_EQ(parts.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(parts.status().message().find(c.says), absl::string_view::npos)
        << c.body << " -> " << parts.status();
  }
}

TEST(Multipart, TooManyParts) {
  std::string body;
  for (int i = 0; i < 5; ++i) body += "--b\r\n" + Field("a", "1") + "\r\n";
  body += "--b--";
  EXPECT_TRUE(ParseMultipart(body, "b", 5).ok());
  auto parts = ParseMultipart(body, "b", 4);
  ASSERT_FALSE(parts.ok());
  EXPECT_NE(parts.status().message().find("more than 4 parts"), absl::string_view::npos);
}

TEST(Query, DecodesInOrder) {
  auto q = ParseQuery("a=1&b=x%20y+z&&c&metadata%5Bk%5D=v%26w");
  ASSERT_TRUE(q.ok()) << q.status();
  ASSERT_EQ(q->size(), 4u);
  EXPECT_EQ((*q)[0], std::make_pair(std::string("a"), std::string("1")));
  EXPECT_EQ((*q)[1].second, "x y z");
  EXPECT_EQ((*q)[2], std::make_pair(std::string("c"), std::string()));
  EXPECT_EQ((*q)[3], std::make_pair(std::string("metadata[k]"), std::string("v&w")));
  EXPECT_FALSE(ParseQuery("a=%2").ok());
  EXPECT_FALSE(ParseQuery("a=%zz").ok());
  EXPECT_FALSE(ParseQuery("=1").ok());
}

TEST(ListQuery, DefaultsLimitsMetadataAndUnknownKeys) {
  ListQueryOptions jobs{.default_limit = 20, .max_limit = 100, .metadata = true};
  auto q = ParseListQuery("", jobs);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->limit, 20);
  EXPECT_EQ(q->after, "");
  q = ParseListQuery("after=ftjob-1&limit=3&metadata[team]=a%20b&metadata%5Bx%5D=1", jobs);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->after, "ftjob-1");
  EXPECT_EQ(q->limit, 3);
  EXPECT_EQ(q->metadata, (std::map<std::string, std::string>{{"team", "a b"}, {"x", "1"}}));

  for (const char* bad : {"limit=0", "limit=101", "limit=x", "limit=", "limit=5abc"}) {
    auto r = ParseListQuery(bad, jobs);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(ParamOf(r.status()), "limit");
    EXPECT_NE(r.status().message().find("from 1 to 100"), absl::string_view::npos);
  }
  auto r = ParseListQuery("purpose=fine-tune", jobs);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(ParamOf(r.status()), "purpose");
  EXPECT_NE(r.status().message().find("allowed: after, limit, metadata[<key>]"),
            absl::string_view::npos);
  EXPECT_FALSE(ParseListQuery("after=a&after=b", jobs).ok());
  EXPECT_FALSE(ParseListQuery("metadata[]=x", jobs).ok());

  ListQueryOptions files{
      .default_limit = 10000, .max_limit = 10000, .purpose = true, .order = true};
  q = ParseListQuery("purpose=fine-tune&order=desc&limit=10000", files);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->purpose, "fine-tune");
  EXPECT_EQ(q->limit, 10000);
  r = ParseListQuery("order=asc", files);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(ParamOf(r.status()), "order");
  EXPECT_FALSE(ParseListQuery("metadata[a]=b", files).ok());
}

}  // namespace
}  // namespace kiln::finetune
