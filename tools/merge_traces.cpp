// Joins the per-rank Chrome traces of one run into a single file, so one timeline
// shows every rank (a row each, with its compute and communication lanes).
//
//   merge_traces runs/x/trace.json 4     # reads trace.rank0.json .. trace.rank3.json
//                                        # writes runs/x/trace.merged.json
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/train/cli.h"
#include "common/tensor/error.h"
#include "common/train/trace.h"

using namespace course;

static const char* const kUsage =
    "usage: merge_traces TRACE WORLD_SIZE [MERGED] (TRACE: the path given to --trace; "
    "MERGED: default TRACE with .merged before its extension)";

static int parse_world_size(const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE || value < 1 || value > 1'000'000) {
    throw UsageError("WORLD_SIZE must be a whole number of at least 1, got '" + text + "'; " + kUsage);
  }
  return static_cast<int>(value);
}

int main(int argc, char** argv) {
  return guarded_main("merge_traces", [&] {
    if (argc < 3 || argc > 4) throw UsageError(kUsage);
    const std::string path = argv[1];
    const int world_size = parse_world_size(argv[2]);
    const std::string merged_path = argc == 4 ? argv[3] : merged_trace_path(path);
    merge_rank_traces(path, world_size, merged_path);
    std::printf("merged %d rank trace%s into %s\n", world_size, world_size == 1 ? "" : "s", merged_path.c_str());
    std::printf("open it at https://ui.perfetto.dev (Open trace file) or in chrome://tracing (Load)\n");
    return 0;
  });
}
