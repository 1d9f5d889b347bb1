// Chapter 01's promise, "habits carry over", tried both ways with PyTorch's own
// torchrun (`python -m torch.distributed.run`, what the `torchrun` command runs):
//   - a chapter under torchrun joins its agent's store as a c10d TCPStore client
//     (common/comm/c10d_store.h) and trains as under the course launcher, loss for
//     loss; torchrun's --max-restarts restarts it and it resumes; two torchrun agents
//     (--nnodes 2) on one machine make one job;
//   - a PyTorch script under the course launcher meets through env:// on MASTER_PORT,
//     which the launcher leaves to it, and its gloo all-reduce is right at 2 and 4 ranks.
// The c10d client is also tried against torch's own TCPStore server, key by key.
// PyTorch is never a dependency: where no Python imports torch (support/python.h),
// those cases exit 77, which CTest reports as skipped. The one case without PyTorch:
// the c10d client refuses a server that is not a TCPStore.
#include <catch2/catch.hpp>

#include <string>
#include <thread>
#include <vector>

#include "common/comm/c10d_store.h"
#include "common/comm/socket.h"
#include "common/comm/store.h"
#include "support/equivalence_model.h"
#include "support/matchers.h"
#include "support/process.h"
#include "support/python.h"
#include "support/runs.h"

using course_test::check_same_losses;
using course_test::concat;
using course_test::course_binary;
using course_test::ProcessResult;
using course_test::python_with;
using course_test::read_log;
using course_test::RunLog;
using course_test::TempDir;

namespace {

const double kTimeoutSeconds = 180;
const int kSteps = 8;

int free_port() {
  int port = 0;
  course::listen_on("127.0.0.1", 0, &port);
  return port;
}

// chapter 02 with the small model, its flags after the program
std::vector<std::string> chapter_02(const std::vector<std::string>& args) {
  return concat(concat({course_binary("02_ddp"), "--quiet", "--backend", "tcp", "--comm-timeout", "60", "--batch", "8",
                        "--steps", std::to_string(kSteps)},
                       course_test::kModel),
                args);
}

// `--` before the program: torchrun's argparse would take the chapter's --log for an
// abbreviation of its own --log-dir
std::vector<std::string> torchrun(const std::string& python, const std::vector<std::string>& flags,
                                  const std::vector<std::string>& program) {
  return concat(concat(concat({python, "-m", "torch.distributed.run"}, flags), {"--"}), program);
}

RunLog course_launcher_run(const TempDir& dir) {
  const std::string log = dir.file("launch.jsonl");
  course_test::run_ok(concat({course_binary("launch"), "--nproc-per-node", "2", "--"}, chapter_02({"--log", log})),
                      kTimeoutSeconds);
  return read_log(log);
}

}  // namespace

TEST_CASE("the c10d client refuses a server that is not a TCPStore, saying what MASTER_PORT should be",
          "[torchrun]") {
  course::StoreServer course_store("127.0.0.1", 0);
  REQUIRE_THROWS_MATCHES(course::C10dStoreClient("127.0.0.1", course_store.port(), 2.0), course::CommError,
                         course_test::MessageContains("is MASTER_PORT torchrun's store?"));
}

TEST_CASE("the c10d client and torch's own TCPStore server: set, get, add, check, wait and a wait that times out",
          "[torchrun]") {
  const std::string python = python_with("torch");
  const int port = free_port();
  // torch's server, with a torch client beside ours: each reads what the other wrote
  const std::string script =
      "import sys, time, datetime, torch.distributed as dist\n"
      "store = dist.TCPStore('127.0.0.1', int(sys.argv[1]), None, True, timeout=datetime.timedelta(seconds=60),\n"
      "                      wait_for_workers=False)\n"
      "store.set('from_torch', 'hello')\n"
      "store.wait(['from_course'])\n"
      "print('course set', store.get('from_course').decode(), 'count', store.add('count', 0), flush=True)\n"
      "store.set('done', '1')\n"
      "time.sleep(2)\n";
  ProcessResult server;
  std::thread torch_side([&] { server = course_test::run_process({python, "-c", script, std::to_string(port)}, 120); });
  {
    course::C10dStoreClient store("127.0.0.1", port, 60);
    CHECK(store.get("from_torch") == "hello");
    CHECK(store.add("count", 5) == 5);
    CHECK(store.add("count", -2) == 3);
    CHECK(store.check({"from_torch"}));
    CHECK_FALSE(store.check({"from_torch", "nobody"}));
    CHECK_THROWS_MATCHES(store.get("nobody", 0.3), course::CommError,
                         course_test::MessageContains("get 'nobody': nobody set it within 0.3 s"));
    // the cancelled wait left the connection in step: it goes on working
    store.set("from_course", "hi");
    CHECK(store.get("done") == "1");
  }
  torch_side.join();
  INFO(server.describe() << "\n" << server.out << server.err);
  CHECK(server.exit_code == 0);
  CHECK_THAT(server.out, Catch::Contains("course set hi count 3"));
}

