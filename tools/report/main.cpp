// The course report: every chapter's run side by side, in pictures, as one HTML page.
//
//   report runs/<stamp>                 # every *.jsonl log there -> runs/<stamp>/report.html
//   report runs/<stamp> --out DIR       # the page and its pictures in DIR instead
//   report runs/<stamp> A.jsonl B.jsonl # only these logs (a missing one is named in the report)
//
// It reads only the logs (--log) and traces (--trace) the chapters wrote, so it works
// on any run, a GPU machine's too. The pictures are SVGs drawn by gnuplot, in
// report_files/ beside the page with the gnuplot scripts that drew them: the page
// needs no network to be viewed. A bad log is named, on stderr and in the page, and
// the report shows what the other logs hold.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "common/train/cli.h"
#include "common/tensor/error.h"
#include "tools/report/memory_model.h"
#include "tools/report/plots.h"
#include "tools/report/run_logs.h"
#include "tools/report/timeline.h"

namespace fs = std::filesystem;
using namespace course;
using namespace course::report;

static const char* const kUsage = "usage: report RUN_DIR [--out DIR] [LOG.jsonl ...]";

// The bound every parallel chapter's test holds it to: relative loss difference per step
// from chapter 00 (tests/support/runs.h, kLossTolerance).
constexpr double kLossBound = 1e-5;

static std::string html(const std::string& text) {
  std::string escaped;
  for (char c : text) {
    switch (c) {
      case '<': escaped += "&lt;"; break;
      case '>': escaped += "&gt;"; break;
      case '&': escaped += "&amp;"; break;
      case '"': escaped += "&quot;"; break;
      default: escaped += c;
    }
  }
  return escaped;
}

static std::string format(const char* pattern, double value) {
  char text[64];
  std::snprintf(text, sizeof(text), pattern, value);
  return text;
}

static std::string megabytes(double bytes) { return format("%.2f", bytes / 1e6); }

static std::string field(const Fields& fields, const std::string& key) {
  auto found = fields.find(key);
  return found == fields.end() ? "-" : found->second;
}

static std::string row(const std::vector<std::string>& cells, const char* tag = "td") {
  std::string text = "<tr>";
  for (const std::string& cell : cells) text += std::string("<") + tag + ">" + cell + "</" + tag + ">";
  return text + "</tr>\n";
}

static std::string figure(const std::string& file, const std::string& caption) {
  return "<figure><img src=\"report_files/" + html(file) + "\" alt=\"" + html(caption) + "\"><figcaption>" +
         html(caption) + "</figcaption></figure>\n";
}

static bool is_bf16(const ChapterLog& log) { return field(log.summary, "matmul_precision") == "bf16"; }

// The chapter 00 run every other is compared with, if the set has one: an fp32 one,
// unless `bf16` (the reference of the bf16 runs).
static const ChapterLog* find_reference(const std::vector<ChapterLog>& chapters, bool bf16 = false) {
  for (const ChapterLog& log : chapters) {
    const bool chapter_00 = field(log.summary, "chapter") == "00_single_gpu" || log.name.rfind("00_", 0) == 0;
    if (chapter_00 && is_bf16(log) == bf16) return &log;
  }
  return nullptr;
}

// The side-by-side table (tools/compare_runs' columns), with every number from the summaries.
// The bubble measured, and after it the schedule's bubble played with the run's own
// measured costs (chapters 05 and 07): on a busy machine the first moves, the second
// says by how much.
static std::string bubble_cell(const Fields& summary) {
  if (!summary.count("bubble_measured")) return "-";
  std::string cell = format("%.0f%%", 100 * number(summary, "bubble_measured"));
  if (summary.count("bubble_simulated")) cell += format(" (sim. %.0f%%)", 100 * number(summary, "bubble_simulated"));
  return cell;
}

// The final loss a run is held against: chapter 00's run of the same model in the same
// precision (a mixture of experts against chapter 00's with the same experts, a bf16 run
// against chapter 00's at bf16), 0 when there is none.
static double reference_loss(const std::vector<ChapterLog>& chapters, const Fields& run) {
  const auto model_of = [](const Fields& s) {
    return field(s, "experts") + "/" + field(s, "top_k") + "/" + field(s, "matmul_precision");
  };
  for (const ChapterLog& log : chapters) {
    if (field(log.summary, "chapter") == "00_single_gpu" && model_of(log.summary) == model_of(run)) {
      return number(log.summary, "final_loss");
    }
  }
  return 0.0;
}

