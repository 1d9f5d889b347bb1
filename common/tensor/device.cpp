#include "common/tensor/device.h"

#include <cstring>

#include "common/tensor/error.h"
#include "common/tensor/guarded_device.h"

namespace course {

#ifdef COURSE_HAVE_CUDA
// common/tensor/cuda/runtime.cu
int cuda_probe_device_count(std::string* why);
void cuda_copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
void cuda_synchronize();
std::string cuda_describe_gpu();
int cuda_gpu_compute_capability();
namespace cuda {
void use_gpu(int index);
}
bool built_with_cuda() { return true; }
int cuda_device_count(std::string* why) { return cuda_probe_device_count(why); }
int cuda_compute_capability() { return cuda_device_count() > 0 ? cuda_gpu_compute_capability() : 0; }
#else
bool built_with_cuda() { return false; }
int cuda_device_count(std::string* why) {
  if (why != nullptr) *why = "built without CUDA";
  return 0;
}
int cuda_compute_capability() { return 0; }
#endif

std::string describe_device(Device device) {
#ifdef COURSE_HAVE_CUDA
  if (device == Device::CUDA) return "cuda: " + cuda_describe_gpu();
#endif
  return device_name(device);
}

Device select_device(const std::string& name, const std::function<int(int visible_gpus)>& pick_gpu) {
  if (name == "cpu") return Device::CPU;
  if (name == "guarded") return Device::Guarded;
  if (name != "cuda") throw UsageError("--device must be cpu, cuda or guarded, got '" + name + "'");
  if (!built_with_cuda()) {
    throw UsageError("--device cuda: this build has no CUDA backend (built without CUDA; hint: install the " +
                     std::string("CUDA toolkit and configure with the `cuda` preset, or use --device cpu)"));
  }
  std::string why;
  const int gpus = cuda_device_count(&why);
  if (gpus == 0) throw UsageError("--device cuda: no GPU found (" + why + "; hint: use --device cpu)");
#ifdef COURSE_HAVE_CUDA
  cuda::use_gpu(pick_gpu ? pick_gpu(gpus) : 0);
#else
  (void)pick_gpu;  // unreachable without CUDA: built_with_cuda() said no above
#endif
  return Device::CUDA;
}

// ---- matmul precision ------------------------------------------------------

static MatmulPrecision global_precision = MatmulPrecision::FP32;
void set_matmul_precision(MatmulPrecision precision) { global_precision = precision; }
MatmulPrecision matmul_precision() { return global_precision; }
void require_bf16_matmuls_for_stored_input() {
  if (global_precision != MatmulPrecision::BF16) {
    throw CourseError("a GEMM input stored in bf16 reached a GEMM that is not bf16 (the model stores its linear "
                      "layers' inputs in bf16 only under --dtype bf16; hint: keep --dtype bf16 for the whole run)");
  }
}

const char* precision_name(MatmulPrecision precision) {
  switch (precision) {
    case MatmulPrecision::FP32: return "fp32";
    case MatmulPrecision::TF32: return "tf32";
    case MatmulPrecision::BF16: return "bf16";
  }
  return "unknown";
}

// ---- copies ----------------------------------------------------------------

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (dst_device == Device::CPU && src_device == Device::CPU) {
    if (bytes > 0) std::memmove(dst, src, bytes);
    return;
  }
  if (dst_device != Device::CUDA && src_device != Device::CUDA) {  // the guarded device and the CPU
    guarded::Open open;
    if (bytes > 0) std::memmove(dst, src, bytes);
    return;
  }
#ifdef COURSE_HAVE_CUDA
  cuda_copy_bytes(dst, dst_device, src, src_device, bytes);
#else
  throw CourseError("copy_bytes: a CUDA buffer in a build without CUDA (a bug)");
#endif
}

void synchronize(Device device) {
#ifdef COURSE_HAVE_CUDA
  if (device == Device::CUDA) cuda_synchronize();
#else
  (void)device;
#endif
}

}  // namespace course
