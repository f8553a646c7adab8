// rope.cu — rotary position embedding with per-head cos/sin tables (HARPE), forward and backward.
//
// Algorithm: x (B, H, T, D) contiguous, tables cos, sin (Htab, T, D/2) f32 with H % Htab == 0; head h
// reads table h / (H / Htab), so one table (classic RoPE), one per kv head (HARPE: the query heads of a
// GQA group share their kv head's row set) or one per head all work. For each pair (j, j + D/2):
//   y[j]       = x[j] cos[j] - x[j + D/2] s sin[j]
//   y[j + D/2] = x[j + D/2] cos[j] + x[j] s sin[j]
// with s = +1 forward. Backward is the rotation by the opposite angle, dx = rope(dy, cos, -sin): the same
// kernel with s = -1. Arithmetic in f32, one rounding to the storage type at the store (the CPU reference
// `ops::rotary::rotary_cpu` upcasts bf16 to f32 and casts back, so results agree to that rounding).
// Work split: one thread per (row, j) pair, rows = B*H*T, a grid-stride loop; consecutive threads take
// consecutive j of one row, so x, y and the table row are read/written coalesced.
// Saved tensors: none (the tables are rebuilt once per (length, scheme) on the host, with angles in f64: in
// f32 the angle pos * inv_freq at position 131072 is off by ~0.008 rad).
// Does not: build tables, handle strided x (the launcher makes x contiguous first).
#include "common.cuh"

template <class T>
__device__ void rope_impl(const T* __restrict__ x, const float* __restrict__ cosb, const float* __restrict__ sinb,
                          T* __restrict__ y, unsigned rows, unsigned h, unsigned t, unsigned half, unsigned htab,
                          float sin_sign) {
  const size_t n = (size_t)rows * half;
  const unsigned rep = h / htab;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const unsigned j = (unsigned)(i % half);
    const size_t row = i / half;             // (b, h, t) flattened
    const unsigned ti = (unsigned)(row % t);
    const unsigned hi = (unsigned)((row / t) % h);
    const size_t trow = ((size_t)(hi / rep) * t + ti) * half;
    const float c = cosb[trow + j], s = sin_sign * sinb[trow + j];
    const size_t base = row * 2 * half;
    const float x1 = load_f32(x[base + j]), x2 = load_f32(x[base + j + half]);
    y[base + j] = store_as<T>(x1 * c - x2 * s);
    y[base + j + half] = store_as<T>(x2 * c + x1 * s);
  }
}

#define ROPE_PARAMS(T) \
  (const T* x, const float* cosb, const float* sinb, T* y, unsigned rows, unsigned h, unsigned t, unsigned half, \
   unsigned htab, float sin_sign)
#define ROPE_ARGS (x, cosb, sinb, y, rows, h, t, half, htab, sin_sign)
#define ROPE_KERNEL(sfx, T)                                                             \
  extern "C" __global__ void rope_##sfx ROPE_PARAMS(T) { rope_impl<T> ROPE_ARGS; } \
  EMU_ENTRY(rope_##sfx, ROPE_PARAMS(T), ROPE_ARGS)

ROPE_KERNEL(f32, float)
ROPE_KERNEL(bf16, bf16)
