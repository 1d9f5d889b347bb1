// The launch contract: how a process learns who it is.
//
// Every launcher tells each process its rank, the world size, its rank and the
// number of ranks on this machine, and where to meet the others. The course reads
// the variables of three launchers, in this order:
//   torchrun / the course's `launch`: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//                                     MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT
//   Open MPI's mpirun:                OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//   Slurm's srun:                     SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, ...
// With none of them set, the process is a world of one. MASTER_ADDR/MASTER_PORT are
// read under every launcher: srun does not say where rank 0 runs, so the tcp and
// nccl backends need them exported under srun (mpi does not).
//
// Who hosts the store the ranks meet at (rendezvous.h):
//   the course's `launch`: COURSE_STORE_PORT, on MASTER_ADDR, with COURSE_JOB_SECRET,
//                          the job's secret (auth.h). MASTER_PORT stays free for the
//                          workers, as PyTorch's env:// expects: rank 0 of a PyTorch
//                          script opens its own store there.
//   torchrun:              its agent, on MASTER_PORT, when it sets
//                          TORCHELASTIC_USE_AGENT_STORE=True: a c10d TCPStore (c10d_store.h)
//   otherwise:             rank 0, on MASTER_PORT.
#pragma once

#include <map>
#include <string>

namespace course {

enum class StoreHost { RankZero, CourseLauncher, TorchrunAgent };

struct LaunchEnv {
  int rank = 0;              // this process, 0 .. world_size-1
  int world_size = 1;        // processes in the job
  int local_rank = 0;        // this process among those on its machine (picks its GPU: gpu_for_rank)
  int local_world_size = 1;  // processes on this machine
  std::string master_addr;   // where the rendezvous store listens ("" when not given)
  int master_port = 0;
  int store_port = 0;        // where the store listens: COURSE_STORE_PORT under the course launcher, else MASTER_PORT
  StoreHost store_host = StoreHost::RankZero;
  int restart_count = 0;     // how many times the launcher restarted the group
  std::string job_secret;    // COURSE_JOB_SECRET: what the store and the tcp mesh ask for (auth.h); "" = none
  std::string launcher;      // "torchrun", "mpirun", "srun" or "none"
};

// A COURSE_JOB_SECRET that is exported must be at least this long (an empty one would
// turn the check off, a short one can be guessed): UsageError otherwise.
inline constexpr size_t kMinJobSecretBytes = 16;
// ... and hold at least this many different bytes: sixteen spaces, or "aaaa...", are
// long enough and guessed at once (`openssl rand -hex 32` has about 16).
inline constexpr size_t kMinJobSecretDistinctBytes = 8;
void check_job_secret(const std::string& secret);
// The reason `secret` is too weak ("" when it is not): too short, or too few different bytes.
std::string job_secret_weakness(const std::string& secret);

// Reads the contract from `vars` (the process environment by default). A variable
// that is set but malformed (RANK=abc, RANK >= WORLD_SIZE, a short secret) is a
// UsageError naming it.
LaunchEnv read_launch_env(const std::map<std::string, std::string>& vars);
LaunchEnv read_launch_env();
// This process's rank as its launcher tells it: 0 alone, or when the variables are
// unreadable (read_launch_env says why when the run reads them). Who prints --help and
// the flag errors that every rank finds.
int launch_rank();

// The GPU this process computes on, of the `visible_gpus` it sees: its local rank
// modulo their number. The one rule for every place that picks a GPU (--device
// cuda's select_device, and the nccl backend's GPU in create_world_comm), so that
// the compute and NCCL are on the same one:
//   - every GPU visible to every rank (torchrun, mpirun, srun --gpus-per-node):
//     local rank r takes GPU r;
//   - one GPU visible per rank (a per-rank CUDA_VISIBLE_DEVICES, as srun
//     --gpus-per-task=1 and many clusters set): GPU 0, a different one for each rank;
//   - more ranks than GPUs: they take turns, and share (host-staged backends only).
// UsageError when visible_gpus < 1.
int gpu_for_rank(const LaunchEnv& env, int visible_gpus);

// Whether gpu_for_rank gives each rank on this machine a GPU no other rank of it
// computes on, as NCCL needs: as many visible GPUs as ranks. With one GPU visible
// per rank, a process cannot tell a GPU of its own from one the machine's ranks
// share, so this says no: --backend auto then stages through the host, and
// --backend nccl is the way to ask for NCCL there.
bool gpus_of_their_own(const LaunchEnv& env, int visible_gpus);

}  // namespace course
