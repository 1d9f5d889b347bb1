// The launch contract: each launcher's variables give the same LaunchEnv, and the
// same GPU for a rank (gpu_for_rank).
#include <catch2/catch.hpp>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "support/matchers.h"

#include "common/comm/env.h"
#include "common/tensor/error.h"

using namespace course;

TEST_CASE("no launcher variables make a world of one", "[env]") {
  LaunchEnv env = read_launch_env(std::map<std::string, std::string>{});
  CHECK(env.launcher == "none");
  CHECK(env.rank == 0);
  CHECK(env.world_size == 1);
  CHECK(env.local_rank == 0);
  CHECK(env.local_world_size == 1);
  CHECK(env.restart_count == 0);
  CHECK(env.store_host == course::StoreHost::RankZero);
}

TEST_CASE("torchrun's variables, as the course launcher sets them", "[env]") {
  LaunchEnv env = read_launch_env({{"RANK", "5"},
                                   {"WORLD_SIZE", "8"},
                                   {"LOCAL_RANK", "1"},
                                   {"LOCAL_WORLD_SIZE", "4"},
                                   {"MASTER_ADDR", "10.0.0.1"},
                                   {"MASTER_PORT", "29500"},
                                   {"TORCHELASTIC_RESTART_COUNT", "2"},
                                   {"COURSE_STORE_PORT", "29400"}});
  CHECK(env.launcher == "torchrun");
  CHECK(env.rank == 5);
  CHECK(env.world_size == 8);
  CHECK(env.local_rank == 1);
  CHECK(env.local_world_size == 4);
  CHECK(env.master_addr == "10.0.0.1");
  CHECK(env.master_port == 29500);
  CHECK(env.restart_count == 2);
  // the course's store on its own port; MASTER_PORT is the workers'
  CHECK(env.store_host == course::StoreHost::CourseLauncher);
  CHECK(env.store_port == 29400);
}

