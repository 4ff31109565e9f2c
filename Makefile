# picoscale build. `make` builds ./train and the tests; `make run`, `make test`, `make bench`
# and `make gpu-check` do what they say; each first runs `make deps`.
NVCC ?= $(shell command -v nvcc || echo /usr/local/cuda/bin/nvcc)
# sm_80 (A100) and sm_90 (H100/H200) machine code plus PTX for newer GPUs.
GPU_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
            -gencode arch=compute_90,code=compute_90
MPI_INC := $(shell mpicxx --showme:incdirs 2>/dev/null)
MPI_LIBDIRS := $(shell mpicxx --showme:libdirs 2>/dev/null)
MPI_LIBS := $(shell mpicxx --showme:libs 2>/dev/null)
BUILD := build

NVFLAGS := -std=c++17 -O3 $(GPU_ARCH) $(addprefix -I,$(MPI_INC)) -I. \
           -Xcompiler -Wall,-Wno-unused-function,-pthread -MMD -MP
LDFLAGS := $(addprefix -L,$(MPI_LIBDIRS)) $(addprefix -l,$(MPI_LIBS)) \
           -lcublas -lcublasLt -lnccl -lopenblas -Xcompiler -pthread

# The book's files at the top; the runtime below them (runtime/) and the kernel variants the
# chapters point to (kernels/).
TECHNIQUE_SRCS := model.cu data_parallel.cu zero.cu tensor_parallel.cu pipeline_parallel.cu \
                  context_parallel.cu flash_attention.cu mixed_precision.cu expert_parallel.cu
