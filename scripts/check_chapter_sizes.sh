#!/usr/bin/env bash
# Keeps the chapters readable as text (issue 27's limits), so that a reader who opens
# a chapter's main.cpp sees its technique and little else:
#   - every chapter's main.cpp is at most 150 lines;
#   - its Technique's step function (`float step(int step) override`) at most 60;
#   - no function in a chapter folder is over 80 lines;
#   - diff -u of the main.cpp files of consecutive chapters changes at most 60 lines.
# A function is counted from the first line of its signature to its closing brace:
# a line at indentation 0 or 2 that starts a declaration and reaches a `{` before a
# `;` opens one, and the next line at the same indentation that is `}` or `};` closes
# it (the course's clang-format style puts both there). Prints every measure; exits 1
# naming each one over its limit.
#   ./scripts/check_chapter_sizes.sh
set -euo pipefail
cd "$(dirname "$0")/.."

chapters=(00_single_gpu 02_ddp 03_fsdp 04_naive_model_parallel 05_pipeline 06_tensor_parallel 07_3d
          08_context_parallel 09_expert_parallel 10_slow_links)
# "from to limit". 06 is held against 00, the trainer it extends, and against 02, the
# chapter before it in the course: that diff also takes out 02's data parallelism.
diff_pairs=("00_single_gpu 02_ddp 60" "02_ddp 03_fsdp 60" "04_naive_model_parallel 05_pipeline 60"
            "05_pipeline 07_3d 60" "00_single_gpu 06_tensor_parallel 60" "02_ddp 06_tensor_parallel 60"
            "02_ddp 08_context_parallel 60" "02_ddp 09_expert_parallel 60"
            "02_ddp 10_slow_links 60")
failed=0

over() {  # what, measure, limit
  if [ "$2" -gt "$3" ]; then
    echo "OVER: $1: $2 lines (at most $3)"
    failed=1
  else
    echo "ok:   $1: $2 lines (at most $3)"
  fi
}

# "file:first:length:signature" for every function definition in the files given
functions() {
  awk '
    function indent_of(line) { match(line, /^ */); return RLENGTH }
    function one_line(code) { return code ~ /\}[ \t]*;?[ \t]*$/ && code !~ /\{[ \t]*$/ }
    FNR == 1 { open = 0; pending = 0 }
    {
      code = $0
      sub(/[ \t]*\/\/.*$/, "", code)  # a trailing comment is not code
      if (open) {
        if (code ~ "^" pad "};?[ \t]*$") {
          printf "%s:%d:%d:%s\n", FILENAME, start, FNR - start + 1, signature
          open = 0
        }
        next
      }
      if (pending) {  # a signature continued: a definition if a { comes before a ;
        if (code ~ /\{/) {
          pending = 0
          if (one_line(code)) printf "%s:%d:%d:%s\n", FILENAME, start, FNR - start + 1, signature
          else open = 1
        } else if (code ~ /;[ \t]*$/) {
          pending = 0
        }
        next
      }
      n = indent_of(code)
      if ((n == 0 || n == 2) && code ~ /^ *[A-Za-z_~][A-Za-z0-9_:<>,*& ~]*[ *&]?[A-Za-z_~][A-Za-z0-9_:~]*\(/ &&
          code !~ /^ *(return|if|for|while|switch|case|else|using|typedef|class|struct|enum|namespace|template|public|private|protected|static_assert)[ (:]/) {
        start = FNR; signature = code; sub(/^ +/, "", signature); pad = sprintf("%" n "s", "")
        if (code ~ /\{/) {
          if (one_line(code)) printf "%s:%d:1:%s\n", FILENAME, FNR, signature
          else open = 1
        } else if (code !~ /;[ \t]*$/) {
          pending = 1
        }
      }
    }
  ' "$@"
}

for chapter in "${chapters[@]}"; do
  main="$chapter/main.cpp"
  over "$main" "$(wc -l < "$main")" 150
  step_length=$(functions "$main" | awk -F: '$4 ~ /^float step\(int step\) override/ { print $3 }')
  if [ -z "$step_length" ]; then
    echo "OVER: $main: no 'float step(int step) override' found (the Technique's step)"
    failed=1
  else
    over "$main: step()" "$step_length" 60
  fi
  mapfile -t sources < <(find "$chapter" -maxdepth 1 \( -name '*.cpp' -o -name '*.h' \) | sort)
  # (awk reads to the end: `head -1` would close the pipe early, and under pipefail
  # sort's SIGPIPE would fail the script now and then)
  longest=$(functions "${sources[@]}" | sort -t: -k3 -n -r | awk 'NR == 1')
  over "$chapter: longest function ${longest%%:*}:$(cut -d: -f2 <<< "$longest") $(cut -d: -f4- <<< "$longest" | cut -c1-50)" \
    "$(cut -d: -f3 <<< "$longest")" 80
done

for pair in "${diff_pairs[@]}"; do
  read -r from to limit <<< "$pair"
  changed=$(diff -u "$from/main.cpp" "$to/main.cpp" | tail -n +3 | grep -c '^[-+]' || true)
  over "diff -u $from/main.cpp $to/main.cpp" "$changed" "$limit"
done

if [ "$failed" -ne 0 ]; then
  echo "some chapter is over a limit above (see the top of scripts/check_chapter_sizes.sh for why)"
fi
exit "$failed"
