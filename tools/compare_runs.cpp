// Prints the chapters' runs side by side from their --log files (JSON lines).
//
//   compare_runs runs/x/00_single_gpu.jsonl runs/x/02_ddp.jsonl ...
//
// The first file is the reference (chapter 00): every other run's final loss is
// shown as a difference from it, which is the course's promise made visible: the
// parallel chapters compute the same thing, at a different cost. A mixture-of-experts
// run (chapter 09) is held against the first run of the same model instead (chapter 00
// with the same --experts and --top-k), and its label says the model: "E4 k2"; a bf16 run
// (--dtype bf16) against the first run at bf16, its label ending "bf16", and chapter 00 at
// bf16 against chapter 00 at fp32 in a line under the table. Memory columns are
// rank 0's, in a second table (one with every column would not fit 100 columns); "bubble"
// is the share of the step the ranks idle (model-parallel runs).
// Under the tables, each ZeRO run is set against the DDP run at the same world size:
// the per-rank memory that sharding saves, the number chapter 03 is about. Chapter 10
// (slow links) trains otherwise by design: a line under the table says so.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "common/train/cli.h"
#include "common/tensor/error.h"
#include "common/train/metrics.h"

using namespace course;

using Fields = std::map<std::string, std::string>;

// The {"summary": 1, ...} line of a run's log.
static Fields read_summary(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw UsageError("cannot open '" + path + "'");
  std::string line;
  Fields summary;
  while (std::getline(file, line)) {
    if (line.empty()) continue;
    Fields fields = parse_json_line(line);
    if (fields.count("summary")) summary = fields;
  }
  if (summary.empty()) throw CourseError("'" + path + "' has no summary line (did the run finish?)");
  return summary;
}

static double number(const Fields& fields, const std::string& key) {
  auto found = fields.find(key);
  return found == fields.end() ? 0.0 : std::stod(found->second);
}

static std::string megabytes(const Fields& fields, const std::string& key) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f", number(fields, key) / 1e6);
  return text;
}

static bool is_bf16(const Fields& run) { return run.count("matmul_precision") && run.at("matmul_precision") == "bf16"; }

// "05_pipeline (1f1b)": the chapter, and the schedule where there is one; chapter
// 07's grid first: "07_3d 2x2x2 (1f1b)"; chapter 08's split and attention when not
// the defaults (zigzag, ring): "08_context_parallel a2a".
static std::string chapter_label(const Fields& run) {
  std::string label = run.at("chapter");
  if (run.count("dp") && run.count("pp") && run.count("tp")) {
    label += " " + run.at("dp") + "x" + run.at("pp") + "x" + run.at("tp");
  }
  if (run.count("cp_split") && run.at("cp_split") == "contiguous") label += " contig";
  if (run.count("cp_mode") && run.at("cp_mode") == "a2a") label += " a2a";
  if (run.count("experts")) label += " E" + run.at("experts") + " k" + run.at("top_k");
  if (is_bf16(run)) label += " bf16";
  return label + (run.count("schedule") ? " (" + run.at("schedule") + ")" : std::string());
}

// "" for a dense model at fp32, "4/2" for 4 experts, top-2, "/bf16" at bf16: runs of
// one model in one precision compare
static std::string model_of(const Fields& run) {
  return (run.count("experts") ? run.at("experts") + "/" + run.at("top_k") : "") + (is_bf16(run) ? "/bf16" : "");
}

// the final loss of the first run of the same model (the reference of its chapter 00)
static double reference_loss(const std::vector<Fields>& runs, const Fields& run) {
  for (const Fields& candidate : runs) {
    if (model_of(candidate) == model_of(run)) return number(candidate, "final_loss");
  }
  return number(run, "final_loss");
}

// "03_fsdp zero-3 against 02_ddp at 4 ranks, per rank: ..." for each ZeRO run
// that has a DDP run of the same world size among `runs`.
static void print_zero_savings(const std::vector<Fields>& runs) {
  for (const Fields& zero : runs) {
    if (zero.at("chapter").rfind("03_fsdp", 0) != 0) continue;
    for (const Fields& ddp : runs) {
      if (ddp.at("chapter") != "02_ddp" || number(ddp, "world_size") != number(zero, "world_size")) continue;
      auto state = [](const Fields& run) {
        return number(run, "peak_parameters") + number(run, "peak_gradients") + number(run, "peak_optimizer_state");
      };
      auto less = [](double ours, double theirs) { return theirs > 0 ? 100.0 * (1.0 - ours / theirs) : 0.0; };
      std::printf("%s against 02_ddp at %.0f ranks, per rank, for %.2fx the bytes sent per step:\n"
                  "  params + grads + optim %.0f%% less (%.2f -> %.2f MB), total peak %.0f%% less (%.2f -> %.2f MB)\n",
                  zero.at("chapter").c_str(), number(zero, "world_size"),
                  number(zero, "bytes_sent_per_step") / number(ddp, "bytes_sent_per_step"),
                  less(state(zero), state(ddp)), state(ddp) / 1e6, state(zero) / 1e6,
                  less(number(zero, "peak_total"), number(ddp, "peak_total")), number(ddp, "peak_total") / 1e6,
                  number(zero, "peak_total") / 1e6);
    }
  }
}

