#include "tools/report/plots.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "common/tensor/error.h"
#include "common/train/trace.h"

namespace fs = std::filesystem;

namespace course::report {

namespace {

// Tableau's ten colours: distinct in print and for most colour-blind readers.
const char* const kColors[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
                               "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};
const char* color(size_t i) { return kColors[i % 10]; }

// The same start for every picture: an SVG of a fixed size (the page scales it), white,
// and "noenhanced" so that the chapters' names keep their underscores.
std::string terminal(int width, int height, const std::string& name) {
  return "set terminal svg size " + std::to_string(width) + "," + std::to_string(height) +
         " noenhanced font 'sans,12' background rgb 'white'\nset output '" + name + ".svg'\n";
}

// A gnuplot string in double quotes, where \n is a line break.
// A long label on lines of about `width` characters, broken at spaces: a rotated
// label then reaches less far to the right, where the picture would cut it off.
std::string wrapped(const std::string& label, size_t width) {
  std::string out;
  size_t line = 0;
  std::istringstream words(label);
  for (std::string word; words >> word;) {
    if (line > 0 && line + 1 + word.size() > width) {
      out += '\n';
      line = 0;
    } else if (line > 0) {
      out += ' ';
      line++;
    }
    out += word;
    line += word.size();
  }
  return out;
}

std::string text(const std::string& value) {
  std::string quoted = "\"";
  for (char c : value) {
    if (c == '"' || c == '\\') quoted += '\\';
    quoted += c == '\n' ? std::string("\\n") : std::string(1, c);
  }
  return quoted + "\"";
}

// An inline data file: $name << EOD ... EOD.
std::string datablock(const std::string& name, const std::string& rows) {
  return "$" + name + " << EOD\n" + rows + "EOD\n";
}

std::string format(const char* pattern, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), pattern, value);
  return buffer;
}

// For the shell: 'text' with any ' closed, escaped and reopened.
std::string shell_quoted(const std::string& value) {
  std::string quoted = "'";
  for (char c : value) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

}  // namespace

void require_gnuplot() {
  if (std::system("gnuplot --version > /dev/null 2>&1") != 0) {
    throw CourseError("gnuplot is not installed: the report draws its pictures with it "
                      "(hint: ./scripts/setup.sh, or apt-get install gnuplot-nox)");
  }
}

std::string run_gnuplot(const std::string& dir, const std::string& name, const std::string& script) {
  const fs::path script_path = fs::path(dir) / (name + ".gp");
  const fs::path log_path = fs::path(dir) / (name + ".gnuplot.log");
  const fs::path svg_path = fs::path(dir) / (name + ".svg");
  {
    std::ofstream file(script_path);
    file << "# made by the course's report tool (tools/report); run `gnuplot " << name << ".gp` here to redraw\n"
         << script;
    if (!file) throw CourseError("cannot write '" + script_path.string() + "'");
  }
  fs::remove(svg_path);
  // gnuplot runs in the picture's directory: the script names its output relative to it
  const std::string command = "cd " + shell_quoted(dir) + " && gnuplot " + shell_quoted(name + ".gp") + " 2> " +
                              shell_quoted(name + ".gnuplot.log");
  const int status = std::system(command.c_str());
  std::ifstream log(log_path);
  std::stringstream said;
  said << log.rdbuf();
  if (status != 0 || !fs::exists(svg_path) || fs::file_size(svg_path) == 0) {
    throw CourseError("gnuplot failed on '" + script_path.string() + "': " + said.str());
  }
  fs::remove(log_path);  // warnings only (e.g. an empty series); the picture is there
  return name + ".svg";
}

std::string plot_losses(const std::string& dir, const std::string& name, const std::string& title,
                        const std::vector<ChapterLog>& chapters, const ChapterLog* reference, double bound) {
  const double floor = 1e-10;  // where an exact match (difference 0) is drawn on the log scale
  std::string data, curves, differences;
  std::map<int, double> reference_loss;
  if (reference) {
    for (const StepLine& s : reference->steps) reference_loss[s.step] = s.loss;
  }
  for (size_t i = 0; i < chapters.size(); i++) {
    const std::string id = std::to_string(i);
    std::string rows, relative_rows;
    for (const StepLine& s : chapters[i].steps) {
      rows += std::to_string(s.step) + " " + format("%.9g", s.loss) + "\n";
      auto found = reference_loss.find(s.step);
      if (found != reference_loss.end() && found->second != 0.0) {
        const double relative = std::fabs(s.loss - found->second) / std::fabs(found->second);
        relative_rows += std::to_string(s.step) + " " + format("%.6g", std::max(relative, floor)) + "\n";
      }
    }
    data += datablock("loss" + id, rows);
    // later chapters thinner and dashed, so that curves lying on each other all show
    const std::string style = " with lines lw " + format("%.1f", std::max(1.0, 3.0 - 0.3 * i)) + " dt " +
                              std::to_string(1 + i % 5) + " lc rgb '" + color(i) + "' title " +
                              text(chapters[i].legend);
    curves += std::string(curves.empty() ? "plot " : ", ") + "$loss" + id + " using 1:2" + style;
    if (reference && &chapters[i] != reference && !relative_rows.empty()) {
      data += datablock("diff" + id, relative_rows);
      differences += ", $diff" + id + " using 1:2 with points pt 7 ps 0.5 lc rgb '" + color(i) + "' title " +
                     text(chapters[i].legend);
    }
  }
  std::string script = terminal(1000, reference ? 760 : 420, name) + data;
  if (reference) script += "set multiplot layout 2,1\n";
  script += "set title " + text(title) +
            "\nset xlabel 'step'\nset ylabel 'loss (nats per byte)'\nset grid\nset key outside right top\n" +
            curves + "\n";
  if (reference) {
    script += "set title " + text("relative difference from " + reference->title +
                                  " per step, |loss - loss00| / loss00 (0, an exact match, is drawn at 1e-10)") +
              "\nset logscale y\nset format y '%.0e'\nset yrange [" + format("%g", floor / 3) + ":" +
              format("%g", std::max(1e-3, 3 * bound)) + "]\n"
              "set ylabel 'relative difference'\nset key outside right top\n"
              "plot " + format("%g", bound) + " with lines lw 2 dt 2 lc rgb 'black' title " +
              text("the tests' bound, " + format("%g", bound)) + differences + "\nunset multiplot\n";
  }
  return run_gnuplot(dir, name, script);
}

std::string plot_slow_links(const std::string& dir, const std::vector<ChapterLog>& runs, const ChapterLog* reference) {
  constexpr size_t kSmoothing = 25;  // steps in each point's running mean
  std::vector<const ChapterLog*> drawn;
  if (reference) drawn.push_back(reference);
  for (const ChapterLog& run : runs) drawn.push_back(&run);
  std::string data, by_step, by_bytes, by_time;
  for (size_t i = 0; i < drawn.size(); i++) {
    const std::string id = std::to_string(i);
    std::string rows;
    double megabytes = 0.0, seconds = 0.0, window_sum = 0.0;
    const std::vector<StepLine>& steps = drawn[i]->steps;
    for (size_t k = 0; k < steps.size(); k++) {
      megabytes += steps[k].bytes_sent / 1e6;
      seconds += steps[k].ms / 1e3;
      // worker 0's loss is on its own slice (2 sequences at 4 workers): a running mean shows the trend
      window_sum += steps[k].loss - (k >= kSmoothing ? steps[k - kSmoothing].loss : 0.0);
      const double mean = window_sum / static_cast<double>(std::min(k + 1, kSmoothing));
      rows += std::to_string(steps[k].step) + " " + format("%.9g", mean) + " " + format("%.6g", megabytes) + " " +
              format("%.6g", seconds) + "\n";
    }
    data += datablock("run" + id, rows);
    const std::string style = " with lines lw 2 dt " + std::to_string(1 + i % 5) + " lc rgb '" + color(i) +
                              "' title " + text(drawn[i]->legend);
    by_step += std::string(by_step.empty() ? "plot " : ", ") + "$run" + id + " using 1:2" + style;
    if (drawn[i] != reference) {  // one process sends nothing
      by_bytes += std::string(by_bytes.empty() ? "plot " : ", ") + "$run" + id + " using 3:2" + style;
    }
    if (drawn[i] != reference) {  // a time on another machine's clock, or another phase of training
      by_time += std::string(by_time.empty() ? "plot " : ", ") + "$run" + id + " using 4:2" + style;
    }
  }
  const std::string script = terminal(1000, 1100, "slow_links") + data + "set multiplot layout 3,1\n" +
                             "set grid\nset key outside right top\n"
                             "set ylabel \"loss (worker 0's, mean of 25 steps)\"\n"
                             "set title 'loss against steps (equal tokens)'\nset xlabel 'step'\n" + by_step + "\n" +
                             "set title 'loss against bytes sent (rank 0, cumulative)'\nset xlabel 'MB'\n"
                             "set logscale x\n" + by_bytes + "\nunset logscale x\n" +
                             "set title 'loss against wall-clock time'\nset xlabel 'seconds'\n" + by_time +
                             "\nunset multiplot\n";
  return run_gnuplot(dir, "slow_links", script);
}

std::string plot_expert_imbalance(const std::string& dir, const std::vector<ChapterLog>& chapters) {
  std::string data, curves;
  for (size_t i = 0; i < chapters.size(); i++) {
    if (!chapters[i].has_experts()) continue;
    std::string rows;
    for (const StepLine& s : chapters[i].steps) {
      rows += std::to_string(s.step) + " " + format("%.6g", s.expert_imbalance) + "\n";
    }
    const std::string id = std::to_string(i);
    data += datablock("imbalance" + id, rows);
    curves += std::string(curves.empty() ? "plot " : ", ") + "$imbalance" + id + " using 1:2 with lines lw 2 lc rgb '" +
              color(i) + "' title " + text(chapters[i].legend);
  }
  const std::string script =
      terminal(1000, 420, "imbalance") + data +
      "set title 'load imbalance per step: the busiest expert over the mean, per layer (1 = balanced)'\n"
      "set xlabel 'step'\nset ylabel 'max / mean token-choices per expert'\nset yrange [1:*]\nset grid\n"
      "set key outside right top\n" + curves + "\n";
  return run_gnuplot(dir, "imbalance", script);
}

std::string plot_expert_shares(const std::string& dir, const ChapterLog& log) {
  const size_t experts = log.steps.front().expert_choices.size();
  std::vector<std::string> rows(experts);
  for (const StepLine& s : log.steps) {
    double choices = 0.0;
    for (double c : s.expert_choices) choices += c;
    for (size_t e = 0; e < experts && e < s.expert_choices.size() && choices > 0.0; e++) {
      rows[e] += std::to_string(s.step) + " " + format("%.6g", s.expert_choices[e] / choices) + "\n";
    }
  }
  const std::string name = "experts_" + log.name;
  std::string script = terminal(1000, 420, name), curves;
  for (size_t e = 0; e < experts; e++) {
    const std::string id = std::to_string(e);
    script += datablock("expert" + id, rows[e]);
    curves += std::string(curves.empty() ? "plot " : ", ") + "$expert" + id + " using 1:2 with lines lw 2 lc rgb '" +
              color(e) + "' title " + text("expert " + id);
  }
  script += "set title " + text(log.legend + ": each expert's share of the step's token-choices") +
            "\nset xlabel 'step'\nset ylabel 'share of the choices'\nset yrange [0:*]\nset grid\n"
            "set key outside right top\n" + curves + ", " + format("%.6g", 1.0 / experts) +
            " with lines lw 1 dt 2 lc rgb 'black' title " + text("balanced, 1/" + std::to_string(experts)) + "\n";
  return run_gnuplot(dir, name, script);
}

std::string plot_memory(const std::string& dir, const std::string& name, const std::vector<MemoryGroup>& groups) {
  const double half = 0.18;  // half a bar's width; the predicted bar left of the group's tic, measured right
  std::array<std::string, kCategories> predicted_rows, measured_rows;
  std::string tics;
  for (size_t g = 0; g < groups.size(); g++) {
    const double x = static_cast<double>(g);
    // "legend\nrank r": the legend wrapped, the rank on its own line
    const std::string& label = groups[g].label;
    const size_t rank_line = label.rfind('\n');
    const std::string wrapped_label = rank_line == std::string::npos
                                          ? wrapped(label, 22)
                                          : wrapped(label.substr(0, rank_line), 22) + label.substr(rank_line);
    tics += std::string(tics.empty() ? "" : ", ") + text(wrapped_label) + " " + std::to_string(g);
    for (const auto& [bars, rows, offset] :
         {std::make_tuple(&groups[g].memory.predicted, &predicted_rows, -0.2),
          std::make_tuple(&groups[g].memory.measured, &measured_rows, 0.2)}) {
      double stacked = 0.0;  // MB below this category
      for (int c = 0; c < kCategories; c++) {
        if (!bars->known[c] || bars->bytes[c] <= 0.0) continue;
        const double top = stacked + bars->bytes[c] / 1e6;
        (*rows)[c] += format("%.4f", x + offset) + " " + format("%.6f", stacked) + " " + format("%.6f", top) + "\n";
        stacked = top;
      }
    }
  }
  std::string script = terminal(std::max(900, 110 * static_cast<int>(groups.size()) + 320), 560, name);
  std::string plots;
  for (int c = 0; c < kCategories; c++) {
    const std::string id = std::to_string(c);
    const std::string range = "using 1:(($2+$3)/2):($1-" + format("%g", half) + "):($1+" + format("%g", half) +
                              "):2:3 with boxxyerror lc rgb '" + color(c) + "' ";
    if (!measured_rows[c].empty()) {
      script += datablock("measured" + id, measured_rows[c]);
      plots += std::string(plots.empty() ? "" : ", ") + "$measured" + id + " " + range +
               "fs solid 0.9 border lc rgb 'black' title " + text(kCategoryTitles[c]);
    }
    if (!predicted_rows[c].empty()) {
      script += datablock("predicted" + id, predicted_rows[c]);
      plots += std::string(plots.empty() ? "" : ", ") + "$predicted" + id + " " + range +
               "fs transparent solid 0.35 border lc rgb '" + color(c) + "' notitle";
    }
  }
  script += "set title 'peak memory per rank by category: predicted by the README formulas (left, light) "
            "and measured (right, solid)'\n"
            "set ylabel 'MB (10^6 bytes)'\nset yrange [0:*]\nset grid ytics\n"
            "set key outside right top\nset rmargin at screen 0.86\n"
            "set xrange [-0.6:" + format("%.1f", groups.size() - 0.4) + "]\n"
            "set xtics (" + tics + ") rotate by -30 font 'sans,10'\n"
            "set bmargin 7\nplot " + plots + "\n";
  return run_gnuplot(dir, name, script);
}

std::string plot_bars(const std::string& dir, const std::string& name, const std::string& title,
                      const std::string& y_label, const std::vector<std::string>& labels,
                      const std::vector<double>& values, const char* value_format, const std::vector<bool>& busy) {
  std::string quiet_rows, busy_rows;
  bool any_busy = false;
  for (size_t i = 0; i < labels.size(); i++) {
    const bool marked = i < busy.size() && busy[i];
    any_busy = any_busy || marked;
    (marked ? busy_rows : quiet_rows) += std::to_string(i) + " " + format("%.9g", values[i]) + " " +
                                         text(wrapped(labels[i] + (marked ? " (busy)" : ""), 24)) + " " +
                                         text(format(value_format, values[i])) + "\n";
  }
  // the page is 1200 px wide: the bars narrow instead of the picture growing past it,
  // and the right margin leaves room for the last label, which the rotation pushes right
  std::string script = terminal(std::min(1150, std::max(600, 80 * static_cast<int>(labels.size()) + 220)), 460, name);
  std::string plots;
  if (!quiet_rows.empty()) {
    script += datablock("bars", quiet_rows);
    plots += std::string("$bars using 1:2:xtic(3) with boxes fs solid 0.85 border lc rgb 'black' lc rgb '") + color(0) +
             "' title 'a quiet machine', $bars using 1:2:4 with labels offset 0,0.7 font 'sans,10' notitle";
  }
  if (!busy_rows.empty()) {
    script += datablock("busy", busy_rows);
    plots += std::string(plots.empty() ? "" : ", ") +
             "$busy using 1:2:xtic(3) with boxes fs pattern 2 border lc rgb 'black' lc rgb '#888888' "
             "title 'a busy machine: not the technique''s own figure', "
             "$busy using 1:2:4 with labels offset 0,0.7 font 'sans,10' notitle";
  }
  script += "set title " + text(title) + "\nset ylabel " + text(y_label) +
            "\nset yrange [0:*]\nset offsets 0, 0, graph 0.1, 0\nset grid ytics\n" +
            (any_busy ? "set key top right\n" : "set key off\n") +
            "set boxwidth 0.6\nset xtics rotate by -30 font 'sans,9'\nset bmargin 8\nset rmargin 14\n"
            "plot " + plots + "\n";
  return run_gnuplot(dir, name, script);
}

std::string plot_timeline(const std::string& dir, const std::string& name, const std::string& title,
                          const Timeline& timeline) {
  // one series per kind of span ("forward", "backward", "recv activation", ...): its colour and legend entry
  std::map<std::string, std::string> rows_by_action;
  std::vector<std::string> actions;  // in order of first appearance
  std::string labels;
  const double least = timeline.length_ms / 400;  // a send is an instant: drawn this wide
  for (const Span& span : timeline.spans) {
    const double top = timeline.ranks - 1 - span.rank + (span.lane == 0 ? 0.45 : -0.05);
    const double bottom = span.lane == 0 ? top - 0.4 : top - 0.3;
    const double end = std::max(span.end_ms, span.start_ms + least);
    if (!rows_by_action.count(span.action)) actions.push_back(span.action);
    rows_by_action[span.action] += format("%.4f", span.start_ms) + " " + format("%.4f", end) + " " +
                                   format("%.3f", bottom) + " " + format("%.3f", top) + "\n";
    if (span.lane == 0 && span.end_ms - span.start_ms > timeline.length_ms / 40) {
      labels += format("%.4f", (span.start_ms + span.end_ms) / 2) + " " + format("%.3f", (top + bottom) / 2) + " " +
                text(span.name) + "\n";
    }
  }
  std::string script = terminal(1000, 140 + 90 * timeline.ranks, name), plots, tics;
  for (size_t a = 0; a < actions.size(); a++) {
    const std::string id = std::to_string(a);
    script += datablock("spans" + id, rows_by_action[actions[a]]);
    plots += std::string(plots.empty() ? "" : ", ") + "$spans" + id +
             " using (($1+$2)/2):(($3+$4)/2):1:2:3:4 with boxxyerror fs solid 0.85 border lc rgb 'white' lc rgb '" +
             action_colour(actions[a]) + "' title " + text(actions[a]);
  }
  if (!labels.empty()) {
    script += datablock("labels", labels);
    plots += ", $labels using 1:2:3 with labels font 'sans,8' tc rgb 'white' notitle";
  }
  for (int r = 0; r < timeline.ranks; r++) {
    const int row = timeline.ranks - 1 - r;
    tics += std::string(tics.empty() ? "" : ", ") + text("rank " + std::to_string(r) + " compute") + " " +
            format("%.2f", row + 0.25) + ", " + text("communication") + " " + format("%.2f", row - 0.2);
  }
  script += "set title " + text(title) + "\nset xlabel 'ms from the start of the step'\n"
            "set xrange [0:" + format("%.3f", timeline.length_ms) + "]\nset yrange [-0.6:" +
            format("%.1f", timeline.ranks - 0.4) + "]\nset ytics (" + tics +
            ") font 'sans,10'\nset grid xtics\nset key outside bottom center horizontal\nplot " + plots + "\n";
  return run_gnuplot(dir, name, script);
}

}  // namespace course::report
