#include "common/train/metrics.h"

#include <fcntl.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>
#include <thread>

#include <cblas.h>
#include <unistd.h>

#include "common/tensor/clock.h"
#include "common/tensor/device.h"
#include "common/comm/test_faults.h"
#include "common/tensor/error.h"
#ifdef COURSE_HAVE_CUDA
#include "common/tensor/cuda/runtime.h"
#endif

namespace course {

// The CPUs this process may run on
static cpu_set_t allowed_cpus() {
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  if (::sched_getaffinity(0, sizeof cpus, &cpus) != 0) {
    for (long cpu = 0; cpu < std::min<long>(CPU_SETSIZE, sysconf(_SC_NPROCESSORS_ONLN)); cpu++) CPU_SET(cpu, &cpus);
  }
  return cpus;
}

double process_cpu_seconds() {
  timespec process{};
  if (::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &process) != 0) return 0.0;
  return static_cast<double>(process.tv_sec) + 1e-9 * static_cast<double>(process.tv_nsec);
}

CpuClock read_cpu_clock() {
  CpuClock clock;
  clock.wall_seconds = now_seconds();
  clock.process_seconds = process_cpu_seconds();
  // "cpuN user nice system idle iowait irq softirq steal ...", in clock ticks, one line per CPU
  const cpu_set_t cpus = allowed_cpus();
  std::ifstream file("/proc/stat");
  double ticks = 0.0;
  for (std::string line; std::getline(file, line);) {
    // (not the first line, "cpu  ...", the sum over every CPU)
    if (line.rfind("cpu", 0) != 0 || line.size() < 4 || !std::isdigit(static_cast<unsigned char>(line[3]))) continue;
    int cpu = -1;
    double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
    if (std::sscanf(line.c_str(), "cpu%d %lf %lf %lf %lf %lf %lf %lf %lf", &cpu, &user, &nice, &system, &idle, &iowait,
                    &irq, &softirq, &steal) != 9 ||
        cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &cpus)) {
      continue;
    }
    ticks += user + nice + system + irq + softirq + steal;
  }
  clock.machine_seconds = ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
  return clock;
}

int machine_cores() {
  const cpu_set_t cpus = allowed_cpus();
  return std::max(1, CPU_COUNT(&cpus));
}

MachineLoad machine_load(const CpuClock& start, const CpuClock& end, double job_cpu_seconds, int ranks_here,
                         int threads, int cores, double tick_seconds) {
  MachineLoad load;
  load.cores = cores;
  load.job_cores = ranks_here * threads;
  const double wall = end.wall_seconds - start.wall_seconds;
  if (start.machine_seconds > 0.0 && wall > 0.0) {
    load.other_cores = std::max(0.0, (end.machine_seconds - start.machine_seconds - job_cpu_seconds) / wall);
    load.slack += 2.0 * cores * tick_seconds / wall;
  }
  return load;
}

MachineLoad machine_load_since(const CpuClock& start, double job_cpu_seconds, int ranks_here, int threads) {
  MachineLoad load = machine_load(start, read_cpu_clock(), job_cpu_seconds, ranks_here, threads, machine_cores(),
                                  1.0 / static_cast<double>(sysconf(_SC_CLK_TCK)));
  double told = 0.0;
  if (busy_cores_told(&told)) load.other_cores = told;  // a test's busy machine
  return load;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int unit = 0;
  while (bytes >= 1000.0 && unit < 4) {
    bytes /= 1000.0;
    unit++;
  }
  char text[32];
  std::snprintf(text, sizeof(text), unit == 0 ? "%.0f %s" : "%.2f %s", bytes, units[unit]);
  return text;
}

// ----------------------------------------------------------------------------
// JSON lines

void JsonLine::key(const std::string& name) {
  if (!body_.empty()) body_ += ", ";
  body_ += "\"" + name + "\": ";
}

JsonLine& JsonLine::merge(const JsonLine& other) {
  if (!body_.empty() && !other.body_.empty()) body_ += ", ";
  body_ += other.body_;
  return *this;
}

JsonLine& JsonLine::add(const std::string& name, double value) {
  key(name);
  char text[40];
  std::snprintf(text, sizeof(text), "%.9g", value);
  body_ += text;
  return *this;
}

JsonLine& JsonLine::add(const std::string& name, int64_t value) {
  key(name);
  body_ += std::to_string(value);
  return *this;
}

JsonLine& JsonLine::add(const std::string& name, const std::string& value) {
  key(name);
  body_ += "\"";
  for (char c : value) {
    if (c == '"' || c == '\\') body_ += '\\';
    body_ += c;
  }
  body_ += "\"";
  return *this;
}

