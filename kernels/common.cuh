// common.cuh — what every kernel is written against: types, conversions, reductions, entry macros.
//
// What: `bf16`, `load_f32`/`store_as` conversions between storage types and f32, `pack2` (two floats as one
// 16-bit-pair mma register), `warp_sum`/`warp_max` (butterfly shuffles), `block_sum`/`block_max` (warp
// partials through shared memory), the two macros that differ between compilers: DYNAMIC_SHARED (extern
// __shared__ array) and EMU_ENTRY (a host launcher under the emulation, nothing under nvcc), and the
// tensor-core instructions `mma_16816`, `ldmatrix_x{2,4}[_trans]`, `copy16` (kernels/mma.cuh under nvcc,
// their emulated twins with the same per-lane layouts in emu.h on the host).
// Reference: llm.c `llmc/cuda_common.h`, `llmc/cuda_utils.cuh` (blockReduce with a warp-sum first).
// The non-obvious decision: this is the ONLY place that knows which compiler is in use — under nvcc it
// includes the CUDA headers, on the host compiler it includes emu.h (blocks in sequence, threads as
// std::threads); the kernels themselves have no #ifdef.
// What it does not do: vectorised 128-bit loads in the row kernels (Packed128 in llm.c; only attention's
// tensor-core path uses `copy16`) — a later speed step, measured by `harpe bench` first.
#pragma once

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include "mma.cuh"
#define EMU_ENTRY(name, params, args)
#define DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#else
#include "emu.h"
#endif

typedef __nv_bfloat16 bf16;

// Storage type <-> f32 (all arithmetic is f32).
__device__ __forceinline__ float load_f32(float v) { return v; }
__device__ __forceinline__ float load_f32(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float load_f32(__half v) { return __half2float(v); }
template <class T>
__device__ __forceinline__ T store_as(float v);
template <>
__device__ __forceinline__ float store_as<float>(float v) { return v; }
template <>
__device__ __forceinline__ bf16 store_as<bf16>(float v) { return __float2bfloat16(v); }
template <>
__device__ __forceinline__ __half store_as<__half>(float v) { return __float2half(v); }

// Two floats as one register of two 16-bit T (bf16 or f16), `lo` in the low half (an mma operand).
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return static_cast<uint32_t>(bits16(store_as<T>(lo))) | static_cast<uint32_t>(bits16(store_as<T>(hi))) << 16;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` is 32 floats of __shared__ memory; it may be reused right after the call returns.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? scratch[lane] : 0.0f;
  r = warp_sum(r);
  __syncthreads();
  return r;
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? scratch[lane] : -INFINITY;
  r = warp_max(r);
  __syncthreads();
  return r;
}
