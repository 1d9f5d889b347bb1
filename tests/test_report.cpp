// The course report (tools/report): on a fixed set of logs written here, the page
// shows every chapter, every picture it references exists and is a well-formed SVG,
// and its numbers are the logs'. Bad input (a missing, truncated or older log, one
// chapter only, a cut-short trace) is named on stderr and in the page, which shows
// what is there. Skipped (exit 77) where gnuplot is not installed.
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "common/train/metrics.h"
#include "common/train/trace.h"
#include "support/process.h"
#include "support/runs.h"

namespace fs = std::filesystem;
using course::JsonLine;
using course::MetricsLog;
using course_test::course_binary;
using course_test::read_file;
using course_test::run_process;
using course_test::TempDir;
using course_test::write_file;

namespace {

void require_gnuplot() {
  if (std::system("gnuplot --version > /dev/null 2>&1") != 0) {
    std::printf("SKIPPED: gnuplot is not installed (hint: ./scripts/setup.sh, or apt-get install gnuplot-nox)\n");
    std::exit(77);
  }
}

// The default model (4 layers, d_model 128, 4 heads, seq 128, vocab 256, batch 8):
// P = 875,264 parameters, chapter 00's activations 45,166,592 bytes.
JsonLine model_shape() {
  return JsonLine()
      .add("layers", 4)
      .add("d_model", 128)
      .add("heads", 4)
      .add("seq_len", 128)
      .add("vocab_size", 256)
      .add("global_batch", 8)
      .add("micro_batches", 1)
      .add("host", "testhost")
      .add("cpu", "Test CPU 9000")
      .add("cpu_cores", 2)
      .add("backend", "tcp");
}

JsonLine memory(double params, double activations, double comm, double workspace) {
  return JsonLine()
      .add("peak_parameters", params)
      .add("peak_gradients", params)
      .add("peak_optimizer_state", 2 * params)
      .add("peak_activations", activations)
      .add("peak_comm_buffers", comm)
      .add("peak_workspace", workspace)
      .add("peak_total", 4 * params + activations + comm + workspace);
}

// The summary fields every chapter logs.
JsonLine summary(const char* chapter, int world_size, double final_loss, double tokens_per_s, double bytes_sent) {
  return JsonLine()
      .add("chapter", chapter)
      .add("world_size", world_size)
      .add("final_loss", final_loss)
      .add("median_tokens_per_s", tokens_per_s)
      .add("bytes_sent_per_step", bytes_sent);
}

// A chapter's log as the trainers write it: `steps` losses, then the summary.
void write_log(const std::string& path, const std::vector<double>& losses, const JsonLine& summary) {
  MetricsLog log(path);
  for (size_t i = 0; i < losses.size(); i++) {
    log.write(JsonLine().add("step", static_cast<int>(i + 1)).add("loss", losses[i]).add("tokens_per_s", 1000.0));
  }
  log.write(JsonLine().add("summary", 1).merge(summary));
}

const std::vector<double> kLosses = {5.5702, 4.2, 3.1, 2.5};

// Chapter 00's run, the reference of every other.
void write_single_log(const TempDir& dir) {
  write_log(dir.file("00_single_gpu.jsonl"), kLosses,
            summary("00_single_gpu", 1, 2.5, 9604.0, 0)
                .merge(memory(3501056, 45166592, 0, 10551296))
                .merge(model_shape()));
}

// Chapters 00, 02, 03, 04 and 05 (with a trace), each with numbers of its own.
void write_course_logs(const TempDir& dir) {
  write_single_log(dir);
  write_log(dir.file("02_ddp.jsonl"), {5.5702, 4.2, 3.1000001, 2.5000002},
            summary("02_ddp", 2, 2.5000002, 18122.0, 3501056)
                .merge(memory(3501056, 22583296, 0, 5308416))
                .merge(model_shape()));
  write_log(dir.file("03_fsdp.jsonl"), kLosses,
            summary("03_fsdp zero-3", 2, 2.5, 17585.0, 5251584)
                .add("zero_stage", 3)
                .merge(memory(1750528, 22583296, 2379264, 5308416))
                .merge(model_shape()));
  JsonLine ranks;  // chapter 04's per-rank table
  for (int r = 0; r < 2; r++) {
    const std::string rank = "rank" + std::to_string(r) + "_";
    ranks.add(rank + "peak_parameters", r == 0 ? 1782784 : 1718272)
        .add(rank + "peak_gradients", r == 0 ? 1782784 : 1718272)
        .add(rank + "peak_optimizer_state", r == 0 ? 3565568 : 3436544)
        .add(rank + "peak_activations", r == 0 ? 21528576 : 24162304)
        .add(rank + "peak_comm_buffers", 524288);
  }
  write_log(dir.file("04_naive_model_parallel.jsonl"), kLosses,
            summary("04_naive_model_parallel", 2, 2.5, 9458.0, 524288)
                .add("bubble_measured", 0.513)
                .merge(memory(1782784, 21528576, 524288, 10551296))
                .merge(ranks)
                .merge(model_shape()));
  write_log(dir.file("05_pipeline_1f1b.jsonl"), kLosses,
            summary("05_pipeline", 1, 2.5, 15798.0, 524288)
                .add("schedule", "1f1b")
                .add("bubble_measured", 0.161)
                .add("bubble_simulated", 0.124)
                .merge(memory(3501056, 5382144, 65536, 1376256))
                .merge(model_shape()));
  // a one-rank trace of two steps, as chapter 05 writes it: the report draws the last
  course::Trace trace(dir.file("05_pipeline_1f1b.trace.json"), 0, 1);
  for (int step = 1; step <= 2; step++) {
    const double t = step;
    trace.span("F0", "compute", t, t + 0.010, 0, JsonLine().add("action", "forward").add("step", step));
    trace.span("send activation 0", "communication", t + 0.010, t + 0.010, 1,
               JsonLine().add("action", "send activation").add("step", step));
    trace.span("B0", "compute", t + 0.012, t + 0.032, 0, JsonLine().add("action", "backward").add("step", step));
  }
  trace.write();
}

struct Report {
  course_test::ProcessResult result;
  std::string page;  // report.html, empty when it was not written
};

Report run_report(const std::vector<std::string>& args, const std::string& dir) {
  Report report;
  std::vector<std::string> argv = {course_binary("report")};
  argv.insert(argv.end(), args.begin(), args.end());
  report.result = run_process(argv, 120);
  REQUIRE_FALSE(report.result.timed_out);
  if (fs::exists(dir + "/report.html")) report.page = read_file(dir + "/report.html");
  return report;
}

// Every <img src="..."> of the page.
std::vector<std::string> pictures_of(const std::string& page) {
  std::vector<std::string> sources;
  const std::regex image("<img src=\"([^\"]+)\"");
  for (auto it = std::sregex_iterator(page.begin(), page.end(), image); it != std::sregex_iterator(); ++it) {
    sources.push_back((*it)[1]);
  }
  return sources;
}

// Well-formed XML with an <svg> root: every tag closed in order, nothing after the
// root. (Comments, <?...?> and <!...> declarations are skipped; gnuplot writes no CDATA
// without its mouse option.) Returns "" or what is wrong.
std::string svg_problem(const std::string& xml) {
  std::vector<std::string> open;
  bool root_seen = false;
  for (size_t i = xml.find('<'); i != std::string::npos; i = xml.find('<', i)) {
    if (xml.compare(i, 4, "<!--") == 0) {
      i = xml.find("-->", i);
      if (i == std::string::npos) return "an unterminated comment";
      continue;
    }
    const size_t end = xml.find('>', i);
    if (end == std::string::npos) return "a tag cut short";
    const std::string tag = xml.substr(i + 1, end - i - 1);
    i = end + 1;
    if (tag.empty() || tag[0] == '?' || tag[0] == '!') continue;
    if (tag[0] == '/') {
      const std::string name = tag.substr(1, tag.find_first_of(" \t\n") - 1);
      if (open.empty() || open.back() != name) return "</" + name + "> closes nothing open";
      open.pop_back();
      continue;
    }
    const std::string name = tag.substr(0, tag.find_first_of(" \t\n/"));
    if (open.empty()) {
      if (root_seen) return "a second root element <" + name + ">";
      if (name != "svg") return "the root is <" + name + ">, not <svg>";
      root_seen = true;
    }
    if (tag.back() != '/') open.push_back(name);
  }
  if (!root_seen) return "no <svg> element";
  if (!open.empty()) return "<" + open.back() + "> is never closed";
  return "";
}

void check_pictures(const std::string& dir, const std::string& page) {
  const std::vector<std::string> pictures = pictures_of(page);
  CHECK_FALSE(pictures.empty());
  for (const std::string& picture : pictures) {
    INFO("picture " << picture);
    REQUIRE(fs::exists(dir + "/" + picture));
    CHECK(svg_problem(read_file(dir + "/" + picture)) == "");
  }
}

}  // namespace

