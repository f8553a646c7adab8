// mma.cuh — the sm_80 tensor-core instructions as small inline functions (nvcc side; inline PTX).
//
// What: `mma_16816<T>` — mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32, D = A B + D in
// place; `ldmatrix_x4` / `ldmatrix_x2` (and `_trans`) — ldmatrix.sync.aligned.m8n8.{x4,x2}[.trans].shared.b16;
// `copy16` — one 16-byte global -> shared copy (a 128-bit load and store).
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"; g = lane / 4, t = lane % 4; a register
// holds two 16-bit elements, the lower column/row index in the low half):
//   A 16x16 row-major, 4 regs: a0 (row g, cols 2t, 2t+1), a1 (row g+8, same), a2 (row g, cols 2t+8, +9),
//     a3 (row g+8, cols 2t+8, +9);
//   B 16x8 "col" (k x n), 2 regs: b0 (rows k = 2t, 2t+1, col n = g), b1 (rows 2t+8, 2t+9, col g);
//   C/D 16x8 f32, 4 floats: c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, cols 2t, 2t+1).
// ldmatrix: lane l gives the shared address of one 16-byte row (8 x b16); rows 8i..8i+7 form matrix i
// (x4: lanes 0-31, x2: lanes 0-15). Lane l receives, of matrix i, register r[i] = (row l/4, cols 2(l%4),
// 2(l%4)+1); with .trans, r[i] = (rows 2(l%4), 2(l%4)+1 of column l/4), i.e. the fragment of the transpose.
// The non-obvious decision: this file is the only one with PTX; kernels/emu.h defines the same functions
// with the same signatures for the host, reproducing these per-lane layouts exactly (through the warp's
// exchange), so the kernels' fragment bookkeeping is tested on CPU (tests/stage_model/attention_emu.rs, mma_probe).
// `cp_async16` / `cp_async_commit` / `cp_async_wait<N>`: sm_80's asynchronous global -> shared copies.
// Does not: wgmma / TMA (Hopper-only; a later, run-time-chosen extra path).
#pragma once

template <class T>
__device__ __forceinline__ void mma_16816(float* d, const uint32_t* a, const uint32_t* b);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t* r, const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(row)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t* r, const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(row)));
}

// 16 bytes from `src` (global) to `dst` (shared), both 16-byte aligned.
__device__ __forceinline__ void copy16(void* dst, const void* src) {
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}

// cp.async.cg.shared.global of 16 bytes (`src` global, `dst` shared, both 16-byte aligned), its commit_group
// and wait_group N (all but the N most recent groups of this thread have landed in shared memory).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Plain global and shared loads and stores; the host emulation's twins also measure them (kernels/emu.h).
template <class T>
__device__ __forceinline__ T gld(const T* p) { return *p; }
template <class T>
__device__ __forceinline__ void gst(T* p, T v) { *p = v; }
template <class T>
__device__ __forceinline__ T sld(const T* p) { return *p; }
template <class T>
__device__ __forceinline__ void sst(T* p, T v) { *p = v; }

__device__ __forceinline__ uint16_t bits16(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ __forceinline__ uint16_t bits16(__half v) { return __half_as_ushort(v); }
