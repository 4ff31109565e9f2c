#!/usr/bin/env bash
# floor.sh: the counts that say the top level is the book's floor (DESIGN 2), printed and
# checked: (1) the top level holds the design card's files and folders, nothing else; (2) each
# technique file is under 400 lines, most of them its algorithm; (3) the dependencies run one
# way: runtime/ includes only runtime/, a kernel only the runtime, kernels and the chapter it
# implements, and the modules (a file's .cu and .cuh together; a kernel counted with its
# chapter) have no include cycle; (4) model.cu does not branch on the attention kind, on context
# parallelism or on a dtype. Exits 1 when a check fails.
#   bash tools/floor.sh            # the report
#   bash tools/floor.sh --graph    # and the module graph, one "module -> dependencies" per line
set -uo pipefail
cd "$(dirname "$0")/.."
failed=0
fail() { echo "  FAIL: $*"; failed=1; }

# ---- (1) the top level ----
card="Makefile README.md model.cu model.cuh train.cu data_parallel.cu data_parallel.cuh zero.cu zero.cuh
tensor_parallel.cu tensor_parallel.cuh pipeline_parallel.cu pipeline_parallel.cuh context_parallel.cu
context_parallel.cuh expert_parallel.cu expert_parallel.cuh flash_attention.cu flash_attention.cuh
mixed_precision.cu mixed_precision.cuh"
folders="runtime kernels planner tests bench tools docs"
echo "top level (git ls-files): the design card's files, and folders"
extra=""
for f in $(git ls-files | cut -d/ -f1 | sort -u); do
  case " $(echo $card) $folders " in *" $f "*) ;; *) [[ $f == .* ]] || extra+=" $f" ;; esac
done
echo "  files: $(git ls-files | grep -v / | grep -v '^\.' | tr '\n' ' ')"
echo "  folders: $(git ls-files | grep / | cut -d/ -f1 | sort -u | grep -v '^\.' | tr '\n' ' ')"
[ -z "$extra" ] || fail "not on the design card:$extra"
for f in Makefile README.md model.cu train.cu data_parallel.cu zero.cu tensor_parallel.cu \
         pipeline_parallel.cu context_parallel.cu flash_attention.cu mixed_precision.cu; do
  [ -f "$f" ] || fail "the card's $f is missing"
done

# ---- (2) lines of each technique file ----
echo "lines of each technique file (.cu, at most 400; its header beside it)"
for f in data_parallel zero tensor_parallel pipeline_parallel context_parallel expert_parallel \
         flash_attention mixed_precision; do
  [ -f "$f.cu" ] || continue
  n=$(wc -l <"$f.cu") h=$(wc -l <"$f.cuh")
  printf "  %-22s %4d lines (+ %3d in %s)\n" "$f.cu" "$n" "$h" "$f.cuh"
  [ "$n" -le 400 ] || fail "$f.cu has $n lines"
done
printf "  %-22s %4d lines, %-22s %4d lines (the model and the composition)\n" model.cu \
  "$(wc -l <model.cu)" train.cu "$(wc -l <train.cu)"

# ---- (3) dependencies ----
# The module of a file: runtime/x, kernels/x (a kernel that includes a chapter's header belongs
# to that chapter), or the top-level stem.
module_of() {
  local f=$1 stem=${1%.*}
  [[ $stem == runtime/comm_* ]] && stem=runtime/comm  # the collectives, in four files
  if [[ $f == kernels/* ]]; then
    local chapter
    chapter=$(grep -ho '#include "[a-z_]*\.cuh"' "$f" | sed 's/#include "//; s/\.cuh"//' | head -1)
    [ -n "$chapter" ] && { echo "$chapter"; return; }
  fi
  echo "$stem"
}
declare -A deps
files=$(ls *.cu *.cuh runtime/*.cu runtime/*.cuh kernels/*.cu kernels/*.cuh 2>/dev/null)
for f in $files; do
  m=$(module_of "$f")
  for inc in $(grep -ho '#include "[a-z_/]*\.cuh"' "$f" | sed 's/#include "//; s/"//'); do
    [ -f "$inc" ] || { [[ $f == kernels/* ]] && [ -f "$inc" ]; continue; }
    d=$(module_of "$inc")
    [ "$d" = "$m" ] && continue
    deps[$m]+=" $d"
    case $f in
      runtime/*) [[ $inc == runtime/* ]] || fail "$f includes $inc (the runtime knows no technique)" ;;
      kernels/*) [[ $inc == runtime/* || $inc == kernels/* || $inc != */* ]] ||
                   fail "$f includes $inc" ;;
    esac
  done
done
echo "dependencies: $(for m in "${!deps[@]}"; do echo "$m"; done | wc -l) modules"
if [ "${1:-}" = "--graph" ]; then
  for m in $(echo "${!deps[@]}" | tr ' ' '\n' | sort); do
    echo "  $m -> $(echo ${deps[$m]} | tr ' ' '\n' | sort -u | tr '\n' ' ')"
  done
fi
# Depth-first search for a cycle.
declare -A state  # 1 on the path, 2 done
cycle=""
visit() {
  local m=$1 d
  state[$m]=1
  for d in $(echo ${deps[$m]:-} | tr ' ' '\n' | sort -u); do
    if [ "${state[$d]:-0}" = 1 ]; then cycle="$d ... $m -> $d"; return 1; fi
    if [ "${state[$d]:-0}" = 0 ]; then visit "$d" || { cycle="$m -> $cycle"; return 1; }; fi
  done
  state[$m]=2
}
for m in "${!deps[@]}"; do
  [ "${state[$m]:-0}" = 0 ] || continue
  visit "$m" || { fail "include cycle: $cycle"; break; }
done
[ -z "$cycle" ] && echo "  no include cycles; runtime/ includes only runtime/"

# ---- (4) the model's block asks nothing ----
branches=$(grep -nE 'AttentionKind::|Attention::(Flash|Naive|Ring)|\bcp\.|ContextParallel|Precision::|ctx\.precision|DType::(BF16|F16|F8)' model.cu)
if [ -n "$branches" ]; then
  fail "model.cu branches on the attention kind, cp or a dtype:"
  echo "$branches" | sed 's/^/    /'
else
  echo "model.cu: no branch on the attention kind, on cp or on a dtype"
fi

if [ $failed -eq 0 ]; then echo "floor: every check holds"; else echo "floor: FAILED"; fi
exit $failed