TEST_CASE("the report shows every chapter with valid pictures and the logs' numbers", "[report]") {
  require_gnuplot();
  TempDir dir;
  write_course_logs(dir);
  const Report report = run_report({dir.path()}, dir.path());
  INFO(report.result.out << report.result.err);
  REQUIRE(report.result.exit_code == 0);
  CHECK(report.result.out.find("report: " + dir.file("report.html")) != std::string::npos);
  CHECK(report.result.err.empty());  // nothing to complain about
  const std::string& page = report.page;

  for (const char* chapter :
       {"00_single_gpu", "02_ddp", "03_fsdp zero-3", "04_naive_model_parallel", "05_pipeline (1f1b)"}) {
    INFO(chapter);
    CHECK(page.find("<td>" + std::string(chapter) + "</td>") != std::string::npos);
  }
  check_pictures(dir.path(), page);
  const std::set<std::string> pictures = [&] {
    std::vector<std::string> list = pictures_of(page);
    return std::set<std::string>(list.begin(), list.end());
  }();
  for (const char* expected : {"report_files/loss.svg", "report_files/memory.svg", "report_files/bytes.svg",
                               "report_files/throughput.svg", "report_files/timeline_05_pipeline_1f1b.svg"}) {
    CHECK(pictures.count(expected) == 1);
  }

  // the side-by-side row of each chapter: final loss, relative to 00, tokens/s, MB sent, total MB, bubble
  CHECK(page.find("<td>00_single_gpu</td><td>1</td><td>2.5000</td><td>0.0e+00</td><td>9604</td><td>0.00</td>"
                  "<td>69.72</td><td>-</td>") != std::string::npos);
  CHECK(page.find("<td>02_ddp</td><td>2</td><td>2.5000</td><td>8.0e-08</td><td>18122</td><td>3.50</td>"
                  "<td>41.90</td><td>-</td>") != std::string::npos);
  CHECK(page.find("<td>04_naive_model_parallel</td><td>2</td><td>2.5000</td><td>0.0e+00</td><td>9458</td>"
                  "<td>0.52</td>") != std::string::npos);
  CHECK(page.find("<td>51%</td>") != std::string::npos);
  // chapter 05's bubble: measured, and simulated with its measured costs
  CHECK(page.find("<td>16% (sim. 12%)</td>") != std::string::npos);
  // memory, predicted / measured: the formulas give what the logs hold here
  CHECK(page.find("<td>00_single_gpu</td><td>0</td><td>3.50 / 3.50</td><td>3.50 / 3.50</td><td>7.00 / 7.00</td>"
                  "<td>45.17 / 45.17</td><td>0.00 / 0.00</td><td>10.55 / 10.55</td>") != std::string::npos);
  CHECK(page.find("<td>03_fsdp zero-3</td><td>0</td><td>1.75 / 1.75</td><td>1.75 / 1.75</td><td>3.50 / 3.50</td>"
                  "<td>22.58 / 22.58</td><td>- / 2.38</td><td>5.31 / 5.31</td>") != std::string::npos);
  CHECK(page.find("<td>04_naive_model_parallel</td><td>1</td><td>1.72 / 1.72</td><td>1.72 / 1.72</td>"
                  "<td>3.44 / 3.44</td><td>24.16 / 24.16</td><td>- / 0.52</td><td>- / -</td>") != std::string::npos);
  // the pictures' data are the logs' numbers too
  const std::string loss_script = read_file(dir.file("report_files/loss.gp"));
  CHECK(loss_script.find("4 2.5000002") != std::string::npos);
  // one colour per kind of span, the one chapter 05's own timelines use (common/train/trace.h)
  const std::string timeline_script = read_file(dir.file("report_files/timeline_05_pipeline_1f1b.gp"));
  for (const char* action : {"forward", "backward", "send activation"}) {
    INFO(action);
    CHECK(timeline_script.find(std::string("lc rgb '") + course::action_colour(action) + "' title \"" + action) !=
          std::string::npos);
  }
  const std::string bytes_script = read_file(dir.file("report_files/bytes.gp"));
  CHECK(bytes_script.find("3.501056 \"02_ddp, 2 ranks\"") != std::string::npos);  // the world size in the label
  // the configuration and the machine
  CHECK(page.find("Test CPU 9000") != std::string::npos);
  CHECK(page.find("4, 128, 4, 128, 256") != std::string::npos);
  CHECK(page.find("ui.perfetto.dev") != std::string::npos);
}

