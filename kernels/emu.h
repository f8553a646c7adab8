// emu.h — a small host emulation of the CUDA execution model, so the kernels' own source runs on CPU.
//
// What: the subset of CUDA that kernels/*.cu use, in plain C++17 for g++/clang: blocks run one after
// another; the threads of a block are real std::threads; __syncthreads is a barrier of the block;
// __shared__ is a function-local `static` (shared by the block's threads, reused by the next block);
// dynamic shared memory is one per-launch buffer; warp shuffles/votes go through a per-warp exchange
// (each lane writes its value, a warp barrier, each lane reads its source lane, a second barrier);
// atomics are compare-and-swap loops on the bit pattern; bf16/f16 are 16-bit structs with
// round-to-nearest-even conversions (NaN kept quiet); the tensor-core instructions of kernels/mma.cuh
// (mma_16816, ldmatrix_x{2,4}[_trans], copy16) are twins that reproduce the PTX ISA's per-lane fragment
// layouts: each lane publishes its registers (or row address) to the warp, one barrier, then computes
// its own output lanes from the table (products and sums in f32, k in order).
// Reference: CUDA C++ Programming Guide (thread hierarchy, warp shuffle and vote functions, atomics).
// The non-obvious decision: one global mutex serialises launches, because `static` __shared__ storage
// is one per kernel function, not one per launch; blocks then never overlap, and a barrier between
// blocks keeps a fast thread from starting block b+1 while a slow one still reads block b's shared data.
// A barrier that waits longer than HARPE_EMU_TIMEOUT_S seconds (default 60) aborts with a message
// (threads that skip a __syncthreads, divergent warps) instead of hanging the test.
// cp.async (cp_async16 / cp_async_commit / cp_async_wait<N>) keeps each lane's copies in commit groups: the
// destination holds poison (0xff bytes, NaN) until the lane's wait completes the group, so a kernel that
// reads before its wait fails its tests. Measuring (emu_profile_enable): per launch and kernel name, global
// traffic in 32-byte sectors beside the bytes asked for, shared-memory wavefronts and bank conflicts per warp
// instruction, barriers, atomics, mma — for the accesses routed through copy16, cp_async16, ldmatrix and the
// gld/gst/sld/sst accessors (`harpe::ops::emu::profile` says how a warp instruction is recognised).
// What it does not do: model timing or caches, warp divergence semantics beyond "all lanes of a warp call
// the shuffle", cooperative groups, or race detection (use compute-sanitizer racecheck on a GPU for that).
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
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

// ---- Measuring (off unless emu_profile_enable(1)): what a launch does to memory, counted per warp instruction.
// One launch's counts (`harpe::ops::emu::profile::Profile` on the Rust side: same fields, same order).
struct Profile {
  unsigned long long launches, global_instr, global_sectors, useful_bytes, shared_instr, shared_wavefronts,
      bank_conflicts, barriers, atomics, mma, cp_async;
};
inline bool& profiling() {
  static bool on = false;
  return on;
}
// One lane's part of a memory instruction.
struct Access {
  uint64_t addr;
  uint32_t bytes, lane;
};
// A warp's memory instructions of the current block: the lanes' accesses keyed by (call site, the lane's n-th
// execution of that site), so one key is one warp instruction as long as the lanes run the site in step.
struct WarpLog {
  std::mutex m;
  std::map<std::pair<unsigned, uint64_t>, std::vector<Access>> global, shared;
};

struct Warp {
  explicit Warp(unsigned size) : size(size), bar(size) {}
  unsigned size;
  Barrier bar;
  uint64_t slot[32] = {};
  uint32_t frag[2][32][8] = {};  // the tensor-core twins' exchange, double-buffered (one barrier per call)
  WarpLog log;
};

// A cp.async copy not yet completed: its 16 bytes (read at issue) and where they go.
struct PendingCopy {
  void* dst;
  unsigned char data[16];
};