static std::string summary_table(const std::vector<ChapterLog>& chapters) {
  std::string text = "<table>\n" + row({"chapter", "world", "final loss", "vs ch. 00 (relative)", "tokens/s",
                                       "sent/step MB/rank", "peak total MB (rank 0)", "bubble"},
                                      "th");
  for (const ChapterLog& log : chapters) {
    const Fields& s = log.summary;
    if (s.empty()) {
      text += row({html(log.title), "-", "(no summary: the run did not finish)", "-", "-", "-", "-", "-"});
      continue;
    }
    const double loss = number(s, "final_loss"), reference = reference_loss(chapters, s);
    const std::string relative =
        reference == 0.0 ? "-" : format("%.1e", std::fabs(loss - reference) / std::fabs(reference));
    // a busy machine stretches every time: the run says so, next to its name
    const std::string busy = number(s, "machine_busy") != 0 ? "<br><small>machine busy: times unreliable</small>" : "";
    text += row({html(log.title) + busy, field(s, "world_size"), format("%.4f", loss), relative,
                 format("%.0f", number(s, "median_tokens_per_s")), megabytes(number(s, "bytes_sent_per_step")),
                 megabytes(number(s, "peak_total")),
                 bubble_cell(s)});
  }
  return text + "</table>\n";
}

// Predicted and measured MB per category, the numbers behind the memory picture.
static std::string memory_table(const std::vector<MemoryGroup>& groups) {
  std::vector<std::string> header = {"chapter", "rank"};
  for (const char* title : kCategoryTitles) header.push_back(std::string(title) + "<br>predicted / measured");
  std::string text = "<table>\n" + row(header, "th");
  for (const MemoryGroup& group : groups) {
    std::vector<std::string> cells = {html(group.chapter), std::to_string(group.memory.rank)};
    for (int c = 0; c < kCategories; c++) {
      const CategoryBytes& p = group.memory.predicted;
      const CategoryBytes& m = group.memory.measured;
      cells.push_back((p.known[c] ? megabytes(p.bytes[c]) : "-") + " / " +
                      (m.known[c] ? megabytes(m.bytes[c]) : "-"));
    }
    text += row(cells);
  }
  return text + "</table>\n";
}

// The run's configuration per chapter, then the machines (usually one) it ran on.
static std::string configuration_tables(const std::vector<ChapterLog>& chapters) {
  std::string text = "<table>\n" + row({"chapter", "world", "backend", "device", "model (L, C, NH, T, V)", "batch",
                                       "micro-batches", "steps", "lr", "seed", "BLAS threads", "data"},
                                      "th");
  std::vector<std::pair<std::string, std::vector<std::string>>> machines;  // description -> its chapters
  for (const ChapterLog& log : chapters) {
    const Fields& s = log.summary;
    if (s.empty()) continue;
    text += row({html(log.title), field(s, "world_size"), html(field(s, "backend")),
                 html(field(s, "device") + " (" + field(s, "matmul_precision") + ")"),
                 field(s, "layers") + ", " + field(s, "d_model") + ", " + field(s, "heads") + ", " +
                     field(s, "seq_len") + ", " + field(s, "vocab_size"),
                 field(s, "global_batch"), field(s, "micro_batches"), field(s, "steps"),
                 s.count("lr") ? format("%g", number(s, "lr")) : "-",
                 field(s, "seed"), field(s, "threads"), html(field(s, "data"))});
    std::string machine = row({html(field(s, "host")), html(field(s, "cpu")), field(s, "cpu_cores"),
                               html(field(s, "gpu")), html(field(s, "compiler")), html(field(s, "blas"))});
    auto found = std::find_if(machines.begin(), machines.end(), [&](const auto& m) { return m.first == machine; });
    if (found == machines.end()) found = machines.insert(machines.end(), {machine, {}});
    found->second.push_back(html(log.title));
  }
  text += "</table>\n<table>\n" + row({"host", "CPU", "cores", "GPU", "compiler", "BLAS", "chapters"}, "th");
  for (const auto& [machine, names] : machines) {
    std::string list;
    for (const std::string& name : names) list += (list.empty() ? "" : ", ") + name;
    text += machine.substr(0, machine.size() - 6) + "<td>" + list + "</td></tr>\n";  // before its "</tr>\n"
  }
  return text + "</table>\n";
}

