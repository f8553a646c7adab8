// attention.cu — causal GQA flash attention (FlashAttention-2), forward and backward, f32 accumulation.
//
// Layouts: q, o, dq, do (B, H, Tq, D); k, v, dk, dv (B, Hkv, Tk, D); lse, delta (B, H, Tq) f32; all
// contiguous. Query head h reads kv head h / (H / Hkv) directly (no repeated K/V copy). Causal: query row i
// sits at key position (Tk - Tq) + i and sees keys j <= that (Tq < Tk is the KV-cache decode / chunked
// prefill; Tq == Tk is training). Scores s = scale * q.k; lse_i = log sum_j exp(s_ij) is saved per row.
// Reference: Dao 2023, FlashAttention-2, Algorithms 1 (forward) and 2 (backward); the CPU reference
// `ops::attention::{attention_fwd_cpu, attention_bwd_cpu}` (same math, plain loops).
//
// Forward (`attn_fwd_*`): one block per (b, h, tile of BQ query rows), NT threads. The Q tile sits in
// shared memory; K/V tiles of BK keys are streamed through shared memory; per tile S = scale Q K^T
// (masked: key beyond Tk, beyond the row's causal limit, or padded row -> -inf), then the online softmax
// per row (running max m, sum l; one thread per row), then O = corr * O + P V with O in registers (each
// thread owns BQ*D/NT fixed elements of the tile). Key tiles past the tile's last causal position are
// never loaded. Writes O = acc / l and lse = m + ln l (rows that see no key: O = 0, lse = -inf).
// Backward: `attn_bwd_delta_*` computes delta_i = dO_i . O_i (one warp per row). `attn_bwd_*`: one
// block per (b, kv head g, tile of BK keys); it owns dK, dV of that tile (registers, no atomics) and loops
// over the H/Hkv query heads of the group and over the query tiles that can see the key tile; per
// (query tile): P = exp(S - lse) recomputed, dP = dO V^T, dS = P (dP - delta);
//   dV += P^T dO,  dK += scale dS^T Q,  dQ += scale dS K  (atomicAdd into an f32 accumulator, FA2's choice;
// `attn_dq_convert_*` then writes dQ in the storage type). Nothing of size Tq x Tk exists anywhere.
// Tiles: BQ = BK = 32 for D <= 64, 16 for D = 128 (static shared memory stays under 48 KiB in f32:
// backward at D = 128 holds Q, dO, K, V tiles = 4 x 16 x 128 x 4 B = 32 KiB plus the two 16 x 16 score tiles).
// The non-obvious decision: the tiles are plain FMA loops over shared memory, not tensor-core mma.sync —
// correctness first, proven by the host emulation (kernels/emu.h, tests/attention_emu.rs) before any GPU
// sees it. Grids are 1-D (block index decoded into tile, head, batch) so the same entry macro serves the
// emulator.
// Does not: tensor cores (mma.sync / ldmatrix with emulated fragment twins: the documented next step),
// deterministic dQ (atomics: summation order varies run to run on a GPU), dropout, sliding windows,
// document masks (varlen), head dims other than 16, 32, 64, 128.
#include "common.cuh"

#define ATTN_NT 128

template <int D>
struct AttnTile {
  static constexpr int BQ = D >= 128 ? 16 : 32;
  static constexpr int BK = BQ;
};

// Absolute key position of query row i.
__device__ __forceinline__ long attn_qpos(unsigned i, unsigned tq, unsigned tk) { return (long)tk - (long)tq + (long)i; }