TEST_CASE("compare_runs puts each chapter's bubble next to its simulated one", "[report]") {
  TempDir dir;
  write_course_logs(dir);
  const course_test::ProcessResult result =
      course_test::run_process({course_test::course_binary("compare_runs"), dir.file("00_single_gpu.jsonl"),
                                dir.file("04_naive_model_parallel.jsonl"), dir.file("05_pipeline_1f1b.jsonl")},
                               60);
  INFO(result.out << result.err);
  REQUIRE(result.exit_code == 0);
  CHECK_THAT(result.out, Catch::Contains("bubble (sim.)"));
  CHECK_THAT(result.out, Catch::Contains("    51%\n"));  // 04: no schedule to simulate
  CHECK_THAT(result.out, Catch::Contains("    16%    12%\n"));
}

TEST_CASE("with experts, the report draws the load imbalance and each run's tokens per expert", "[report]") {
  require_gnuplot();
  TempDir dir;
  // chapter 00 with E 4 top-2 twice, with and without the aux loss, as the trainer logs it
  for (const auto& [name, coef] : {std::make_pair("00_moe_aux0.01", 0.01), std::make_pair("00_moe_aux0", 0.0)}) {
    MetricsLog log(dir.file(std::string(name) + ".jsonl"));
    for (int step = 1; step <= 4; step++) {
      JsonLine line;
      line.add("step", step).add("loss", kLosses[step - 1]).add("tokens_per_s", 1000.0);
      line.add("expert_imbalance", 2.0 - 0.2 * step);
      for (int e = 0; e < 4; e++) line.add("expert_choices_" + std::to_string(e), 1000 + 100 * e * step);
      log.write(line);
    }
    log.write(JsonLine()
                  .add("summary", 1)
                  .merge(summary("00_single_gpu", 1, 2.5, 9604.0, 0))
                  .merge(model_shape())
                  .add("experts", 4)
                  .add("top_k", 2)
                  .add("aux_loss_coef", static_cast<double>(static_cast<float>(coef))));
  }
  const Report report = run_report({dir.path()}, dir.path());
  INFO(report.result.out << report.result.err);
  REQUIRE(report.result.exit_code == 0);
  check_pictures(dir.path(), report.page);
  // the two runs of one chapter told apart by their experts and aux coefficient (logged as a float)
  CHECK(report.page.find("<td>00_single_gpu (E4 top-2, aux 0.01)</td>") != std::string::npos);
  CHECK(report.page.find("<td>00_single_gpu (E4 top-2, aux 0)</td>") != std::string::npos);
  for (const char* picture : {"imbalance.svg", "experts_00_moe_aux0.01.svg", "experts_00_moe_aux0.svg"}) {
    CHECK(report.page.find(std::string("report_files/") + picture) != std::string::npos);
  }
  // step 4's shares: (1000, 1400, 1800, 2200) of 6400 choices; its imbalance 1.2
  const std::string shares = read_file(dir.file("report_files/experts_00_moe_aux0.gp"));
  CHECK(shares.find("4 0.15625\n") != std::string::npos);
  CHECK(shares.find("4 0.34375\n") != std::string::npos);
  CHECK(read_file(dir.file("report_files/imbalance.gp")).find("4 1.2\n") != std::string::npos);
}