// With experts: the load imbalance of every such run in one picture, then each run's
// tokens per expert over the steps. Nothing for dense runs.
static std::string routing_section(const std::string& pictures, const std::vector<ChapterLog>& chapters) {
  std::string figures;
  for (const ChapterLog& log : chapters) {
    if (!log.has_experts()) continue;
    if (figures.empty()) {
      figures += figure(plot_expert_imbalance(pictures, chapters),
                        "The load imbalance per step of each run with experts: in every layer, the token-choices of "
                        "the busiest expert over the mean, averaged over the layers (1: balanced; E: every choice "
                        "to one expert). The auxiliary loss (aux) pulls it towards 1.");
    }
    figures += figure(plot_expert_shares(pictures, log),
                      "Tokens per expert over the steps in " + log.legend +
                      ": each expert's share of the step's token-choices, summed over the layers.");
  }
  return figures.empty() ? "" : "<h2>Routing: where the experts' tokens go</h2>\n" + figures;
}

// Chapter 10's runs: a worker's weights leave it every H steps, or its gradients
// compressed, so its losses are not chapter 00's; what it buys is in its bytes and time.
static bool is_slow_links(const ChapterLog& log) { return log.title.rfind("10_slow_links", 0) == 0; }

static std::string slow_links_section(const std::string& pictures, const std::vector<ChapterLog>& runs,
                                      const ChapterLog* reference) {
  std::string table = "<table>\n" + row({"run", "workers", "sent by the averages, MB/worker", "(formula)",
                                         "eval loss", "final loss (worker 0)", "time, s"},
                                        "th");
  for (const ChapterLog& log : runs) {
    const Fields& s = log.summary;
    if (s.empty()) continue;
    double seconds = 0.0;
    for (const StepLine& step : log.steps) seconds += step.ms / 1e3;
    table += row({html(log.title), field(s, "world_size"), megabytes(number(s, "sync_bytes_sent")),
                  megabytes(number(s, "sync_bytes_formula")), format("%.4f", number(s, "eval_loss")),
                  format("%.4f", number(s, "final_loss")), format("%.1f", seconds)});
  }
  return "<h2>Slow links: talking less</h2>\n"
         "<p>Chapter 10 trains otherwise than chapter 00 on purpose: its workers average weights every H steps "
         "(DiLoCo) or send compressed gradients, so its curves are not chapter 00's. Its step lines carry worker "
         "0's loss on its own slice of the batch (averaging it would cross the slow link every step); the eval "
         "loss is the final model's on 16 batches no step trained on.</p>\n" +
         figure(plot_slow_links(pictures, runs, reference),
                "Chapter 10's runs: the loss against steps, against the bytes rank 0 sent, and against the time "
                "its steps took.") +
         table + "</table>\n";
}

// The runs at --dtype bf16 with chapter 00 at fp32: bf16 training parts slowly from
// fp32's (each product's inputs rounded to about 3 digits), and every parallel chapter at
// bf16 lies on chapter 00's bf16 curve, within the tests' 1e-2 (test_bf16_training.cpp).
static std::string mixed_precision_section(const std::string& pictures, const std::vector<ChapterLog>& bf16_runs,
                                           const ChapterLog* fp32_reference) {
  std::vector<ChapterLog> runs;
  if (fp32_reference) runs.push_back(*fp32_reference);
  runs.insert(runs.end(), bf16_runs.begin(), bf16_runs.end());
  constexpr double kBf16Bound = 1e-2;
  return "<h2>Mixed precision: bf16 against fp32</h2>\n" +
         figure(plot_losses(pictures, "loss_bf16", "loss per step: chapter 00 at fp32 and at bf16, chapters at bf16",
                            runs, find_reference(runs, /*bf16=*/true), kBf16Bound),
                "Chapter 00 at fp32 and at bf16 (--dtype bf16: each product's inputs rounded to bf16, fp32 sums; "
                "activations sent between ranks as bf16), and the parallel chapters at bf16, each one's relative "
                "difference from chapter 00 at bf16 below, with the tests' bound of " +
                    format("%g", kBf16Bound) + " per step. The fp32 curve parts from the bf16 ones slowly.");
}

static const char* const kStyle =
    "body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:1em 0;font-size:90%}td,th{border:1px solid #ccc;padding:3px 8px;"
    "text-align:right}td:first-child,th:first-child{text-align:left}th{background:#f3f3f3}"
    "img{max-width:100%;border:1px solid #eee}figure{margin:1em 0}figcaption{color:#555;font-size:90%}"
    ".problems{background:#fff4e5;border-left:4px solid #f28e2b;padding:0.5em 1em}code{background:#f3f3f3}";

