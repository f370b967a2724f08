#include "models/io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "models/io/errors.h"

namespace kiln::models {

StatusOr<std::shared_ptr<const MappedFile>> MappedFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return NotFound(path, ": no such file");
    return Internal(path, ": cannot open: ", std::strerror(err));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return Internal(path, ": cannot stat: ", std::strerror(err));
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    return InvalidArgument(path, ": is a directory, expected a file");
  }
  std::shared_ptr<MappedFile> file(new MappedFile());
  file->name_ = path;
  file->size_ = static_cast<size_t>(st.st_size);
  if (file->size_ > 0) {
    void* p = ::mmap(nullptr, file->size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      return Internal(path, ": mmap of ", file->size_, " bytes failed: ", std::strerror(err));
    }
    file->mapping_ = p;
    file->data_ = static_cast<const uint8_t*>(p);
  }
  // The mapping stays valid after close.
  ::close(fd);
  return std::shared_ptr<const MappedFile>(std::move(file));
}

std::shared_ptr<const MappedFile> MappedFile::FromBytes(std::string bytes, std::string name) {
  std::shared_ptr<MappedFile> file(new MappedFile());
  file->name_ = std::move(name);
  file->owned_ = std::move(bytes);
  file->size_ = file->owned_.size();
  file->data_ = file->size_ ? reinterpret_cast<const uint8_t*>(file->owned_.data()) : nullptr;
  return file;
}

MappedFile::~MappedFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, size_);
}

}  // namespace kiln::models
