#!/usr/bin/env bash
# The collective-bandwidth tables of chapter 01 at 2 and 4 ranks: the tcp backend
# (shared memory between same-machine peers, then sockets only) and Open MPI.
#   ./benchmarks/run_collectives.sh [--collective all_reduce] [--max-mb 64]
set -euo pipefail
cd "$(dirname "$0")/.."
bin="$(./scripts/build.sh)"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
for ranks in 2 4; do
  for transport in shm socket; do
    echo
    echo "tcp backend, COURSE_TCP_TRANSPORT=$transport"
    COURSE_TCP_TRANSPORT=$transport "$bin/launch" --nproc-per-node "$ranks" --master-port 0 -- \
      "$bin/bench_collectives" --backend tcp "$@" | sed -n 's/^\[rank 0\] //p'
  done
  echo
  mpirun -np "$ranks" "$bin/bench_collectives" --backend mpi "$@"
done