template <class T, int D>
__device__ void attn_fwd_impl(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              T* __restrict__ o, float* __restrict__ lse, unsigned nb, unsigned h, unsigned hkv,
                              unsigned tq, unsigned tk, float scale, int causal) {
  constexpr int BQ = AttnTile<D>::BQ, BK = AttnTile<D>::BK, PER = BQ * D / ATTN_NT;
  __shared__ float qs[BQ][D];
  __shared__ float ks[BK][D];
  __shared__ float vs[BK][D];
  __shared__ float ss[BQ][BK];
  __shared__ float row_m[BQ], row_l[BQ], row_corr[BQ];
  const unsigned tid = threadIdx.x;
  const unsigned ntiles = (tq + BQ - 1) / BQ;
  const unsigned qt = blockIdx.x % ntiles, bh = blockIdx.x / ntiles, bi = bh / h, hi = bh % h;
  const unsigned g = hi / (h / hkv);
  const unsigned q0 = qt * BQ;
  const T* qh = q + (size_t)bh * tq * D;
  const T* kh = k + ((size_t)bi * hkv + g) * tk * D;
  const T* vh = v + ((size_t)bi * hkv + g) * tk * D;

  for (unsigned e = tid; e < BQ * D; e += ATTN_NT) {
    const unsigned r = e / D, c = e % D;
    qs[r][c] = q0 + r < tq ? load_f32(qh[(size_t)(q0 + r) * D + c]) : 0.0f;
  }
  if (tid < BQ) {
    row_m[tid] = -INFINITY;
    row_l[tid] = 0.0f;
  }
  float acc[PER];
  #pragma unroll
  for (int p = 0; p < PER; ++p) acc[p] = 0.0f;
  // keys this tile can see: all, or up to the causal position of its last valid row
  const unsigned last = (q0 + BQ < tq ? q0 + BQ : tq) - 1;
  long kend = causal ? attn_qpos(last, tq, tk) + 1 : (long)tk;
  if (kend > (long)tk) kend = tk;
  if (kend < 0) kend = 0;
  __syncthreads();

  for (unsigned k0 = 0; k0 < (unsigned)kend; k0 += BK) {
    for (unsigned e = tid; e < BK * D; e += ATTN_NT) {
      const unsigned r = e / D, c = e % D;
      const bool in = k0 + r < tk;
      ks[r][c] = in ? load_f32(kh[(size_t)(k0 + r) * D + c]) : 0.0f;
      vs[r][c] = in ? load_f32(vh[(size_t)(k0 + r) * D + c]) : 0.0f;
    }
    __syncthreads();
    for (unsigned e = tid; e < BQ * BK; e += ATTN_NT) {
      const unsigned r = e / BK, j = e % BK;
      const unsigned kj = k0 + j;
      const bool ok = q0 + r < tq && kj < tk && (!causal || (long)kj <= attn_qpos(q0 + r, tq, tk));
      float s = 0.0f;
      for (int c = 0; c < D; ++c) s += qs[r][c] * ks[j][c];
      ss[r][j] = ok ? s * scale : -INFINITY;
    }
    __syncthreads();
    if (tid < BQ) {  // online softmax, one thread per row
      const float m_old = row_m[tid];
      float mx = m_old;
      for (int j = 0; j < BK; ++j) mx = fmaxf(mx, ss[tid][j]);
      float corr = 1.0f, lsum = row_l[tid];
      if (mx != -INFINITY) {
        corr = m_old == -INFINITY ? 0.0f : expf(m_old - mx);
        lsum *= corr;
        for (int j = 0; j < BK; ++j) {
          const float p = ss[tid][j] == -INFINITY ? 0.0f : expf(ss[tid][j] - mx);
          ss[tid][j] = p;
          lsum += p;
        }
      } else {
        for (int j = 0; j < BK; ++j) ss[tid][j] = 0.0f;
      }
      row_m[tid] = mx;
      row_l[tid] = lsum;
      row_corr[tid] = corr;
    }
    __syncthreads();
    #pragma unroll
    for (int p = 0; p < PER; ++p) {
      const unsigned e = tid + p * ATTN_NT, r = e / D, c = e % D;
      float a = acc[p] * row_corr[r];
      for (int j = 0; j < BK; ++j) a += ss[r][j] * vs[j][c];
      acc[p] = a;
    }
    __syncthreads();  // ks/vs/ss are rewritten by the next tile
  }

  #pragma unroll

  for (int p = 0; p < PER; ++p) {
    const unsigned e = tid + p * ATTN_NT, r = e / D, c = e % D;
    if (q0 + r < tq) {
      const float l = row_l[r];
      o[((size_t)bh * tq + q0 + r) * D + c] = store_as<T>(l > 0.0f ? acc[p] / l : 0.0f);
    }
  }
  if (tid < BQ && q0 + tid < tq) {
    const float l = row_l[tid];
    lse[(size_t)bh * tq + q0 + tid] = l > 0.0f ? row_m[tid] + logf(l) : -INFINITY;
  }
}

// delta_i = dO_i . O_i over `rows` rows of D; one warp per row.
template <class T>
__device__ void attn_bwd_delta_impl(const T* __restrict__ o, const T* __restrict__ dout, float* __restrict__ delta,
                                    unsigned rows, unsigned d) {
  const unsigned lane = threadIdx.x % 32, wpb = blockDim.x / 32;
  for (unsigned row = blockIdx.x * wpb + threadIdx.x / 32; row < rows; row += gridDim.x * wpb) {
    float s = 0.0f;
    for (unsigned c = lane; c < d; c += 32) s += load_f32(o[(size_t)row * d + c]) * load_f32(dout[(size_t)row * d + c]);
    s = warp_sum(s);
    if (lane == 0) delta[row] = s;
  }
}

