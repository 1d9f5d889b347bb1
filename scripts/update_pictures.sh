#!/usr/bin/env bash
# Regenerates what the READMEs show from the code and the runs: first the chapter
# READMEs' diffs against the previous chapter and their files tables
# (scripts/update_readme_diffs.sh and update_readme_files.sh, which need no run), then the pictures they embed (docs/pictures/*.svg) from a run of the main
# command, with the course report's tool: the same pictures as its report.html, and,
# where a headless Chromium is installed, docs/report.png, a screenshot of that report.
#   ./scripts/run_course.sh && ./scripts/update_pictures.sh      # from the newest run
#   ./scripts/update_pictures.sh runs/20261123-222846            # from that run
# Then the mixture-of-experts pictures (chapter 09's README): chapter 00 trains E 4 top-2
# twice, with the default auxiliary loss and without it (about a minute on 2 cores), and
# the report draws both runs' load imbalance and each one's tokens per expert.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/update_readme_diffs.sh
./scripts/update_readme_files.sh
# the newest run of the main command: its folders are named by their time (runs/20261129-230620);
# the benchmarks' (runs/bf16-..., ...) are not runs of it
run="${1:-$(ls -d runs/[0-9]*/ 2>/dev/null | sort | tail -n 1 || true)}"
if [[ -z "$run" || ! -d "$run" ]]; then
  echo "update_pictures: no run to draw (hint: ./scripts/run_course.sh first, or name a runs/<stamp>)" >&2
  exit 2
fi
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
build/bin/report "${run%/}" --out "$scratch" >/dev/null
mkdir -p docs/pictures
# the memory bars come in pictures of a few chapters each (memory_1.svg, ...): the
# READMEs embed the first, which holds chapters 00 to 04 in a run of the main command
rm -f docs/pictures/memory*.svg
for picture in loss memory_1 memory_2 memory_3 memory_4 bytes throughput timeline_05_pipeline_1f1b \
  timeline_05_pipeline_zb-h1; do
  if [[ ! -f "$scratch/report_files/$picture.svg" ]]; then
    echo "update_pictures: $run made no $picture.svg (hint: a run of ./scripts/run_course.sh makes them all)" >&2
    exit 1
  fi
  cp "$scratch/report_files/$picture.svg" docs/pictures/
done

# README.md's docs/report.png: the top of that report (the side-by-side table, the loss
# and memory pictures), where a headless Chromium is installed. Only this picture needs
# one: the course and the report itself never do, and without one the picture stays.
browser="$(command -v chromium chromium-browser google-chrome 2>/dev/null | head -n 1 || true)"
if [[ -n "$browser" ]]; then
  "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1300,1930 \
    --screenshot="$scratch/report.png" "file://$scratch/report.html" >/dev/null 2>&1 || true
  if [[ ! -s "$scratch/report.png" ]]; then
    echo "update_pictures: $browser took no screenshot of the report" >&2
    exit 1
  fi
  if command -v optipng >/dev/null 2>&1; then optipng -quiet -o2 "$scratch/report.png"; fi
  cp "$scratch/report.png" docs/report.png
else
  echo "update_pictures: no chromium here: docs/report.png left as it was (hint: apt-get install chromium)"
fi

moe="$scratch/moe"
mkdir -p "$moe"
for coef in 0.01 0; do
  build/bin/00_single_gpu --experts 4 --top-k 2 --aux-loss-coef "$coef" --print-every 200 \
    --log "$moe/00_moe_aux$coef.jsonl" >/dev/null
done
build/bin/report "$moe" --out "$moe" >/dev/null
cp "$moe/report_files/imbalance.svg" docs/pictures/moe_imbalance.svg
for coef in 0.01 0; do
  cp "$moe/report_files/experts_00_moe_aux$coef.svg" "docs/pictures/moe_experts_aux$coef.svg"
done
echo "docs/pictures/ updated from $run and two MoE runs of chapter 00"
