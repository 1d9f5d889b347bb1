#include "common/tensor/guarded_device.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string>

#include "common/tensor/error.h"

namespace course::guarded {

namespace {

constexpr size_t kArenaBytes = size_t{16} << 30;  // address space reserved; pages are used as allocated
constexpr size_t kPage = 4096;

struct Arena {
  std::mutex mutex;
  char* base = nullptr;
  size_t high_water = 0;                 // bytes handed out at least once: the span mprotect covers
  std::map<size_t, size_t> free_blocks;  // offset -> bytes, below high_water
  std::map<size_t, size_t> used_blocks;  // offset -> bytes
  int open_count = 0;                    // Open objects alive, on all threads
};

Arena& arena() {
  static Arena instance;
  return instance;
}

void protect(char* first, size_t bytes, bool open) {
  if (bytes == 0) return;
  if (mprotect(first, bytes, open ? PROT_READ | PROT_WRITE : PROT_NONE) != 0) {
    throw CourseError(std::string("guarded device: mprotect failed: ") + std::strerror(errno));
  }
}

// A fault inside the arena is the mistake the guarded device exists to catch: say so
// before dying of it (write(2) is safe in a signal handler; printf is not).
void on_segfault(int signal, siginfo_t* info, void*) {
  const Arena& a = arena();
  const char* address = static_cast<const char*>(info->si_addr);
  if (a.base != nullptr && address >= a.base && address < a.base + kArenaBytes) {
    const char message[] =
        "guarded device: host code touched a device buffer (a GPU run would read garbage or crash here; "
        "hint: go through ops_for(device) or copy_bytes; gdb's backtrace names the line)\n";
    (void)!write(STDERR_FILENO, message, sizeof(message) - 1);
  }
  ::signal(signal, SIG_DFL);  // the fault repeats on return, now with the default action
}

void reserve(Arena& a) {
  void* base = mmap(nullptr, kArenaBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    throw CourseError(std::string("guarded device: reserving its arena failed: ") + std::strerror(errno) +
                      " (hint: use --device cpu)");
  }
  a.base = static_cast<char*>(base);
  struct sigaction action {};
  action.sa_sigaction = on_segfault;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, nullptr);
}

// First fit among the freed blocks, else new pages at the high-water mark.
size_t take_block(Arena& a, size_t bytes) {
  for (auto it = a.free_blocks.begin(); it != a.free_blocks.end(); ++it) {
    if (it->second < bytes) continue;
    const size_t offset = it->first, rest = it->second - bytes;
    a.free_blocks.erase(it);
    if (rest > 0) a.free_blocks[offset + bytes] = rest;
    return offset;
  }
  if (a.high_water + bytes > kArenaBytes) {
    throw CourseError("guarded device: its 16 GiB arena is full (hint: a smaller model, or --device cpu)");
  }
  const size_t offset = a.high_water;
  a.high_water += bytes;
  protect(a.base + offset, bytes, a.open_count > 0);  // new pages follow the arena's state
  return offset;
}

}  // namespace

void* allocate(size_t bytes) {
  bytes = (bytes + kPage - 1) / kPage * kPage;
  Arena& a = arena();
  char* block = nullptr;
  {
    std::lock_guard<std::mutex> lock(a.mutex);
    if (a.base == nullptr) reserve(a);
    const size_t offset = take_block(a, bytes);
    a.used_blocks[offset] = bytes;
    block = a.base + offset;
  }
  Open open;
  std::memset(block, 0, bytes);
  return block;
}

void release(void* pointer) {
  Arena& a = arena();
  std::lock_guard<std::mutex> lock(a.mutex);
  const size_t offset = static_cast<size_t>(static_cast<char*>(pointer) - a.base);
  auto used = a.used_blocks.find(offset);
  if (used == a.used_blocks.end()) return;
  size_t first = offset, bytes = used->second;
  a.used_blocks.erase(used);
  // merge with the free neighbours, so the arena does not splinter
  auto next = a.free_blocks.find(first + bytes);
  if (next != a.free_blocks.end()) {
    bytes += next->second;
    a.free_blocks.erase(next);
  }
  auto previous = a.free_blocks.lower_bound(first);
  if (previous != a.free_blocks.begin() && std::prev(previous)->first + std::prev(previous)->second == first) {
    --previous;
    first = previous->first;
    bytes += previous->second;
    a.free_blocks.erase(previous);
  }
  a.free_blocks[first] = bytes;
}

bool contains(const void* pointer) {
  const Arena& a = arena();
  const char* address = static_cast<const char*>(pointer);
  return a.base != nullptr && address >= a.base && address < a.base + kArenaBytes;
}

Open::Open() {
  Arena& a = arena();
  std::lock_guard<std::mutex> lock(a.mutex);
  if (a.open_count++ == 0) protect(a.base, a.high_water, true);
}

Open::~Open() {
  Arena& a = arena();
  std::lock_guard<std::mutex> lock(a.mutex);
  if (--a.open_count == 0) {
    try {
      protect(a.base, a.high_water, false);
    } catch (const CourseError&) {
      // a destructor cannot throw; the arena stays open, which only weakens the check
    }
  }
}

}  // namespace course::guarded