static int make_report(const std::string& run_dir, const std::string& out_dir, const std::vector<std::string>& logs) {
  require_gnuplot();
  RunSet set = read_run_directory(run_dir, logs);
  const std::string pictures = (fs::path(out_dir) / "report_files").string();
  fs::create_directories(pictures);
  const ChapterLog* reference = find_reference(set.chapters);
  if (!set.chapters.empty() && !reference) {
    set.problems.push_back(run_dir + ": no chapter 00 log (00_single_gpu.jsonl): "
                           "the difference panel and the 'vs ch. 00' column are left out");
  }

  std::string body;
  if (!set.chapters.empty()) {
    body += "<h2>Side by side</h2>\n" + summary_table(set.chapters);
    // the curves of chapter 00's model (a mixture of experts trains another: its runs are in "Routing")
    // (chapter 10 trains otherwise, by design: its runs have a section of their own)
    // (the bf16 runs are drawn with chapter 00's at both precisions, in a picture of their own)
    std::vector<ChapterLog> same_model, slow_links, bf16_runs;
    for (const ChapterLog& log : set.chapters) {
      const bool dense = !reference || field(log.summary, "experts") == field(reference->summary, "experts");
      if (is_slow_links(log)) {
        slow_links.push_back(log);
      } else if (dense && is_bf16(log)) {
        bf16_runs.push_back(log);
      } else if (dense) {
        same_model.push_back(log);
      }
    }
    body += "<h2>Loss: the same curve in every chapter</h2>\n" +
            figure(plot_losses(pictures, "loss", "loss per step: every chapter computes the same thing", same_model,
                               find_reference(same_model), kLossBound),
                   "Every chapter's loss per step (they lie on one another), and each one's relative difference "
                   "from chapter 00 with the tests' bound of " + format("%g", kLossBound) + " per step.");

    if (!bf16_runs.empty()) body += mixed_precision_section(pictures, bf16_runs, reference);
    if (!slow_links.empty()) body += slow_links_section(pictures, slow_links, reference);

    // the memory bars in pictures of a few chapters each (every rank of a chapter in one),
    // so that each fits the page with labels that can be read
    std::vector<std::vector<MemoryGroup>> memory_pictures;
    std::vector<std::string> names;
    std::vector<double> bytes, rates;
    std::vector<bool> busy;
    for (const ChapterLog& log : set.chapters) {
      std::vector<MemoryGroup> ranks;
      for (const RankMemory& memory : rank_memory(log)) {
        ranks.push_back({log.legend + "\nrank " + std::to_string(memory.rank), log.title, memory});
      }
      if (!ranks.empty()) {
        if (memory_pictures.empty() ||
            memory_pictures.back().size() + ranks.size() > kMemoryGroupsPerPicture) {
          memory_pictures.emplace_back();
        }
        memory_pictures.back().insert(memory_pictures.back().end(), ranks.begin(), ranks.end());
      }
      if (log.summary.empty()) continue;
      names.push_back(log.legend);
      bytes.push_back(number(log.summary, "bytes_sent_per_step") / 1e6);
      rates.push_back(number(log.summary, "median_tokens_per_s"));
      busy.push_back(number(log.summary, "machine_busy") != 0);
    }
    if (!memory_pictures.empty()) {
      std::string figures;
      std::vector<MemoryGroup> groups;
      for (size_t p = 0; p < memory_pictures.size(); p++) {
        const std::string name = "memory" + (memory_pictures.size() > 1 ? "_" + std::to_string(p + 1) : "");
        figures += figure(plot_memory(pictures, name, memory_pictures[p]),
                          "Peak memory per rank by category (" + std::to_string(p + 1) + " of " +
                              std::to_string(memory_pictures.size()) + ").");
        groups.insert(groups.end(), memory_pictures[p].begin(), memory_pictures[p].end());
      }
      body += "<h2>Memory: how each technique divides it</h2>\n"
              "<p>Chapters 04, 05, 07, 08 and 09 log every rank (their workspace is rank 0's only); the others log "
              "rank 0, whose ranks hold the same. A predicted bar (left, light) shows the categories a README "
              "formula gives (the planner's for 07 and 08; for 09 its parameters, gradients and AdamW state).</p>\n" +
              figures + memory_table(groups);
    }
    if (!names.empty()) {
      const bool any_busy = std::find(busy.begin(), busy.end(), true) != busy.end();
      body += "<h2>Cost: what each technique sends, and how fast it runs</h2>\n" +
              figure(plot_bars(pictures, "bytes", "bytes sent per step, per rank (rank 0)", "MB (10^6 bytes)", names,
                               bytes, "%.2f"),
                     "Bytes each rank sends per optimizer step (rank 0's): the same on a busy machine.") +
              figure(plot_bars(pictures, "throughput", "tokens per second (median step, all ranks together)",
                               "tokens/s", names, rates, "%.0f", busy),
                     std::string("Median tokens per second of each run (on a shared machine these vary by 20% or "
                                 "more).") +
                         (any_busy ? " The hatched grey bars are runs whose machine was busy (its ranks and other "
                                     "processes wanted more cores than it has): their speed is the machine's, not "
                                     "the technique's."
                                   : ""));
    }
    body += routing_section(pictures, set.chapters);
    std::string timelines;
    for (const ChapterLog& log : set.chapters) {
      if (log.trace_path.empty()) continue;
      try {
        const Timeline timeline = read_timeline(log.trace_path);
        // a busy machine's timeline shows the machine's waits as much as the schedule's
        const bool busy = number(log.summary, "machine_busy") != 0;
        const std::string title = log.title + (timeline.step ? ", step " + std::to_string(timeline.step) : "") +
                                  format(": %.1f ms", timeline.length_ms) +
                                  (busy ? " (a busy machine: the gaps are partly other work's)" : "");
        timelines += figure(plot_timeline(pictures, "timeline_" + log.name, title, timeline),
                            "What each rank did in " + title + ": compute spans above, communication below.") +
                     "<p>The whole trace: open <a href=\"" + html(fs::relative(log.trace_path, out_dir).string()) +
                     "\"><code>" + html(log.trace_path) +
                     "</code></a> at <code>https://ui.perfetto.dev</code> (Open trace file) or in "
                     "<code>chrome://tracing</code> (Load): one row per rank, every step.</p>\n";
      } catch (const CourseError& error) {
        set.problems.push_back(std::string(error.what()) + ": no timeline for " + log.name);
      }
    }
    if (!timelines.empty()) body += "<h2>Timelines: where each rank computes, sends and waits</h2>\n" + timelines;
    body += "<h2>Configuration and machine</h2>\n" + configuration_tables(set.chapters);
  }

  std::string problems;
  for (const std::string& problem : set.problems) {
    std::fprintf(stderr, "report: warning: %s\n", problem.c_str());
    problems += "<li>" + html(problem) + "</li>\n";
  }
  char stamp[64];
  const std::time_t now = std::time(nullptr);
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%d %H:%M", std::localtime(&now));
  const std::string page =
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>Course report: " +
      html(run_dir) + "</title>\n<style>" + kStyle + "</style>\n</head>\n<body>\n<h1>Course report: <code>" +
      html(run_dir) + "</code></h1>\n<p>" + std::to_string(set.chapters.size()) +
      " run(s), made " + stamp + " by <code>tools/report</code> from the chapters' logs and traces.</p>\n" +
      (problems.empty() ? "" : "<div class=\"problems\"><p>Problems with the logs:</p><ul>\n" + problems +
                                   "</ul></div>\n") +
      body + "</body>\n</html>\n";
  const std::string page_path = (fs::path(out_dir) / "report.html").string();
  std::ofstream file(page_path);
  file << page;
  if (!file) throw CourseError("cannot write '" + page_path + "'");
  std::printf("report: %s\n", page_path.c_str());
  return set.chapters.empty() ? 1 : 0;
}

int main(int argc, char** argv) {
  return guarded_main("report", [&] {
    std::string run_dir, out_dir;
    std::vector<std::string> logs;
    for (int i = 1; i < argc; i++) {
      const std::string arg = argv[i];
      if (arg == "--help" || arg == "-h") {
        std::printf("%s\n", kUsage);
        return 0;
      } else if (arg == "--out") {
        if (i + 1 == argc) throw UsageError(std::string("--out needs a directory; ") + kUsage);
        out_dir = argv[++i];
      } else if (run_dir.empty()) {
        run_dir = arg;
      } else {
        logs.push_back(arg);
      }
    }
    if (run_dir.empty()) throw UsageError(kUsage);
    return make_report(run_dir, out_dir.empty() ? run_dir : out_dir, logs);
  });
}
