// Asks the CUDA runtime how many GPUs this process can see. Compiled only in CUDA
// builds; it is what lets --device cuda tell "no GPU here" from "no CUDA build".
#include <cuda_runtime.h>

#include <string>

namespace course {

int cuda_probe_device_count(std::string* why) {
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    if (why != nullptr) *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(status);
    return 0;
  }
  if (count == 0 && why != nullptr) *why = "the CUDA driver reports 0 devices";
  return count;
}

}  // namespace course
