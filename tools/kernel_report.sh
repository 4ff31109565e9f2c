#!/usr/bin/env bash
# kernel_report.sh: what the compiler says about every CUDA kernel in kernels/, on a machine
# without a GPU. Compiles each file for sm_80 and sm_90 with `ptxas -v` and the PTX kept, and
# prints one row per kernel and architecture: registers, spill bytes (stores/loads), static
# shared memory (ptxas), dynamic shared memory (the launch's, from tools/kernel_smem.cu), and
# how many ldmatrix, cp.async and mma.sync instructions its PTX holds (static counts, after
# unrolling: one per instruction written out, not per execution). Where NVIDIA's cuobjdump is
# found (tools/sass_tools.sh; `make deps-sass` fetches it), three more columns count the same
# instructions in the SASS ptxas wrote, the code the GPU runs: LDSM (ldmatrix), LDGSTS
# (cp.async) and HMMA (mma); without it they read "-" and the report says so.
# --check also holds the kernels to the rules below and ends with
# "kernel_report: N rows checked, M violations" (exit 1 on a violation):
#   1. no kernel spills (0 bytes of spill stores and loads);
#   2. the tensor-core kernels still use what they are built on, on every architecture:
#      matmul_tensor_cores_kernel ldmatrix and mma; flash_forward_bf16_kernel and
#      flash_backward_bf16_kernel ldmatrix, cp.async and mma (every head dim);
#   3. the kernels launched with dynamic shared memory (flash_*_bf16_kernel) have it known (from
#      tools/kernel_smem.cu) and, with their static shared memory, within what a block may have:
#      163 KiB on sm_80, 227 KiB on sm_90;
#   4. with the SASS counted, rule 2 holds in the SASS too (ptxas kept every instruction kind).
# Usage: tools/kernel_report.sh [--check] [--out FILE] [--table FILE] [FILE.cu ...]
#   FILE.cu: the files to compile (default: every kernels/*.cu); --out: the table also to FILE;
#   --table FILE: compile nothing, check that table (tools/test_kernel_report.sh plants
#   violations in copies of one). About a minute on two cores for all of kernels/.
set -uo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
ARCHS="sm_80 sm_90"
CHECK=0 OUT="" TABLE="" FILES=()
while [ $# -gt 0 ]; do
  case $1 in
    --check) CHECK=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    --table) TABLE=$2; shift 2 ;;
    -*) echo "kernel_report: unknown option $1 (usage: tools/kernel_report.sh [--check]" \
             "[--out FILE] [--table FILE] [FILE.cu ...])"; exit 2 ;;
    *) FILES+=("$1"); shift ;;
  esac
