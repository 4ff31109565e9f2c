// inputs.cuh: what an input file must be before it is read. Every input is read whole (the data,
// a checkpoint's files, the planner's tables) and, under mpirun, checksummed whole by every rank
// before the run starts (runtime/launch.cuh): a FIFO, a device or a directory in a file's place
// would block that read forever or never end it, so it is refused before it is opened; a file
// is compared whole, so ranks whose files differ anywhere are told apart.
#pragma once
#include <cstdint>
#include <string>

// "" when `path` is a regular file (symlinks followed); else what is there instead: "not
// found", "a FIFO (named pipe)", "a directory", "a character device", "a block device", "a
// socket".
std::string input_file_problem(const std::string& path);
// Throws UsageError "<what>: <problem>, not a regular file; ..." unless `path` is a regular
// file (`what` names the flag and the file: "--data /tmp/fifo").
void check_input_file(const std::string& what, const std::string& path);
// Whether two paths name one file: symlinks followed in every component (a missing tail kept),
// so two spellings of one file compare equal; two existing paths are also the same file when
// they are hard links of one inode. For an output that must not replace an input.
bool same_file(const std::string& a, const std::string& b);
// This machine's physical memory, bytes.
double host_memory_bytes();

// A regular file's size and a 64-bit checksum of all its bytes (not cryptographic: it tells
// two files apart, as a run's ranks compare them). `why` says why there is none: the file is
// not regular (never opened, so a FIFO cannot block), or cannot be read.
struct FileChecksum {
  uint64_t size = 0, checksum = 0;
  std::string why;  // "" when size and checksum hold
};
FileChecksum checksum_file(const std::string& path);