// Per-thread view of where it is in the launch.
struct Ctx {
  uint3 thread{0, 0, 0}, block{0, 0, 0};
  dim3 block_dim, grid_dim;
  unsigned lane = 0;
  Barrier* block_bar = nullptr;
  Warp* warp = nullptr;
  unsigned char* dyn_smem = nullptr;
  unsigned frag_parity = 0;  // which half of Warp::frag this lane's next gather uses
  std::map<unsigned, uint64_t> site_count;          // per call site, how often this lane ran it (this block)
  std::vector<PendingCopy> cp_open;                 // cp.async copies since the last commit
  std::vector<std::vector<PendingCopy>> cp_groups;  // committed groups, oldest first
  Profile* prof = nullptr;                          // this launch's counts (null: not measuring)
};
inline thread_local Ctx ctx;

inline std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

// The measured launches, by kernel name (summed over launches until reset).
inline std::map<std::string, Profile>& profiles() {
  static std::map<std::string, Profile> p;
  return p;
}

// Add `n` to one count of the launch's Profile: lane 0 of every warp counts, and warps run concurrently.
inline void count(unsigned long long& field, unsigned long long n) { __atomic_fetch_add(&field, n, __ATOMIC_RELAXED); }

// Record one lane's access at `site` into its warp's log (global or shared).
inline void log_access(bool global, const void* p, unsigned bytes, unsigned site) {
  if (!ctx.prof) return;
  const uint64_t k = ctx.site_count[site]++;
  WarpLog& w = ctx.warp->log;
  std::lock_guard<std::mutex> g(w.m);
  (global ? w.global : w.shared)[{site, k}].push_back(Access{reinterpret_cast<uint64_t>(p), bytes, ctx.lane});
}

// Shared-memory wavefronts of one warp instruction: lanes are served in phases of 128 bytes (32 lanes of 4
// bytes, 16 of 8, 8 of 16); within a phase each of the 32 banks (4-byte words, bank = word % 32) serves one
// distinct word per wavefront, so a phase takes as many wavefronts as its busiest bank has distinct words.
inline unsigned long long wavefronts(const std::vector<Access>& acc) {
  unsigned bytes = 4;
  for (const Access& a : acc) bytes = a.bytes > bytes ? a.bytes : bytes;
  const unsigned per_phase = 128 / bytes;
  std::map<unsigned, std::map<unsigned, std::vector<uint64_t>>> phase_bank_words;
  for (const Access& a : acc)
    for (uint64_t wd = a.addr / 4; wd < (a.addr + a.bytes + 3) / 4; ++wd) {
      auto& words = phase_bank_words[a.lane / per_phase][static_cast<unsigned>(wd % 32)];
      bool seen = false;
      for (uint64_t x : words) seen |= x == wd;
      if (!seen) words.push_back(wd);
    }
  unsigned long long total = 0;
  for (auto& ph : phase_bank_words) {
    size_t most = 1;
    for (auto& b : ph.second) most = b.second.size() > most ? b.second.size() : most;
    total += most;
  }
  return total;
}

// Fold a warp's log of the block just finished into the launch's counts: per global instruction the distinct
// 32-byte sectors and the bytes asked for, per shared instruction its wavefronts (conflicts = wavefronts -
// phases). The warps of a block fold concurrently, so every count is an atomic add (plain `+=` lost updates:
// the launch's totals came out a few per mille low, at random).
inline void flush_log(Warp& w, Profile& p) {
  std::lock_guard<std::mutex> g(w.log.m);
  for (auto& kv : w.log.global) {
    std::vector<uint64_t> sectors;
    for (const Access& a : kv.second) {
      count(p.useful_bytes, a.bytes);
      for (uint64_t sct = a.addr / 32; sct <= (a.addr + a.bytes - 1) / 32; ++sct) {
        bool seen = false;
        for (uint64_t x : sectors) seen |= x == sct;
        if (!seen) sectors.push_back(sct);
      }
    }
    count(p.global_sectors, sectors.size());
    count(p.global_instr, 1);
  }
  for (auto& kv : w.log.shared) {
    unsigned bytes = 4;
    unsigned lanes_max = 0;
    for (const Access& a : kv.second) {
      bytes = a.bytes > bytes ? a.bytes : bytes;
      lanes_max = a.lane > lanes_max ? a.lane : lanes_max;
    }
    std::map<unsigned, bool> phases;
    for (const Access& a : kv.second) phases[a.lane / (128 / bytes)] = true;
    const unsigned long long wf = wavefronts(kv.second);
    count(p.shared_instr, 1);
    count(p.shared_wavefronts, wf);
    count(p.bank_conflicts, wf - phases.size());
  }
  w.log.global.clear();
  w.log.shared.clear();
}