TEST_CASE("the report predicts the activations that --recompute keeps", "[report]") {
  require_gnuplot();
  TempDir dir;
  // chapter 00's default model as it logs each mode: 45.17 MB kept without recomputation
  for (const auto& [mode, activations] :
       {std::make_pair("selective", 38875136.0), std::make_pair("full", 15757312.0)}) {
    write_log(dir.file(std::string("00_") + mode + ".jsonl"), kLosses,
              summary("00_single_gpu", 1, 2.5, 9604.0, 0)
                  .add("recompute", mode)
                  .merge(memory(3501056, activations, 0, 10551296))
                  .merge(model_shape()));
  }
  const Report report = run_report({dir.path()}, dir.path());
  INFO(report.result.out << report.result.err);
  REQUIRE(report.result.exit_code == 0);
  CHECK(report.page.find("<td>00_single_gpu (recompute selective)</td><td>0</td><td>3.50 / 3.50</td>"
                         "<td>3.50 / 3.50</td><td>7.00 / 7.00</td><td>38.88 / 38.88</td>") != std::string::npos);
  CHECK(report.page.find("<td>00_single_gpu (recompute full)</td><td>0</td><td>3.50 / 3.50</td>"
                         "<td>3.50 / 3.50</td><td>7.00 / 7.00</td><td>15.76 / 15.76</td>") != std::string::npos);
}

