// mma_probe.cu — one 16x16x16 product C = A B through the tensor-core fragments, four ways.
//
// What: one warp loads A (16x16 row-major), B (16x16 row-major, [k][n]) and B^T ([n][k]) into shared memory,
// takes A's fragment with ldmatrix_x4 and B's in four ways — x4.trans from B, x2 (per 8-column tile) from
// B^T, x2.trans from B, x4 from B^T — and writes the four products (16x16 f32 each, from the C fragments'
// per-lane positions). Each must equal the plain matmul.
// Reference: PTX ISA, warp-level matrix fragments for mma.m16n8k16 and ldmatrix (kernels/mma.cuh).
// The non-obvious decision: the same source runs on the host (kernels/emu.h twins; tests/stage_model/attention_emu.rs)
// and on the GPU (`harpe selftest`), so the emulated layouts are checked against the hardware's.
// Does not: time anything; it exists to pin the fragment layouts the attention kernels rely on.
#include "common.cuh"

template <class T>
__device__ void mma_probe_impl(const T* a, const T* b, const T* bt, float* out) {
  __shared__ __align__(16) T as[16][16];
  __shared__ __align__(16) T bs[16][16];
  __shared__ __align__(16) T bts[16][16];
  const unsigned l = threadIdx.x % 32, g = l / 4, t = l % 4;
  for (unsigned e = l; e < 256; e += 32) {
    as[e / 16][e % 16] = a[e];
    bs[e / 16][e % 16] = b[e];
    bts[e / 16][e % 16] = bt[e];
  }
  __syncthreads();
  uint32_t af[4];
  ldmatrix_x4(af, &as[l % 8 + (l / 8) % 2 * 8][l / 16 * 8]);
  for (int way = 0; way < 4; ++way) {
    uint32_t bf[4];
    if (way == 0) {
      ldmatrix_x4_trans(bf, &bs[l % 8 + (l / 8) % 2 * 8][l / 16 * 8]);
    } else if (way == 1) {
      ldmatrix_x2(bf, &bts[l % 8][(l / 8) % 2 * 8]);
      ldmatrix_x2(bf + 2, &bts[8 + l % 8][(l / 8) % 2 * 8]);
    } else if (way == 2) {
      ldmatrix_x2_trans(bf, &bs[l % 8 + (l / 8) % 2 * 8][0]);
      ldmatrix_x2_trans(bf + 2, &bs[l % 8 + (l / 8) % 2 * 8][8]);
    } else {
      ldmatrix_x4(bf, &bts[l % 8 + l / 16 * 8][(l / 8) % 2 * 8]);
    }
    for (int nt = 0; nt < 2; ++nt) {
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      mma_16816<T>(c, af, bf + 2 * nt);
      for (int e = 0; e < 4; ++e) out[way * 256 + (g + (e >= 2 ? 8 : 0)) * 16 + nt * 8 + 2 * t + (e & 1)] = c[e];
    }
  }
}

#define MMA_PROBE_PARAMS(T) (const T* a, const T* b, const T* bt, float* out)
#define MMA_PROBE_ARGS (a, b, bt, out)
extern "C" __global__ void mma_probe_bf16 MMA_PROBE_PARAMS(bf16) { mma_probe_impl<bf16> MMA_PROBE_ARGS; }
EMU_ENTRY(mma_probe_bf16, MMA_PROBE_PARAMS(bf16), MMA_PROBE_ARGS)
extern "C" __global__ void mma_probe_f16 MMA_PROBE_PARAMS(__half) { mma_probe_impl<__half> MMA_PROBE_ARGS; }
EMU_ENTRY(mma_probe_f16, MMA_PROBE_PARAMS(__half), MMA_PROBE_ARGS)
