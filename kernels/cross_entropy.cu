// cross_entropy.cu — fused log-sum-exp, nll and dlogits on one chunk of lm-head logits.
//
// Algorithm (`model::loss::chunked_cross_entropy`; Liger-Kernel fused linear cross-entropy): the chunk's logits
// (n, V) come from one cuBLAS matmul h_c W^T; per row i with target y_i and upstream gradient g_i:
//   lse_i = log sum_j exp(l_ij)                  (online: running max and rescaled sum, one pass)
//   nll_i = lse_i - l_{i,y_i}                    (0 when y_i == IGNORE_INDEX = 0xFFFFFFFF)
//   dl_ij = g_i (exp(l_ij - lse_i) - [j == y_i])   (0 for an ignored row)
// so the (T x V) logits never exist: the caller loops over chunks and turns dlogits into dh = dl W and
// dW += dl^T h with two more matmuls. With `gout == nullptr` only nll and lse are written (forward).
// Work split: one block per row (grid-stride over rows); each thread keeps an online (max, sum) over its
// strided columns, then the block combines them (block_max, rescale, block_sum). All arithmetic in f32.
// Saved tensors: none here; the caller may keep lse (n) to skip the first pass in a backward.
// `dlogits` may alias `logits`: each element is overwritten only by the thread that read it, after the
// row's reductions; the target's logit is read before them.
// A target >= V that is not IGNORE_INDEX gives nll = NaN: the backstop. Ids are checked on the host
// when the batch is built (`train::batch_tensors`), not here per launch (that would be a device sync).
// Does not: z-loss, label smoothing, soft targets.
#include "common.cuh"

#define CE_IGNORE 0xFFFFFFFFu

template <class T>
__device__ void cross_entropy_impl(const T* logits, const unsigned* __restrict__ targets,
                                   const float* __restrict__ gout, float* __restrict__ nll,
                                   float* __restrict__ lse_out, T* dlogits, unsigned n, unsigned v) {
  __shared__ float scratch[32];
  for (unsigned row = blockIdx.x; row < n; row += gridDim.x) {
    const T* lr = logits + (size_t)row * v;
    float m = -INFINITY, s = 0.0f;
    for (unsigned j = threadIdx.x; j < v; j += blockDim.x) {
      const float l = load_f32(lr[j]);
      if (l > m) {
        s = s * expf(m - l) + 1.0f;
        m = l;
      } else {
        s += expf(l - m);
      }
    }
    const unsigned y = targets[row];
    const bool ignored = y == CE_IGNORE;
    // read before the reductions' barriers: after them, other threads may overwrite lr[y] in place
    const float picked = (threadIdx.x == 0 && !ignored && y < v) ? load_f32(lr[y]) : 0.0f;
    const float bm = block_max(m, scratch);
    const float bs = block_sum(s == 0.0f ? 0.0f : s * expf(m - bm), scratch);
    const float lse = bm + logf(bs);
    if (threadIdx.x == 0) {
      nll[row] = ignored ? 0.0f : (y < v ? lse - picked : NAN);
      if (lse_out != nullptr) lse_out[row] = lse;
    }
    if (gout != nullptr && dlogits != nullptr) {
      const float g = ignored ? 0.0f : gout[row];
      T* dr = dlogits + (size_t)row * v;
      for (unsigned j = threadIdx.x; j < v; j += blockDim.x) {
        const float p = expf(load_f32(lr[j]) - lse);
        dr[j] = store_as<T>(g * (p - (j == y ? 1.0f : 0.0f)));
      }
    }
  }
}

#define CE_PARAMS(T) \
  (const T* logits, const unsigned* targets, const float* gout, float* nll, float* lse_out, T* dlogits, unsigned n, \
   unsigned v)
#define CE_ARGS (logits, targets, gout, nll, lse_out, dlogits, n, v)
#define CE_KERNEL(sfx, T)                                                                       \
  extern "C" __global__ void cross_entropy_##sfx CE_PARAMS(T) { cross_entropy_impl<T> CE_ARGS; } \
  EMU_ENTRY(cross_entropy_##sfx, CE_PARAMS(T), CE_ARGS)

CE_KERNEL(f32, float)
CE_KERNEL(bf16, bf16)
