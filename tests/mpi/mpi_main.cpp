// mpi_main.cpp: the MPI tests' main. Every rank runs the same Catch2 session, because a
// collective needs every rank of its group to call it in the same order. Rank 0 reports to the
// console, every other rank to build/mpi_tests.rank<R>.log; rank 0 then prints the log of each
// rank that failed and one last line, "mpi ranks failed: K". Every rank exits non-zero when K > 0.
#define CATCH_CONFIG_RUNNER
// The console reporter indents a failing case's or section's name past its first ": ", and at
// its default width of 80 aborts (TextFlow's `m_width > m_indent`) when that lies beyond the
// width: the names here read as claims and run longer, so the report is 256 columns wide.
#define CATCH_CONFIG_CONSOLE_WIDTH 256
#include <mpi.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

static std::string log_path(int rank) {
  return "build/mpi_tests.rank" + std::to_string(rank) + ".log";
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  int failed = 0;  // failed test cases on this rank (Catch caps it at 255)
  {
    Catch::Session session;
    failed = session.applyCommandLine(argc, argv);
    if (failed == 0) {
      Catch::ConfigData& config = session.configData();
      if (rank > 0) config.outputFilename = log_path(rank);
      failed = session.run();
      // Listing returns how many it listed, not failures.
      if (config.listTests || config.listTestNamesOnly || config.listTags || config.listReporters)
        failed = 0;
    }
  }  // the session's end closes this rank's log before rank 0 reads it

  std::vector<int> failed_per_rank(size);
  MPI_Gather(&failed, 1, MPI_INT, failed_per_rank.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  int this_rank_failed = failed > 0, ranks_failed = 0;
  MPI_Allreduce(&this_rank_failed, &ranks_failed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) {
    for (int r = 1; r < size; r++) {
      if (failed_per_rank[r] == 0) continue;
      std::cout << "rank " << r << ": " << failed_per_rank[r] << " test cases failed (see "
                << log_path(r) << ")\n";
      std::ifstream log(log_path(r));
      if (log.peek() != EOF) std::cout << log.rdbuf();  // (an empty one would fail std::cout)
      std::cout << "\n";
    }
    std::cout << "mpi ranks failed: " << ranks_failed << std::endl;
  }
  MPI_Finalize();
  return ranks_failed > 0 ? 1 : 0;
}