template <class T, int D>
__device__ void attn_bwd_impl(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              const T* __restrict__ dout, const float* __restrict__ lse,
                              const float* __restrict__ delta, float* __restrict__ dq_acc, T* __restrict__ dk,
                              T* __restrict__ dv, unsigned nb, unsigned h, unsigned hkv, unsigned tq, unsigned tk,
                              float scale, int causal) {
  constexpr int BQ = AttnTile<D>::BQ, BK = AttnTile<D>::BK, PER = BK * D / ATTN_NT;
  __shared__ float ks[BK][D];
  __shared__ float vs[BK][D];
  __shared__ float qs[BQ][D];
  __shared__ float dos[BQ][D];
  __shared__ float ps[BQ][BK];
  __shared__ float dss[BQ][BK];
  __shared__ float lse_s[BQ], delta_s[BQ];
  const unsigned tid = threadIdx.x;
  const unsigned ntiles = (tk + BK - 1) / BK;
  const unsigned kt = blockIdx.x % ntiles, bg = blockIdx.x / ntiles, bi = bg / hkv, g = bg % hkv;
  const unsigned rep = h / hkv, k0 = kt * BK;
  const size_t kvoff = (size_t)bg * tk * D;

  for (unsigned e = tid; e < BK * D; e += ATTN_NT) {
    const unsigned r = e / D, c = e % D;
    const bool in = k0 + r < tk;
    ks[r][c] = in ? load_f32(k[kvoff + (size_t)(k0 + r) * D + c]) : 0.0f;
    vs[r][c] = in ? load_f32(v[kvoff + (size_t)(k0 + r) * D + c]) : 0.0f;
  }
  float dk_acc[PER], dv_acc[PER];
  #pragma unroll
  for (int p = 0; p < PER; ++p) dk_acc[p] = dv_acc[p] = 0.0f;
  // first query row that can see key k0: qpos(i) >= k0  <=>  i >= k0 - (tk - tq)
  unsigned qstart = 0;
  if (causal) {
    const long first = (long)k0 - ((long)tk - (long)tq);
    qstart = first > 0 ? (unsigned)first / BQ * BQ : 0;
  }
  __syncthreads();

  for (unsigned r = 0; r < rep; ++r) {
    const unsigned bh = bi * h + g * rep + r;
    const T* qh = q + (size_t)bh * tq * D;
    const T* doh = dout + (size_t)bh * tq * D;
    float* dqh = dq_acc + (size_t)bh * tq * D;
    for (unsigned q0 = qstart; q0 < tq; q0 += BQ) {
      for (unsigned e = tid; e < BQ * D; e += ATTN_NT) {
        const unsigned i = e / D, c = e % D;
        const bool in = q0 + i < tq;
        qs[i][c] = in ? load_f32(qh[(size_t)(q0 + i) * D + c]) : 0.0f;
        dos[i][c] = in ? load_f32(doh[(size_t)(q0 + i) * D + c]) : 0.0f;
      }
      if (tid < BQ) {
        const bool in = q0 + tid < tq;
        lse_s[tid] = in ? lse[(size_t)bh * tq + q0 + tid] : -INFINITY;
        delta_s[tid] = in ? delta[(size_t)bh * tq + q0 + tid] : 0.0f;
      }
      __syncthreads();
      for (unsigned e = tid; e < BQ * BK; e += ATTN_NT) {
        const unsigned i = e / BK, j = e % BK, kj = k0 + j;
        const bool ok = q0 + i < tq && kj < tk && lse_s[i] != -INFINITY &&
                        (!causal || (long)kj <= attn_qpos(q0 + i, tq, tk));
        float s = 0.0f, dp = 0.0f;
        for (int c = 0; c < D; ++c) {
          s += qs[i][c] * ks[j][c];
          dp += dos[i][c] * vs[j][c];
        }
        const float p = ok ? expf(s * scale - lse_s[i]) : 0.0f;
        ps[i][j] = p;
        dss[i][j] = p * (dp - delta_s[i]);
      }
      __syncthreads();
      #pragma unroll
      for (int p = 0; p < PER; ++p) {
        const unsigned e = tid + p * ATTN_NT, j = e / D, c = e % D;
        float a = 0.0f, b = 0.0f;
        for (int i = 0; i < BQ; ++i) {
          a += ps[i][j] * dos[i][c];
          b += dss[i][j] * qs[i][c];
        }
        dv_acc[p] += a;
        dk_acc[p] += scale * b;
      }
      for (unsigned e = tid; e < BQ * D; e += ATTN_NT) {
        const unsigned i = e / D, c = e % D;
        if (q0 + i < tq) {
          float a = 0.0f;
          for (int j = 0; j < BK; ++j) a += dss[i][j] * ks[j][c];
          if (a != 0.0f) atomicAdd(&dqh[(size_t)(q0 + i) * D + c], scale * a);
        }
      }
      __syncthreads();  // qs/dos/ps/dss are rewritten by the next query tile
    }
  }
  #pragma unroll
  for (int p = 0; p < PER; ++p) {
    const unsigned e = tid + p * ATTN_NT, j = e / D, c = e % D;
    if (k0 + j < tk) {
      dk[kvoff + (size_t)(k0 + j) * D + c] = store_as<T>(dk_acc[p]);
      dv[kvoff + (size_t)(k0 + j) * D + c] = store_as<T>(dv_acc[p]);
    }
  }
}

