#!/usr/bin/env bash
# Regenerates each chapter README's "The files" table: the files that hold the chapter's
# code, each with its line count and the first sentence of its own header comment,
# written between two marker lines so that the counts are the code's and cannot drift.
# A .h and its .cpp share a row; main.cpp is the trainer. Chapter 07's table also lists
# planner/, its planner, which is built after chapter 08 because it counts cp too.
# And docs/ARCHITECTURE.md's table of common/'s four layers: each one's files and lines.
#   ./scripts/update_readme_files.sh           # rewrite the tables that are stale
#   ./scripts/update_readme_files.sh --check   # change nothing; exit 1 naming each stale README
# A README without the markers gets them (and its table) under a "## The files" heading,
# just above "## Run it". CTest runs --check (test readme_files).
set -euo pipefail
cd "$(dirname "$0")/.."
export LC_ALL=C

check=0
case "${1:-}" in
  "") ;;
  --check) check=1 ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

begin_marker='<!-- files (scripts/update_readme_files.sh writes this block) -->'
end_marker='<!-- end files -->'

# The first sentence of a file's leading // comment, on one line.
first_sentence() {
  awk '
    # a paragraph ends at an empty comment line, a drawing or a list (an indented line)
    /^\/\/ ?$/ || /^\/\/   / { exit }
    /^\/\// { line = $0; sub(/^\/\/ ?/, "", line); text = text (text == "" ? "" : " ") line; next }
    { exit }
    END {
      # the first full stop that ends a sentence, not one after an abbreviation (et al. 2019)
      rest = text; cut = 0
      while (match(rest, /\.( |$)/)) {
        before = substr(rest, 1, RSTART)
        cut += RSTART
        if (before !~ /(al|e\.g|i\.e|etc|vs)\.$/) { text = substr(text, 1, cut); break }
        rest = substr(rest, RSTART + 1)
      }
      sub(/:$/, ".", text)  # a paragraph that leads into a drawing
      print text
    }' "$1"
}

lines_of() { wc -l <"$1" | tr -d ' '; }

# The table of the files in the folders given.
table() {
  echo "| file | lines | what it holds |"
  echo "|---|---:|---|"
  for folder in "$@"; do
    for file in "$folder"/*.h "$folder"/*.cpp "$folder"/*.cu; do
      [[ -f "$file" ]] || continue
      base="${file%.*}"
      case "$file" in
        */main.cpp)
          echo "| \`$file\` | $(lines_of "$file") | the trainer: its flags, the technique's class (what a rank holds, one step), the step loop |"
          ;;
        *.h)
          if [[ -f "$base.cpp" ]]; then
            echo "| \`$file\`, \`${base##*/}.cpp\` | $(lines_of "$file") + $(lines_of "$base.cpp") | $(first_sentence "$file") |"
          else
            echo "| \`$file\` | $(lines_of "$file") | $(first_sentence "$file") |"
          fi
          ;;
        *)
          [[ -f "$base.h" ]] && continue  # its header's row
          echo "| \`$file\` | $(lines_of "$file") | $(first_sentence "$file") |"
          ;;
      esac
    done
  done
}

# Rewrites (or with --check, compares) the block between `begin` and `end` in `file`.
stale=0
write_block() {  # file, begin marker, end marker, block
  local file="$1" begin="$2" end="$3" block="$4" current
  current="$(awk -v b="$begin" -v e="$end" '$0 == b { on = 1 } on { print } $0 == e { on = 0 }' "$file")"
  [[ "$current" == "$block" ]] && return 0
  stale=1
  if [[ $check == 1 ]]; then
    echo "STALE: $file: its block '$begin' is not the code's (run ./scripts/update_readme_files.sh)"
    return 0
  fi
  awk -v b="$begin" -v e="$end" -v source=<(echo "$block") '
    $0 == b { while ((getline line < source) > 0) print line; skip = 1; next }
    skip && $0 == e { skip = 0; next }
    !skip { print }' "$file" >"$file.new"
  mv "$file.new" "$file"
  echo "$file: '$begin' written"
}

# common/'s layers, lowest first: files and lines of each, and in all
layers_block() {
  echo "$1"
  echo "| layer | target | files | lines |"
  echo "|---|---|---:|---:|"
  local total=0 layer files lines
  for layer in tensor comm model train; do
    files=$(find "common/$layer" -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' \) | wc -l)
    lines=$(find "common/$layer" -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' \) -exec cat {} + | wc -l)
    local note=""
    [[ $layer == tensor ]] && note=" (the CUDA backend, \`cuda/\`: $(cat common/tensor/cuda/* | wc -l))"
    echo "| \`common/$layer/\` | \`course_$layer\` | $files | $lines$note |"
    total=$((total + lines))
  done
  echo "| all of \`common/\` | | | $total |"
  echo "$2"
}
arch=docs/ARCHITECTURE.md
layers_begin='<!-- layers (scripts/update_readme_files.sh writes this block) -->'
layers_end='<!-- end layers -->'
grep -q -x -F -e "$layers_begin" "$arch" || { echo "$arch: no line '$layers_begin'" >&2; exit 2; }
write_block "$arch" "$layers_begin" "$layers_end" "$(layers_block "$layers_begin" "$layers_end")"

for chapter in [01][0-9]_*/; do
  chapter="${chapter%/}"
  readme="$chapter/README.md"
  folders=("$chapter")
  [[ "$chapter" == 07_3d ]] && folders+=(planner)
  block="$(
    echo "$begin_marker"
    table "${folders[@]}"
    echo "$end_marker"
  )"
  if grep -q -x -F -e "$begin_marker" "$readme"; then
    write_block "$readme" "$begin_marker" "$end_marker" "$block"
    continue
  else
    stale=1
    if [[ $check == 1 ]]; then
      echo "STALE: $readme has no files table (run ./scripts/update_readme_files.sh)"
      continue
    fi
    grep -q -x -e '## Run it' "$readme" || { echo "$readme: no '## Run it' heading to put the table above" >&2; exit 2; }
    awk -v file=<(echo "$block") '
      $0 == "## Run it" && !done {
        print "## The files"; print ""
        print "The chapter'"'"'s code, and how long each file is (the first sentence is the file'"'"'s own summary):"; print ""
        while ((getline line < file) > 0) print line
        print ""; done = 1
      }
      { print }' "$readme" >"$readme.new"
  fi
  mv "$readme.new" "$readme"
  echo "$readme: files table written"
done

if [[ $check == 1 && $stale == 1 ]]; then exit 1; fi
[[ $check == 1 ]] && echo "ok: every chapter README's files table is the code's"
exit 0
