#include "common/device.h"

#include "common/error.h"

namespace course {

#ifdef COURSE_HAVE_CUDA
int cuda_probe_device_count(std::string* why);  // common/cuda/probe.cu
bool built_with_cuda() { return true; }
int cuda_device_count(std::string* why) { return cuda_probe_device_count(why); }
#else
bool built_with_cuda() { return false; }
int cuda_device_count(std::string* why) {
  if (why != nullptr) *why = "built without CUDA";
  return 0;
}
#endif

Device select_device(const std::string& name) {
  if (name == "cpu") return Device::CPU;
  if (name != "cuda") throw UsageError("--device must be cpu or cuda, got '" + name + "'");
  if (!built_with_cuda()) {
    throw UsageError("--device cuda: this build has no CUDA backend (built without CUDA; hint: install the " +
                     std::string("CUDA toolkit and configure with the `cuda` preset, or use --device cpu)"));
  }
  std::string why;
  if (cuda_device_count(&why) == 0) {
    throw UsageError("--device cuda: no GPU found (" + why + "; hint: use --device cpu)");
  }
  throw UsageError("--device cuda: the CUDA ops are not part of this version of the course yet " +
                   std::string("(they arrive with the CUDA backend; hint: use --device cpu)"));
}

}  // namespace course
