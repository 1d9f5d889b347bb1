// The trainer's command line: every mistake a reader can make with the flags is
// refused before any work starts, with exit code 2 and one line on stderr that
// names the problem. These tests run the real 00_single_gpu binary, because what
// matters is what the reader sees: the exit code and the text, not an exception.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/tensor/device.h"
#include "support/process.h"
#include "support/runs.h"

using course_test::run_process;
using course_test::TempDir;

namespace {

const double kTimeoutSeconds = 60;

course_test::ProcessResult run_trainer(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {course_test::course_binary("00_single_gpu")};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, kTimeoutSeconds);
}

// Runs the trainer with `args` and checks it is refused as a usage error: exit
// code 2, and stderr is exactly one line "00_single_gpu: error: ..." that contains
// every string in `expected` (no stack trace, no second message).
void expect_usage_error(const std::vector<std::string>& args, const std::vector<std::string>& expected) {
  std::string command = "00_single_gpu";
  for (const std::string& arg : args) command += " " + arg;
  INFO("command: " << command);
  const course_test::ProcessResult result = run_trainer(args);
  INFO("result: " << result.describe() << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);

  CHECK(result.exit_code == 2);
  CHECK_THAT(result.err, Catch::StartsWith("00_single_gpu: error: "));
  CHECK_THAT(result.err, Catch::EndsWith("\n"));
  CHECK(std::count(result.err.begin(), result.err.end(), '\n') == 1);
  for (const std::string& text : expected) CHECK_THAT(result.err, Catch::Contains(text));
}

// A small model, so that the one case that does train finishes at once.
const std::vector<std::string> kTinyModel = {"--layers", "1", "--d-model", "16", "--heads", "2", "--batch", "2"};

}  // namespace

TEST_CASE("asking for --help exits 0 and lists every common flag", "[cli]") {
  const course_test::ProcessResult result = run_trainer({"--help"});
  INFO("result: " << result.describe() << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 0);
  CHECK(result.err.empty());
  CHECK_THAT(result.out, Catch::StartsWith("usage: 00_single_gpu"));
  for (const char* flag : {"--layers", "--d-model", "--heads", "--seq", "--steps", "--batch", "--micro-batches", "--lr",
                           "--weight-decay", "--grad-clip", "--seed", "--data", "--device", "--dtype", "--tf32", "--threads", "--log",
                           "--checkpoint-dir", "--checkpoint-every", "--resume", "--quiet", "--experts", "--top-k",
                           "--capacity-factor", "--aux-loss-coef"}) {
    CHECK_THAT(result.out, Catch::Contains(std::string("  ") + flag + " "));
  }
}

TEST_CASE("an unknown flag is refused, naming the flag and pointing to --help", "[cli]") {
  expect_usage_error({"--layer", "2"}, {"unknown flag '--layer'", "--help"});
}

TEST_CASE("a word that is no flag is refused as an unexpected argument, a flag's value is not", "[cli]") {
  expect_usage_error({"extra"}, {"unexpected argument 'extra'", "takes flags only", "--help"});
  expect_usage_error({"--steps", "2", "3"}, {"unexpected argument '3'"});
  expect_usage_error({"--quiet", "true"}, {"unexpected argument 'true'"});
}

TEST_CASE("a misspelled flag gets the nearest real one as a suggestion, a made-up one none", "[cli]") {
  expect_usage_error({"--step", "2"}, {"unknown flag '--step' (did you mean --steps?)"});
  expect_usage_error({"--micro-batch", "2"}, {"(did you mean --micro-batches?)"});
  expect_usage_error({"--bach", "2"}, {"(did you mean --batch?)"});
  // the beginning of exactly one flag's name
  expect_usage_error({"--grad", "1"}, {"(did you mean --grad-clip?)"});
  const course_test::ProcessResult made_up = run_trainer({"--colour", "red"});
  CHECK(made_up.exit_code == 2);
  CHECK_THAT(made_up.err, !Catch::Contains("did you mean"));
}

