#!/usr/bin/env bash
# Builds the GPU kit: what scripts/run_gpu_checks.sh needs on a GPU machine that
# cannot build the course itself. The device machines this project is lent have
# nvcc, CMake and the CUDA libraries, but no OpenBLAS, Catch2, pkg-config or Open
# MPI, and no network, so `cmake --preset cuda` stops at configure there. The kit is
# built here instead, for that GPU's architecture, and carried there:
#
#   gpu_kit/bin/   the check's programs (test_cuda, test_comm_cuda, comm_worker,
#                  launch, the chapters, bench_gpu_step), built without MPI
#   gpu_kit/lib/   the shared libraries they need that such a machine lacks
#                  (OpenBLAS and the Fortran runtime it links), found with ldd
#   gpu_kit/BUILT  what it was built from: the commit, the architecture, the sizes
#
# The CUDA libraries (cudart, cuBLAS, NCCL) are not in it: they are the machine's
# own, found there by run_gpu_checks.sh (a copy of cuBLAS alone is over 500 MB).
#
#   ./scripts/make_gpu_kit.sh          # sm_90 (H100, H200); ARCH=80 for an A100
#   ./scripts/make_gpu_kit.sh --rehearse
#
# --rehearse then runs run_gpu_checks.sh --rehearse from the kit with OpenBLAS,
# Open MPI and Catch2 hidden (a private mount namespace; root only): every program
# must load from the kit alone, and the check's steps run on the guarded device in
# place of the GPU, timed. The kit is git-ignored; `carry: ["gpu_kit"]` takes it.
set -euo pipefail
cd "$(dirname "$0")/.."

arch="${ARCH:-90}"
build=build/gpu-kit
kit=gpu_kit
programs=(test_cuda test_comm_cuda comm_worker launch 00_single_gpu 02_ddp 03_fsdp 04_naive_model_parallel
          05_pipeline 06_tensor_parallel 07_3d 08_context_parallel 09_expert_parallel 10_slow_links bench_gpu_step)

if [ ! -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null 2>&1; then
  echo "make_gpu_kit: no nvcc here (hint: install the CUDA toolkit; the kit's GPU code is built by it)" >&2
  exit 2
fi
./scripts/setup.sh >&2
# MPI off: the machine has no libmpi, and one GPU's ranks share it through tcp
cmake -S . -B "$build" -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release -DCOURSE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DCOURSE_ONEDNN=OFF >/dev/null
cmake --build "$build" -j "$(nproc)" --target "${programs[@]}" >/dev/null

rm -rf "$kit"
mkdir -p "$kit/bin" "$kit/lib"
for program in "${programs[@]}"; do
  cp "$build/bin/$program" "$kit/bin/"
  strip --strip-unneeded "$kit/bin/$program"
done
# the libraries such a machine lacks: everything ldd resolves outside the C and C++
# runtimes and the CUDA libraries
for program in "$kit"/bin/*; do
  ldd "$program" | awk '$3 ~ /^\// { print $3 }'
done | sort -u | while read -r library; do
  case "$(basename "$library")" in
    libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | ld-linux* | libstdc++.so* | libgcc_s.so* | \
      libcuda.so* | libcudart.so* | libcublas*.so* | libnccl.so*) ;;
    *) cp -L "$library" "$kit/lib/" ;;
  esac
done
cp scripts/run_gpu_checks.sh "$kit/"
{
  echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')"
  echo "built $(date -u +%Y-%m-%dT%H:%MZ) on $(. /etc/os-release && echo "$PRETTY_NAME"), sm_$arch"
  echo "libraries: $(cd "$kit/lib" && ls | tr '\n' ' ')"
  echo "size: $(du -sh "$kit" | cut -f1)"
} >"$kit/BUILT"
cat "$kit/BUILT"

if [ "${1:-}" != "--rehearse" ]; then exit 0; fi
# ---- the rehearsal: the kit alone, with what the GPU machine lacks hidden --------------------------
if [ "$(id -u)" != 0 ] || ! command -v unshare >/dev/null 2>&1; then
  echo "make_gpu_kit: --rehearse hides libraries in a private mount namespace: it needs root and unshare" >&2
  exit 2
fi
hide=()
for path in /usr/lib/x86_64-linux-gnu/openblas-pthread /usr/lib/x86_64-linux-gnu/blas /usr/lib/x86_64-linux-gnu/lapack \
            /usr/lib/x86_64-linux-gnu/openmpi /usr/include/catch2 /usr/lib/x86_64-linux-gnu/libmpi.so.40 \
            /usr/lib/x86_64-linux-gnu/libgfortran.so.5 /usr/bin/pkg-config; do
  [ -e "$path" ] && hide+=("$path")
done
unshare -m bash -c '
  set -e
  for path in "$@"; do
    if [ -d "$path" ]; then mount -t tmpfs none "$path"; else mount --bind /dev/null "$path"; fi
  done
  echo "rehearsal: hidden: $*"
  exec ./'"$kit"'/run_gpu_checks.sh --rehearse
' rehearse "${hide[@]}"
