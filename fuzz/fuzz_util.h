// Fuzz targets' helper: the input as a file (memfd, no disk) for readers that take a path.
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace moekit::fuzz {

class MemFile {
 public:
  MemFile(const uint8_t* data, size_t size) {
    fd_ = memfd_create("moekit-fuzz", MFD_CLOEXEC);
    size_t done = 0;
    while (fd_ >= 0 && done < size) {
      const ssize_t n = ::write(fd_, data + done, size - done);
      if (n <= 0) break;
      done += size_t(n);
    }
  }
  ~MemFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  bool ok() const { return fd_ >= 0; }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_ = -1;
};

}  // namespace moekit::fuzz
