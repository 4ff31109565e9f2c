// test_context.cu: a Context's lifetime against the buffers made on it (core.cuh). A buffer from
// the stream-ordered empty / zeros is freed on its context's stream, so it must go before the
// context does; Context::destroy stops with a [BUG] otherwise. The count is kept on the CPU as
// on CUDA, so these tests, and every CPU test that destroys a context, catch the mistake on a
// machine without a GPU.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <csignal>
#include <cstdio>
#include <functional>
#include <string>

#include "runtime/core.cuh"

namespace {

// How a child process that ran `body` ended, and what it wrote.
struct ChildEnd {
  bool signaled = false;
  int signal = 0, exit_code = -1;
  std::string output;  // stdout and stderr
};

// Runs `body` in a forked child: an abort there (PICO_ASSERT's) ends the child, not the test
// runner. The child exits 0 when body returns, 3 when it throws; its stdout and stderr are
// collected in `output`.
ChildEnd run_in_child(const std::function<void()>& body) {
  int pipe_fds[2];
  REQUIRE(pipe(pipe_fds) == 0);
  fflush(stdout);
  fflush(stderr);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(pipe_fds[0]);
    dup2(pipe_fds[1], STDERR_FILENO);
    dup2(pipe_fds[1], STDOUT_FILENO);  // nothing of the child's on the runner's console
    // Catch2's handlers would report the abort as this test's failure, from the child: the
    // default action instead, an abort the parent sees in the exit status.
    for (int sig : {SIGABRT, SIGSEGV, SIGILL, SIGFPE, SIGTERM, SIGINT}) signal(sig, SIG_DFL);
    const rlimit no_core{0, 0};  // an expected abort leaves no core file behind
    setrlimit(RLIMIT_CORE, &no_core);
    try {
      body();
    } catch (...) {
      _exit(3);
    }
    fflush(stdout);
    fflush(stderr);
    _exit(0);
  }
  close(pipe_fds[1]);
  ChildEnd end;
  char buffer[4096];
  for (ssize_t n; (n = read(pipe_fds[0], buffer, sizeof buffer)) > 0;)
    end.output.append(buffer, (size_t)n);
  close(pipe_fds[0]);
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  end.signaled = WIFSIGNALED(status);
  if (end.signaled) end.signal = WTERMSIG(status);
  if (WIFEXITED(status)) end.exit_code = WEXITSTATUS(status);
  return end;
}

}  // namespace

TEST_CASE("a Context counts the live buffers made on it, its copies' included, and no others",
          "[core]") {
  Context ctx = Context::create(Device::CPU), other = Context::create(Device::CPU);
  CHECK(ctx.live_allocations() == 0);
  {
    Tensor a = empty(ctx, {4, 8}, Mem::Activations);
    Tensor b = zeros(ctx, {3}, Mem::Workspace, DType::BF16);
    Tensor view = a.view(8, {8});  // shares a's buffer: not another allocation
    const Context copy = ctx;      // the same stream: the same count
    Tensor c = empty(copy, {2}, Mem::Workspace);
    Tensor legacy = empty({5}, Mem::Workspace);  // no Context: the legacy stream's, not counted
    Tensor elsewhere = empty(other, {6}, Mem::Workspace);
    CHECK(ctx.live_allocations() == 3);
    CHECK(copy.live_allocations() == 3);
    CHECK(other.live_allocations() == 1);
    a = Tensor{};
    CHECK(ctx.live_allocations() == 3);  // the view keeps a's buffer
    view = Tensor{};
    CHECK(ctx.live_allocations() == 2);
  }
  CHECK(ctx.live_allocations() == 0);
  CHECK(other.live_allocations() == 0);
  ctx.destroy();  // nothing alive: returns
  other.destroy();
}

// The bug tests/test_fp8_gemm.cu once had: outputs made on a context at function scope, the
// context destroyed before they went (on CUDA their frees would then run on a destroyed stream).
TEST_CASE("destroying a Context while buffers made on it are alive is a [BUG] stop, on the CPU too",
          "[core]") {
  const ChildEnd early = run_in_child([] {
    Context ctx = Context::create(Device::CPU);
    Tensor y = empty(ctx, {64, 256}, Mem::Workspace);
    Tensor dx = zeros(ctx, {64, 384}, Mem::Workspace);
    Tensor w = empty({256, 384}, Mem::Params);  // the legacy stream's: not the context's
    ctx.destroy();                              // y and dx are still alive
  });
  INFO("child output: " << early.output);
  CHECK(early.signaled);
  CHECK(early.signal == SIGABRT);
  CHECK_THAT(early.output,
             Catch::Contains("[BUG]") &&
                 Catch::Contains("2 allocations made on this context are still alive"));

  // The same code with the buffers gone first ends normally.
  const ChildEnd in_order = run_in_child([] {
    Context ctx = Context::create(Device::CPU);
    {
      Tensor y = empty(ctx, {64, 256}, Mem::Workspace);
      Tensor dx = zeros(ctx, {64, 384}, Mem::Workspace);
    }
    ctx.destroy();
  });
  INFO("child output: " << in_order.output);
  CHECK(!in_order.signaled);
  CHECK(in_order.exit_code == 0);
  CHECK(in_order.output.find("[BUG]") == std::string::npos);
}