TEST_CASE("the report fits the page: memory over several pictures, 07 predicted by the planner, 09 by its formula, "
          "busy runs marked",
          "[report]") {
  require_gnuplot();
  TempDir dir;
  write_course_logs(dir);
  // chapter 07 at 2x2x2, a real run: its 8 ranks' memory, which the planner predicts
  course_test::run_ok(course_test::concat(course_test::launcher_command(8),
                                          {course_binary("07_3d"), "--quiet", "--steps", "2", "--dp", "2", "--pp", "2",
                                           "--tp", "2", "--micro-batches", "2", "--log", dir.file("07_3d.jsonl")}),
                      120);
  // ... and chapter 09 at --ep 2, whose parameters the README's P_r + L (E/R) P_e predicts
  course_test::run_ok(course_test::concat(course_test::launcher_command(2),
                                          {course_binary("09_expert_parallel"), "--quiet", "--steps", "2", "--experts",
                                           "4", "--log", dir.file("09_expert_parallel.jsonl")}),
                      120);
  // a run on a busy machine: its speed is not the technique's
  write_log(dir.file("06_tensor_parallel.jsonl"), kLosses,
            summary("06_tensor_parallel", 2, 2.5, 9000.0, 1000.0).add("machine_busy", 1).merge(model_shape()));
  const Report report = run_report({dir.path()}, dir.path());
  INFO(report.result.out << report.result.err);
  REQUIRE(report.result.exit_code == 0);
  check_pictures(dir.path(), report.page);

  // 7 + 8 ranks' bars: more than one memory picture, and no picture wider than the page
  CHECK(report.page.find("report_files/memory_1.svg") != std::string::npos);
  CHECK(report.page.find("report_files/memory_2.svg") != std::string::npos);
  const std::regex width_of("<svg\\s+width=\"([0-9]+)\"");
  for (const std::string& picture : pictures_of(report.page)) {
    std::smatch width;
    const std::string svg = read_file(dir.file(picture));
    REQUIRE(std::regex_search(svg, width, width_of));
    INFO(picture);
    CHECK(std::stoi(width[1]) <= 1200);
  }
  // every 07 rank's predicted parameters, gradients, AdamW state and activations are what it measured
  for (int rank = 0; rank < 8; rank++) {
    INFO("07_3d rank " << rank);
    const std::regex row("<td>07_3d[^<]*</td><td>" + std::to_string(rank) +
                         "</td><td>([0-9.]+) / \\1</td><td>([0-9.]+) / \\2</td><td>([0-9.]+) / \\3</td>"
                         "<td>([0-9.]+) / \\4</td>");
    CHECK(std::regex_search(report.page, row));
  }
  for (int rank = 0; rank < 2; rank++) {
    INFO("09_expert_parallel rank " << rank);
    const std::regex row("<td>09_expert_parallel[^<]*</td><td>" + std::to_string(rank) +
                         "</td><td>([0-9.]+) / \\1</td><td>([0-9.]+) / \\2</td><td>([0-9.]+) / \\3</td>");
    CHECK(std::regex_search(report.page, row));
  }
  // the busy run's speed is drawn apart and said to be the machine's
  const std::string throughput = read_file(dir.file("report_files/throughput.gp"));
  CHECK(throughput.find("(busy)") != std::string::npos);
  CHECK(throughput.find("fs pattern") != std::string::npos);
  CHECK(report.page.find("The hatched grey bars are runs whose machine was busy") != std::string::npos);
}

