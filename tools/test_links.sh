#!/usr/bin/env bash
# test_links.sh: the README and the guides point at what exists. Checks, printing a FAILED line
# for each problem:
#   1. README.md has at most 250 lines, none wider than 160 characters; each guide in docs/ has
#      at most 250 lines;
#   2. the chapter map (README's "The book, chapter by chapter"): every file a row names exists,
#      and every function the row names is defined in one of the row's files (a definition or
#      declaration line, not a call or a comment: see defines below), and the row's first file
#      opens with a banner that names the row's guide;
#   3. every relative Markdown link of README.md, docs/*.md, tests/README.md, bench/README.md and
#      tools/README.md resolves (from the linking file's folder), and so does its #anchor when it
#      has one (a heading of the target, slugged as GitHub does for ASCII headings);
#   4. every `file:function` written in backticks in those files names a file that exists and a
#      name it defines, and every `path.cu` (.cuh .cpp .sh .py .md .patch) in backticks exists,
#      from the repository's root or the linking file's folder.
# Prints "test_links: N checked, N failed"; exits 1 on a failure. A second or two.
set -uo pipefail
cd "$(dirname "$0")/.."
failed=0 checked=0
# defines FILE NAME: FILE defines (or declares) NAME: a function (a line with a type, then NAME and
# "(", nothing assigned or called before it), a struct, class, enum or alias, or Class::member
# (written out of line, or the class in FILE with the member declared in it).
defines() {
  local file=$1 name=$2 cls member
  if [[ $name == *::* ]]; then
    cls=${name%::*} member=${name##*::}
    grep -qE "(^|[^A-Za-z0-9_])${cls}::~?${member#\~}[[:space:]]*\(" "$file" && return 0
    grep -qE "^[[:space:]]*(struct|class)[[:space:]]+${cls}([^A-Za-z0-9_]|$)" "$file" &&
      grep -qE "^[[:space:]]*[A-Za-z_][^=(/;]*[[:space:]*&:]${member}[[:space:]]*\(" "$file" && return 0
    return 1
  fi
  grep -qE "^[[:space:]]*(template[[:space:]]*<[^>]*>[[:space:]]*)?[A-Za-z_][^=(/;]*[[:space:]*&:]${name}[[:space:]]*\(" "$file" ||
    grep -qE "^[[:space:]]*(struct|class|enum( class)?|using|constexpr[^=]*|const[^=]*|static[^=]*)[[:space:]]+${name}([^A-Za-z0-9_]|$)" "$file"
}
fail() { echo "FAILED: $*"; failed=$((failed + 1)); }
pass() { checked=$((checked + 1)); }
docs=(README.md docs/*.md tests/README.md bench/README.md tools/README.md)

# ---- 1. lengths ----
n=$(wc -l <README.md)
if [ "$n" -le 250 ]; then pass; else fail "README.md has $n lines (at most 250)"; fi
width=0 line=0
while IFS= read -r l; do  # characters, not bytes (the README has § and Ψ)
  line=$((line + 1)) w=$(LC_ALL=C.UTF-8 bash -c 'echo ${#1}' _ "$l")
  [ "$w" -gt 160 ] && fail "README.md:$line is $w characters wide (at most 160)"
  [ "$w" -gt "$width" ] && width=$w
done <README.md
[ "$width" -le 160 ] && pass
for g in docs/*.md; do
  n=$(wc -l <"$g")
  if [ "$n" -le 250 ]; then pass; else fail "$g has $n lines (a guide is read in one sitting: at most 250)"; fi
done

# ---- 2. the chapter map ----
# Each row as "LINE<TAB>files<TAB>functions": the second column's backticked names, and the third's.
rows=$(awk '
  /^## / { inmap = ($0 ~ /^## The book, chapter by chapter/) }
  inmap && /^\|/ && !/^\|[-| :]*$/ {
    row = $0; gsub(/\\\|/, "", row)          # an escaped pipe inside a cell
    n = split(row, c, "|")
    if (c[3] ~ /^ *file *$/) next              # the header
    files = ""; fns = ""
    s = c[3]; while (match(s, /`[^`]+`/)) { files = files " " substr(s, RSTART + 1, RLENGTH - 2); s = substr(s, RSTART + RLENGTH) }
    s = c[4]; while (match(s, /`[^`]+`/)) { fns = fns " " substr(s, RSTART + 1, RLENGTH - 2); s = substr(s, RSTART + RLENGTH) }
    guide = ""; if (match(c[2], /\]\([^)]+\)/)) guide = substr(c[2], RSTART + 2, RLENGTH - 3)
    print NR "\t" files "\t" fns "\t" guide
  }' README.md)
[ -n "$rows" ] || fail "README.md: no chapter map found under \"## The book, chapter by chapter\""
while IFS=$'\t' read -r line files fns guide; do
  [ -n "$files" ] || { fail "README.md:$line: a map row without a file"; continue; }
  # The row's first file opens with a banner that points to the row's guide.
  first=${files# }; first=${first%% *}
  if [ -z "$guide" ]; then fail "README.md:$line: a map row without a guide link"
  elif [ -f "$first" ] && awk '!/^\/\//{exit} {print}' "$first" | grep -qF -- "$guide"; then pass
  else fail "README.md:$line: $first's opening comment does not name its guide, $guide"; fi
  [ -n "$fns" ] || fail "README.md:$line: a map row without a function to read first"
  for f in $files; do
    if [ -f "$f" ]; then pass; else fail "README.md:$line: the map names $f, which does not exist"; fi
  done
  for fn in $fns; do
    found=0
    for f in $files; do [ -f "$f" ] && defines "$f" "$fn" && found=1; done
    if [ "$found" = 1 ]; then pass; else fail "README.md:$line: $fn is not defined in$(printf ' %s' $files)"; fi
  done
done <<<"$rows"

# ---- 3. links ----
slug() { echo "$1" | tr 'A-Z' 'a-z' | sed -E 's/[^a-z0-9 _-]//g; s/ /-/g'; }
has_anchor() {  # file anchor (grep reads every heading: -q would stop early, and pipefail
  # would then count the writer's broken pipe as a missing anchor)
  grep -E '^#{1,6} ' "$1" | sed -E 's/^#+ +//' | while read -r h; do slug "$h"; done |
    grep -xF -- "$2" >/dev/null
}
for doc in "${docs[@]}"; do
  [ -f "$doc" ] || { fail "$doc is missing"; continue; }
  base=$(dirname "$doc")
  while IFS= read -r target; do
    case $target in http://* | https://* | mailto:*) continue ;; esac
    path=${target%%#*} anchor=""
    [[ $target == *"#"* ]] && anchor=${target#*#}
    resolved=$doc
    if [ -n "$path" ]; then resolved=$(realpath -m --relative-to=. "$base/$path"); fi
    if [ ! -e "$resolved" ]; then
      fail "$doc: the link ($target) leads nowhere ($resolved)"; continue
    fi
    if [ -n "$anchor" ] && [[ $resolved == *.md ]] && ! has_anchor "$resolved" "$anchor"; then
      fail "$doc: the link ($target): $resolved has no heading #$anchor"; continue
    fi
    pass
  done < <(grep -oE '\]\([^) ]+\)' "$doc" | sed -E 's/^\]\(//; s/\)$//')
done

# ---- 4. names in backticks ----
exists_from() {  # doc path: from the root, or from the doc's folder
  [ -e "$2" ] || [ -e "$(dirname "$1")/$2" ]
}
for doc in "${docs[@]}"; do
  [ -f "$doc" ] || continue
  while IFS= read -r ref; do
    f=${ref%%:*} name=${ref#*:}
    file=$f; [ -e "$file" ] || file=$(dirname "$doc")/$f
    if [ ! -f "$file" ]; then
      fail "$doc: \`$ref\`: no file $f"; continue
    fi
    if defines "$file" "$name"; then pass; else fail "$doc: \`$ref\`: $file does not define $name"; fi
  done < <(grep -oE '`[A-Za-z0-9_./-]+\.(cu|cuh|cpp|sh|py):[A-Za-z_~][A-Za-z0-9_:~]*`' "$doc" | tr -d '`' | sort -u)
  while IFS= read -r f; do
    if exists_from "$doc" "$f"; then pass
    else fail "$doc: \`$f\` does not exist"; fi
  done < <(grep -oE '`[A-Za-z0-9_./-]+\.(cu|cuh|cpp|sh|py|md|patch)`' "$doc" | tr -d '`' | sort -u)
done

echo "test_links: $checked checked, $failed failed"
[ "$failed" -eq 0 ]
