// launch.cuh: every rank of a job launched alike. mpirun can start ranks with different
// command lines (an MPMD launch, `mpirun -np 1 ./train ... : -np 1 ./train ... --seq 64`), from
// different builds, reading different files; such a job would train on a bogus grid, or stop
// with MPI_ERR_TRUNCATE and no word of ours. So before the grid's communicators are built, the
// ranks compare what they were given and, when they differ, every rank stops naming the setting.
#pragma once
#include <string>
#include <vector>

namespace CLI {
class App;
}

// One thing every rank must agree on: its name (a flag, "the build of ./train", "--data FILE"),
// its value as shown when ranks differ, and the canonical form compared (numbers written one
// way, so --lr 3e-3 and --lr 0.003 agree).
struct LaunchSetting {
  std::string name, value, canonical;
};

// One setting per flag of the parsed command line, in --help's order: the value it was given
// (the last, when given twice), or "(not given)".
std::vector<LaunchSetting> command_line_settings(const CLI::App& app);
// This binary: its size and a checksum of its bytes (/proc/self/exe).
LaunchSetting build_setting();
// Input files as every rank must see them (`name`: "--data x.bin"): each one's size and a
// checksum of its first 64 KiB (a safetensors or llm.c header, the start of a text).
LaunchSetting files_setting(const std::string& name, const std::vector<std::string>& paths);

// Collective over MPI_COMM_WORLD, before communicator set-up; every wait bounded by timeout_s.
// Each rank brings its start-up error ("" for none: a bad flag, a missing file) and its
// settings in stages (the build; the flags; the files), each stage as long on every rank when
// the ones before agree. When some rank has an error, every rank throws UsageError with the
// lowest such rank's message (so no rank waits for one that stopped); otherwise, when some
// rank's settings differ from rank 0's, every rank throws UsageError naming the first that
// differs, rank 0's value and that rank's.
void agree_on_launch(const std::string& error,
                     const std::vector<std::vector<LaunchSetting>>& stages, double timeout_s);
