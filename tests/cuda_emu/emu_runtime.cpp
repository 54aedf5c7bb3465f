// The CPU emulation's scheduler (see emu.h): a launch runs its blocks one after another and a
// block's threads as fibers on the calling thread. A fiber runs until it reaches __syncthreads,
// a warp shuffle or its end; a barrier opens when every live thread of the block (of the warp,
// for a shuffle) has reached it. A block where live threads wait at different barriers can never
// finish: that is reported and the process stops, as a hung kernel would need stopping.
#include <ucontext.h>

#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <vector>

#include "emu.h"

namespace emu {
namespace {

enum class State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone };

constexpr size_t kStackBytes = 256 * 1024;  // pages are touched only as used
constexpr unsigned kMaxThreads = 1024;

struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  dim3 index;
  State state = State::kDone;
  uint64_t published = 0;  // the value a warp shuffle publishes
  int exchange_phase = 0;  // 1: published, waiting for the warp; 2: read, waiting again
};

struct Machine {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = -1;
  dim3 block_index, block_size, grid_size;
  std::vector<unsigned char> shared_memory;
  void (*body)(void*) = nullptr;
  void* context = nullptr;
  bool trapped = false;
  cudaError_t last_error = cudaSuccess;
};

Machine& machine() {
  static Machine m;
  return m;
}

Fiber& me() { return machine().fibers[machine().current]; }

void fiber_main() {
  Machine& m = machine();
  m.body(m.context);
  me().state = State::kDone;  // uc_link returns to the scheduler
}

void wait(State at) {
  Machine& m = machine();
  me().state = at;
  swapcontext(&me().context, &m.scheduler);
}

// Opens the barriers every live thread waiting on has reached; false when none can open.
bool open_barriers(unsigned threads) {
  Machine& m = machine();
  bool opened = false;
  for (unsigned w = 0; w * 32 < threads; ++w) {  // a warp whose live lanes all wait at a shuffle
    bool all = true, any = false;
    for (unsigned t = w * 32; t < threads && t < (w + 1) * 32; ++t) {
      const State s = m.fibers[t].state;
      if (s == State::kDone) continue;
      any = true;
      all = all && s == State::kAtWarpBarrier;
    }
    if (!any || !all) continue;
    for (unsigned t = w * 32; t < threads && t < (w + 1) * 32; ++t)
      if (m.fibers[t].state == State::kAtWarpBarrier) m.fibers[t].state = State::kRunnable;
    opened = true;
  }
  if (opened) return true;
  bool all = true, any = false;
  for (unsigned t = 0; t < threads; ++t) {
    const State s = m.fibers[t].state;
    if (s == State::kDone) continue;
    any = true;
    all = all && s == State::kAtBlockBarrier;
  }
  if (!any || !all) return false;
  for (unsigned t = 0; t < threads; ++t)
    if (m.fibers[t].state == State::kAtBlockBarrier) m.fibers[t].state = State::kRunnable;
  return true;
}

void run_block(unsigned threads) {
  Machine& m = machine();
  const dim3 size = m.block_size;
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = m.fibers[t];
    if (!f.stack) f.stack.reset(new char[kStackBytes]);
    f.index = dim3(t % size.x, (t / size.x) % size.y, t / (size.x * size.y));
    f.state = State::kRunnable;
    f.exchange_phase = 0;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &m.scheduler;
    makecontext(&f.context, fiber_main, 0);
  }
  for (;;) {
    bool ran = false;
    for (unsigned t = 0; t < threads && !m.trapped; ++t) {
      if (m.fibers[t].state != State::kRunnable) continue;
      m.current = static_cast<int>(t);
      swapcontext(&m.scheduler, &m.fibers[t].context);
      ran = true;
    }
    if (m.trapped) return;
    bool live = false;
    for (unsigned t = 0; t < threads; ++t) live = live || m.fibers[t].state != State::kDone;
    if (!live) return;
    if (!open_barriers(threads) && !ran) {
      std::fprintf(stderr, "emu: block (%u, %u, %u) hangs: its live threads wait at different barriers\n",
                   m.block_index.x, m.block_index.y, m.block_index.z);
      std::abort();
    }
  }
}

}  // namespace

const dim3& thread_idx() { return me().index; }
const dim3& block_idx() { return machine().block_index; }
const dim3& block_dim() { return machine().block_size; }
const dim3& grid_dim() { return machine().grid_size; }
void* dynamic_shared() { return machine().shared_memory.data(); }
void sync_block() { wait(State::kAtBlockBarrier); }

uint64_t warp_exchange(uint64_t bits, int src) {
  Machine& m = machine();
  const int self = machine().current, first = self - self % 32;
  me().published = bits;
  wait(State::kAtWarpBarrier);  // every live lane has published
  const int from = first + src;
  const bool readable = src >= 0 && src < 32 && static_cast<unsigned>(from) < m.fibers.size() &&
                        from < static_cast<int>(m.block_size.x * m.block_size.y * m.block_size.z) &&
                        m.fibers[from].state != State::kDone;
  const uint64_t got = readable ? m.fibers[from].published : bits;
  wait(State::kAtWarpBarrier);  // every live lane has read before anyone publishes again
  return got;
}

void trap() {
  std::fflush(stdout);  // the kernel's message first, as CUDA's printf buffer would show it
  Machine& m = machine();
  m.trapped = true;
  me().state = State::kDone;
  swapcontext(&me().context, &m.scheduler);
  std::abort();  // never resumed
}

void Launch::run(void (*body)(void*), void* context) const {
  Machine& m = machine();
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (threads == 0 || threads > kMaxThreads || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.y > 65535 || grid.z > 65535 || shared_bytes > 227 * 1024) {
    m.last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (m.fibers.size() < threads) m.fibers.resize(kMaxThreads);
  m.shared_memory.assign(shared_bytes, 0xcd);  // not zero: a kernel must write before it reads
  m.body = body;
  m.context = context;
  m.block_size = block;
  m.grid_size = grid;
  m.trapped = false;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        m.block_index = dim3(x, y, z);
        run_block(static_cast<unsigned>(threads));
        if (m.trapped) {
          m.last_error = cudaErrorLaunchFailure;
          return;
        }
      }
}

}  // namespace emu

cudaError_t cudaGetLastError() {
  const cudaError_t err = emu::machine().last_error;
  emu::machine().last_error = cudaSuccess;
  return err;
}

const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t) {
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  if (attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  const char* sms = std::getenv("SWIFTKERN_EMULATED_SMS");
  *value = sms != nullptr ? std::atoi(sms) : 132;
  return cudaSuccess;
}