// Complete this lane's cp.async groups until at most `keep` are pending (cp.async.wait_group keep).
inline void cp_complete(size_t keep) {
  while (ctx.cp_groups.size() > keep) {
    for (PendingCopy& c : ctx.cp_groups.front()) std::memcpy(c.dst, c.data, 16);
    ctx.cp_groups.erase(ctx.cp_groups.begin());
  }
}

// Run `body` as a kernel over grid x block with `smem` bytes of dynamic shared memory.
template <class F>
void launch(const char* name, dim3 grid, dim3 block, size_t smem, F body) {
  std::lock_guard<std::mutex> guard(launch_mutex());
  Profile prof{};
  Profile* measure = profiling() ? &prof : nullptr;
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
      ctx.frag_parity = 0;
      ctx.prof = measure;
      for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
          for (unsigned bx = 0; bx < grid.x; ++bx) {
            ctx.block = uint3{bx, by, bz};
            ctx.site_count.clear();
            body();
            cp_complete(0);  // copies still in flight land before the block's shared memory is reused
            bar.wait();      // the block is done before any thread starts the next one
            if (measure) {
              if (ctx.lane == 0) flush_log(*ctx.warp, *measure);
              bar.wait();
            }
          }
      ctx.prof = nullptr;
    });
  }
  for (auto& th : threads) th.join();
  for (auto* w : warps) delete w;
  if (measure) {
    prof.launches = 1;
    Profile& acc = profiles()[name];
    unsigned long long* a = &acc.launches;
    const unsigned long long* b = &prof.launches;
    for (size_t i = 0; i < sizeof(Profile) / sizeof(unsigned long long); ++i) a[i] += b[i];
  }
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

