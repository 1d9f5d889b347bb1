// What a run reports: a progress line per step, a summary at the end, and the same
// numbers as JSON lines (one object per line) for tools and tests to read.
#pragma once

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "common/tensor/clock.h"
#include "common/tensor/memory.h"
#include "common/model/model.h"

namespace course {


// How busy the machine is while a run trains. The CPU clock of the cores this process
// may run on (/proc/stat's cpuN lines: their non-idle time, the hypervisor's steal
// included), read at the start and the end of the run, against the CPU time the job's
// ranks on this machine spent meanwhile (MachineLoad). What those cores did beyond the
// job is other processes' work. When the others' cores and this job's ranks (one core
// per BLAS thread each) want more than there are, processes queue for cores, and every
// time measured then (step times, bubbles, overlap) stretches; losses, memory and
// bytes do not change. Measured over the run itself, not a load average that still
// remembers the job before it.
struct CpuClock {
  double machine_seconds = 0.0;  // the cores' non-idle time since boot; 0 where /proc/stat is not
  double process_seconds = 0.0;  // this process's, all its threads
  double wall_seconds = 0.0;     // now_seconds()
};
CpuClock read_cpu_clock();
// This process's CPU time so far, all its threads: CpuClock's process_seconds alone
double process_cpu_seconds();
// The cores this process may run on (its affinity: all of them, or what taskset or a cpuset leaves)
int machine_cores();

struct MachineLoad {
  int cores = 1;
  int job_cores = 1;         // the job's ranks on this machine times their BLAS threads
  double other_cores = 0.0;  // the cores other processes kept busy, on average over the run
  // half a core (the kernel's own work, the launcher), and what /proc/stat's ticks
  // (10 ms on each core, at each end) can miss over the run
  double slack = 0.5;
  // processes wanted more cores than there are
  bool busy() const { return other_cores + job_cores > cores + slack; }
};
// Between two readings of this machine's clock (`cores` of them, `tick_seconds` a
// tick), when the job's ranks here spent `job_cpu_seconds`, each with `threads` BLAS
// threads.
MachineLoad machine_load(const CpuClock& start, const CpuClock& end, double job_cpu_seconds, int ranks_here,
                         int threads, int cores, double tick_seconds);
// From `start` to now. A test may say what the others took: busy_cores
// (common/comm/test_faults.h).
MachineLoad machine_load_since(const CpuClock& start, double job_cpu_seconds, int ranks_here, int threads);

// "1.66 MB"
std::string format_bytes(double bytes);
// Tokens per second in 5 characters, so that the step line's width does not depend
// on the machine's speed: "18791", then " 123k" from 10^5, then "   12M" from 10^7.
std::string format_tokens_per_second(double per_second);
// A step's time in 8 columns: "137.4 ms" below a second, then " 1.234 s" (up to
// 999999 s), so that a slow step does not widen the line.
std::string format_step_time(double seconds);

// Builds one flat JSON object.
class JsonLine {
 public:
  JsonLine& add(const std::string& key, double value);
  JsonLine& add(const std::string& key, int64_t value);
  JsonLine& add(const std::string& key, int value) { return add(key, static_cast<int64_t>(value)); }
  JsonLine& add(const std::string& key, size_t value) { return add(key, static_cast<int64_t>(value)); }
  JsonLine& add(const std::string& key, const std::string& value);
  JsonLine& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  JsonLine& merge(const JsonLine& other);  // appends other's fields
  std::string str() const { return "{" + body_ + "}"; }

 private:
  void key(const std::string& name);
  std::string body_;
};

// Parses one flat JSON object of numbers and strings (what JsonLine writes) into
// key -> raw text (strings unquoted). Throws CourseError on anything else.
std::map<std::string, std::string> parse_json_line(const std::string& line);

// Appends JSON lines to a file; does nothing when the path is empty.
class MetricsLog {
 public:
  explicit MetricsLog(const std::string& path);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void write(const JsonLine& line);

 private:
  std::FILE* file_ = nullptr;  // null: no --log
  std::string path_;
};

// Per-step numbers of one run, and the summary computed from them.
struct StepRecord {
  int step;
  float loss;
  double seconds;
  double tokens_per_second;
};

class RunReport {
 public:
  RunReport(std::string chapter, const GPTConfig& config, int global_batch, int world_size, Device device);

  // Records a step, prints its progress line (every print_every steps, the first
  // and last, and whenever kProgressSeconds have passed since the last line; never
  // when print_every is 0) and logs it.
  // `extra` adds the chapter's own numbers to the JSON line and `extra_text` to the
  // printed line (e.g. bytes sent per step). The printed line is meant to fit 100
  // columns with a launcher's "[rank 0] " in front: a chapter prints its main
  // figures there and leaves the rest to the JSON line and the summary.
  void step(int step, int total_steps, float loss, double seconds, int print_every, MetricsLog& log,
            const JsonLine& extra = JsonLine(), const std::string& extra_text = "");
  // Prints the summary and logs it as {"summary": 1, ...}. `extra` adds chapter figures.
  void finish(MetricsLog& log, const JsonLine& extra = JsonLine());

  double median_tokens_per_second() const;

 private:
  // the model shape, the global batch, the machine and the software: added to the summary
  JsonLine run_description() const;

  std::string chapter_;
  GPTConfig config_;
  int global_batch_;
  int world_size_;
  Device device_;
  std::vector<StepRecord> steps_;
  static constexpr double kProgressSeconds = 3.0;
  double last_printed_ = 0.0;  // steady-clock seconds of the last progress line
};

}  // namespace course