RUNTIME_SRCS := $(wildcard runtime/*.cu)
KERNEL_SRCS := $(wildcard kernels/*.cu)
# The planner (Playbook §11): uses the techniques and the runtime; ./plan and train's MFU use it.
PLANNER_SRCS := $(wildcard planner/*.cu)
LIB_SRCS := $(TECHNIQUE_SRCS) $(RUNTIME_SRCS) $(KERNEL_SRCS) $(PLANNER_SRCS)
LIB_OBJS := $(LIB_SRCS:%.cu=$(BUILD)/%.o)
TEST_SRCS := $(wildcard tests/test_*.cu)
TEST_OBJS := $(TEST_SRCS:%.cu=$(BUILD)/%.o)
MPI_TEST_SRCS := $(wildcard tests/mpi/test_*.cu)
MPI_TEST_OBJS := $(MPI_TEST_SRCS:%.cu=$(BUILD)/%.o)
NVTX_RECORD := $(BUILD)/tests/libnvtx_record.so

.PHONY: all deps deps-plots deps-sass run test test-sweep bench gpu-check mutants clean format format-check floor plots
all: train plan $(BUILD)/unit_tests $(BUILD)/mpi_tests $(BUILD)/bench_step $(BUILD)/bench_comm $(BUILD)/bench_tp \
     $(BUILD)/bench_attention $(BUILD)/bench_matmul $(BUILD)/device_info

# Objects depend on the flags they were built with: a new GPU_ARCH rebuilds them.
FLAGS_STAMP := $(BUILD)/flags.txt
$(shell mkdir -p $(BUILD); echo '$(NVFLAGS)' | cmp -s - $(FLAGS_STAMP) || echo '$(NVFLAGS)' > $(FLAGS_STAMP))

$(BUILD)/%.o: %.cu $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

# Catch2's main is plain C++ and never changes: compile it once with the host compiler.
$(BUILD)/tests/catch_main.o: tests/catch_main.cpp
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 -O1 -c $< -o $@

# The MPI tests' main initialises MPI and gathers every rank's verdict: also host-only C++.
$(BUILD)/tests/mpi/mpi_main.o: tests/mpi/mpi_main.cpp
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 -O1 $(addprefix -I,$(MPI_INC)) -c $< -o $@

$(BUILD)/mpi_tests: $(MPI_TEST_OBJS) $(BUILD)/tests/mpi/mpi_main.o $(LIB_OBJS)
	$(NVCC) $(NVFLAGS) $^ -o $@ $(LDFLAGS)

train: $(BUILD)/train.o $(LIB_OBJS)
	$(NVCC) $(NVFLAGS) $^ -o $@ $(LDFLAGS)

# The planner's command line: the best layouts for a model on a cluster (docs/planner.md).
plan: $(BUILD)/tools/plan.o $(LIB_OBJS)
	$(NVCC) $(NVFLAGS) $^ -o $@ $(LDFLAGS)

# The benchmarks (bench/): the step, collectives and gradient sync, tensor parallelism, attention.
$(BUILD)/bench_step: $(BUILD)/bench/bench_step.o $(LIB_OBJS)
	$(NVCC) $(NVFLAGS) $^ -o $@ $(LDFLAGS)

$(BUILD)/bench_comm: $(BUILD)/bench/bench_comm.o $(LIB_OBJS)
	$(NVCC) $(NVFLAGS) $^ -o $@ $(LDFLAGS)

$(BUILD)/bench_tp: $(BUILD)/bench/bench_tp.o $(LIB_OBJS)
	$(NVCC) $(NVFLAGS) $^ -o $@ $(LDFLAGS)

# The GPU chapter's change-one-file experiment as a reader applies it (docs/experiments/
# coarsen-8x8.patch on a copy of kernels/matmul_ladder.cu), linked beside the ladder's own
# benchmark: the GPU check times both (tools/gpu_bundle.sh builds it; `make` does not).
COARSEN8 := $(BUILD)/experiments/coarsen-8x8
$(COARSEN8)/matmul_ladder.cu: kernels/matmul_ladder.cu docs/experiments/coarsen-8x8.patch
	@mkdir -p $(dir $@)
	cp kernels/matmul_ladder.cu $@ && patch --quiet $@ docs/experiments/coarsen-8x8.patch
$(COARSEN8)/matmul_ladder.o: $(COARSEN8)/matmul_ladder.cu $(FLAGS_STAMP)
	$(NVCC) $(NVFLAGS) -c $< -o $@
$(BUILD)/bench_matmul_coarsen8x8: $(BUILD)/bench/bench_matmul.o $(COARSEN8)/matmul_ladder.o \
                                  $(filter-out $(BUILD)/kernels/matmul_ladder.o,$(LIB_OBJS))
	$(NVCC) $(NVFLAGS) $^ -o $@ $(LDFLAGS)

# What the machine is (driver, runtime, devices, libraries): the GPU check's first step.
$(BUILD)/device_info: $(BUILD)/tools/device_info.o $(LIB_OBJS)
	$(NVCC) $(NVFLAGS) $^ -o $@ $(LDFLAGS)

$(BUILD)/bench_attention: $(BUILD)/bench/bench_attention.o $(LIB_OBJS)
	$(NVCC) $(NVFLAGS) $^ -o $@ $(LDFLAGS)

# The GPU chapter's matmul ladder against cuBLAS (kernels/matmul_ladder.cu).
$(BUILD)/bench_matmul: $(BUILD)/bench/bench_matmul.o $(LIB_OBJS)
	$(NVCC) $(NVFLAGS) $^ -o $@ $(LDFLAGS)

# (The tests' NVTX tool, tests/nvtx_record.cpp, comes with them: ./train loads it when a test
# names it, as it would a profiler. NVTX's headers come with CUDA's.)
$(BUILD)/unit_tests: $(TEST_OBJS) $(BUILD)/tests/catch_main.o $(LIB_OBJS) | $(NVTX_RECORD)
	$(NVCC) $(NVFLAGS) $^ -o $@ $(LDFLAGS)

$(NVTX_RECORD): tests/nvtx_record.cpp
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 -O1 -shared -fPIC -I$(dir $(NVCC))../include $< -o $@

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)

# ---------------------------------------------------------------------------------------
# Debian packages picoscale needs; installed when missing (as root), else the command is shown.
DEB_PACKAGES := openmpi-bin libopenmpi-dev libcli11-dev catch2 libopenblas-dev \
                nlohmann-json3-dev fortunes
deps:
	@bash tools/deps.sh $(DEB_PACKAGES)
# Only for the pictures (`make plots`, and their test in `make test`, skipped without it):
# building and training need no Python.
PLOT_PACKAGES := python3-matplotlib
deps-plots:
	@bash tools/deps.sh $(PLOT_PACKAGES)
# Only for the SASS counts of tools/kernel_report.sh (and its test, skipped without them):
# NVIDIA's cuobjdump and nvdisasm, where the CUDA install lacks them, into build/sass-tools.
deps-sass:
	@bash tools/sass_tools.sh

# The main job: train the tiny model on the fortune corpus and print a sample.
run: deps
	@$(MAKE) --no-print-directory -j$$(nproc) train
	./train --model tiny --steps 500 --sample 400

# Every test; ends with the suite's own last line, "N passed, N failed, N skipped".
test: deps
	@$(MAKE) --no-print-directory -j$$(nproc) train plan $(BUILD)/unit_tests $(BUILD)/mpi_tests \
	  $(BUILD)/bench_comm
	@bash tools/run_tests.sh

# The parity criteria on 24 layouts drawn at random (seeded; tests/test_parity.cu, [.sweep]):
# about a minute on two cores; not part of `make test`.
test-sweep: deps
	@$(MAKE) --no-print-directory -j$$(nproc) train $(BUILD)/unit_tests
	@export OMPI_MCA_btl_vader_single_copy_mechanism=none; \
	  if [ "$$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi; \
	  $(BUILD)/unit_tests "[sweep]" --use-colour no --durations yes

bench: deps
	@$(MAKE) --no-print-directory -j$$(nproc) train plan $(BUILD)/bench_step $(BUILD)/bench_comm $(BUILD)/bench_tp \
	  $(BUILD)/bench_attention $(BUILD)/bench_matmul
	@bash tools/bench.sh

gpu-check:
	@bash tools/gpu_check.sh

# Short runs into plots/ and their pictures (tools/plots.py, Debian's matplotlib): loss curves of
# four layouts, pipeline schedules, memory and traffic against the formulas, the planner's
# heatmap of the book's campaign. About a minute on two cores.
plots: deps deps-plots
	@$(MAKE) --no-print-directory -j$$(nproc) train plan
	@bash tools/make_plots.sh plots

# Plants single-line bugs in a copy of the tree and reports which ones the tests catch (slow:
# a rebuild and a test subset per mutant; not part of `make test`).
mutants: deps
	@bash tools/mutants.sh

# The book's floor, counted: top level, technique files' lines, include graph, model.cu's seams.
floor:
	@bash tools/floor.sh

# Every C++ and CUDA file of the tree, formatted by the repository's .clang-format; format-check
# (CI) fails when formatting would change a file, and names it.
FORMATTED = git ls-files '*.cu' '*.cuh' '*.cpp'
format:
	$(FORMATTED) | xargs clang-format -i

format-check:
	@bad=$$($(FORMATTED) | while read -r f; do clang-format --dry-run -Werror "$$f" >/dev/null 2>&1 || \
	  echo "$$f"; done); if [ -n "$$bad" ]; then echo "not formatted (make format):" $$bad; exit 1; fi; \
	  echo "format-check: every file formatted by .clang-format"

clean:
	rm -rf $(BUILD) train plan