done
[ ${#FILES[@]} -gt 0 ] || FILES=(kernels/*.cu)

# The rules of --check: a kernel name pattern (an awk regex on the demangled name) and the
# instructions every kernel matching it must contain.
RULES="
matmul_tensor_cores_kernel ldmatrix,mma
flash_forward_bf16_kernel< ldmatrix,cp.async,mma
flash_backward_bf16_kernel< ldmatrix,cp.async,mma
"

# check TABLE: the rules against a table this script printed.
check() {
  awk -F'|' -v rules="$RULES" -v archs="$ARCHS" '
    function trim(x) { gsub(/^ +| +$/, "", x); return x }
    BEGIN {
      limit["sm_80"] = 163 * 1024; limit["sm_90"] = 227 * 1024
      n_rules = split(rules, lines, "\n"); nr = 0
      for (i = 1; i <= n_rules; i++) if (split(lines[i], f, " ") == 2) { nr++; pat[nr] = f[1]; need[nr] = f[2] }
      col["ldmatrix"] = 9; col["cp.async"] = 10; col["mma"] = 11
      sass["ldmatrix"] = 12; sass["cp.async"] = 13; sass["mma"] = 14
      sass_name["ldmatrix"] = "LDSM"; sass_name["cp.async"] = "LDGSTS"; sass_name["mma"] = "HMMA"
    }
    /^\| / && NF >= 12 && trim($2) != "kernel" {
      name = trim($2); arch = trim($3); rows++
      split(trim($5), sp, "/")
      if (sp[1] + 0 != 0 || sp[2] + 0 != 0) { printf "VIOLATION: %s (%s) spills %s bytes (stores/loads)\n", name, arch, trim($5); bad++ }
      if (name ~ /^flash_(forward|backward)_bf16_kernel</) {
        shared = trim($6) + trim($7)
        if (trim($7) + 0 == 0) { printf "VIOLATION: %s (%s): its launch'"'"'s dynamic shared memory is unknown (tools/kernel_smem.cu)\n", name, arch; bad++ }
        else if (shared > limit[arch]) { printf "VIOLATION: %s (%s) needs %d bytes of shared memory, past %d\n", name, arch, shared, limit[arch]; bad++ }
      }
      for (r = 1; r <= nr; r++) if (name ~ pat[r]) {
        seen[r, arch]++
        k = split(need[r], kinds, ",")
        for (j = 1; j <= k; j++) {
          if (trim($(col[kinds[j]])) + 0 == 0) {
            printf "VIOLATION: %s (%s) has no %s instruction\n", name, arch, kinds[j]; bad++ }
          s = trim($(sass[kinds[j]]))
          if (s == "-" || s == "") no_sass++
          else if (s + 0 == 0) {
            printf "VIOLATION: %s (%s) has no %s in its SASS\n", name, arch, sass_name[kinds[j]]; bad++ }
        }
      }
    }
    END {
      na = split(archs, a, " ")
      for (r = 1; r <= nr; r++) for (i = 1; i <= na; i++) if (!seen[r, a[i]]) {
        printf "VIOLATION: no kernel matching %s for %s\n", pat[r], a[i]; bad++ }
      if (no_sass) print "kernel_report: SASS not checked (no cuobjdump; tools/sass_tools.sh fetches it)"
      printf "kernel_report: %d rows checked, %d violations\n", rows, bad
      exit bad > 0
    }' "$1"
}

if [ -n "$TABLE" ]; then check "$TABLE"; exit; fi

WORK=$(mktemp -d /tmp/kernel_report.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
INCLUDES="-I. $(mpicxx --showme:incdirs 2>/dev/null | tr ' ' '\n' | sed '/^$/d; s/^/-I/' | tr '\n' ' ')"
GENCODE=""
for a in $ARCHS; do GENCODE="$GENCODE -gencode arch=compute_${a#sm_},code=$a"; done

# Every file in parallel (as many at a time as there are cores), PTX kept per architecture.
compile() {
  local f=$1 d=$WORK/$(basename "$1" .cu)
  mkdir -p "$d"
  # shellcheck disable=SC2086
  "$NVCC" -std=c++17 -O3 $GENCODE $INCLUDES -Xptxas -v --keep --keep-dir "$d" -c "$f" \
    -o "$d/out.o" >"$d/ptxas.log" 2>&1 || { echo "FAILED" >"$d/status"; return; }
  echo ok >"$d/status"
}
jobs_max=$(nproc)
for f in "${FILES[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do sleep 0.2; done
  compile "$f" &
done
"$NVCC" -std=c++17 $INCLUDES tools/kernel_smem.cu -o "$WORK/kernel_smem" >"$WORK/smem.log" 2>&1 &&
  "$WORK/kernel_smem" >"$WORK/dynamic.txt" || { echo "kernel_report: tools/kernel_smem.cu:"; cat "$WORK/smem.log"; }
wait
failed=0
for f in "${FILES[@]}"; do
  d=$WORK/$(basename "$f" .cu)
  if [ "$(cat "$d/status" 2>/dev/null)" != ok ]; then
    echo "kernel_report: $f does not compile:"; grep -m5 error "$d/ptxas.log"; failed=1
  fi
done
[ "$failed" = 0 ] || exit 1

# name|arch|registers|spill stores/loads|static smem, from ptxas -v; then the PTX counts.
rows=$WORK/rows.txt
for f in "${FILES[@]}"; do
  d=$WORK/$(basename "$f" .cu)
  awk -v file="$f" '
    /Compiling entry function/ { split($0, q, "'"'"'"); name = q[2]; arch = q[4]; smem = 0 }
    /bytes spill stores/ { st = $5; ld = $9 }
    /Used [0-9]+ registers/ {
      regs = $5; smem = 0
      if (match($0, /[0-9]+ bytes smem/)) smem = substr($0, RSTART, RLENGTH - 11)
      print name "|" arch "|" regs "|" st "/" ld "|" smem "|" file }' "$d/ptxas.log" >>"$rows"
  for a in $ARCHS; do
    awk -v arch="$a" '
      /\.entry / { name = $0; sub(/.*\.entry +/, "", name); sub(/\(.*/, "", name); ldm[name] = cpa[name] = mma[name] = 0; order[++n] = name }
      /^[ \t]*ldmatrix/ { ldm[name]++ }
      /^[ \t]*cp\.async\.c[ag]\./ { cpa[name]++ }
      /^[ \t]*mma\.sync/ { mma[name]++ }
      END { for (i = 1; i <= n; i++) print order[i] "|" arch "|" ldm[order[i]] "|" cpa[order[i]] "|" mma[order[i]] }' \
      "$d"/*.compute_${a#sm_}.ptx >>"$WORK/ptx.txt"
  done
done

# The SASS counts, by (mangled name, arch), where a cuobjdump is found.
CUOBJDUMP_FOUND=$(bash tools/sass_tools.sh --find 2>/dev/null)
: >"$WORK/sass.txt"
if [ -n "$CUOBJDUMP_FOUND" ]; then
  for f in "${FILES[@]}"; do
    "$CUOBJDUMP_FOUND" -sass "$WORK/$(basename "$f" .cu)/out.o" 2>>"$WORK/sass.log" | awk '
      /code for sm_/ { arch = $NF }
      /Function : / { name = $NF; key = name "|" arch; order[++n] = key; ldsm[key] = ldg[key] = hmma[key] = 0 }
      /[ \t]LDSM[. ]/ { ldsm[key]++ }
      /[ \t]LDGSTS[. ]/ { ldg[key]++ }
      /[ \t]HMMA[. ]/ { hmma[key]++ }
      END { for (i = 1; i <= n; i++) print order[i] "|" ldsm[order[i]] "|" ldg[order[i]] "|" hmma[order[i]] }' \
      >>"$WORK/sass.txt"
  done
fi

# Join by (mangled name, arch), demangle, add the launch's dynamic shared memory.
{
  echo "| kernel | arch | registers | spill bytes (st/ld) | static smem (ptxas) | dynamic smem (launch) | file | ldmatrix | cp.async | mma | LDSM | LDGSTS | HMMA |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  awk -F'|' 'FILENAME == ARGV[1] { sass[$1 "|" $2] = $3 "|" $4 "|" $5; next }
             FILENAME == ARGV[2] { counts[$1 "|" $2] = $3 "|" $4 "|" $5; next }
             { c = counts[$1 "|" $2]; if (c == "") c = "?|?|?"
               s = sass[$1 "|" $2]; if (s == "") s = "-|-|-"
               print $1 "|" $2 "|" $3 "|" $4 "|" $5 "|" $6 "|" c "|" s }' \
    "$WORK/sass.txt" "$WORK/ptx.txt" "$rows" |
    while IFS='|' read -r mangled arch regs spills smem file counts; do
      name=$(echo "$mangled" | c++filt | sed 's/(.*//; s/^void //')
      dyn=$(awk -v n="$name" '{ bytes = $NF; $NF = ""; sub(/ +$/, "") } $0 == n { print bytes }' \
        "$WORK/dynamic.txt" 2>/dev/null)
      IFS='|' read -r ldm cpa mma ldsm ldgsts hmma <<<"$counts"
      printf '| %s | %s | %s | %s | %s | %s | `%s` | %s | %s | %s | %s | %s | %s |\n' "$name" "$arch" \
        "$regs" "$spills" "$smem" "${dyn:-0}" "$file" "$ldm" "$cpa" "$mma" "$ldsm" "$ldgsts" "$hmma"
    done | sort -t'|' -k8,8 -k2,2 -k3,3
} >"$WORK/table.md"
cat "$WORK/table.md"
[ -n "$OUT" ] && cp "$WORK/table.md" "$OUT"
if [ "$CHECK" = 1 ]; then echo; check "$WORK/table.md"; fi
