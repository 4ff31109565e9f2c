// launch.cuh: every rank of a job launched alike. mpirun can start ranks with different
// command lines (an MPMD launch, `mpirun -np 1 ./train ... : -np 1 ./train ... --seq 64`), from
// different builds, reading different files; such a job would train on a bogus grid, or stop
// with MPI_ERR_TRUNCATE and no word of ours. So before the grid's communicators are built, the
// ranks compare what they were given and, when they differ, every rank stops naming the setting.
#pragma once
#include <string>
#include <vector>

#include "runtime/observe.cuh"

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
// checksum of all its bytes, so files that differ anywhere differ here; a FIFO or a device in a
// file's place is named, never opened (runtime/inputs.cuh).
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

// The job's end, in place of MPI_Finalize: every rank waits for the others at a barrier bounded
// by timeout_s (past it, every rank is stopped naming the wait, as any collective's), then
// finalizes; a rank whose MPI_Finalize has not returned after timeout_s more (a peer held inside
// it) says so and exits with `code`, or 1 when `code` is 0, so that mpirun ends the others.
// `fault` (null: none) fires at its place "finalize", inside that bound. Returns `code`.
int finish_ranks(int code, double timeout_s, const Fault* fault);
