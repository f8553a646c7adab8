// adamw.cu — fused AdamW step over a flat f32 slice, and the gradient sum of squares for the global norm.
//
// Algorithm (`optim::adamw::AdamW::step`, torch `_single_tensor_adamw` order), per element with the
// clipping scale s (1 when not clipped; `grads::clip_by_global_norm`) applied to the gradient first:
//   g  = grad * s
//   p *= 1 - lr wd                               (decoupled weight decay)
//   m += (1 - b1) (g - m)                        (torch's lerp)
//   v  = v b2 + (1 - b2) g g
//   p -= step_size m / (sqrt(v) / bc2_sqrt + eps)  with step_size = lr / (1 - b1^t), bc2_sqrt = sqrt(1 - b2^t)
// and, when `out` is given, out = p rounded to the compute dtype (bf16 or f32 weights for the next
// forward), so the master -> compute copy costs no extra pass. The host computes step_size and bc2_sqrt
// in f64 once per step (as the CPU reference does) and passes them as f32.
// Work split: one thread per element, grid-stride; purely memory-bound (16 B read + 12-14 B written).
// One launch per run of parameters with the same weight decay (norms have none): the launcher merges
// adjacent segments.
// Global norm: `grad_sumsq_partial` — each block sums squares of a grid-stride share in f64 (as
// `grads::sum_squares`) into partial[blockIdx]; `grad_sumsq_finish` — one block adds the partials in a
// fixed order. Deterministic, no atomics; only the final scalar crosses to the host.
// Saved state: master, m, v (f32, this rank's slice). Does not: fp16 grads, AMSGrad, 8-bit moments.
#include "common.cuh"

template <class T>
__device__ void adamw_impl(float* __restrict__ master, float* __restrict__ m, float* __restrict__ v,
                           const float* __restrict__ grad, T* __restrict__ out, unsigned long long n, float lr,
                           float beta1, float beta2, float eps, float wd, float step_size, float bc2_sqrt,
                           float grad_scale) {
  const float decay = 1.0f - lr * wd;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const float g = grad[i] * grad_scale;
    float p = master[i] * decay;
    float mi = m[i];
    mi += (1.0f - beta1) * (g - mi);
    const float vi = v[i] * beta2 + (1.0f - beta2) * g * g;
    const float denom = sqrtf(vi) / bc2_sqrt + eps;
    p -= step_size * mi / denom;
    master[i] = p;
    m[i] = mi;
    v[i] = vi;
    if (out != nullptr) out[i] = store_as<T>(p);
  }
}

__device__ __forceinline__ double warp_sum_f64(double x) {
  for (int k = 16; k > 0; k >>= 1) x += __shfl_xor_sync(0xffffffffu, x, k);
  return x;
}

__device__ double block_sum_f64(double x) {
  __shared__ double scratch[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  x = warp_sum_f64(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  double r = lane < nwarps ? scratch[lane] : 0.0;
  r = warp_sum_f64(r);
  __syncthreads();
  return r;
}

extern "C" __global__ void grad_sumsq_partial(const float* g, unsigned long long n, double* partial) {
  double s = 0.0;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const double x = g[i];
    s += x * x;
  }
  s = block_sum_f64(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
EMU_ENTRY(grad_sumsq_partial, (const float* g, unsigned long long n, double* partial), (g, n, partial))

extern "C" __global__ void grad_sumsq_finish(const double* partial, unsigned parts, double* out) {
  double s = 0.0;
  for (unsigned i = threadIdx.x; i < parts; i += blockDim.x) s += partial[i];
  s = block_sum_f64(s);
  if (threadIdx.x == 0) out[0] = s;
}
EMU_ENTRY(grad_sumsq_finish, (const double* partial, unsigned parts, double* out), (partial, parts, out))

#define ADAMW_PARAMS(T)                                                                                       \
  (float* master, float* m, float* v, const float* grad, T* out, unsigned long long n, float lr, float beta1, \
   float beta2, float eps, float wd, float step_size, float bc2_sqrt, float grad_scale)
#define ADAMW_ARGS (master, m, v, grad, out, n, lr, beta1, beta2, eps, wd, step_size, bc2_sqrt, grad_scale)
#define ADAMW_KERNEL(sfx, T)                                                              \
  extern "C" __global__ void adamw_##sfx ADAMW_PARAMS(T) { adamw_impl<T> ADAMW_ARGS; } \
  EMU_ENTRY(adamw_##sfx, ADAMW_PARAMS(T), ADAMW_ARGS)

ADAMW_KERNEL(f32, float)
ADAMW_KERNEL(bf16, bf16)
