// The guarded device: a GPU's rules, enforced on the CPU (`--device guarded`).
//
// On a GPU, host code cannot read or write device memory: `params.data()[0]` in a
// chapter compiles, and then reads garbage or crashes, on a GPU the course's CI
// never sees. The guarded device makes that mistake crash on every machine. Its
// ops are the CPU's, but its buffers live in one arena whose pages are mapped
// PROT_NONE (no access) except while a device op or an explicit copy (copy_bytes)
// runs. A chapter that touches a device buffer from the host dies with SIGSEGV in
// the tests; one that runs on the guarded device computes exactly what the CPU
// does, through the code path a GPU takes (device buffers, ops through
// ops_for(device), communication staged through host memory, copies where the host
// needs a value).
//
// The arena is opened for the process, not for one thread: while the comm thread
// copies a staged buffer, a host access on the training thread goes unnoticed. The
// windows are short (one op, one copy), so a stray access is caught on most steps.
//
// A test device: it is slower than the CPU (two mprotect calls per op), and it
// holds 16 GiB of address space (reserved, not used).
#pragma once

#include <cstddef>

namespace course::guarded {

// `bytes` of arena memory, zeroed, page-aligned (CourseError when the arena is full).
void* allocate(size_t bytes);
void release(void* pointer);
// Whether `pointer` is in the arena (the staging Comm asks, to know what to copy).
bool contains(const void* pointer);

// While one of these lives (on any thread), the arena is readable and writable.
class Open {
 public:
  Open();
  ~Open();
  Open(const Open&) = delete;
  Open& operator=(const Open&) = delete;
};

// A CPU op as the guarded device's: the CPU's function, with the arena open while it
// runs. An op table lists Op<&cpu_function>::run (common/tensor/ops_table.cpp, and
// chapter 06's own table of its ops, 06_tensor_parallel/tp_ops.cpp).
template <auto cpu_op>
struct Op;
template <typename Result, typename... Args, Result (*cpu_op)(Args...)>
struct Op<cpu_op> {
  static Result run(Args... args) {
    Open open;
    return cpu_op(args...);
  }
};

}  // namespace course::guarded