template <class T>
__device__ void attn_dq_convert_impl(const float* __restrict__ acc, T* __restrict__ dq, unsigned long long n) {
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    dq[i] = store_as<T>(acc[i]);
}

#define ATTN_FWD_PARAMS(T)                                                                                 \
  (const T* q, const T* k, const T* v, T* o, float* lse, unsigned nb, unsigned h, unsigned hkv, unsigned tq, \
   unsigned tk, float scale, int causal)
#define ATTN_FWD_ARGS (q, k, v, o, lse, nb, h, hkv, tq, tk, scale, causal)
#define ATTN_BWD_PARAMS(T)                                                                                   \
  (const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, float* dq_acc,   \
   T* dk, T* dv, unsigned nb, unsigned h, unsigned hkv, unsigned tq, unsigned tk, float scale, int causal)
#define ATTN_BWD_ARGS (q, k, v, dout, lse, delta, dq_acc, dk, dv, nb, h, hkv, tq, tk, scale, causal)
#define ATTN_DELTA_PARAMS(T) (const T* o, const T* dout, float* delta, unsigned rows, unsigned d)
#define ATTN_DELTA_ARGS (o, dout, delta, rows, d)
#define ATTN_CONV_PARAMS(T) (const float* acc, T* dq, unsigned long long n)
#define ATTN_CONV_ARGS (acc, dq, n)

#define ATTN_KERNELS_D(sfx, T, D)                                                                       \
  extern "C" __global__ void __launch_bounds__(ATTN_NT) attn_fwd_##sfx##_d##D ATTN_FWD_PARAMS(T) {      \
    attn_fwd_impl<T, D> ATTN_FWD_ARGS;                                                                  \
  }                                                                                                     \
  EMU_ENTRY(attn_fwd_##sfx##_d##D, ATTN_FWD_PARAMS(T), ATTN_FWD_ARGS)                                   \
  extern "C" __global__ void __launch_bounds__(ATTN_NT) attn_bwd_##sfx##_d##D ATTN_BWD_PARAMS(T) {      \
    attn_bwd_impl<T, D> ATTN_BWD_ARGS;                                                                  \
  }                                                                                                     \
  EMU_ENTRY(attn_bwd_##sfx##_d##D, ATTN_BWD_PARAMS(T), ATTN_BWD_ARGS)

#define ATTN_KERNELS(sfx, T)                                                                                \
  ATTN_KERNELS_D(sfx, T, 16)                                                                                \
  ATTN_KERNELS_D(sfx, T, 32)                                                                                \
  ATTN_KERNELS_D(sfx, T, 64)                                                                                \
  ATTN_KERNELS_D(sfx, T, 128)                                                                               \
  extern "C" __global__ void attn_bwd_delta_##sfx ATTN_DELTA_PARAMS(T) { attn_bwd_delta_impl<T> ATTN_DELTA_ARGS; } \
  EMU_ENTRY(attn_bwd_delta_##sfx, ATTN_DELTA_PARAMS(T), ATTN_DELTA_ARGS)                                    \
  extern "C" __global__ void attn_dq_convert_##sfx ATTN_CONV_PARAMS(T) { attn_dq_convert_impl<T> ATTN_CONV_ARGS; } \
  EMU_ENTRY(attn_dq_convert_##sfx, ATTN_CONV_PARAMS(T), ATTN_CONV_ARGS)

ATTN_KERNELS(f32, float)
ATTN_KERNELS(bf16, bf16)