TEST_CASE("a model too large for the machine is refused at once, saying how many bytes the flags ask for",
          "[cli]") {
  // counted before any allocation: no billion layer layouts, no wrapped byte count
  SECTION("a billion layers") {
    expect_usage_error({"--layers", "1000000000"},
                       {"the model flags ask for 1.37e+16 bytes: 1.98e+14 parameters x 16 bytes", "--layers"});
  }
  SECTION("a billion heads of a billion channels") {
    expect_usage_error({"--heads", "1000000000", "--d-model", "1000000000"},
                       {"the model flags ask for 7.68e+20 bytes: 4.8e+19 parameters x 16 bytes"});
  }
  SECTION("a batch of a billion sequences") {
    expect_usage_error({"--batch", "1000000000"}, {"plus 5.65e+15 bytes of activations per micro-batch"});
  }
}

TEST_CASE("a flag whose value is not a number is refused, naming the flag and the value", "[cli]") {
  SECTION("--steps abc") { expect_usage_error({"--steps", "abc"}, {"--steps expects a whole number", "'abc'"}); }
  SECTION("--lr x") { expect_usage_error({"--lr", "x"}, {"--lr expects a number", "'x'"}); }
}

TEST_CASE("a zero or negative size is refused, naming the flag and the value", "[cli]") {
  SECTION("--layers 0") { expect_usage_error({"--layers", "0"}, {"--layers must be at least 1, got 0"}); }
  SECTION("--batch -1") { expect_usage_error({"--batch", "-1"}, {"--batch must be at least 1, got -1"}); }
  SECTION("--d-model 0") { expect_usage_error({"--d-model", "0"}, {"--d-model must be at least 1, got 0"}); }
  SECTION("--seq 0") { expect_usage_error({"--seq", "0"}, {"--seq must be at least 1, got 0"}); }
}

TEST_CASE("a value outside what the flag can hold is refused, saying why", "[cli]") {
  SECTION("too large") { expect_usage_error({"--steps", "2000000000"}, {"--steps must be at most 1000000000"}); }
  SECTION("infinite") { expect_usage_error({"--lr", "inf"}, {"--lr must be a finite number"}); }
  SECTION("below float precision") { expect_usage_error({"--lr", "1e-50"}, {"--lr must be a finite number"}); }
}

TEST_CASE("a head count that does not divide d-model is refused", "[cli]") {
  expect_usage_error({"--heads", "5", "--d-model", "128"}, {"--heads 5 does not divide --d-model 128"});
}

TEST_CASE("a batch that does not split into the micro-batches is refused", "[cli]") {
  expect_usage_error({"--batch", "6", "--micro-batches", "4"}, {"--batch 6", "--micro-batches 4"});
}

TEST_CASE("a --data file that does not exist is refused, naming the file", "[cli]") {
  TempDir dir;
  const std::string missing = dir.file("no_such_file.txt");
  expect_usage_error({"--data", missing}, {"--data", "cannot open '" + missing + "'"});
}

TEST_CASE("under the launcher a missing --data file is said once, however many ranks find it", "[cli]") {
  TempDir dir;
  // every rank reads --data and fails alike; the launcher forwards the first line to arrive, not its repeats
  course_test::check_refusals(course_test::course_binary("02_ddp"), kTinyModel,
                              {{{"--data", dir.file("no_such_file.txt"), "--batch", "4"}, 4, "cannot open"}}, kTimeoutSeconds);
}

