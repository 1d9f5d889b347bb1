// Choosing where to compute. The CPU is always there; CUDA needs a build with the
// CUDA toolkit (the `cuda` preset, or any preset on a machine with nvcc) and a GPU.
#pragma once

#include <functional>
#include <string>

#include "common/tensor/memory.h"

namespace course {

bool built_with_cuda();

// Number of visible CUDA GPUs; 0 in a CPU-only build or when the driver finds none
// (the reason is written to *why when it is not null).
int cuda_device_count(std::string* why = nullptr);

// This process's GPU's compute capability as one number (90 for sm_90); 0 without one.
int cuda_compute_capability();

// "cpu", or "cuda: GPU 0 of 1, NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB)"
std::string describe_device(Device device);

// Turns --device into a Device, or throws UsageError saying why it cannot be used
// ("guarded": the CPU with a GPU's rule that host code never touches device memory,
// for tests; common/tensor/guarded_device.h).
// For cuda it also makes one GPU this process's: pick_gpu(visible GPUs) says which, GPU 0
// without it. A trainer passes the launcher's choice, gpu_for_rank (common/comm/env.h:
// the local rank modulo the GPUs visible), which this layer cannot read: the launch
// environment belongs to the comm layer above it.
Device select_device(const std::string& name, const std::function<int(int visible_gpus)>& pick_gpu = {});

// How the GEMMs (linear layers and attention's two products) compute:
// - FP32: fp32 in, fp32 math, fp32 out. The reference, and the default.
// - TF32: fp32 in and out, tensor-core products on 10-bit mantissas (--tf32). A GPU's
//   only: the CPU computes FP32 then.
// - BF16: bf16 inputs, fp32 accumulation, fp32 out (--dtype bf16), on every device
//   (the CPU's: gemm_cpu.h; the GPU's: cuda/gemm.h). The weights, gradients and
//   optimizer state stay fp32: the master weights are never rounded; only each
//   product's inputs are, at each call.
enum class MatmulPrecision { FP32, TF32, BF16 };
void set_matmul_precision(MatmulPrecision precision);
MatmulPrecision matmul_precision();
const char* precision_name(MatmulPrecision precision);  // "fp32", "tf32", "bf16"
// CourseError unless the GEMMs are BF16: the check of every device's GEMM that is given an
// input stored in bf16 (common/model/model.h's LinearInput), which the model keeps only
// under --dtype bf16
void require_bf16_matmuls_for_stored_input();

// Copies `bytes` from src (on src_device) to dst (on dst_device). A copy that
// involves the GPU is queued in order with the ops (the compute stream): it sees
// every op queued before it, and the ops queued after it see its result. It
// returns once the host may use the buffers it gave:
// - to the host: when the copy is done (it waits for the ops queued before it);
// - from the host: at once for pageable memory (std::vector, a CPU Buffer), which
//   CUDA stages before returning: src may be reused or freed; pinned host memory
//   is read by the GPU later, so for it this waits for the copy;
// - GPU to GPU: at once, without waiting for the GPU.
// CPU to CPU is a memmove.
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
// Returns when every op queued on `device` has finished (the CPU: at once).
void synchronize(Device device);

}  // namespace course
