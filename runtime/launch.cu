// launch.cu: the ranks of a job compare their command lines, builds and input files before the
// grid is built (launch.cuh). Each setting travels as a 64-bit hash; only the first that differs
// travels as text, for the message.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <thread>

#include "runtime/comm.cuh"
#include "runtime/inputs.cuh"
#include "runtime/launch.cuh"

namespace fs = std::filesystem;

// FNV-1a, 64 bits: not cryptographic, only to tell two launches apart.
static uint64_t fnv1a(const void* data, size_t n, uint64_t h = 14695981039346656037ull) {
  const unsigned char* p = (const unsigned char*)data;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}
static std::string hex(uint64_t h) {
  char buf[20];
  snprintf(buf, sizeof buf, "%016llx", (unsigned long long)h);
  return buf;
}
// A file as the ranks compare it: its size and the checksum of all its bytes, or what is in its
// place (a FIFO is never opened: it would block every rank before any check).
static std::string fingerprint(const std::string& path) {
  const FileChecksum c = checksum_file(path);
  if (!c.why.empty()) return c.why;
  return std::to_string(c.size) + " bytes, checksum " + hex(c.checksum);
}

// A number in one form (3e-3 and 0.003 are one learning rate); anything else as it is.
static std::string canonical(const std::string& value) {
  char* end = nullptr;
  const double v = strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0') return value;
  char buf[40];
  snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::vector<LaunchSetting> command_line_settings(const CLI::App& app) {
  std::vector<const CLI::App*> groups = {&app};
  for (const CLI::App* g : app.get_subcommands([](const CLI::App*) { return true; }))
    groups.push_back(g);
  std::vector<LaunchSetting> settings;
  for (const CLI::App* g : groups)
    for (const CLI::Option* opt : g->get_options()) {
      if (opt->get_name().empty()) continue;
      LaunchSetting s{opt->get_name(), "", ""};
      if (opt->count() && opt->get_type_size() == 0) {  // a switch such as --sp
        s.value = s.canonical = "given";
      } else if (opt->count()) {
        for (const std::string& r : opt->reduced_results()) {
          s.value += (s.value.empty() ? "" : ",") + r;
          s.canonical += (s.canonical.empty() ? "" : ",") + canonical(r);
        }
      } else if (!opt->get_default_str().empty()) {  // as if given its default
        s.value = opt->get_default_str() + " (the default)";
        s.canonical = canonical(opt->get_default_str());
      } else {
        s.value = s.canonical = "(not given)";
      }
      settings.push_back(s);
    }
  return settings;
}

LaunchSetting build_setting() {
  std::string v = fingerprint("/proc/self/exe");
  return {"the build of ./train", v, v};
}

LaunchSetting files_setting(const std::string& name, const std::vector<std::string>& paths) {
  std::string v;
  for (const std::string& p : paths) v += (v.empty() ? "" : "; ") + p + ": " + fingerprint(p);
  if (paths.empty()) v = "no files";
  return {name, v + (paths.empty() ? "" : " (checksums of the whole files)"), v};
}

// ----------------------------------------------------------------------------
// The comparison

static Group world_group(double timeout_s) {
  Group g;
  g.name = "world";
  g.mpi = MPI_COMM_WORLD;
  g.timeout_s = timeout_s;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &g.rank));
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &g.size));
  g.members.assign(g.size, -1);
  g.members[g.rank] = g.rank;  // the timeout message's rank
  return g;
}

