// The CPU emulation's scheduler (see emu.h): a launch runs its blocks one after another and a
// block's threads as fibers on the calling thread. A fiber runs until it reaches __syncthreads,
// a warp shuffle or its end; a barrier opens when every live thread of the block (of the warp,
// for a shuffle) has reached it, in one of two schedules (run_block). A block where live threads
// wait at different barriers can never finish: that is reported and the process stops, as a hung
// kernel would need stopping. Static shared memory is filled with 0xff bytes per block
// (fresh_shared), the dynamic one before each block.
#include <ucontext.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <unordered_map>
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
  uint64_t block_serial = 0;  // counts blocks run, from 1
  std::unordered_map<void*, uint64_t> shared_filled;  // static __shared__ -> the block that last filled it
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

// Opens warp w's shuffle barrier if every live lane of it waits there.
bool open_warp(unsigned w, unsigned threads) {
  Machine& m = machine();
  bool all = true, any = false;
  for (unsigned t = w * 32; t < threads && t < (w + 1) * 32; ++t) {
    const State s = m.fibers[t].state;
    if (s == State::kDone) continue;
    any = true;
    all = all && s == State::kAtWarpBarrier;
  }
  if (!any || !all) return false;
  for (unsigned t = w * 32; t < threads && t < (w + 1) * 32; ++t)
    if (m.fibers[t].state == State::kAtWarpBarrier) m.fibers[t].state = State::kRunnable;
  return true;
}

// Opens the block barrier if every live thread waits there.
bool open_block(unsigned threads) {
  Machine& m = machine();
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

// Runs the runnable threads of [first, last) once each, in order; false if none was runnable.
bool run_threads(unsigned first, unsigned last) {
  Machine& m = machine();
  bool ran = false;
  for (unsigned t = first; t < last && !m.trapped; ++t) {
    if (m.fibers[t].state != State::kRunnable) continue;
    m.current = static_cast<int>(t);
    swapcontext(&m.scheduler, &m.fibers[t].context);
    ran = true;
  }
  return ran;
}

// Two schedules (SWIFTKERN_EMULATED_SCHEDULE, read per launch):
//   "lockstep" (default): every thread runs to its next barrier before any barrier opens;
//   "warps": one warp at a time, the last first, each as far as it can go (its shuffles open as
//     soon as its lanes arrive) before the next starts: a warp gets ahead of the others up to
//     the block barrier, so shared memory one warp rewrites before another has read it (a missing
//     __syncthreads) changes the result.
void run_block(unsigned threads, bool by_warps) {
  Machine& m = machine();
  const dim3 size = m.block_size;
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = m.fibers[t];
    if (!f.stack) f.stack.reset(new char[kStackBytes]);
    f.index = dim3(t % size.x, (t / size.x) % size.y, t / (size.x * size.y));
    f.state = State::kRunnable;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &m.scheduler;
    makecontext(&f.context, fiber_main, 0);
  }
  const unsigned warps = (threads + 31) / 32;
  for (;;) {
    bool progress = false;
    if (by_warps) {
      for (unsigned w = warps; w-- > 0 && !m.trapped;)
        while (run_threads(w * 32, std::min(threads, (w + 1) * 32)) || open_warp(w, threads)) progress = true;
    } else {
      progress = run_threads(0, threads);
      for (unsigned w = 0; w < warps; ++w) progress = open_warp(w, threads) || progress;
    }
    if (m.trapped) return;
    bool live = false;
    for (unsigned t = 0; t < threads; ++t) live = live || m.fibers[t].state != State::kDone;
    if (!live) return;
    if (open_block(threads) || progress) continue;
    std::fprintf(stderr, "emu: block (%u, %u, %u) hangs: its live threads wait at different barriers\n",
                 m.block_index.x, m.block_index.y, m.block_index.z);
    std::abort();
  }
}

}  // namespace

const dim3& thread_idx() { return me().index; }
const dim3& block_idx() { return machine().block_index; }
const dim3& block_dim() { return machine().block_size; }
const dim3& grid_dim() { return machine().grid_size; }
void* dynamic_shared() { return machine().shared_memory.data(); }

void fresh_shared(void* p, size_t bytes) {
  Machine& m = machine();
  uint64_t& filled = m.shared_filled[p];
  if (filled == m.block_serial) return;
  filled = m.block_serial;
  std::memset(p, 0xff, bytes);  // NaN as a float or double, -1 as an integer
}
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

StreamWork& stream_work() {
  static StreamWork work;
  return work;
}

void Launch::run(void (*body)(void*), void* context) const {
  Machine& m = machine();
  ++stream_work().kernels;
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (threads == 0 || threads > kMaxThreads || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.y > 65535 || grid.z > 65535 || shared_bytes > 227 * 1024) {
    m.last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (m.fibers.size() < threads) m.fibers.resize(kMaxThreads);
  m.shared_memory.assign(shared_bytes, 0xff);  // and again before each block: a kernel must write before it reads
  m.body = body;
  m.context = context;
  m.block_size = block;
  m.grid_size = grid;
  m.trapped = false;
  const char* schedule = std::getenv("SWIFTKERN_EMULATED_SCHEDULE");
  const bool by_warps = schedule != nullptr && std::strcmp(schedule, "warps") == 0;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        m.block_index = dim3(x, y, z);
        ++m.block_serial;
        std::fill(m.shared_memory.begin(), m.shared_memory.end(), 0xff);
        run_block(static_cast<unsigned>(threads), by_warps);
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
  ++::emu::stream_work().memsets;
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