TEST_CASE("the report names bad logs and shows what is there", "[report]") {
  require_gnuplot();
  TempDir dir;
  write_course_logs(dir);

  SECTION("a missing log, a truncated one and one of an older format") {
    // cut chapter 03's log in the middle of its summary line
    const std::string whole = read_file(dir.file("03_fsdp.jsonl"));
    write_file(dir.file("03_fsdp.jsonl"), whole.substr(0, whole.size() - 40));
    // chapter 02's summary as the course wrote it before the model shape was logged
    write_log(dir.file("02_ddp.jsonl"), kLosses,
              summary("02_ddp", 2, 2.5, 18122.0, 3501056)
                  .merge(memory(3501056, 22583296, 0, 5308416)));
    const Report report = run_report({dir.path(), dir.file("00_single_gpu.jsonl"), dir.file("02_ddp.jsonl"),
                                      dir.file("03_fsdp.jsonl"), dir.file("06_tensor_parallel.jsonl")},
                                     dir.path());
    INFO(report.result.out << report.result.err);
    CHECK(report.result.exit_code == 0);
    const std::string& err = report.result.err;
    CHECK(err.find(dir.file("06_tensor_parallel.jsonl") + ": cannot be read") != std::string::npos);
    CHECK(err.find(dir.file("03_fsdp.jsonl") + ": line 5 is not a whole JSON object") != std::string::npos);
    CHECK(err.find(dir.file("03_fsdp.jsonl") + ": no summary line") != std::string::npos);
    CHECK(err.find(dir.file("02_ddp.jsonl") + ": an older log format") != std::string::npos);
    // the same problems in the page, and what the logs do hold
    CHECK(report.page.find(dir.file("06_tensor_parallel.jsonl") + ": cannot be read") != std::string::npos);
    CHECK(report.page.find("<td>03_fsdp</td><td>-</td><td>(no summary") != std::string::npos);
    CHECK(report.page.find("<td>02_ddp</td><td>0</td><td>- / 3.50</td>") != std::string::npos);
    check_pictures(dir.path(), report.page);
  }

  SECTION("a run with one chapter only") {
    const Report report = run_report({dir.path(), dir.file("02_ddp.jsonl")}, dir.path());
    INFO(report.result.out << report.result.err);
    CHECK(report.result.exit_code == 0);
    CHECK(report.result.err.find("no chapter 00 log") != std::string::npos);
    CHECK(report.page.find("<td>02_ddp</td><td>2</td><td>2.5000</td><td>-</td>") != std::string::npos);
    CHECK(report.page.find("00_single_gpu</td>") == std::string::npos);
    check_pictures(dir.path(), report.page);
  }

  SECTION("a trace cut short") {
    const std::string whole = read_file(dir.file("05_pipeline_1f1b.trace.json"));
    write_file(dir.file("05_pipeline_1f1b.trace.json"), whole.substr(0, whole.size() / 2));
    const Report report = run_report({dir.path()}, dir.path());
    INFO(report.result.out << report.result.err);
    CHECK(report.result.exit_code == 0);
    CHECK(report.result.err.find(dir.file("05_pipeline_1f1b.trace.json")) != std::string::npos);
    CHECK(report.page.find("timeline_05") == std::string::npos);
    CHECK(report.page.find("<td>05_pipeline (1f1b)</td>") != std::string::npos);
    check_pictures(dir.path(), report.page);
  }

  SECTION("no logs at all, or no directory") {
    TempDir empty;
    const Report report = run_report({empty.path()}, empty.path());
    CHECK(report.result.exit_code == 1);
    CHECK(report.result.err.find(empty.path() + ": no *.jsonl logs") != std::string::npos);
    const Report none = run_report({dir.file("no_such_run")}, dir.file("no_such_run"));
    CHECK(none.result.exit_code == 1);
    CHECK(none.result.err.find("'" + dir.file("no_such_run") + "' is not a directory") != std::string::npos);
  }
}

