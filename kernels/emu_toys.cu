// emu_toys.cu — small kernels whose memory behaviour is known by hand, to check the host emulation's
// measuring (kernels/emu.h: global sectors, bank conflicts, barriers, cp.async) and to define its host entry
// points once.
//
// What: `toy_copy` reads 32-bit floats coalesced (stride 1) or one per 32-byte sector (stride 8) and writes
// them coalesced; `toy_shared_column` writes a 32 x 32 float tile row by row and reads one column, unpadded
// (every lane in bank 0: a 32-way conflict) or padded to 33 columns (32 distinct banks); `toy_cp_async`
// copies 2 x 512 bytes into shared memory with cp.async in two groups and records what a reader sees after
// wait_group 1 and after wait_group 0 — or, with `early`, before any wait (poison on the emulator: the bug
// the poison exists to catch).
// Reference: CUDA C++ Best Practices Guide (coalescing, 32 banks of 4 bytes); PTX ISA cp.async.
// The non-obvious decision: the counts are asserted in tests/stage_model/emu_profile.rs from arithmetic written there,
// so these kernels stay tiny (one warp) and use the measured accessors (gld/gst/sld/sst) for every access.
// Does not: anything harpe runs in training (they exist for the tests; compiled to PTX too, never launched).
#define EMU_DEFINE_PROFILE_EXPORTS
#include "common.cuh"

// y[i] = x[i * stride] for i < n (one warp: n <= 32).
__device__ void toy_copy_impl(const float* x, float* y, unsigned n, unsigned stride) {
  const unsigned i = threadIdx.x;
  if (i < n) gst(&y[i], gld(&x[(size_t)i * stride]));
}

// out[lane] = tile[lane][0] after tile[j][lane] = j * 32 + lane, with rows of 32 + PAD floats.
template <int PAD>
__device__ void toy_shared_column_impl(float* out) {
  __shared__ float tile[32][32 + PAD];
  const unsigned lane = threadIdx.x;
  for (unsigned j = 0; j < 32; ++j) sst(&tile[j][lane], (float)(j * 32 + lane));
  __syncthreads();
  out[lane] = sld(&tile[lane][0]);
}

// 256 floats from x through shared memory: lane l copies floats 4l..4l+3 (group 0) and 128+4l.. (group 1).
// y[0..256): what lane l reads back from its own 8 floats after wait_group 1 (group 0 landed, group 1 may
// not have), y[256..512) after wait_group 0; with `early` both reads happen before any wait.
__device__ void toy_cp_async_impl(const float* x, float* y, int early) {
  __shared__ __align__(16) float buf[256];
  const unsigned l = threadIdx.x;
  cp_async16(&buf[4 * l], &x[4 * l]);
  cp_async_commit();
  cp_async16(&buf[128 + 4 * l], &x[128 + 4 * l]);
  cp_async_commit();
  if (!early) cp_async_wait<1>();
  for (int i = 0; i < 4; ++i) {
    y[4 * l + i] = buf[4 * l + i];
    y[128 + 4 * l + i] = buf[128 + 4 * l + i];
  }
  if (!early) cp_async_wait<0>();
  for (int i = 0; i < 4; ++i) {
    y[256 + 4 * l + i] = buf[4 * l + i];
    y[384 + 4 * l + i] = buf[128 + 4 * l + i];
  }
}

extern "C" __global__ void toy_copy(const float* x, float* y, unsigned n, unsigned stride) {
  toy_copy_impl(x, y, n, stride);
}
EMU_ENTRY(toy_copy, (const float* x, float* y, unsigned n, unsigned stride), (x, y, n, stride))
extern "C" __global__ void toy_shared_column(float* out) { toy_shared_column_impl<0>(out); }
EMU_ENTRY(toy_shared_column, (float* out), (out))
extern "C" __global__ void toy_shared_column_padded(float* out) { toy_shared_column_impl<1>(out); }
EMU_ENTRY(toy_shared_column_padded, (float* out), (out))
extern "C" __global__ void toy_cp_async(const float* x, float* y, int early) { toy_cp_async_impl(x, y, early); }
EMU_ENTRY(toy_cp_async, (const float* x, float* y, int early), (x, y, early))