// The first setting of `settings` on which some rank differs from rank 0: every rank throws
// UsageError naming it. Every rank holds as many settings.
static void compare(Group& g, const std::vector<LaunchSetting>& settings) {
  std::vector<uint64_t> mine;
  for (const LaunchSetting& s : settings)
    mine.push_back(
        fnv1a(s.canonical.data(), s.canonical.size(), fnv1a(s.name.data(), s.name.size())));
  std::vector<uint64_t> all(g.size * mine.size());
  host_wait(g, "agree_on_launch", mine.size() * sizeof(uint64_t), [&](MPI_Request* r) {
    return MPI_Iallgather(mine.data(), (int)mine.size(), MPI_UINT64_T, all.data(), (int)mine.size(),
                          MPI_UINT64_T, g.mpi, r);
  });
  for (size_t i = 0; i < mine.size(); i++)
    for (int r = 1; r < g.size; r++) {
      if (all[r * mine.size() + i] == all[i]) continue;
      const std::string name = broadcast_text(g, "agree_on_launch", settings[i].name, 0);
      const std::string ours = broadcast_text(g, "agree_on_launch", settings[i].value, 0);
      const std::string theirs = broadcast_text(g, "agree_on_launch", settings[i].value, r);
      throw UsageError("the ranks were launched differently: " + name + " is " + ours +
                       " on rank 0 but " + theirs + " on rank " + std::to_string(r) +
                       "; every rank must run the same build with the same flags and files (an "
                       "MPMD launch, `mpirun ... : ...`, gave them different ones): launch them "
                       "alike");
    }
}

void agree_on_launch(const std::string& error,
                     const std::vector<std::vector<LaunchSetting>>& stages, double timeout_s) {
  Group g = world_group(timeout_s);
  // Errors first: every rank throws the lowest failing rank's.
  agree_on_error(
      g,
      [&] {
        if (!error.empty()) throw UsageError(error);
      },
      "agree_on_launch");
  if (g.size == 1) return;
  for (const std::vector<LaunchSetting>& stage : stages) compare(g, stage);
}

// ----------------------------------------------------------------------------
// The end

int finish_ranks(int code, double timeout_s, const Fault* fault) {
  if (!(timeout_s > 0 && std::isfinite(timeout_s))) timeout_s = 300;  // a refused --comm-timeout
  Group g = world_group(timeout_s);
  // Every rank here before any finalizes: a rank still at work, or stuck, ends the job by the
  // deadline as any collective's wait would.
  if (g.size > 1)
    host_wait(g, "the end of the job (every rank, before MPI_Finalize)", 0,
              [&](MPI_Request* r) { return MPI_Ibarrier(g.mpi, r); });
  // MPI_Finalize itself waits for the peers (Open MPI's closing fence): a peer held inside it
  // would hold this rank forever, so a watchdog gives it timeout_s and then leaves without it,
  // with a non-zero status that has mpirun end the rest.
  std::mutex m;
  std::condition_variable finalized;
  bool done = false;
  const int rank = g.rank, status = code != 0 ? code : 1;
  // Rank 0 leaves first, the others a second later: mpirun ends them as rank 0 exits, whereas
  // ranks leaving at the same instant can leave mpirun itself hung or crashed in its teardown
  // (measured here: about 1 job in 10 with every rank leaving at once; open-mpi/ompi#3380).
  // At least a second: MPI_Finalize's own work takes milliseconds even with nothing held, and a
  // shorter --comm-timeout bounds the collectives, not it. At most 1e8 s: a wait that long is
  // one a clock counting nanoseconds in 64 bits still holds.
  const double wait_s = std::clamp(timeout_s, 1.0, 1e8), bound_s = wait_s + (rank == 0 ? 0 : 1);
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> lock(m);
    if (finalized.wait_for(lock, std::chrono::duration<double>(bound_s), [&] { return done; }))
      return;
    fprintf(stderr,
            "rank %d: MPI_Finalize has not returned within %g s (--comm-timeout %g s)%s (a rank "
            "is held in the job's end): leaving without it, exit code %d\n",
            rank, wait_s, timeout_s, rank == 0 ? "" : " and the second left to rank 0 to go first",
            status);
    fflush(stderr);
    _exit(status);
  });
  if (fault) fault->at(FaultWhere::Finalize, rank, 0);  // --fault KIND:RANK:0:finalize
  MPI_Finalize();
  {
    std::lock_guard<std::mutex> lock(m);
    done = true;
  }
  finalized.notify_one();
  watchdog.join();
  return code;
}
