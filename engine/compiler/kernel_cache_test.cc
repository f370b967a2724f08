#include "engine/compiler/kernel_cache.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

namespace kiln::compiler {
namespace {

std::string TestDir(const char* name) {
  const std::string d =
      ::testing::TempDir() + "/kiln_cache_test_" + name + "_" + std::to_string(getpid());
  std::filesystem::remove_all(d);
  return d;
}

TEST(DiskCacheTest, PutGetRoundTrip) {
  DiskCache c(TestDir("roundtrip"));
  EXPECT_EQ(c.Get("ns", "abc").status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(c.Put("ns", "abc", std::string("hello\0world", 11)).ok());
  auto v = c.Get("ns", "abc");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, std::string("hello\0world", 11));
  ASSERT_TRUE(c.Put("ns", "abc", "replaced").ok());
  EXPECT_EQ(*c.Get("ns", "abc"), "replaced");
  EXPECT_EQ(c.Get("other", "abc").status().code(), StatusCode::kNotFound);
  std::filesystem::remove_all(c.dir());
}

TEST(DiskCacheTest, CorruptOrTornEntriesReadAsMissesAndAreRemoved) {
  DiskCache c(TestDir("corrupt"));
  ASSERT_TRUE(c.Put("ns", "key1", "0123456789").ok());
  const std::string path = c.dir() + "/ns/ke/key1";
  ASSERT_TRUE(std::filesystem::exists(path));
  std::ofstream(path, std::ios::trunc) << "01234";  // truncated
  EXPECT_EQ(c.Get("ns", "key1").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(c.corrupt_entries(), 1);
  EXPECT_FALSE(std::filesystem::exists(path));
  // Data without its sidecar (a writer died between the renames) is a plain miss.
  ASSERT_TRUE(c.Put("ns", "key2", "abc").ok());
  std::filesystem::remove(c.dir() + "/ns/ke/key2.sha256");
  EXPECT_EQ(c.Get("ns", "key2").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(c.corrupt_entries(), 1);
  std::filesystem::remove_all(c.dir());
}

TEST(DiskCacheTest, FilesKeepTheirName) {
  DiskCache c(TestDir("files"));
  const std::string tmp = c.dir() + "_src.bin";
  std::filesystem::create_directories(std::filesystem::path(tmp).parent_path());
  std::ofstream(tmp) << "\x7f"
                        "ELF...";
  ASSERT_TRUE(c.PutFile("ns", "b123", ".so", tmp).ok());
  auto p = c.GetFile("ns", "b123", ".so");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(*p, c.dir() + "/ns/b1/b123.so");
  std::filesystem::remove(tmp);
  std::filesystem::remove_all(c.dir());
}

TEST(DiskCacheTest, ConcurrentWritersAndReadersSeeWholeEntries) {
  DiskCache c(TestDir("concurrent"));
  std::atomic<int> bad{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const std::string v(1000 + (i % 7) * 997, static_cast<char>('a' + (i + t) % 26));
        if (!c.Put("ns", "shared", v).ok()) ++bad;
        auto got = c.Get("ns", "shared");
        // Readers may miss an entry being replaced, never see a mixed one.
        if (got.ok()) {
          for (char ch : *got) {
            if (ch != (*got)[0]) {
              ++bad;
              break;
            }
          }
        }
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad.load(), 0);
  std::filesystem::remove_all(c.dir());
}

TEST(DiskCacheTest, LockKeyIsExclusive) {
  DiskCache c(TestDir("lock"));
  std::atomic<int> inside{0}, max_inside{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&] {
      for (int i = 0; i < 20; ++i) {
        auto l = c.LockKey("ns", "k");
        ASSERT_TRUE(l.ok());
        const int now = ++inside;
        max_inside = std::max(max_inside.load(), now);
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        --inside;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(max_inside.load(), 1);
  std::filesystem::remove_all(c.dir());
}

TEST(DiskCacheTest, DirectoryFollowsTheEnvironmentThenTheServer) {
  const char* saved = std::getenv("KILN_CACHE_DIR");
  const std::string keep = saved ? saved : "";
  unsetenv("KILN_CACHE_DIR");
  SetCacheDir("/var/lib/kiln/cache");
  EXPECT_EQ(CacheDir(), "/var/lib/kiln/cache");
  setenv("KILN_CACHE_DIR", "/tmp/override", 1);
  EXPECT_EQ(CacheDir(), "/tmp/override");
  SetCacheDir("");
  unsetenv("KILN_CACHE_DIR");
  EXPECT_FALSE(CacheDir().empty());
  if (saved) setenv("KILN_CACHE_DIR", keep.c_str(), 1);
}

}  // namespace
}  // namespace kiln::compiler
