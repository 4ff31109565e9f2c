#!/usr/bin/env bash
# floor.sh: `make floor`, the counts that say the top level is the book's floor (DESIGN 2),
# printed and checked: (1) the top level holds the design card's files and folders, nothing
# else; (2) each technique file's lines (past 450, the sign of a missing seam); (3) the
# dependencies run one way: runtime/ includes only runtime/, a kernel only the runtime, kernels
# and the chapter it implements, and the modules (a file's .cu and .cuh together; a kernel
# counted with its chapter) have no include cycle; (4) model.cu does not branch on the attention
# kind, on context parallelism or on a dtype; (5) train.cu composes: its branches on a technique
# (at most 5) and train_step's lines (at most 50); (6) each chapter as its guide's "The code, in
# order" has a reader follow it: at most 4 files and 900 lines; (7) the production code's lines.
# Exits 1 when a check fails. CI runs it on the tree; `make test` does not (an applied
# experiment may grow a file), but runs its own test (test_floor.sh).
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
echo "lines of each technique file (.cu; past 450 is the sign of a missing seam; its header beside it)"
for f in data_parallel zero tensor_parallel pipeline_parallel context_parallel expert_parallel \
         flash_attention mixed_precision; do
  [ -f "$f.cu" ] || continue
  n=$(wc -l <"$f.cu") h=$(wc -l <"$f.cuh")
  printf "  %-22s %4d lines (+ %3d in %s)\n" "$f.cu" "$n" "$h" "$f.cuh"
  [ "$n" -le 450 ] || fail "$f.cu has $n lines: a missing seam?"
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

# ---- (5) train.cu composes ----
# A branch on a technique: a condition (if, ?, &&, ||) on one of its flags or kinds.
technique='\.(experts|zero|cp|tp|sp|pp|ep|pp_virtual|pp_schedule|attention|dtype|capacity_factor|cp_balance|cp_comm|dp_sync|bucket_mb)\b|AttentionKind::|Precision::|DType::(BF16|F16|F8)|\bring\b|zero_stage\(|\.mixed\(|dynamic_cast|\bstage\b'
branches=$(grep -nE '\bif \(|\?|&&|\|\||\bswitch \(' train.cu | grep -E "$technique")
nb=$(grep -c . <<<"$branches")
[ -z "$branches" ] && nb=0
step=$(awk '/^static bool train_step\(/ { on = 1 } on { n++; if ($0 ~ /^}/) { print n; exit } }' train.cu)
echo "train.cu: $nb branches on a technique (at most 5), train_step ${step:-?} lines (at most 50)"
[ -n "$branches" ] && echo "$branches" | sed 's/^/    /'
[ "$nb" -le 5 ] || fail "train.cu branches on a technique in $nb places"
[ "${step:-999}" -le 50 ] || fail "train_step is ${step:-?} lines"

# ---- (5) each chapter as a reader follows it ----
# A guide's "The code, in order" names what a reader opens, in backticks: `file`, or
# `file:function`. The chapter's own files (data-parallel.md: data_parallel.cu, and its header
# with it: the interface a reader opens beside it) and any file named bare are read whole; another file named only by its functions (model.cu's block,
# train.cu's step, another chapter's merge, a runtime function) counts those functions' lines,
# from the definition to its closing brace.
extent() {  # file name: lines of the definition of `name` (a function, method or struct)
  awk -v name="$2" '
    !on && $0 !~ /^[ \t]/ && $0 !~ /;[ \t]*$/ && $0 !~ /^\/\// &&
      (index($0, name "(") || $0 ~ ("(struct|class) " name "( |$|:)")) {
      on = 1; n = 0 }
    on { n++; if ($0 ~ /^}/) { print n; exit } }
    END { if (on && n && $0 !~ /^}/) print n }' "$1" | head -1
}
chapter_files_lines() {  # guide: prints "files lines list"
  local guide=$1 refs f fn total=0 list="" files=0 own
  own=$(basename "$guide" .md | tr - _)  # the chapter's own stem
  refs=$(awk '/^## / { on = ($0 ~ /^## The code, in order/) } on' "$guide" |
         grep -oE '`[a-z_/]+\.cuh?(:[A-Za-z_:~]+)?`' | tr -d '`' | sort -u)
  declare -A whole=() part=()
  for r in $refs; do
    f=${r%%:*}
    [ -f "$f" ] || continue
    if [[ $r != *:* || ${f%.*} == "$own" ]]; then whole[$f]=1
    else part[$f]+=" ${r#*:}"; fi
  done
  [ -n "${whole[$own.cu]:-}" ] && [ -f "$own.cuh" ] && whole[$own.cuh]=1
  for f in "${!whole[@]}"; do total=$((total + $(wc -l <"$f"))); list+=" $f"; files=$((files + 1)); done
  for f in "${!part[@]}"; do
    [ -n "${whole[$f]:-}" ] && continue
    local n=0
    for fn in ${part[$f]}; do
      local e
      e=$(extent "$f" "${fn##*::}")
      n=$((n + ${e:-0}))
    done
    total=$((total + n)); list+=" $f($n)"; files=$((files + 1))
  done
  echo "$files $total$list"
}
echo "each chapter as its guide has a reader follow it (\"The code, in order\"; at most 4 files, 900 lines)"
printf "  %-24s %5s %6s  %s\n" guide files lines "what it names (a file's functions only: their lines)"
for g in docs/first-steps.md docs/data-parallel.md docs/zero.md docs/tensor-parallel.md \
         docs/context-parallel.md docs/pipeline-parallel.md docs/expert-parallel.md \
         docs/flash-attention.md docs/mixed-precision.md; do
  [ -f "$g" ] || continue
  read -r files lines list <<<"$(chapter_files_lines "$g")"
  printf "  %-24s %5d %6d  %s\n" "$(basename "$g")" "$files" "$lines" "$list"
  [ "$files" -le 4 ] || fail "$g names $files files"
  [ "$lines" -le 900 ] || fail "$g has a reader follow $lines lines"
done

# ---- (7) the production code ----
prod=$(git ls-files '*.cu' '*.cuh' | grep -vE '^(tests|bench|tools)/' | xargs cat | wc -l)
echo "production code (the top level, runtime/, kernels/, planner/): $prod lines"

if [ $failed -eq 0 ]; then echo "floor: every check holds"; else echo "floor: FAILED"; fi
exit $failed
