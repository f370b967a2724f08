#include "server/tls/tls.h"

#include <openssl/ssl.h>
#include <unistd.h>

#include <boost/asio/ssl/context.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/tls/testing.h"

namespace kiln::tls {
namespace {

using ::testing::HasSubstr;
using testing::KeyPair;
using testing::MakeCert;
using testing::NewKey;
using ::testing::StartsWith;
using testing::WriteFile;

class TlsFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kiln-tls-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    ca_ = NewKey();
    key_ = NewKey();
    WriteFile(Path("ca.crt"), MakeCert(ca_, "Test CA", ca_, "Test CA", 1, -60, 86400, true));
    WriteFile(Path("tls.crt"), MakeCert(key_, "kilnd", ca_, "Test CA", 0x1234));
    WriteFile(Path("tls.key"), key_.pem);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  Files Good() const { return Files{Path("tls.crt"), Path("tls.key"), Path("ca.crt")}; }
  std::string Error(const Files& f) const {
    StatusOr<Pem> pem = LoadFiles(f);
    EXPECT_FALSE(pem.ok());
    return pem.ok() ? "" : std::string(pem.status().message());
  }

  std::string dir_;
  KeyPair ca_, key_;
};

TEST_F(TlsFilesTest, GoodFilesLoad) {
  StatusOr<Pem> pem = LoadFiles(Good());
  ASSERT_TRUE(pem.ok()) << pem.status();
  EXPECT_THAT(pem->summary, HasSubstr("CN=kilnd"));
  EXPECT_THAT(pem->summary, HasSubstr("serial 1234"));
  EXPECT_THAT(pem->private_key, HasSubstr("PRIVATE KEY"));
  EXPECT_THAT(pem->client_ca, HasSubstr("BEGIN CERTIFICATE"));
  StatusOr<std::shared_ptr<ServerContext>> context = ServerContext::Create(*pem);
  ASSERT_TRUE(context.ok()) << context.status();
  SSL_CTX* native = (*context)->Current()->native_handle();
  EXPECT_EQ(SSL_CTX_get_min_proto_version(native), TLS1_2_VERSION);
  // The client CA is set: client certificates are required.
  EXPECT_EQ(SSL_CTX_get_verify_mode(native), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT);
}

TEST_F(TlsFilesTest, ExpiredCertificateNamesTheDate) {
  WriteFile(Path("old.crt"), MakeCert(key_, "kilnd", ca_, "Test CA", 2, -7200, -3600));
  Files f = Good();
  f.cert_file = Path("old.crt");
  EXPECT_THAT(Error(f), StartsWith("server.tls.cert_file: " + Path("old.crt") + " expired on "));
  EXPECT_THAT(Error(f), HasSubstr(" UTC"));
}

TEST_F(TlsFilesTest, NotYetValidCertificate) {
  WriteFile(Path("new.crt"), MakeCert(key_, "kilnd", ca_, "Test CA", 3, 3600, 7200));
  Files f = Good();
  f.cert_file = Path("new.crt");
  EXPECT_THAT(Error(f),
              StartsWith("server.tls.cert_file: " + Path("new.crt") + " is not valid before "));
}

TEST_F(TlsFilesTest, KeyOfAnotherCertificate) {
  WriteFile(Path("other.key"), NewKey().pem);
  Files f = Good();
  f.key_file = Path("other.key");
  EXPECT_EQ(Error(f), "server.tls.key_file: " + Path("other.key") +
                          " does not match the certificate in server.tls.cert_file (" +
                          Path("tls.crt") + ")");
}

TEST_F(TlsFilesTest, MissingAndMalformedFiles) {
  Files f = Good();
  f.cert_file = Path("missing.crt");
  EXPECT_EQ(Error(f), "server.tls.cert_file: cannot read " + Path("missing.crt") +
                          ": No such file or directory");
  f = Good();
  f.cert_file = Path("tls.key");  // a key where the certificate belongs
  EXPECT_THAT(Error(f),
              StartsWith("server.tls.cert_file: " + Path("tls.key") + " holds no PEM certificate"));
  f = Good();
  f.key_file = Path("tls.crt");
  EXPECT_THAT(Error(f),
              StartsWith("server.tls.key_file: " + Path("tls.crt") + " holds no PEM private key"));
  f = Good();
  f.client_ca_file = Path("tls.key");
  EXPECT_THAT(Error(f), StartsWith("server.tls.client_ca_file: " + Path("tls.key") +
                                   " holds no PEM certificate"));
}

TEST_F(TlsFilesTest, EncryptedKeyIsRefusedWithoutPrompting) {
  WriteFile(Path("enc.key"), testing::EncryptedPem(key_));
  Files f = Good();
  f.key_file = Path("enc.key");
  EXPECT_THAT(Error(f), StartsWith("server.tls.key_file: " + Path("enc.key") + " is encrypted"));
}

TEST_F(TlsFilesTest, KeyPrefixNamesTheConfigKey) {
  Files f = Good();
  f.cert_file = Path("missing.crt");
  f.key_prefix = "tls";
  EXPECT_THAT(Error(f), StartsWith("tls.cert_file: cannot read"));
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(MemoryFilesTest, PathsStayAndContentsChange) {
  Pem pem{"cert-1", "key-1", "ca-1", ""};
  StatusOr<std::unique_ptr<MemoryFiles>> files = MemoryFiles::Create(pem);
  ASSERT_TRUE(files.ok()) << files.status();
  const std::string cert = (*files)->cert_path(), key = (*files)->key_path(),
                    ca = (*files)->client_ca_path();
  EXPECT_EQ(ReadAll(cert), "cert-1");
  EXPECT_EQ(ReadAll(key), "key-1");
  EXPECT_EQ(ReadAll(ca), "ca-1");
  ASSERT_TRUE((*files)->Update(Pem{"cert-2 longer", "k2", "ca-2", ""}).ok());
  EXPECT_EQ((*files)->cert_path(), cert);
  EXPECT_EQ(ReadAll(cert), "cert-2 longer");
  EXPECT_EQ(ReadAll(key), "k2");
  EXPECT_EQ(ReadAll(ca), "ca-2");
}

TEST(MemoryFilesTest, NoClientCaNoPath) {
  StatusOr<std::unique_ptr<MemoryFiles>> files = MemoryFiles::Create(Pem{"c", "k", "", ""});
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_EQ((*files)->client_ca_path(), "");
}

}  // namespace
}  // namespace kiln::tls
