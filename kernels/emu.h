// emu.h — a small host emulation of the CUDA execution model, so the kernels' own source runs on CPU.
//
// What: the subset of CUDA that kernels/*.cu use, in plain C++17 for g++/clang: blocks run one after
// another; the threads of a block are real std::threads; __syncthreads is a barrier of the block;
// __shared__ is a function-local `static` (shared by the block's threads, reused by the next block);
// dynamic shared memory is one per-launch buffer; warp shuffles/votes go through a per-warp exchange
// (each lane writes its value, a warp barrier, each lane reads its source lane, a second barrier);
// atomics are compare-and-swap loops on the bit pattern; bf16/f16 are 16-bit structs with
// round-to-nearest-even conversions (NaN kept quiet).
// Reference: CUDA C++ Programming Guide (thread hierarchy, warp shuffle and vote functions, atomics).
// The non-obvious decision: one global mutex serialises launches, because `static` __shared__ storage
// is one per kernel function, not one per launch; blocks then never overlap, and a barrier between
// blocks keeps a fast thread from starting block b+1 while a slow one still reads block b's shared data.
// A barrier that waits longer than HARPE_EMU_TIMEOUT_S seconds (default 60) aborts with a message
// (threads that skip a __syncthreads, divergent warps) instead of hanging the test.
// What it does not do: model timing, memory coalescing, bank conflicts, warp divergence semantics
// beyond "all lanes of a warp call the shuffle", cooperative groups, or race detection (use
// compute-sanitizer racecheck on a GPU for that).
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3() = default;
  dim3(unsigned a, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

namespace emu {

// A reusable barrier (generation counter) with a deadlock timeout.
class Barrier {
 public:
  explicit Barrier(unsigned n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lk(m_);
    unsigned gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    static const long timeout_s = [] {
      const char* e = std::getenv("HARPE_EMU_TIMEOUT_S");
      return e ? std::atol(e) : 60L;
    }();
    if (!cv_.wait_for(lk, std::chrono::seconds(timeout_s), [&] { return gen_ != gen; })) {
      std::fprintf(stderr,
                   "emu: barrier of %u threads timed out with %u waiting: a thread skipped a "
                   "__syncthreads or a warp collective (divergent control flow in the kernel)\n",
                   n_, count_);
      std::abort();
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  unsigned n_, count_ = 0, gen_ = 0;
};

struct Warp {
  explicit Warp(unsigned size) : size(size), bar(size) {}
  unsigned size;
  Barrier bar;
  uint64_t slot[32] = {};
};

// Per-thread view of where it is in the launch.
struct Ctx {
  uint3 thread{0, 0, 0}, block{0, 0, 0};
  dim3 block_dim, grid_dim;
  unsigned lane = 0;
  Barrier* block_bar = nullptr;
  Warp* warp = nullptr;
  unsigned char* dyn_smem = nullptr;
};
inline thread_local Ctx ctx;

inline std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

// Run `body` as a kernel over grid x block with `smem` bytes of dynamic shared memory.
template <class F>
void launch(dim3 grid, dim3 block, size_t smem, F body) {
  std::lock_guard<std::mutex> guard(launch_mutex());
  const unsigned nt = block.x * block.y * block.z;
  if (nt == 0 || nt > 1024) {
    std::fprintf(stderr, "emu: block of %u threads (CUDA allows 1..1024)\n", nt);
    std::abort();
  }
  Barrier bar(nt);
  std::vector<Warp*> warps;
  for (unsigned w = 0; w * 32 < nt; ++w) warps.push_back(new Warp(nt - w * 32 < 32 ? nt - w * 32 : 32));
  std::vector<unsigned char> dyn(smem + 16);
  std::vector<std::thread> threads;
  threads.reserve(nt);
  for (unsigned t = 0; t < nt; ++t) {
    threads.emplace_back([&, t] {
      ctx.thread = uint3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
      ctx.block_dim = block;
      ctx.grid_dim = grid;
      ctx.lane = t % 32;
      ctx.block_bar = &bar;
      ctx.warp = warps[t / 32];
      ctx.dyn_smem = dyn.data();
      for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
          for (unsigned bx = 0; bx < grid.x; ++bx) {
            ctx.block = uint3{bx, by, bz};
            body();
            bar.wait();  // the block is done before any thread starts the next one
          }
    });
  }
  for (auto& th : threads) th.join();
  for (auto* w : warps) delete w;
}

template <class T>
T exchange(T v, int src_lane) {
  static_assert(sizeof(T) <= 8, "warp exchange of at most 8 bytes");
  Warp& w = *ctx.warp;
  std::memcpy(&w.slot[ctx.lane], &v, sizeof(T));
  w.bar.wait();
  T r = v;
  if (src_lane >= 0 && static_cast<unsigned>(src_lane) < w.size) std::memcpy(&r, &w.slot[src_lane], sizeof(T));
  w.bar.wait();
  return r;
}

template <class T>
T atomic_rmw(T* addr, T val, T (*op)(T, T)) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomics on 4 or 8 bytes");
  using U = typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type;
  U* p = reinterpret_cast<U*>(addr);
  U old_bits = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  for (;;) {
    T old;
    std::memcpy(&old, &old_bits, sizeof(T));
    T nv = op(old, val);
    U new_bits;
    std::memcpy(&new_bits, &nv, sizeof(T));
    if (__atomic_compare_exchange_n(p, &old_bits, new_bits, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return old;
  }
}

}  // namespace emu

// The CUDA built-in variables, per emulated thread.
#define threadIdx (emu::ctx.thread)
#define blockIdx (emu::ctx.block)
#define blockDim (emu::ctx.block_dim)
#define gridDim (emu::ctx.grid_dim)
#define warpSize 32

inline void __syncthreads() { emu::ctx.block_bar->wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::ctx.warp->bar.wait(); }
template <class T>
T __shfl_sync(unsigned, T v, int src) {
  return emu::exchange(v, src);
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int mask) {
  return emu::exchange(v, static_cast<int>(emu::ctx.lane) ^ mask);
}
template <class T>
T __shfl_down_sync(unsigned, T v, unsigned delta) {
  return emu::exchange(v, static_cast<int>(emu::ctx.lane + delta));
}
inline unsigned __ballot_sync(unsigned, int pred) {
  emu::Warp& w = *emu::ctx.warp;
  w.slot[emu::ctx.lane] = pred ? 1 : 0;
  w.bar.wait();
  unsigned r = 0;
  for (unsigned l = 0; l < w.size; ++l) r |= static_cast<unsigned>(w.slot[l]) << l;
  w.bar.wait();
  return r;
}
inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }
inline int __all_sync(unsigned m, int pred) {
  unsigned b = __ballot_sync(m, pred);
  unsigned full = emu::ctx.warp->size == 32 ? 0xffffffffu : ((1u << emu::ctx.warp->size) - 1);
  return b == full;
}

inline float atomicAdd(float* a, float v) {
  return emu::atomic_rmw<float>(a, v, [](float x, float y) { return x + y; });
}
inline double atomicAdd(double* a, double v) {
  return emu::atomic_rmw<double>(a, v, [](double x, double y) { return x + y; });
}
inline unsigned atomicAdd(unsigned* a, unsigned v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
inline float atomicMax(float* a, float v) {
  return emu::atomic_rmw<float>(a, v, [](float x, float y) { return x > y ? x : y; });
}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }

// bf16 and f16 storage types with round-to-nearest-even conversions.
struct __nv_bfloat16 {
  uint16_t x;
};
inline float __bfloat162float(__nv_bfloat16 h) {
  uint32_t u = static_cast<uint32_t>(h.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}

struct __half {
  uint16_t x;
};
inline float __half2float(__half h) {
  uint32_t sign = (h.x & 0x8000u) << 16, exp = (h.x >> 10) & 0x1f, man = h.x & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __half __float2half(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  float a = std::fabs(f);
  if (std::isnan(f)) return __half{static_cast<uint16_t>(sign | 0x7e00u)};
  if (a >= 65520.0f) return __half{static_cast<uint16_t>(sign | 0x7c00u)};
  if (a < 6.103515625e-05f) {  // subnormal half: a multiple of 2^-24, rounded to nearest even
    float q = std::nearbyint(a * 16777216.0f);
    return __half{static_cast<uint16_t>(sign | static_cast<uint16_t>(q))};
  }
  uint32_t au;
  std::memcpy(&au, &a, 4);
  au += 0xfffu + ((au >> 13) & 1u);
  uint32_t exp = (au >> 23) - 112, man = (au >> 13) & 0x3ffu;
  return __half{static_cast<uint16_t>(sign | (exp << 10) | man)};
}

// Host entry point for one kernel: `extern "C" void emu_NAME(dim3 grid, dim3 block, size_t smem, PARAMS)`.
#define EMU_ENTRY(name, params, args)                                                  \
  extern "C" void emu_##name(unsigned gx, unsigned bx, size_t smem, EMU_UNPAREN params) { \
    emu::launch(dim3(gx), dim3(bx), smem, [&] { name args; });                          \
  }
#define EMU_UNPAREN(...) __VA_ARGS__
#define DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(emu::ctx.dyn_smem)