std::map<std::string, std::string> parse_json_line(const std::string& line) {
  std::map<std::string, std::string> fields;
  size_t i = 0;
  auto fail = [&](const std::string& what) {
    throw CourseError("cannot parse metrics line (" + what + "): " + line.substr(0, 120));
  };
  auto skip_spaces = [&] {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) i++;
  };
  auto read_string = [&] {
    if (line[i] != '"') fail("expected a string");
    std::string text;
    for (i++; i < line.size() && line[i] != '"'; i++) {
      if (line[i] == '\\' && i + 1 < line.size()) i++;
      text += line[i];
    }
    if (i >= line.size()) fail("unterminated string");
    i++;
    return text;
  };
  skip_spaces();
  if (i >= line.size() || line[i++] != '{') fail("expected '{'");
  for (;;) {
    skip_spaces();
    if (i < line.size() && line[i] == '}') break;
    std::string name = read_string();
    skip_spaces();
    if (i >= line.size() || line[i++] != ':') fail("expected ':'");
    skip_spaces();
    if (i < line.size() && line[i] == '"') {
      fields[name] = read_string();
    } else {
      size_t end = line.find_first_of(",}", i);
      if (end == std::string::npos) fail("unterminated number");
      fields[name] = line.substr(i, end - i);
      while (!fields[name].empty() && fields[name].back() == ' ') fields[name].pop_back();
      i = end;
    }
    skip_spaces();
    if (i < line.size() && line[i] == ',') {
      i++;
    } else if (i >= line.size() || line[i] != '}') {
      fail("expected ',' or '}'");
    }
  }
  return fields;
}

MetricsLog::MetricsLog(const std::string& path) {
  if (path.empty()) return;
  path_ = path;
  // O_NOFOLLOW: never through a symbolic link, which whoever planted it at the name
  // would point at the file to overwrite (the log streams, so a device such as
  // /dev/full is still allowed)
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0666);
  if (fd < 0 && errno == ELOOP) {
    throw UsageError("--log: cannot write '" + path + "': it is a symbolic link, and the course never writes " +
                     "through one (hint: remove the link, or log elsewhere)");
  }
  file_ = fd < 0 ? nullptr : ::fdopen(fd, "w");
  if (file_ == nullptr) {
    if (fd >= 0) ::close(fd);
    throw UsageError("--log: cannot write '" + path + "' (hint: does its directory exist?)");
  }
}

MetricsLog::~MetricsLog() {
  if (file_ != nullptr) std::fclose(file_);
}

void MetricsLog::write(const JsonLine& line) {
  if (file_ == nullptr) return;
  const std::string text = line.str() + "\n";
  // a full disk (or /dev/full) would otherwise lose the metrics without a word
  if (std::fwrite(text.data(), 1, text.size(), file_) != text.size() || std::fflush(file_) != 0) {
    throw CourseError("--log: writing '" + path_ + "' failed (hint: is the disk full?)");
  }
}

// ----------------------------------------------------------------------------
// the run report

RunReport::RunReport(std::string chapter, const GPTConfig& config, int global_batch, int world_size, Device device)
    : chapter_(std::move(chapter)),
      config_(config),
      global_batch_(global_batch),
      world_size_(world_size),
      device_(device) {}

std::string format_tokens_per_second(double per_second) {
  char text[32];
  if (per_second < 99999.5) {
    std::snprintf(text, sizeof(text), "%5.0f", per_second);
  } else if (per_second < 9999.5e3) {
    std::snprintf(text, sizeof(text), "%4.0fk", per_second / 1e3);
  } else {
    std::snprintf(text, sizeof(text), "%4.0fM", per_second / 1e6);
  }
  return text;
}

// A step's time in 8 columns however long it took: " 137.4 ms", "1234 ms" would be
// one wider (and push a 99-column step line past 100), so a second or more is "1.23 s".
std::string format_step_time(double seconds) {
  char text[32];
  if (seconds < 0.99995) {
    std::snprintf(text, sizeof(text), "%5.1f ms", seconds * 1e3);
  } else {
    // as many decimals as fit 6 columns: " 1.234", " 12.34", " 123.4", "  1234"
    const int decimals = seconds < 9.9995 ? 3 : seconds < 99.995 ? 2 : seconds < 999.95 ? 1 : 0;
    std::snprintf(text, sizeof(text), "%6.*f s", decimals, seconds);
  }
  return text;
}

void RunReport::step(int step, int total_steps, float loss, double seconds, int print_every, MetricsLog& log,
                     const JsonLine& extra, const std::string& extra_text) {
  const double tokens = static_cast<double>(global_batch_) * config_.seq_len;
  StepRecord record{step, loss, seconds, tokens / seconds};
  steps_.push_back(record);
  // every print_every steps, the first and the last, and at least every
  // kProgressSeconds: a busy machine must not leave the reader minutes without a line
  const double now = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  const bool print = print_every > 0 && (step % print_every == 0 || step == 1 || step == total_steps ||
                                         now - last_printed_ >= kProgressSeconds);
  if (print) {
    last_printed_ = now;
    // as wide as the step count, so that the line stays short and its columns line up
    const int step_width = static_cast<int>(std::to_string(total_steps).size());
    std::printf("step %*d/%d | loss %.4f | %s | %s tok/s%s\n", step_width, step, total_steps, loss,
                format_step_time(seconds).c_str(), format_tokens_per_second(record.tokens_per_second).c_str(),
                extra_text.c_str());
    std::fflush(stdout);
  }
  log.write(JsonLine()
                .add("step", step)
                .add("loss", static_cast<double>(loss))
                .add("ms", seconds * 1e3)
                .add("tokens_per_s", record.tokens_per_second)
                .merge(extra));
}