TEST_CASE("a --data path that is a device or a pipe is refused at once, not read forever", "[cli]") {
  expect_usage_error({"--data", "/dev/zero"}, {"--data: '/dev/zero' is not a regular file"});
  TempDir dir;
  const std::string fifo = dir.file("fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);  // no writer: reading it would block forever
  expect_usage_error({"--data", fifo}, {"--data: '" + fifo + "' is not a regular file"});
}

TEST_CASE("a --log on a full disk fails with exit 1 naming it, instead of losing the metrics", "[cli]") {
  const course_test::ProcessResult result =
      run_trainer(course_test::concat(kTinyModel, {"--log", "/dev/full", "--steps", "2", "--quiet"}));
  INFO("result: " << result.describe() << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 1);
  CHECK_THAT(result.err, Catch::Contains("--log: writing '/dev/full' failed"));
}

TEST_CASE("a --data file shorter than --seq + 1 bytes is refused, naming the file and the sizes", "[cli]") {
  // one window of T tokens needs T + 1 bytes: the targets are the tokens shifted by one
  TempDir dir;
  const std::string short_file = dir.file("short.txt");
  course_test::write_file(short_file, std::string(64, 'a'));
  expect_usage_error({"--data", short_file, "--seq", "64"}, {"'" + short_file + "' has 64 bytes", "--seq + 1 = 65"});
}

TEST_CASE("a --data file of exactly --seq + 1 bytes is long enough to train on", "[cli]") {
  TempDir dir;
  const std::string data_file = dir.file("just_enough.txt");
  course_test::write_file(data_file, std::string(65, 'a'));
  std::vector<std::string> args = kTinyModel;
  args.insert(args.end(), {"--data", data_file, "--seq", "64", "--steps", "1", "--quiet"});
  const course_test::ProcessResult result = run_trainer(args);
  INFO("result: " << result.describe() << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 0);
  CHECK(result.err.empty());
}

TEST_CASE("asking to --resume without a --checkpoint-dir is refused", "[cli]") {
  expect_usage_error({"--resume"}, {"--resume needs --checkpoint-dir"});
}

TEST_CASE("a flag without its value is refused, naming the flag", "[cli]") {
  SECTION("the flag is the last argument") { expect_usage_error({"--steps"}, {"--steps expects a value"}); }
  SECTION("the flag is given as --flag= with nothing after the '='") {
    expect_usage_error({"--data="}, {"--data expects a value"});
  }
}

TEST_CASE("asking for --device cuda is refused with the reason when this build or machine has no GPU", "[cli]") {
  // The reason depends on the build and the machine, which the test asks the
  // same library the trainer uses. With a GPU, the same flags train instead.
  std::vector<std::string> expected = {"--device cuda"};
  if (!course::built_with_cuda()) {
    expected.push_back("built without CUDA");
  } else if (course::cuda_device_count() == 0) {
    expected.push_back("no GPU found");
  } else {
    std::vector<std::string> args = kTinyModel;
    args.insert(args.end(), {"--device", "cuda", "--steps", "1", "--quiet"});
    const course_test::ProcessResult result = run_trainer(args);
    INFO("result: " << result.describe() << "\nstderr:\n" << result.err);
    CHECK(result.exit_code == 0);
    return;
  }
  expect_usage_error({"--device", "cuda"}, expected);
}

TEST_CASE("the mixture-of-experts flags are refused when they make no model, naming the flag", "[cli]") {
  SECTION("--experts 0") { expect_usage_error({"--experts", "0"}, {"--experts must be at least 1, got 0"}); }
  SECTION("--top-k 0") { expect_usage_error({"--experts", "2", "--top-k", "0"}, {"--top-k must be at least 1, got 0"}); }
  SECTION("more experts per token than experts") {
    expect_usage_error({"--experts", "2", "--top-k", "3"}, {"--top-k 3 is more than --experts 2"});
  }
  SECTION("a negative capacity factor") {
    expect_usage_error({"--experts", "2", "--capacity-factor", "-1"}, {"--capacity-factor must be at least 0, got -1"});
  }
  SECTION("a negative aux loss coefficient") {
    expect_usage_error({"--experts", "2", "--aux-loss-coef", "-0.1"}, {"--aux-loss-coef must be at least 0, got -0.1"});
  }
  SECTION("an expert flag without --experts") {
    expect_usage_error({"--top-k", "1"}, {"--top-k, --capacity-factor and --aux-loss-coef", "hint: add --experts"});
  }
  SECTION("an expert flag without --experts, given its default value") {
    expect_usage_error({"--top-k", "2"}, {"--top-k, --capacity-factor and --aux-loss-coef", "hint: add --experts"});
    expect_usage_error({"--aux-loss-coef=0.01"}, {"--top-k, --capacity-factor and --aux-loss-coef"});
  }
}

TEST_CASE("the chapters that train dense blocks only refuse --experts, naming the ones that train experts", "[cli]") {
  for (const char* chapter : {"02_ddp", "03_fsdp", "04_naive_model_parallel", "05_pipeline", "06_tensor_parallel",
                              "07_3d"}) {
    const course_test::ProcessResult result =
        run_process({course_test::course_binary(chapter), "--experts", "4"}, kTimeoutSeconds);
    INFO(chapter << ": " << result.describe() << "\nstderr:\n" << result.err);
    REQUIRE_FALSE(result.timed_out);
    CHECK(result.exit_code == 2);
    CHECK(result.err == std::string(chapter) + ": error: --experts is trained by chapter 00 and chapter 09 (hint: " +
                            "./build/bin/00_single_gpu --experts 4 trains this mixture of experts on one process; " +
                            chapter + (std::string(chapter) == "03_fsdp" ? " zero-3" : "") + " trains dense blocks)\n");
  }
}

TEST_CASE("the CPU refuses --tf32 (bf16 runs there), and --tf32 with --dtype bf16 is refused", "[cli]") {
  SECTION("--tf32 on the CPU") { expect_usage_error({"--tf32"}, {"--tf32 needs --device cuda", "--dtype bf16"}); }
  SECTION("an unknown dtype") { expect_usage_error({"--dtype", "fp16"}, {"--dtype", "fp16"}); }
  SECTION("both") {
    expect_usage_error({"--device", "cuda", "--dtype", "bf16", "--tf32"}, {"--tf32 and --dtype bf16", "pick one"});
  }
}

// Another user plants a symbolic link where a root-run trainer will write, pointing
// at a file the attacker wants overwritten: the trainer refuses at the start, exit 2,
// and the target keeps its bytes.
TEST_CASE("a --trace or --log that is a symbolic link is refused, and what it points at is left alone", "[cli]") {
  TempDir dir;
  const std::string victim = dir.file("victim");
  std::ofstream(victim) << "precious\n";
  for (const char* flag : {"--trace", "--log"}) {
    INFO(flag);
    const std::string planted = dir.file(std::string("planted") + flag);
    REQUIRE(::symlink(victim.c_str(), planted.c_str()) == 0);
    expect_usage_error(course_test::concat(kTinyModel, {flag, planted, "--steps", "1"}),
                       {std::string(flag) + ": cannot write", "'" + planted + "': it is a symbolic link"});
    std::ifstream in(victim);
    CHECK(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()) == "precious\n");
  }
}

