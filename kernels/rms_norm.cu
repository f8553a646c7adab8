// rms_norm.cu — RMSNorm forward and backward (dx and dweight), f32 accumulation for bf16 storage.
//
// Algorithm (HF LlamaRMSNorm, `model::llama::rms_norm`): per row x (C),
//   r = 1 / sqrt(mean(x^2) + eps)          (f32, saved per row as `rstd`)
//   xhat = x * r, stored in the input dtype  (HF casts the normalised row back before the weight)
//   y = xhat * w
// Backward with upstream dy, g = dy * w (f32):
//   dx = r * (g - xhat * mean(g * xhat))
//   dw = sum over rows of dy * xhat
// Work split, forward and dx: one block per row (grid-stride over rows), threads stride over the C
// columns; mean(x^2) and mean(g xhat) are block reductions (warp butterflies, then one warp over the
// warp partials). dw: each block of the backward owns one row of `dw_partial` (gridDim x C, f32) and adds
// the rows it processed into it (each column belongs to one thread: no atomics); `rms_norm_dw_*` then sums
// the gridDim partial rows per column in a fixed order, so dw is deterministic.
// Saved tensors: x (the op's input); rstd (N) f32 when the caller keeps it, else (rstd == nullptr) the
// backward recomputes it from x with the forward's exact expression (one more read of the row).
// Does not: fuse the residual add (llm.c's fused_residual_forward) or keep the row in shared memory
// between the two passes (it is read twice; L2 serves the second read at C <= 8192).
#include "common.cuh"

template <class T>
__device__ void rms_norm_fwd_impl(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                  float* __restrict__ rstd, unsigned n, unsigned c, float eps) {
  __shared__ float scratch[32];
  for (unsigned row = blockIdx.x; row < n; row += gridDim.x) {
    const T* xr = x + (size_t)row * c;
    T* yr = y + (size_t)row * c;
    float ss = 0.0f;
    for (unsigned j = threadIdx.x; j < c; j += blockDim.x) {
      const float v = load_f32(xr[j]);
      ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float denom = sqrtf(ss / (float)c + eps);
    for (unsigned j = threadIdx.x; j < c; j += blockDim.x) {
      const float xhat = load_f32(store_as<T>(load_f32(xr[j]) / denom));
      yr[j] = store_as<T>(xhat * load_f32(w[j]));
    }
    if (threadIdx.x == 0 && rstd != nullptr) rstd[row] = 1.0f / denom;
  }
}

template <class T>
__device__ void rms_norm_bwd_impl(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                                  const float* __restrict__ rstd, T* __restrict__ dx,
                                  float* __restrict__ dw_partial, unsigned n, unsigned c, float eps) {
  __shared__ float scratch[32];
  float* part = dw_partial + (size_t)blockIdx.x * c;
  for (unsigned j = threadIdx.x; j < c; j += blockDim.x) part[j] = 0.0f;
  for (unsigned row = blockIdx.x; row < n; row += gridDim.x) {
    const size_t off = (size_t)row * c;
    float r;
    if (rstd != nullptr) {  // uniform over the block: the barriers in block_sum are reached by all
      r = rstd[row];
    } else {
      float ss = 0.0f;
      for (unsigned j = threadIdx.x; j < c; j += blockDim.x) {
        const float v = load_f32(x[off + j]);
        ss += v * v;
      }
      r = 1.0f / sqrtf(block_sum(ss, scratch) / (float)c + eps);
    }
    float dot = 0.0f;
    for (unsigned j = threadIdx.x; j < c; j += blockDim.x) {
      const float g = load_f32(dy[off + j]) * load_f32(w[j]);
      dot += g * load_f32(x[off + j]) * r;
    }
    dot = block_sum(dot, scratch) / (float)c;
    for (unsigned j = threadIdx.x; j < c; j += blockDim.x) {
      const float d = load_f32(dy[off + j]);
      const float xhat = load_f32(x[off + j]) * r;
      dx[off + j] = store_as<T>(r * (d * load_f32(w[j]) - xhat * dot));
      part[j] += d * load_f32(store_as<T>(xhat));
    }
  }
}

template <class T>
__device__ void rms_norm_dw_impl(const float* __restrict__ dw_partial, T* __restrict__ dw, unsigned parts,
                                 unsigned c) {
  for (unsigned j = blockIdx.x * blockDim.x + threadIdx.x; j < c; j += gridDim.x * blockDim.x) {
    float s = 0.0f;
    for (unsigned p = 0; p < parts; ++p) s += dw_partial[(size_t)p * c + j];
    dw[j] = store_as<T>(s);
  }
}

#define RMS_FWD_PARAMS(T) (const T* x, const T* w, T* y, float* rstd, unsigned n, unsigned c, float eps)
#define RMS_FWD_ARGS (x, w, y, rstd, n, c, eps)
#define RMS_BWD_PARAMS(T) \
  (const T* dy, const T* x, const T* w, const float* rstd, T* dx, float* dw_partial, unsigned n, unsigned c, float eps)
#define RMS_BWD_ARGS (dy, x, w, rstd, dx, dw_partial, n, c, eps)
#define RMS_DW_PARAMS(T) (const float* dw_partial, T* dw, unsigned parts, unsigned c)
#define RMS_DW_ARGS (dw_partial, dw, parts, c)
#define RMS_KERNELS(sfx, T)                                                                             \
  extern "C" __global__ void rms_norm_fwd_##sfx RMS_FWD_PARAMS(T) { rms_norm_fwd_impl<T> RMS_FWD_ARGS; } \
  EMU_ENTRY(rms_norm_fwd_##sfx, RMS_FWD_PARAMS(T), RMS_FWD_ARGS)                                       \
  extern "C" __global__ void rms_norm_bwd_##sfx RMS_BWD_PARAMS(T) { rms_norm_bwd_impl<T> RMS_BWD_ARGS; } \
  EMU_ENTRY(rms_norm_bwd_##sfx, RMS_BWD_PARAMS(T), RMS_BWD_ARGS)                                       \
  extern "C" __global__ void rms_norm_dw_##sfx RMS_DW_PARAMS(T) { rms_norm_dw_impl<T> RMS_DW_ARGS; }    \
  EMU_ENTRY(rms_norm_dw_##sfx, RMS_DW_PARAMS(T), RMS_DW_ARGS)

RMS_KERNELS(f32, float)
RMS_KERNELS(bf16, bf16)
