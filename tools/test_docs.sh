#!/usr/bin/env bash
# test_docs.sh: every fenced `./train`, `mpirun` or `./plan` command of README.md and docs/*.md
# runs as written and exits 0, with its training shortened: `--steps N` becomes `--steps 2` (or is
# added), and `--val-every 0` is added when the command does not set it (a `--score` command,
# which refuses training flags, and a command that runs no ./train, such as ./plan, run
# untouched). Each file's commands run in order in a folder of their own, so a `--save ckpt` followed by `--load ckpt` works as the guide shows it. Under
# mpirun the launcher gets `--oversubscribe` (the guides' rank counts exceed two cores), and
# `--allow-run-as-root` when run as root. Commands that need a GPU (`--device cuda`,
# `--comm nccl`) or several nodes (`--hostfile`) print a SKIP line. A command that ends non-zero,
# or runs past 300 s, fails. Prints "test_docs: N passed, N failed, N skipped"; exits 1 on a
# failure. A couple of minutes on two cores.
#   bash tools/test_docs.sh                 # every file
#   bash tools/test_docs.sh docs/zero.md    # some files
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CAP=2
[ -x ./train ] && [ -x ./plan ] || { echo "FAILED: build ./train and ./plan first (make train plan)"; exit 1; }
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(README.md docs/*.md)

launcher=(--oversubscribe)
[ "$(id -u)" -eq 0 ] && launcher+=(--allow-run-as-root)
export OMPI_MCA_btl_vader_single_copy_mechanism=none OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The commands of one Markdown file, one per line as "LINE<TAB>COMMAND": lines of fenced code
# blocks that start with ./train, ./plan or mpirun, continuation backslashes joined, trailing
# "# comments" dropped.
commands() {
  awk '
    /^[ \t]*```/ { fenced = !fenced; next }
    !fenced { next }
    {
      line = $0
      if (pending != "") cmd = cmd " " line
      else if (line ~ /^[ \t]*(\.\/train|\.\/plan|mpirun)([ \t]|$)/) { cmd = line; start = NR }
      else next
      pending = (cmd ~ /\\[ \t]*$/) ? "yes" : ""
      if (pending != "") { sub(/\\[ \t]*$/, "", cmd); next }
      sub(/[ \t]+#.*$/, "", cmd); sub(/^[ \t]+/, "", cmd); gsub(/[ \t]+/, " ", cmd)
      print start "\t" cmd
    }' "$1"
}

# The command as the test runs it: steps capped, validation at the end only, the launcher's flags.
# The cap ($2) grows by CAP with each --load of the file, so a resume continues past the step
# the run it loads was shortened to; it also reaches a --fault's step.
shorten() {
  local cmd=$1 cap=$2
  if [[ $cmd =~ --fault\ [a-z]+:[0-9]+:([0-9]+) ]] && [ "${BASH_REMATCH[1]}" -ge "$cap" ]; then
    cap=$((BASH_REMATCH[1] + 1))
  fi
  if [[ $cmd == *"./train"* && $cmd != *"--score"* ]]; then
    if [[ $cmd =~ --steps\ ([0-9]+) ]]; then
      local n=${BASH_REMATCH[1]}
      [ "$n" -gt "$cap" ] && cmd=${cmd/--steps $n/--steps $cap}
    else
      cmd+=" --steps $cap"
    fi
    [[ $cmd == *"--val-every"* ]] || cmd+=" --val-every 0"
  fi
  if [[ $cmd == mpirun* ]]; then
    local extra="" f
    for f in "${launcher[@]}"; do [[ $cmd == *" $f"* ]] || extra+=" $f"; done
    cmd="mpirun$extra${cmd#mpirun}"
  fi
  echo "$cmd"
}

passed=0 failed=0 skipped=0
for file in "${files[@]}"; do
  dir=$work/$(echo "$file" | tr '/.' '__')
  loads=0
  mkdir -p "$dir" && ln -s "$ROOT/train" "$dir/train" && ln -s "$ROOT/plan" "$dir/plan" && ln -s "$ROOT/build" "$dir/build"
  while IFS=$'\t' read -r line cmd; do
    where="$file:$line"
    case " $cmd " in
      *" --device cuda "* | *" --comm nccl "*)
        echo "SKIP: $where (needs a GPU): $cmd"; skipped=$((skipped + 1)); continue ;;
      *" --hostfile "*)
        echo "SKIP: $where (needs several nodes): $cmd"; skipped=$((skipped + 1)); continue ;;
    esac
    [[ " $cmd " == *" --load "* ]] && loads=$((loads + 1))
    run=$(shorten "$cmd" $((CAP * (1 + loads))))
    t0=$(date +%s.%N)
    (cd "$dir" && timeout 300 bash -c "$run") </dev/null >"$dir/out.txt" 2>&1  # mpirun reads stdin
    rc=$?
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if [ "$rc" -eq 0 ]; then
      passed=$((passed + 1)); printf "ok   %5s s  %s: %s\n" "$secs" "$where" "$cmd"
    else
      failed=$((failed + 1))
      echo "FAILED (exit $rc): $where: $cmd"
      echo "  ran: $run"
      tail -5 "$dir/out.txt" | sed 's/^/  | /'
    fi
  done < <(commands "$file")
done
echo "test_docs: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