// Writing a trace renames a new file over the target: over a device node that would
// turn the node into a regular file (as root, /dev/full was). A node of our own (the
// null device's numbers, as root; else a FIFO, the other kind of non-regular file)
// stands in for it here.
TEST_CASE("a --trace on a device node or a FIFO is refused, and the node is left as it was", "[cli]") {
  TempDir dir;
  const std::string node = dir.file("node");
  const bool device = ::mknod(node.c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0;
  if (!device) REQUIRE(::mkfifo(node.c_str(), 0600) == 0);
  expect_usage_error(course_test::concat(kTinyModel, {"--trace", node, "--steps", "1"}),
                     {"--trace: cannot write", "it is not a regular file"});
  struct stat info;
  REQUIRE(::lstat(node.c_str(), &info) == 0);
  CHECK((device ? S_ISCHR(info.st_mode) : S_ISFIFO(info.st_mode)));
}

// Every rank read the whole --data file into memory, which the per-node memory check
// did not count: an 8 GB sparse file ended in bad_alloc. The file is mapped now, and
// only the windows the sampler draws are ever read.
TEST_CASE("a --data file of 8 GB trains under a 1.5 GB data limit: it is mapped, not read whole", "[cli]") {
  TempDir dir;
  const std::string huge = dir.file("huge.bin");
  std::ofstream(huge).close();
  std::filesystem::resize_file(huge, uint64_t{8} << 30);  // sparse: no disk space taken
  std::string command = "ulimit -d 1500000; exec " + course_test::course_binary("00_single_gpu");
  for (const std::string& arg : course_test::concat(kTinyModel, {"--data", huge, "--steps", "2", "--quiet"})) {
    command += " " + arg;
  }
  const course_test::ProcessResult result = run_process({"bash", "-c", command}, kTimeoutSeconds);
  INFO(result.describe() << "\n" << result.err);
  CHECK(result.exit_code == 0);
}
