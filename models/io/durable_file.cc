#include "models/io/durable_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "models/io/errors.h"

namespace kiln::models {
namespace {

Status Errno(const std::string& path, std::string_view what) {
  const int e = errno;
  if (e == ENOENT) return NotFound(path, ": ", what, ": ", std::strerror(e));
  return Internal(path, ": ", what, ": ", std::strerror(e));
}

}  // namespace

Status WriteFileDurably(const std::string& path, std::string_view bytes) {
  return WriteFileDurably(path, std::vector<std::string_view>{bytes});
}

Status WriteFileDurably(const std::string& path, const std::vector<std::string_view>& pieces) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno(path, "cannot create");
  for (std::string_view bytes : pieces) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        Status s = Errno(path, "write failed");
        ::close(fd);
        return s;
      }
      done += static_cast<size_t>(n);
    }
  }
  if (::fsync(fd) != 0) {
    Status s = Errno(path, "fsync failed");
    ::close(fd);
    return s;
  }
  if (::close(fd) != 0) return Errno(path, "close failed");
  return OkStatus();
}

Status FsyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno(dir, "cannot open directory");
  const int rc = ::fsync(fd);
  Status s = rc == 0 ? OkStatus() : Errno(dir, "fsync of directory failed");
  ::close(fd);
  return s;
}

StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Errno(path, "cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Internal(path, ": read failed");
  return std::move(ss).str();
}

}  // namespace kiln::models