// Every lane publishes `n` (<= 8) words; returns the warp's table [lane][word] once all lanes have.
// Double-buffered: a lane can only overwrite this buffer after the next gather's barrier, which every
// lane reaches only after it has finished reading this one — so one barrier per call suffices.
inline const uint32_t (*gather(const uint32_t* mine, int n))[8] {
  Warp& w = *ctx.warp;
  if (w.size != 32) {
    std::fprintf(stderr, "emu: mma/ldmatrix need a full warp of 32 lanes (this one has %u)\n", w.size);
    std::abort();
  }
  uint32_t(*buf)[8] = w.frag[ctx.frag_parity];
  ctx.frag_parity ^= 1u;
  for (int i = 0; i < n; ++i) buf[ctx.lane][i] = mine[i];
  w.bar.wait();
  return buf;
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

inline void __syncthreads() {
  if (emu::ctx.prof && emu::ctx.thread.x == 0 && emu::ctx.thread.y == 0 && emu::ctx.thread.z == 0)
    __atomic_fetch_add(&emu::ctx.prof->barriers, 1ull, __ATOMIC_RELAXED);
  emu::ctx.block_bar->wait();
}
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
  if (emu::ctx.prof) __atomic_fetch_add(&emu::ctx.prof->atomics, 1ull, __ATOMIC_RELAXED);
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
    emu::launch(#name, dim3(gx), dim3(bx), smem, [&] { name args; });                   \
  }
#define EMU_UNPAREN(...) __VA_ARGS__
#define DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(emu::ctx.dyn_smem)

// ---- Twins of kernels/mma.cuh (the tensor-core instructions), with the PTX ISA's per-lane layouts ----
// g = lane / 4, t = lane % 4. The element (row, col) of a fragment lives in lane 4 (row % 8) + (col % 8) / 2,
// register (A) (row >= 8) + 2 (col >= 8), (B, k x n) (k >= 8) at lane 4 n + (k % 8) / 2; half = col % 2
// (A) or k % 2 (B), the low 16 bits holding the even index. See kernels/mma.cuh for the layouts.
inline uint16_t bits16(__nv_bfloat16 v) { return v.x; }
inline uint16_t bits16(__half v) { return v.x; }
namespace emu {
inline float b16_to_f32(uint16_t b, const __nv_bfloat16*) { return __bfloat162float(__nv_bfloat16{b}); }
inline float b16_to_f32(uint16_t b, const __half*) { return __half2float(__half{b}); }
inline uint16_t half_of(uint32_t r, int hi) { return static_cast<uint16_t>(hi ? r >> 16 : r & 0xffffu); }

// The lane's row address, published as two words; returns the table of all lanes' addresses.
inline const uint32_t (*gather_addr(const void* row))[8] {
  uint64_t a = reinterpret_cast<uint64_t>(row);
  uint32_t w[2] = {static_cast<uint32_t>(a), static_cast<uint32_t>(a >> 32)};
  return gather(w, 2);
}
inline const uint16_t* addr_of(const uint32_t (*tab)[8], unsigned lane) {
  return reinterpret_cast<const uint16_t*>(static_cast<uint64_t>(tab[lane][0]) | static_cast<uint64_t>(tab[lane][1]) << 32);
}
// ldmatrix of `nmat` 8x8 b16 matrices; matrix i's rows come from lanes 8i..8i+7.
inline void ldmatrix(uint32_t* r, const void* row, int nmat, bool trans) {
  const uint32_t(*tab)[8] = gather_addr(row);
  const unsigned l = ctx.lane, g = l / 4, t = l % 4;
  if (ctx.prof && l == 0) {  // one instruction: matrix i's 8 rows of 16 bytes are one phase
    std::vector<Access> acc;
    for (unsigned i = 0; i < 8u * nmat; ++i)
      acc.push_back(Access{reinterpret_cast<uint64_t>(addr_of(tab, i)), 16, i});
    const unsigned long long wf = wavefronts(acc);
    count(ctx.prof->shared_instr, 1);
    count(ctx.prof->shared_wavefronts, wf);
    count(ctx.prof->bank_conflicts, wf - nmat);
  }
  for (int i = 0; i < nmat; ++i) {
    uint16_t lo, hi;
    if (!trans) {
      const uint16_t* p = addr_of(tab, 8 * i + g);
      lo = p[2 * t];
      hi = p[2 * t + 1];
    } else {
      lo = addr_of(tab, 8 * i + 2 * t)[g];
      hi = addr_of(tab, 8 * i + 2 * t + 1)[g];
    }
    r[i] = static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
  }
}
}  // namespace emu

inline void ldmatrix_x4(uint32_t* r, const void* row) { emu::ldmatrix(r, row, 4, false); }
inline void ldmatrix_x4_trans(uint32_t* r, const void* row) { emu::ldmatrix(r, row, 4, true); }
inline void ldmatrix_x2(uint32_t* r, const void* row) { emu::ldmatrix(r, row, 2, false); }
inline void ldmatrix_x2_trans(uint32_t* r, const void* row) { emu::ldmatrix(r, row, 2, true); }

// D (16x8 f32) += A (16x16) B (16x8), inputs of type T (bf16 or f16): products and sums in f32, k in order.
template <class T>
inline void mma_16816(float* d, const uint32_t* a, const uint32_t* b) {
  uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  const uint32_t(*tab)[8] = emu::gather(mine, 6);
  const unsigned l = emu::ctx.lane, g = l / 4, t = l % 4;
  if (emu::ctx.prof && l == 0) emu::count(emu::ctx.prof->mma, 1);
  const T* tag = nullptr;
  for (int e = 0; e < 4; ++e) {
    const unsigned row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
    float acc = 0.0f;
    for (unsigned k = 0; k < 16; ++k) {
      const uint32_t ar = tab[4 * (row % 8) + (k % 8) / 2][(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
      const uint32_t br = tab[4 * col + (k % 8) / 2][4 + (k >= 8 ? 1 : 0)];
      acc = std::fma(emu::b16_to_f32(emu::half_of(ar, k % 2), tag), emu::b16_to_f32(emu::half_of(br, k % 2), tag), acc);
    }
    d[e] += acc;
  }
}

// 16 bytes from `src` (global) to `dst` (shared): one 16-byte load and one 16-byte shared store per lane.
inline void copy16(void* dst, const void* src, unsigned site = __builtin_LINE()) {
  emu::log_access(true, src, 16, site);
  emu::log_access(false, dst, 16, site);
  std::memcpy(dst, src, 16);
}

// cp.async.cg.shared.global 16 bytes: the source is read now, the destination holds poison (0xff bytes: NaN in
// f32, bf16 and f16) until this lane's cp_async_wait completes the group holding the copy.
inline void cp_async16(void* dst, const void* src, unsigned site = __builtin_LINE()) {
  emu::log_access(true, src, 16, site);
  emu::log_access(false, dst, 16, site);
  if (emu::ctx.prof) __atomic_fetch_add(&emu::ctx.prof->cp_async, 1ull, __ATOMIC_RELAXED);
  emu::PendingCopy c;
  c.dst = dst;
  std::memcpy(c.data, src, 16);
  std::memset(dst, 0xff, 16);
  emu::ctx.cp_open.push_back(c);
}
// cp.async.commit_group: this lane's copies since the last commit form one group.
inline void cp_async_commit() {
  emu::ctx.cp_groups.push_back(emu::ctx.cp_open);
  emu::ctx.cp_open.clear();
}
// cp.async.wait_group N: all but this lane's N most recent groups have landed.
template <int N>
inline void cp_async_wait() {
  emu::cp_complete(N);
}

// Global and shared loads and stores the measuring counts (plain accesses elsewhere are not seen).
template <class T>
inline T gld(const T* p, unsigned site = __builtin_LINE()) {
  emu::log_access(true, p, sizeof(T), site);
  return *p;
}
template <class T>
inline void gst(T* p, T v, unsigned site = __builtin_LINE()) {
  emu::log_access(true, p, sizeof(T), site);
  *p = v;
}
template <class T>
inline T sld(const T* p, unsigned site = __builtin_LINE()) {
  emu::log_access(false, p, sizeof(T), site);
  return *p;
}
template <class T>
inline void sst(T* p, T v, unsigned site = __builtin_LINE()) {
  emu::log_access(false, p, sizeof(T), site);
  *p = v;
}

// The measuring's host entry points (defined once, in kernels/emu_toys.cu, which defines
// EMU_DEFINE_PROFILE_EXPORTS before including common.cuh).
extern "C" void emu_profile_enable(int on);
extern "C" void emu_profile_reset();
extern "C" int emu_profile_get(const char* name, emu::Profile* out);
#ifdef EMU_DEFINE_PROFILE_EXPORTS
extern "C" void emu_profile_enable(int on) { emu::profiling() = on != 0; }
extern "C" void emu_profile_reset() {
  std::lock_guard<std::mutex> g(emu::launch_mutex());
  emu::profiles().clear();
}
// The summed counts of kernel `name` since the last reset; 0 if it has not run measured.
extern "C" int emu_profile_get(const char* name, emu::Profile* out) {
  std::lock_guard<std::mutex> g(emu::launch_mutex());
  auto it = emu::profiles().find(name);
  if (it == emu::profiles().end()) return 0;
  *out = it->second;
  return 1;
}
#endif
#define __align__(n) __attribute__((aligned(n)))