TEST_CASE("bf16 runs: each held to chapter 00 at bf16, drawn with chapter 00 at fp32 in a picture of their own",
          "[report]") {
  require_gnuplot();
  TempDir dir;
  write_single_log(dir);
  write_log(dir.file("00_single_gpu_bf16.jsonl"), {5.5703, 4.21, 3.11, 2.52},
            summary("00_single_gpu", 1, 2.52, 9000.0, 0)
                .merge(memory(3501056, 45166592, 0, 10551296))
                .merge(model_shape())
                .add("matmul_precision", "bf16"));
  write_log(dir.file("07_3d_bf16.jsonl"), {5.5703, 4.21, 3.11, 2.5201},
            summary("07_3d", 8, 2.5201, 3000.0, 95424)
                .merge(memory(437632, 22583296, 0, 10551296))
                .merge(model_shape())
                .add("matmul_precision", "bf16"));
  const Report report = run_report({dir.path()}, dir.path());
  INFO(report.result.out << report.result.err);
  REQUIRE(report.result.exit_code == 0);
  check_pictures(dir.path(), report.page);
  CHECK(report.page.find("report_files/loss_bf16.svg") != std::string::npos);
  CHECK(report.page.find("<td>00_single_gpu (bf16)</td>") != std::string::npos);
  // 07 at bf16 against chapter 00 at bf16 (2.5201 against 2.52), not at fp32 (2.5)
  CHECK(report.page.find("<td>4.0e-05</td>") != std::string::npos);
  // the fp32 picture holds the fp32 run alone; the bf16 one all three
  CHECK(read_file(dir.file("report_files/loss.gp")).find("(bf16)") == std::string::npos);
  const std::string bf16_picture = read_file(dir.file("report_files/loss_bf16.gp"));
  CHECK(bf16_picture.find("00_single_gpu (bf16)") != std::string::npos);
  CHECK(bf16_picture.find("07_3d (bf16)") != std::string::npos);

  const course_test::ProcessResult compared =
      run_process({course_binary("compare_runs"), dir.file("00_single_gpu.jsonl"),
                   dir.file("00_single_gpu_bf16.jsonl"), dir.file("07_3d_bf16.jsonl")},
                  60);
  INFO(compared.out << compared.err);
  REQUIRE(compared.exit_code == 0);
  CHECK_THAT(compared.out, Catch::Contains("00_single_gpu bf16 against 00_single_gpu: final loss 2.5200 vs 2.5000 "
                                           "(0.80% apart"));
  CHECK_THAT(compared.out, Catch::Contains("4.0e-05"));
}
