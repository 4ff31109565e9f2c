// inputs.cu: input files checked before they are opened, and checksummed whole (inputs.cuh).
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "runtime/core.cuh"
#include "runtime/inputs.cuh"

namespace fs = std::filesystem;

std::string input_file_problem(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0)  // follows symlinks, opens nothing
    return errno == ENOENT ? "not found" : std::string("cannot be read: ") + strerror(errno);
  struct statfs on;
  if (S_ISREG(st.st_mode) && statfs(path.c_str(), &on) == 0 &&
      (on.f_type == PROC_SUPER_MAGIC || on.f_type == SYSFS_MAGIC))
    return "a kernel file of /proc or /sys (its bytes are made as it is read: its size is not "
           "theirs, and two ranks may read two different ones)";
  if (S_ISREG(st.st_mode)) return "";
  if (S_ISFIFO(st.st_mode)) return "a FIFO (named pipe)";
  if (S_ISDIR(st.st_mode)) return "a directory";
  if (S_ISCHR(st.st_mode)) return "a character device";
  if (S_ISBLK(st.st_mode)) return "a block device";
  if (S_ISSOCK(st.st_mode)) return "a socket";
  return "not a regular file";
}

void check_input_file(const std::string& what, const std::string& path) {
  const std::string problem = input_file_problem(path);
  if (problem.empty()) return;
  if (problem == "not found") throw UsageError(what + ": not found");
  throw UsageError(what + ": " + problem +
                   ", not a regular file; an input is read whole (under mpirun by every rank, "
                   "for its checksum, before the run), which a pipe or a device would block "
                   "forever or never end: write it to a file first");
}

bool same_file(const std::string& a, const std::string& b) {
  std::error_code ec;
  if (fs::exists(a, ec) && fs::exists(b, ec) && fs::equivalent(a, b, ec)) return true;
  const fs::path ra = fs::weakly_canonical(output_target(a), ec);
  const fs::path rb = fs::weakly_canonical(output_target(b), ec);
  return !ra.empty() && ra == rb;
}

double host_memory_bytes() {
  return (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
}

// Four independent lanes of FNV-style multiply-xor over 8-byte words (each lane's multiply
// waits for its own previous one only, so the four run side by side at several GB/s), folded
// with the size and the tail bytes at the end.
namespace {
struct WordHash {
  static constexpr uint64_t kPrime = 1099511628211ull;
  uint64_t lane[4] = {14695981039346656037ull, 0x9e3779b97f4a7c15ull, 0xc2b2ae3d27d4eb4full,
                      0x165667b19e3779f9ull};
  void words(const unsigned char* p, size_t n_words) {
    for (size_t i = 0; i < n_words; i++) {
      uint64_t w;
      memcpy(&w, p + 8 * i, 8);
      uint64_t& h = lane[i % 4];
      h = (h ^ w) * kPrime;
    }
  }
  uint64_t finish(const unsigned char* tail, size_t n, uint64_t size) const {
    uint64_t h = 14695981039346656037ull;
    for (uint64_t x : {lane[0], lane[1], lane[2], lane[3], size})
      for (int b = 0; b < 8; b++) h = (h ^ (x >> (8 * b) & 0xff)) * kPrime;
    for (size_t i = 0; i < n; i++) h = (h ^ tail[i]) * kPrime;
    return h;
  }
};
}  // namespace

FileChecksum checksum_file(const std::string& path) {
  FileChecksum c;
  c.why = input_file_problem(path);
  if (!c.why.empty()) return c;
  // Opened without waiting (a FIFO put in the file's place since would block a plain open), then
  // asked again what it is.
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK);
  struct stat st;
  if (fd < 0) return c.why = std::string("cannot open: ") + strerror(errno), c;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return c.why = "not a regular file", c;
  }
  FILE* f = fdopen(fd, "rb");
  if (!f) {
    close(fd);
    return c.why = std::string("cannot open: ") + strerror(errno), c;
  }
  // Chunks of 1 MiB, a multiple of the 32 bytes a round of the lanes takes: every chunk but the
  // last is whole words in the same lane order as one long read.
  std::vector<unsigned char> buf(1 << 20);
  WordHash h;
  const unsigned char* tail = buf.data();
  size_t n = 0, tail_bytes = 0;
  while ((n = fread(buf.data(), 1, buf.size(), f)) > 0) {
    c.size += n;
    const size_t whole = n / 32 * 32;
    h.words(buf.data(), whole / 8);
    tail = buf.data() + whole, tail_bytes = n - whole;
    if (n < buf.size()) break;
  }
  const bool failed = ferror(f);
  fclose(f);
  if (failed) return c.why = "read error", c;
  c.checksum = h.finish(tail, tail_bytes, c.size);
  return c;
}
