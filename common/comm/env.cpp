#include "common/comm/env.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>

#include "common/tensor/error.h"

extern char** environ;

namespace course {

namespace {

const std::string* find(const std::map<std::string, std::string>& vars, const std::string& name) {
  auto found = vars.find(name);
  return found == vars.end() ? nullptr : &found->second;
}

int integer(const std::map<std::string, std::string>& vars, const std::string& name, int fallback, int min_value,
            int max_value = 1'000'000) {
  const std::string* text = find(vars, name);
  if (text == nullptr) return fallback;
  errno = 0;
  char* end = nullptr;
  long value = std::strtol(text->c_str(), &end, 10);
  if (text->empty() || *end != '\0' || errno == ERANGE || value < min_value || value > max_value) {
    throw UsageError("environment variable " + name + "='" + *text + "' is not a number from " +
                     std::to_string(min_value) + " to " + std::to_string(max_value));
  }
  return static_cast<int>(value);
}

// Slurm writes tasks per node as "2(x3),1": the count on this node is the entry
// that covers SLURM_NODEID. Compressed "N(xM)" means M nodes with N tasks each.
int slurm_tasks_on_this_node(const std::string& spec, int node_id) {
  auto malformed = [&] {
    return UsageError("environment variable SLURM_TASKS_PER_NODE='" + spec + "' is not a list like 2(x3),1");
  };
  size_t position = 0;
  int node = 0;
  while (position < spec.size()) {
    char* end = nullptr;
    long tasks = std::strtol(spec.c_str() + position, &end, 10);
    if (end == spec.c_str() + position || tasks < 1) throw malformed();
    long repeat = 1;
    if (std::strncmp(end, "(x", 2) == 0) {
      char* repeat_end = nullptr;
      repeat = std::strtol(end + 2, &repeat_end, 10);
      if (repeat < 1 || *repeat_end != ')') throw malformed();
      end = repeat_end + 1;
    }
    if (node_id < node + repeat) return static_cast<int>(tasks);
    node += static_cast<int>(repeat);
    if (*end == '\0') break;
    if (*end != ',') throw malformed();
    position = static_cast<size_t>(end - spec.c_str()) + 1;
  }
  throw UsageError("SLURM_TASKS_PER_NODE='" + spec + "' lists no tasks for SLURM_NODEID " + std::to_string(node_id));
}

}  // namespace

std::string job_secret_weakness(const std::string& secret) {
  // an empty one would turn the check off, a short or repetitive one can be guessed
  if (secret.size() < kMinJobSecretBytes) {
    return std::to_string(secret.size()) + " bytes: a job's secret needs at least " +
           std::to_string(kMinJobSecretBytes);
  }
  const std::set<char> different(secret.begin(), secret.end());
  if (different.size() < kMinJobSecretDistinctBytes) {
    return std::to_string(secret.size()) + " bytes but only " + std::to_string(different.size()) +
           " different ones: a job's secret needs at least " + std::to_string(kMinJobSecretDistinctBytes) +
           ", or it is guessed at once";
  }
  return "";
}

void check_job_secret(const std::string& secret) {
  const std::string weakness = job_secret_weakness(secret);
  if (!weakness.empty()) {
    throw UsageError("COURSE_JOB_SECRET is " + weakness +
                     " (hint: export COURSE_JOB_SECRET=$(openssl rand -hex 32), or unset it on one machine: "
                     "the launcher then makes one)");
  }
}

LaunchEnv read_launch_env(const std::map<std::string, std::string>& vars) {
  LaunchEnv env;
  if (find(vars, "RANK") != nullptr || find(vars, "WORLD_SIZE") != nullptr) {
    env.launcher = "torchrun";
    env.rank = integer(vars, "RANK", 0, 0);
    env.world_size = integer(vars, "WORLD_SIZE", 1, 1);
    env.local_rank = integer(vars, "LOCAL_RANK", env.rank, 0);
    env.local_world_size = integer(vars, "LOCAL_WORLD_SIZE", env.world_size, 1);
  } else if (find(vars, "OMPI_COMM_WORLD_RANK") != nullptr) {
    env.launcher = "mpirun";
    env.rank = integer(vars, "OMPI_COMM_WORLD_RANK", 0, 0);
    env.world_size = integer(vars, "OMPI_COMM_WORLD_SIZE", 1, 1);
    env.local_rank = integer(vars, "OMPI_COMM_WORLD_LOCAL_RANK", 0, 0);
    env.local_world_size = integer(vars, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, 1);
  } else if (find(vars, "SLURM_PROCID") != nullptr) {
    env.launcher = "srun";
    env.rank = integer(vars, "SLURM_PROCID", 0, 0);
    env.world_size = integer(vars, "SLURM_NTASKS", 1, 1);
    env.local_rank = integer(vars, "SLURM_LOCALID", 0, 0);
    const std::string* per_node = find(vars, "SLURM_TASKS_PER_NODE");
    env.local_world_size =
        per_node == nullptr ? 1 : slurm_tasks_on_this_node(*per_node, integer(vars, "SLURM_NODEID", 0, 0));
  } else {
    env.launcher = "none";
  }
  if (const std::string* addr = find(vars, "MASTER_ADDR")) env.master_addr = *addr;
  env.master_port = integer(vars, "MASTER_PORT", 0, 0, 65535);
  env.restart_count = integer(vars, "TORCHELASTIC_RESTART_COUNT", 0, 0);
  env.store_port = env.master_port;
  if (find(vars, "COURSE_STORE_PORT") != nullptr) {
    env.store_host = StoreHost::CourseLauncher;
    env.store_port = integer(vars, "COURSE_STORE_PORT", 0, 1, 65535);
  } else if (const std::string* agent = find(vars, "TORCHELASTIC_USE_AGENT_STORE"); agent != nullptr && *agent == "True") {
    env.store_host = StoreHost::TorchrunAgent;
  }
  if (const std::string* secret = find(vars, "COURSE_JOB_SECRET")) {
    check_job_secret(*secret);
    env.job_secret = *secret;
  }

  if (env.rank >= env.world_size) {
    throw UsageError("the launcher says rank " + std::to_string(env.rank) + " but world size " +
                     std::to_string(env.world_size) + " (" + env.launcher + " variables; rank must be below it)");
  }
  if (env.local_rank >= env.local_world_size) {
    throw UsageError("the launcher says local rank " + std::to_string(env.local_rank) + " but local world size " +
                     std::to_string(env.local_world_size) + " (" + env.launcher + " variables)");
  }
  return env;
}

LaunchEnv read_launch_env() {
  std::map<std::string, std::string> vars;
  for (char** entry = environ; *entry != nullptr; entry++) {
    std::string text = *entry;
    size_t equals = text.find('=');
    if (equals != std::string::npos) vars[text.substr(0, equals)] = text.substr(equals + 1);
  }
  return read_launch_env(vars);
}

int launch_rank() {
  try {
    return read_launch_env().rank;
  } catch (const UsageError&) {
    return 0;
  }
}

int gpu_for_rank(const LaunchEnv& env, int visible_gpus) {
  if (visible_gpus < 1) {
    throw UsageError("rank " + std::to_string(env.rank) + " sees no GPU to compute on (hint: nvidia-smi should " +
                     "list one, and CUDA_VISIBLE_DEVICES, when set, must name one; or use --device cpu)");
  }
  return env.local_rank % visible_gpus;
}

bool gpus_of_their_own(const LaunchEnv& env, int visible_gpus) { return visible_gpus >= env.local_world_size; }

}  // namespace course