TEST_CASE("chapter 02 under torchrun --standalone equals the course launcher's run, loss for loss", "[torchrun]") {
  const std::string python = python_with("torch");
  TempDir dir;
  const std::string log = dir.file("torchrun.jsonl");
  const ProcessResult result = course_test::run_ok(
      torchrun(python, {"--standalone", "--nproc-per-node", "2", "--no-python"}, chapter_02({"--log", log})),
      kTimeoutSeconds);
  // rank 0 says that torchrun's store asks for no secret
  CHECK_THAT(result.err, Catch::Contains("the ranks meet at torchrun's store, localhost:"));
  CHECK_THAT(result.err, Catch::Contains("which asks for no secret"));
  check_same_losses(read_log(log), course_launcher_run(dir), 1);
}

TEST_CASE("a rank killed under torchrun --max-restarts 1: torchrun restarts the group, which resumes", "[torchrun]") {
  const std::string python = python_with("torch");
  TempDir dir;
  const std::string log = dir.file("restarted.jsonl");
  // checkpoints after steps 4 and 8; rank 1 dies after step 6, so 5 and 6 are redone
  const ProcessResult result = course_test::run_ok(
      concat({"env", "COURSE_TEST_FAULT=die_at_step=6,rank=1"},
             torchrun(python, {"--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--no-python"},
                      chapter_02({"--log", log, "--checkpoint-dir", dir.file("checkpoints"), "--checkpoint-every", "4"}))),
      kTimeoutSeconds);
  CHECK_THAT(result.out, Catch::Contains("the launcher restarted the group (restart 1): resumed from"));
  check_same_losses(read_log(log), course_launcher_run(dir), 5);
}

TEST_CASE("two torchrun agents on one machine (--nnodes 2, c10d rendezvous) make one job of chapter 02",
          "[torchrun]") {
  const std::string python = python_with("torch");
  TempDir dir;
  const std::string endpoint = "127.0.0.1:" + std::to_string(free_port());
  std::vector<ProcessResult> nodes(2);
  std::vector<std::thread> agents;
  for (int node = 0; node < 2; node++) {
    agents.emplace_back([&, node] {
      const std::string log = dir.file("node" + std::to_string(node) + ".jsonl");
      nodes[node] = course_test::run_process(
          torchrun(python,
                   {"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", "1", "--rdzv-backend",
                    "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "course", "--no-python"},
                   chapter_02({"--log", log})),
          kTimeoutSeconds);
    });
  }
  for (std::thread& agent : agents) agent.join();
  for (int node = 0; node < 2; node++) {
    INFO("node " << node << ": " << nodes[node].describe() << "\n" << nodes[node].err);
    CHECK(nodes[node].exit_code == 0);
  }
  // the rank that logs is rank 0, on whichever node the rendezvous made it
  const RunLog reference = course_launcher_run(dir);
  int logged = 0;
  for (int node = 0; node < 2; node++) {
    const std::string log = dir.file("node" + std::to_string(node) + ".jsonl");
    if (!std::filesystem::exists(log)) continue;
    logged++;
    check_same_losses(read_log(log), reference, 1);
  }
  CHECK(logged == 1);
}

TEST_CASE("a PyTorch script under the course launcher: gloo through env:// all-reduces right at 2 and 4 ranks",
          "[torchrun]") {
  const std::string python = python_with("torch");
  const int ranks = GENERATE(2, 4);
  INFO(ranks << " ranks");
  const ProcessResult result = course_test::run_ok(
      {course_binary("launch"), "--nproc-per-node", std::to_string(ranks), "--", python,
       std::string(COURSE_SOURCE_DIR) + "/01_torchrun/torch_all_reduce.py"},
      kTimeoutSeconds);
  const int sum = ranks * (ranks + 1) / 2;
  const std::string expected = "all_reduce gave [" + std::to_string(sum) + ".0, " + std::to_string(2 * sum) + ".0, " +
                               std::to_string(3 * sum) + ".0]";
  for (int rank = 0; rank < ranks; rank++) {
    CHECK_THAT(result.out, Catch::Contains("[rank " + std::to_string(rank) + "] rank " + std::to_string(rank) + " of " +
                                           std::to_string(ranks) + ": " + expected));
  }
}