TEST_CASE("torchrun's own variables: its agent hosts the store on MASTER_PORT, and rank 0 hosts none", "[env]") {
  const std::map<std::string, std::string> torchrun = {{"RANK", "1"},
                                                       {"WORLD_SIZE", "2"},
                                                       {"LOCAL_RANK", "1"},
                                                       {"LOCAL_WORLD_SIZE", "2"},
                                                       {"MASTER_ADDR", "localhost"},
                                                       {"MASTER_PORT", "43821"},
                                                       {"TORCHELASTIC_RESTART_COUNT", "0"},
                                                       {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
  LaunchEnv env = read_launch_env(torchrun);
  CHECK(env.store_host == course::StoreHost::TorchrunAgent);
  CHECK(env.store_port == 43821);
  std::map<std::string, std::string> without_agent = torchrun;
  without_agent["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  CHECK(read_launch_env(without_agent).store_host == course::StoreHost::RankZero);
  CHECK_THROWS_WITH(read_launch_env({{"COURSE_STORE_PORT", "0"}}), Catch::Contains("from 1 to 65535"));
}

TEST_CASE("Open MPI's variables, as mpirun sets them", "[env]") {
  LaunchEnv env = read_launch_env({{"OMPI_COMM_WORLD_RANK", "3"},
                                   {"OMPI_COMM_WORLD_SIZE", "4"},
                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  CHECK(env.launcher == "mpirun");
  CHECK(env.rank == 3);
  CHECK(env.world_size == 4);
  CHECK(env.local_rank == 1);
  CHECK(env.local_world_size == 2);
  CHECK(env.master_addr.empty());
}

TEST_CASE("Slurm's variables, as srun sets them, including the compressed tasks-per-node list", "[env]") {
  // 3 nodes: two with 2 tasks, then one with 1 task; this is task 4, on node 2
  LaunchEnv env = read_launch_env({{"SLURM_PROCID", "4"},
                                   {"SLURM_NTASKS", "5"},
                                   {"SLURM_LOCALID", "0"},
                                   {"SLURM_NODEID", "2"},
                                   {"SLURM_TASKS_PER_NODE", "2(x2),1"},
                                   {"MASTER_ADDR", "192.168.1.7"}});
  CHECK(env.launcher == "srun");
  CHECK(env.rank == 4);
  CHECK(env.world_size == 5);
  CHECK(env.local_rank == 0);
  CHECK(env.local_world_size == 1);
  CHECK(env.master_addr == "192.168.1.7");
  // the second node has two tasks
  LaunchEnv second = read_launch_env({{"SLURM_PROCID", "3"},
                                      {"SLURM_NTASKS", "5"},
                                      {"SLURM_LOCALID", "1"},
                                      {"SLURM_NODEID", "1"},
                                      {"SLURM_TASKS_PER_NODE", "2(x2),1"}});
  CHECK(second.local_world_size == 2);
}

TEST_CASE("torchrun's variables win when a launcher runs under another (launch inside an srun job)", "[env]") {
  LaunchEnv env = read_launch_env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});
  CHECK(env.launcher == "torchrun");
  CHECK(env.rank == 1);
}

TEST_CASE("malformed or inconsistent launcher variables are refused, naming the variable", "[env]") {
  CHECK_THROWS_WITH(read_launch_env({{"RANK", "abc"}, {"WORLD_SIZE", "2"}}), Catch::Contains("RANK='abc'"));
  CHECK_THROWS_WITH(read_launch_env({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), Catch::Contains("rank 2 but world size 2"));
  CHECK_THROWS_WITH(read_launch_env({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), Catch::Contains("WORLD_SIZE='0'"));
  CHECK_THROWS_AS(read_launch_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "http"}}), UsageError);
  CHECK_THROWS_WITH(read_launch_env({{"MASTER_PORT", "70000"}}), Catch::Contains("from 0 to 65535"));
  CHECK_THROWS_WITH(read_launch_env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_TASKS_PER_NODE", "abc"}}),
                    Catch::Contains("SLURM_TASKS_PER_NODE='abc'"));
}

TEST_CASE("an exported COURSE_JOB_SECRET shorter than 16 bytes is refused, an empty one too", "[env]") {
  for (const std::string& weak : {std::string(), std::string("x"), std::string(15, 'k')}) {
    INFO("'" << weak << "'");
    CHECK_THROWS_MATCHES(read_launch_env({{"COURSE_JOB_SECRET", weak}}), course::UsageError,
                         course_test::MessageContains("COURSE_JOB_SECRET is " + std::to_string(weak.size()) +
                                                      " bytes: a job's secret needs at least 16"));
  }
  CHECK(read_launch_env({{"COURSE_JOB_SECRET", "0123456789abcdef"}}).job_secret == "0123456789abcdef");
}

TEST_CASE("an exported COURSE_JOB_SECRET of 16 bytes or more with fewer than 8 different ones is refused", "[env]") {
  for (const std::string& weak : {std::string(16, 'k'), std::string(16, ' '), std::string("0123456012345601")}) {
    INFO("'" << weak << "'");
    CHECK_THROWS_MATCHES(read_launch_env({{"COURSE_JOB_SECRET", weak}}), course::UsageError,
                         course_test::MessageContains("different ones: a job's secret needs at least 8"));
  }
}


// ---- which GPU a rank computes on (gpu_for_rank) -----------------------------------

namespace {

// The GPU of each rank of an 8-rank job on 2 machines of 4 ranks, as `vars_of(rank)`
// describes rank `rank` to read_launch_env, when each process sees `visible_gpus`.
std::vector<int> gpus_of_job(const std::function<std::map<std::string, std::string>(int)>& vars_of,
                             int visible_gpus) {
  std::vector<int> gpus;
  for (int rank = 0; rank < 8; rank++) gpus.push_back(gpu_for_rank(read_launch_env(vars_of(rank)), visible_gpus));
  return gpus;
}

std::map<std::string, std::string> torchrun_vars(int rank) {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", "8"},
          {"LOCAL_RANK", std::to_string(rank % 4)},
          {"LOCAL_WORLD_SIZE", "4"}};
}

std::map<std::string, std::string> mpirun_vars(int rank) {
  return {{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_SIZE", "8"},
          {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(rank % 4)},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}};
}

// srun -N 2 --ntasks-per-node 4: Slurm says nothing in torchrun's or Open MPI's words
std::map<std::string, std::string> srun_vars(int rank) {
  return {{"SLURM_PROCID", std::to_string(rank)},
          {"SLURM_NTASKS", "8"},
          {"SLURM_LOCALID", std::to_string(rank % 4)},
          {"SLURM_NODEID", std::to_string(rank / 4)},
          {"SLURM_TASKS_PER_NODE", "4(x2)"}};
}

}  // namespace

TEST_CASE("gpu_for_rank: each launcher's local rank picks the GPU, 4 ranks on each of 2 machines", "[env]") {
  const std::vector<int> one_each = {0, 1, 2, 3, 0, 1, 2, 3};
  CHECK(gpus_of_job(torchrun_vars, 4) == one_each);
  CHECK(gpus_of_job(mpirun_vars, 4) == one_each);
  CHECK(gpus_of_job(srun_vars, 4) == one_each);
  // a machine with more GPUs than ranks: the first ones
  CHECK(gpus_of_job(srun_vars, 8) == one_each);
  for (const auto& vars_of : {torchrun_vars, mpirun_vars, srun_vars}) {
    CHECK(gpus_of_their_own(read_launch_env(vars_of(5)), 4));
    CHECK(gpus_of_their_own(read_launch_env(vars_of(5)), 8));
  }
}

TEST_CASE("gpu_for_rank: one visible GPU per rank (a per-rank CUDA_VISIBLE_DEVICES) is GPU 0", "[env]") {
  const std::vector<int> all_zero(8, 0);
  CHECK(gpus_of_job(torchrun_vars, 1) == all_zero);
  CHECK(gpus_of_job(mpirun_vars, 1) == all_zero);
  CHECK(gpus_of_job(srun_vars, 1) == all_zero);
  // one process cannot tell its own GPU from one its machine's 4 ranks share
  CHECK_FALSE(gpus_of_their_own(read_launch_env(srun_vars(5)), 1));
}

TEST_CASE("gpu_for_rank: more ranks than GPUs share them in turn", "[env]") {
  CHECK(gpus_of_job(srun_vars, 2) == std::vector<int>{0, 1, 0, 1, 0, 1, 0, 1});
  CHECK(gpus_of_job(torchrun_vars, 3) == std::vector<int>{0, 1, 2, 0, 0, 1, 2, 0});
  CHECK_FALSE(gpus_of_their_own(read_launch_env(torchrun_vars(5)), 3));
}

TEST_CASE("gpu_for_rank: torchrun's RANK stands in for a missing LOCAL_RANK, and no launcher means GPU 0", "[env]") {
  CHECK(gpu_for_rank(read_launch_env({{"RANK", "3"}, {"WORLD_SIZE", "4"}}), 4) == 3);
  CHECK(gpu_for_rank(read_launch_env(std::map<std::string, std::string>{}), 4) == 0);
  CHECK(gpus_of_their_own(read_launch_env(std::map<std::string, std::string>{}), 1));
}

TEST_CASE("gpu_for_rank: no visible GPU is a UsageError naming the rank", "[env]") {
  CHECK_THROWS_MATCHES(gpu_for_rank(read_launch_env(srun_vars(6)), 0), course::UsageError,
                       course_test::MessageContains("rank 6 sees no GPU to compute on"));
}