double RunReport::median_tokens_per_second() const {
  std::vector<double> rates;
  for (const StepRecord& record : steps_) rates.push_back(record.tokens_per_second);
  if (rates.empty()) return 0.0;
  std::nth_element(rates.begin(), rates.begin() + rates.size() / 2, rates.end());
  return rates[rates.size() / 2];
}

void RunReport::finish(MetricsLog& log, const JsonLine& extra) {
  const MemoryTotals& memory = memory_totals(device_);
  const double tokens_per_second = median_tokens_per_second();
  const double gflops = tokens_per_second * training_flops_per_token(config_) / 1e9;
  const float final_loss = steps_.empty() ? 0.0f : steps_.back().loss;
  const int final_step = steps_.empty() ? 0 : steps_.back().step;

  // the CPU's matmuls are fp32 unless --dtype bf16 says otherwise; a GPU's always say
  const bool say_precision = device_ == Device::CUDA || matmul_precision() != MatmulPrecision::FP32;
  std::printf("---- summary: %s (world size %d, %s%s%s) ----\n", chapter_.c_str(), world_size_, device_name(device_),
              say_precision ? ", matmuls in " : "", say_precision ? precision_name(matmul_precision()) : "");
  std::printf("final loss         %.4f (step %d)\n", final_loss, final_step);
  std::printf("median tokens/s    %.0f\n", tokens_per_second);
  std::printf("achieved GFLOP/s   %.2f (%.3g training FLOPs per token%s)\n", gflops,
              training_flops_per_token(config_), world_size_ > 1 ? "; all ranks together" : "");
  std::printf("peak memory (this rank, by category):\n");
  JsonLine summary;
  summary.add("summary", 1)
      .add("chapter", chapter_)
      .add("world_size", world_size_)
      .add("device", device_name(device_))
      .add("matmul_precision", precision_name(matmul_precision()))
      .add("final_step", final_step)
      .add("final_loss", static_cast<double>(final_loss))
      .add("median_tokens_per_s", tokens_per_second)
      .add("gflops", gflops);
  for (int c = 0; c < kNumMemCategories; c++) {
    const char* name = category_name(static_cast<MemCategory>(c));
    std::printf("  %-16s %s\n", name, format_bytes(memory.peak[c]).c_str());
    summary.add(std::string("peak_") + name, memory.peak[c]);
  }
  std::printf("  %-16s %s\n", "total", format_bytes(memory.peak_total).c_str());
  summary.add("peak_total", memory.peak_total);
#ifdef COURSE_HAVE_CUDA
  if (device_ == Device::CUDA) {
    // the pool holds the tracked buffers plus the ops' own scratch (bf16 copies, score gradients)
    const cuda::PoolStats pool = cuda::pool_stats();
    std::printf("  %-16s %s (caching pool's peak; %zu cudaMalloc calls for %zu allocations)\n", "reserved",
                format_bytes(pool.peak_reserved_bytes).c_str(), pool.cuda_malloc_calls, pool.allocations);
    summary.add("peak_reserved", pool.peak_reserved_bytes);
  }
#endif
  std::fflush(stdout);
  log.write(summary.merge(run_description()).merge(extra));
}

#if defined(__clang__)
static const char* const kCompiler = "clang " __clang_version__;
#else
static const char* const kCompiler = "g++ " __VERSION__;
#endif

// The CPU's model name as /proc/cpuinfo gives it ("unknown" elsewhere).
static std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
  }
  return "unknown";
}

JsonLine RunReport::run_description() const {
  // the model and batch (what the report's memory formulas need), then the machine
  // and the software, so that two runs' numbers can be told apart and compared
  char host[256] = "unknown";
  gethostname(host, sizeof(host) - 1);
  JsonLine fields;
  fields.add("layers", config_.n_layer)
      .add("d_model", config_.d_model)
      .add("heads", config_.n_head)
      .add("seq_len", config_.seq_len)
      .add("vocab_size", config_.vocab_size)
      .add("global_batch", global_batch_)
      .add("host", host)
      .add("cpu", cpu_model())
      .add("cpu_cores", static_cast<int>(std::thread::hardware_concurrency()))
      .add("compiler", kCompiler)
      .add("blas", openblas_get_config());
  if (device_ == Device::CUDA) fields.add("gpu", describe_device(device_));
  if (config_.recompute != Recompute::None) {
    fields.add("recompute", recompute_name(config_.recompute));
  }
  if (config_.n_experts > 0) {
    fields.add("experts", config_.n_experts)
        .add("top_k", config_.top_k)
        .add("aux_loss_coef", static_cast<double>(config_.aux_loss_coef))
        .add("capacity_factor", static_cast<double>(config_.capacity_factor));
  }
  return fields;
}

}  // namespace course