int main(int argc, char** argv) {
  return guarded_main("compare_runs", [&] {
    if (argc < 2) throw UsageError("usage: compare_runs REFERENCE.jsonl [OTHER.jsonl ...]");
    std::vector<Fields> runs;
    for (int i = 1; i < argc; i++) runs.push_back(read_summary(argv[i]));

    // two tables rather than one wide one: each fits 100 columns (a terminal, a README)
    // the bubble measured, and as the schedule played with the run's own measured
    // costs gives it: on a busy machine the first moves and the second tells by how much
    std::printf("%-24s %5s %10s %10s %10s %10s %7s %6s\n", "chapter", "world", "final loss", "vs ch. 00", "tokens/s",
                "sent/step", "bubble", "(sim.)");
    std::printf("%-24s %5s %10s %10s %10s %10s\n", "", "", "", "(relative)", "", "MB/rank");
    for (const Fields& run : runs) {
      const double loss = number(run, "final_loss"), reference = reference_loss(runs, run);
      const double relative = reference == 0.0 ? 0.0 : std::fabs(loss - reference) / std::fabs(reference);
      char bubble[16] = "-", simulated[16] = "";
      if (run.count("bubble_measured")) std::snprintf(bubble, sizeof(bubble), "%.0f%%", 100 * number(run, "bubble_measured"));
      if (run.count("bubble_simulated")) {
        std::snprintf(simulated, sizeof(simulated), " %5.0f%%", 100 * number(run, "bubble_simulated"));
      }
      std::printf("%-24s %5.0f %10.4f %10.1e %10.0f %10s %7s%s\n", chapter_label(run).c_str(),
                  number(run, "world_size"), loss, relative, number(run, "median_tokens_per_s"),
                  megabytes(run, "bytes_sent_per_step").c_str(), bubble, simulated);
    }
    // bf16 against fp32: chapter 00 in both precisions (the first run at bf16 against the first at fp32)
    for (const Fields& bf16 : runs) {
      if (!is_bf16(bf16) || bf16.at("chapter") != "00_single_gpu" || bf16.count("experts")) continue;
      const Fields& fp32 = runs.front();
      const double loss = number(bf16, "final_loss"), reference = number(fp32, "final_loss");
      std::printf("%s against %s: final loss %.4f vs %.4f (%.2f%% apart: bf16 rounds each product's inputs)\n",
                  chapter_label(bf16).c_str(), chapter_label(fp32).c_str(), loss, reference,
                  100.0 * std::fabs(loss - reference) / std::fabs(reference));
      break;
    }
    for (const Fields& run : runs) {
      if (run.at("chapter").rfind("10_slow_links", 0) != 0) continue;
      std::printf("%s: its loss is worker 0's own (averaging it would cross the slow link every step), not held "
                  "to chapter 00's; its final model's eval loss is %.4f\n",
                  chapter_label(run).c_str(), number(run, "eval_loss"));
    }
    // a busy machine stretches every time: say which runs had one
    std::string busy;
    for (const Fields& run : runs) {
      if (number(run, "machine_busy") != 0) busy += (busy.empty() ? "" : ", ") + chapter_label(run);
    }
    if (!busy.empty()) {
      std::printf("machine busy (its ranks and other processes wanted more cores than it has) during: %s: their "
                  "times are not reliable\n",
                  busy.c_str());
    }
    std::printf("\npeak memory per rank, MB\n");
    std::printf("%-24s %5s %9s %9s %9s %9s %9s\n", "chapter", "world", "params", "grads", "optim", "acts", "total");
    for (const Fields& run : runs) {
      std::printf("%-24s %5.0f %9s %9s %9s %9s %9s\n", chapter_label(run).c_str(), number(run, "world_size"),
                  megabytes(run, "peak_parameters").c_str(), megabytes(run, "peak_gradients").c_str(),
                  megabytes(run, "peak_optimizer_state").c_str(), megabytes(run, "peak_activations").c_str(),
                  megabytes(run, "peak_total").c_str());
    }
    print_zero_savings(runs);
    return 0;
  });
}
