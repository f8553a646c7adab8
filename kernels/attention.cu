// attention.cu — causal GQA flash attention (FlashAttention-2), forward and backward, f32 accumulation.
//
// Layouts: q, o, dq, do (B, H, Tq, D); k, v, dk, dv (B, Hkv, Tk, D); lse, delta (B, H, Tq) f32. k, v, dk,
// dv, dq and delta are contiguous; the rows of o and lse (forward) and of q, do and lse (backward) have a
// stride (`ldo`/`ldq` elements, `ldl` floats), so the kernels read and write the op's packed rows in place:
// the forward's O|lse rows (D + E elements, lse's f32 in the first slots after O) and the backward's
// [q | O | lse | dO | .] rows (3D + 2E), E = 1 for f32 and 8 for 16-bit types (lse's 4 bytes plus padding
// that keeps 16-bit rows 16-byte aligned for copy16) — `ops::attention_shape::PackedRows`. Nothing is
// converted to f32 but lse, delta and the dQ accumulator. Query head h reads kv head h / (H / Hkv) directly (no repeated K/V copy). Causal: query row i
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
// Two sets of tiles: `attn_{fwd,bwd}_*` are plain FMA loops over shared memory (every dtype, every head
// dim: the readable reference and the f32 path), `attn_{fwd,bwd}_tc_*` the same algorithm on sm_80 tensor
// cores (mma.sync m16n8k16 + ldmatrix, bf16/f16, D = 64 and 128; described at their definition below).
// The non-obvious decision: correctness first, proven by the host emulation (kernels/emu.h, whose twins of
// mma.sync/ldmatrix reproduce the PTX per-lane fragment layouts; tests/attention_emu.rs) before any GPU
// sees it. Grids are 1-D (block index decoded into tile, head, batch) so the same entry macro serves the
// emulator.
// Document masks (packed sequences; `docs` non-null, causal only): docs (B, Tk) u32 holds, per key
// position, where its document starts, so query row i at position p sees keys docs[p] ..= p — one range,
// a lower bound beside the causal upper one (`ops::attention::DocStarts` says why this and not cu_seqlens).
// Starts are non-decreasing in p, so the forward begins at the key tile holding its first row's start (key
// tiles entirely before it are never loaded: the speed point of varlen), and the backward stops at the
// first query tile whose first row's document starts past the key tile's last key.
// Does not: wgmma/TMA (Hopper), cp.async double buffering (the instructions are in kernels/mma.cuh and the
// emulator, not yet in these loops), 128-row forward tiles, deterministic dQ (atomics: summation order
// varies run to run on a GPU), dropout, sliding windows, head dims other than 16, 32, 64, 128 (tensor
// cores: 64, 128).
#include "common.cuh"

#define ATTN_NT 128

template <int D>
struct AttnTile {
  static constexpr int BQ = D >= 128 ? 16 : 32;
  static constexpr int BK = BQ;
};

// Absolute key position of query row i.
__device__ __forceinline__ long attn_qpos(unsigned i, unsigned tq, unsigned tk) { return (long)tk - (long)tq + (long)i; }

// First key query row i of sequence bi may see under the document mask (0 without one, or for a padded row).
__device__ __forceinline__ unsigned attn_lo(const unsigned* docs, unsigned bi, unsigned i, unsigned tq, unsigned tk) {
  const long p = attn_qpos(i, tq, tk);
  return docs && i < tq && p >= 0 ? docs[(size_t)bi * tk + p] : 0u;
}

template <class T, int D>
__device__ void attn_fwd_impl(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              T* __restrict__ o, float* __restrict__ lse, const unsigned* __restrict__ docs,
                              unsigned nb, unsigned h, unsigned hkv, unsigned tq, unsigned tk, float scale,
                              int causal, unsigned ldo, unsigned ldl) {
  constexpr int BQ = AttnTile<D>::BQ, BK = AttnTile<D>::BK, PER = BQ * D / ATTN_NT;
  __shared__ float qs[BQ][D];
  __shared__ float ks[BK][D];
  __shared__ float vs[BK][D];
  __shared__ float ss[BQ][BK];
  __shared__ float row_m[BQ], row_l[BQ], row_corr[BQ];
  __shared__ unsigned row_lo[BQ];
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
    row_lo[tid] = attn_lo(docs, bi, q0 + tid, tq, tk);
  }
  float acc[PER];
  #pragma unroll
  for (int p = 0; p < PER; ++p) acc[p] = 0.0f;
  // keys this tile can see: all, or up to the causal position of its last valid row
  const unsigned last = (q0 + BQ < tq ? q0 + BQ : tq) - 1;
  long kend = causal ? attn_qpos(last, tq, tk) + 1 : (long)tk;
  if (kend > (long)tk) kend = tk;
  if (kend < 0) kend = 0;
  // document mask: key tiles before the first row's document start are skipped
  const unsigned kstart = attn_lo(docs, bi, q0, tq, tk) / BK * BK;
  __syncthreads();

  for (unsigned k0 = kstart; k0 < (unsigned)kend; k0 += BK) {
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
      const bool ok = q0 + r < tq && kj < tk && (!causal || (long)kj <= attn_qpos(q0 + r, tq, tk)) && kj >= row_lo[r];
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

  T* oh = o + ((size_t)bh * tq + q0) * ldo;  // this tile's first output row
  #pragma unroll
  for (int p = 0; p < PER; ++p) {
    const unsigned e = tid + p * ATTN_NT, r = e / D, c = e % D;
    if (q0 + r < tq) {
      const float l = row_l[r];
      oh[r * ldo + c] = store_as<T>(l > 0.0f ? acc[p] / l : 0.0f);
    }
  }
  if (tid < BQ && q0 + tid < tq) {
    const float l = row_l[tid];
    lse[((size_t)bh * tq + q0 + tid) * ldl] = l > 0.0f ? row_m[tid] + logf(l) : -INFINITY;
  }
}

// delta_i = dO_i . O_i over `rows` rows of D (row stride `ld` elements for O and dO); one warp per row.
template <class T>
__device__ void attn_bwd_delta_impl(const T* __restrict__ o, const T* __restrict__ dout, float* __restrict__ delta,
                                    unsigned rows, unsigned d, unsigned ld) {
  const unsigned lane = threadIdx.x % 32, wpb = blockDim.x / 32;
  for (unsigned row = blockIdx.x * wpb + threadIdx.x / 32; row < rows; row += gridDim.x * wpb) {
    float s = 0.0f;
    for (unsigned c = lane; c < d; c += 32) s += load_f32(o[(size_t)row * ld + c]) * load_f32(dout[(size_t)row * ld + c]);
    s = warp_sum(s);
    if (lane == 0) delta[row] = s;
  }
}

template <class T, int D>
__device__ void attn_bwd_impl(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              const T* __restrict__ dout, const float* __restrict__ lse,
                              const float* __restrict__ delta, const unsigned* __restrict__ docs,
                              float* __restrict__ dq_acc, T* __restrict__ dk, T* __restrict__ dv, unsigned nb,
                              unsigned h, unsigned hkv, unsigned tq, unsigned tk, float scale, int causal,
                              unsigned ldq, unsigned ldl) {
  constexpr int BQ = AttnTile<D>::BQ, BK = AttnTile<D>::BK, PER = BK * D / ATTN_NT;
  __shared__ float ks[BK][D];
  __shared__ float vs[BK][D];
  __shared__ float qs[BQ][D];
  __shared__ float dos[BQ][D];
  __shared__ float ps[BQ][BK];
  __shared__ float dss[BQ][BK];
  __shared__ float lse_s[BQ], delta_s[BQ];
  __shared__ unsigned lo_s[BQ];
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
    const T* qh = q + (size_t)bh * tq * ldq;
    const T* doh = dout + (size_t)bh * tq * ldq;
    float* dqh = dq_acc + (size_t)bh * tq * D;
    for (unsigned q0 = qstart; q0 < tq; q0 += BQ) {
      // document mask: this and every later query tile start their documents past this key tile
      if (attn_lo(docs, bi, q0, tq, tk) >= k0 + BK) break;
      for (unsigned e = tid; e < BQ * D; e += ATTN_NT) {
        const unsigned i = e / D, c = e % D;
        const bool in = q0 + i < tq;
        qs[i][c] = in ? load_f32(qh[(size_t)(q0 + i) * ldq + c]) : 0.0f;
        dos[i][c] = in ? load_f32(doh[(size_t)(q0 + i) * ldq + c]) : 0.0f;
      }
      if (tid < BQ) {
        const bool in = q0 + tid < tq;
        lse_s[tid] = in ? lse[((size_t)bh * tq + q0 + tid) * ldl] : -INFINITY;
        delta_s[tid] = in ? delta[(size_t)bh * tq + q0 + tid] : 0.0f;
        lo_s[tid] = attn_lo(docs, bi, q0 + tid, tq, tk);
      }
      __syncthreads();
      for (unsigned e = tid; e < BQ * BK; e += ATTN_NT) {
        const unsigned i = e / BK, j = e % BK, kj = k0 + j;
        const bool ok = q0 + i < tq && kj < tk && lse_s[i] != -INFINITY &&
                        (!causal || (long)kj <= attn_qpos(q0 + i, tq, tk)) && kj >= lo_s[i];
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

// ---- Tensor-core path (sm_80 mma.sync m16n8k16 + ldmatrix; bf16 and f16 inputs, f32 accumulation) ----
// Same math, masks, outputs and launch grids (1-D, decoded the same way) as the FMA kernels above, which stay
// the reference and the path for f32 inputs and small head dims; these run for 16-bit inputs at D = 64, 128.
// 4 warps per block. Forward: BQ = 64 query rows per block, 16 per warp (the warp's Q fragments stay in
// registers); K/V tiles of BK keys in shared memory (rows padded by 8 elements: conflict-free ldmatrix);
// per tile S = Q K^T (A = Q via ldmatrix_x4, B = K rows via ldmatrix_x4), masked, online softmax on the C
// fragments (a row's 4 lanes reduce with two shuffles), P re-packed from C to A fragments in registers (the
// C layout of two 8-column tiles is the A layout of one 16-wide k step), O += P V (B = V via
// ldmatrix_x4_trans). P is rounded to the input type before P V (FA2's choice); the row sum l is f32.
// Backward: one block per (b, kv head, BK = 64 keys), 16 keys per warp; dK, dV of the warp's keys in C
// fragments (registers) over all query tiles (BQ rows) of the group's heads; per tile S^T = K Q^T and
// dP^T = V dO^T (A from K/V rows, B from Q/dO rows, both ldmatrix_x4), P^T = exp(scale S^T - lse),
// dS^T = P^T (dP^T - delta); dV += P^T dO and dK += dS^T Q (A re-packed from C, B via ldmatrix_x4_trans);
// dS^T goes to shared memory, and the block computes dQ (BQ x D) = dS K with each warp owning 4 of the
// 8-column tiles (A = dS via ldmatrix_x4_trans of dS^T, B = K via ldmatrix_x4_trans), atomically added to
// the f32 dQ accumulator. Inputs must be 16-byte aligned (the launcher checks; copy16 loads).
// FA2's softmax details in both: scores in the log2 domain (scale folded into log2 e, exp2f; lse stays natural
// log at the boundary), and the mask evaluated only on tiles that straddle the diagonal, a document start or
// the ends of the sequence — a warp whose rows (forward) or keys (backward) lie wholly inside every window
// skips it (`full`). Each dQ element gets one atomicAdd per (query tile, key tile) (the block sums its BK keys
// first).
template <int D>
struct AttnTc {
  static constexpr int NW = 4, BQ = 64, BK = D >= 128 ? 32 : 64;  // forward tiles
  static constexpr int BKB = 64, BQB = D >= 128 ? 16 : 32;        // backward tiles (keys, queries)
  static constexpr int DP = D + 8;                                  // padded shared row (elements)
};

// Rows [r0, r0 + n) of a (rows, D) tensor with row stride `ld` elements (a multiple of 8: 16-byte rows) into a
// padded shared tile; rows at or past `valid` are zero.
template <class T, int D, int DP>
__device__ __forceinline__ void attn_tile_load(T (*dst)[DP], const T* src, unsigned r0, int n, unsigned valid,
                                               unsigned ld) {
  for (unsigned e = threadIdx.x; e < (unsigned)n * (D / 8); e += blockDim.x) {
    const unsigned r = e / (D / 8), c = e % (D / 8) * 8;
    if (r0 + r < valid) {
      copy16(&dst[r][c], src + (size_t)(r0 + r) * ld + c);
    } else {
      for (int i = 0; i < 8; ++i) dst[r][c + i] = store_as<T>(0.0f);
    }
  }
}

template <class T, int D>
__device__ void attn_fwd_tc_impl(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                 T* __restrict__ o, float* __restrict__ lse, const unsigned* __restrict__ docs,
                                 unsigned nb, unsigned h, unsigned hkv, unsigned tq, unsigned tk, float scale,
                                 int causal, unsigned ldo, unsigned ldl) {
  using P = AttnTc<D>;
  constexpr int BQ = P::BQ, BK = P::BK, DP = P::DP, KD = D / 16, NS = BK / 8, NO = D / 8;
  __shared__ __align__(16) T qs[BQ][DP];
  __shared__ __align__(16) T ks[BK][DP];
  __shared__ __align__(16) T vs[BK][DP];
  const unsigned l = threadIdx.x % 32, w = threadIdx.x / 32, g = l / 4, t = l % 4;
  const unsigned ntiles = (tq + BQ - 1) / BQ;
  const unsigned qt = blockIdx.x % ntiles, bh = blockIdx.x / ntiles, bi = bh / h, hi = bh % h;
  const unsigned kvh = bi * hkv + hi / (h / hkv), q0 = qt * BQ;
  const T* kh = k + (size_t)kvh * tk * D;
  const T* vh = v + (size_t)kvh * tk * D;
  attn_tile_load<T, D, DP>(qs, q + (size_t)bh * tq * D, q0, BQ, tq, D);
  __syncthreads();
  uint32_t qf[KD][4];  // this warp's 16 query rows as A fragments, one per 16-wide k step
  #pragma unroll
  for (int kk = 0; kk < KD; ++kk) ldmatrix_x4(qf[kk], &qs[w * 16 + l % 8 + (l / 8) % 2 * 8][kk * 16 + l / 16 * 8]);
  // this lane's two rows: g and g + 8 of the warp's 16
  const unsigned row[2] = {q0 + w * 16 + g, q0 + w * 16 + g + 8};
  const unsigned lo[2] = {attn_lo(docs, bi, row[0], tq, tk), attn_lo(docs, bi, row[1], tq, tk)};
  float m[2] = {-INFINITY, -INFINITY}, lsum[2] = {0.0f, 0.0f};
  float acc[NO][4];
  #pragma unroll
  for (int n = 0; n < NO; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  const unsigned last = (q0 + BQ < tq ? q0 + BQ : tq) - 1;
  long kend = causal ? attn_qpos(last, tq, tk) + 1 : (long)tk;
  if (kend > (long)tk) kend = tk;
  if (kend < 0) kend = 0;
  const unsigned kstart = attn_lo(docs, bi, q0, tq, tk) / BK * BK;  // document mask: earlier tiles skipped
  // scores in the log2 domain (FA2): s = q.k * scale * log2(e), p = exp2(s - m); lse = m ln 2 + ln l
  const float sl2 = scale * 1.4426950408889634f;
  // a key tile inside every row window of this warp's 16 rows needs no mask (FA2: masks only on the tiles
  // that straddle the diagonal, a document start or the ends); row windows grow with the row, so the first
  // row bounds the causal side and the last row the document side
  const unsigned wr0 = q0 + w * 16;
  const bool rows_full = wr0 + 16 <= tq;
  const long wlimit = attn_qpos(wr0, tq, tk);
  const unsigned wlo = rows_full ? attn_lo(docs, bi, wr0 + 15, tq, tk) : 0u;

  for (unsigned k0 = kstart; k0 < (unsigned)kend; k0 += BK) {
    const bool full = rows_full && k0 + BK <= tk && (!causal || (long)(k0 + BK - 1) <= wlimit) && k0 >= wlo;
    attn_tile_load<T, D, DP>(ks, kh, k0, BK, tk, D);
    attn_tile_load<T, D, DP>(vs, vh, k0, BK, tk, D);
    __syncthreads();
    float s[NS][4];
    #pragma unroll
    for (int n = 0; n < NS; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      #pragma unroll
      for (int kk = 0; kk < KD; kk += 2) {
        uint32_t b[4];  // keys n*8.., d kk*16.. (b[0..1]) and (kk+1)*16.. (b[2..3])
        ldmatrix_x4(b, &ks[n * 8 + l % 8][kk * 16 + l / 8 * 8]);
        mma_16816<T>(s[n], qf[kk], b);
        mma_16816<T>(s[n], qf[kk + 1], b + 2);
      }
    }
    float mx[2] = {-INFINITY, -INFINITY};
    if (full) {  // warp-uniform
      #pragma unroll
      for (int n = 0; n < NS; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[n][e] *= sl2;
          mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
        }
    } else {
      #pragma unroll
      for (int n = 0; n < NS; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const unsigned r = row[e / 2], kj = k0 + n * 8 + 2 * t + (e & 1);
          const bool ok = r < tq && kj < tk && (!causal || (long)kj <= attn_qpos(r, tq, tk)) && kj >= lo[e / 2];
          s[n][e] = ok ? s[n][e] * sl2 : -INFINITY;
          mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
        }
    }
    float corr[2];
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
      const float mnew = fmaxf(m[i], mx[i]);
      corr[i] = mnew == -INFINITY || m[i] == -INFINITY ? (mnew == -INFINITY ? 1.0f : 0.0f) : exp2f(m[i] - mnew);
      m[i] = mnew;
      lsum[i] *= corr[i];
    }
    #pragma unroll
    for (int n = 0; n < NS; ++n)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = s[n][e] == -INFINITY ? 0.0f : exp2f(s[n][e] - m[e / 2]);
        s[n][e] = p;
        lsum[e / 2] += p;  // this lane's part of the row sum; the row's 4 lanes are summed at the end
      }
    #pragma unroll
    for (int n = 0; n < NO; ++n)
      #pragma unroll
      for (int e = 0; e < 4; ++e) acc[n][e] *= corr[e / 2];
    #pragma unroll
    for (int kt = 0; kt < BK / 16; ++kt) {
      const uint32_t a[4] = {pack2<T>(s[2 * kt][0], s[2 * kt][1]), pack2<T>(s[2 * kt][2], s[2 * kt][3]),
                             pack2<T>(s[2 * kt + 1][0], s[2 * kt + 1][1]), pack2<T>(s[2 * kt + 1][2], s[2 * kt + 1][3])};
      #pragma unroll
      for (int n = 0; n < NO; n += 2) {
        uint32_t b[4];  // V keys kt*16.. (k) x d n*8.. and (n+1)*8.. (n), transposed from V's rows
        ldmatrix_x4_trans(b, &vs[kt * 16 + l % 8 + (l / 8) % 2 * 8][n * 8 + l / 16 * 8]);
        mma_16816<T>(acc[n], a, b);
        mma_16816<T>(acc[n + 1], a, b + 2);
      }
    }
    __syncthreads();  // ks/vs are rewritten by the next tile
  }

  #pragma unroll
  for (int i = 0; i < 2; ++i) {
    lsum[i] += __shfl_xor_sync(0xffffffffu, lsum[i], 1);
    lsum[i] += __shfl_xor_sync(0xffffffffu, lsum[i], 2);
  }
  #pragma unroll
  for (int n = 0; n < NO; ++n)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const unsigned r = row[e / 2];
      const float lv = lsum[e / 2];
      if (r < tq) o[((size_t)bh * tq + r) * ldo + n * 8 + 2 * t + (e & 1)] = store_as<T>(lv > 0.0f ? acc[n][e] / lv : 0.0f);
    }
  #pragma unroll
  for (int i = 0; i < 2; ++i)
    if (t == 0 && row[i] < tq)
      lse[((size_t)bh * tq + row[i]) * ldl] = lsum[i] > 0.0f ? m[i] * 0.6931471805599453f + logf(lsum[i]) : -INFINITY;
}

template <class T, int D>
__device__ void attn_bwd_tc_impl(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                 const T* __restrict__ dout, const float* __restrict__ lse,
                                 const float* __restrict__ delta, const unsigned* __restrict__ docs,
                                 float* __restrict__ dq_acc, T* __restrict__ dk, T* __restrict__ dv, unsigned nb,
                                 unsigned h, unsigned hkv, unsigned tq, unsigned tk, float scale, int causal,
                                 unsigned ldq, unsigned ldl) {
  using P = AttnTc<D>;
  constexpr int BK = P::BKB, BQ = P::BQB, DP = P::DP, KD = D / 16, NS = BQ / 8, NO = D / 8;
  constexpr int WPM = D / 32;  // warps per 16-row m tile of dQ (each owns 4 of its D/8 column tiles)
  static_assert(BQ / 16 * WPM == P::NW, "dQ tiles must split evenly over the warps");
  __shared__ __align__(16) T ks[BK][DP];
  __shared__ __align__(16) T vs[BK][DP];
  __shared__ __align__(16) T qs[BQ][DP];
  __shared__ __align__(16) T dos[BQ][DP];
  __shared__ __align__(16) T dst[BK][BQ + 8];  // dS^T (keys x queries)
  __shared__ float lse_s[BQ], delta_s[BQ];
  __shared__ unsigned lo_s[BQ];
  const unsigned l = threadIdx.x % 32, w = threadIdx.x / 32, g = l / 4, t = l % 4;
  const unsigned ntiles = (tk + BK - 1) / BK;
  const unsigned kt0 = blockIdx.x % ntiles, bg = blockIdx.x / ntiles, bi = bg / hkv, gi = bg % hkv;
  const unsigned rep = h / hkv, k0 = kt0 * BK;
  const size_t kvoff = (size_t)bg * tk * D;
  attn_tile_load<T, D, DP>(ks, k + kvoff, k0, BK, tk, D);
  attn_tile_load<T, D, DP>(vs, v + kvoff, k0, BK, tk, D);
  // this lane's two key rows: g and g + 8 of the warp's 16
  const unsigned key[2] = {k0 + w * 16 + g, k0 + w * 16 + g + 8};
  const unsigned kw0 = k0 + w * 16;                 // this warp's first key
  const float sl2 = scale * 1.4426950408889634f;  // P = exp2(s scale log2 e - lse log2 e), as in the forward
  float dka[NO][4], dva[NO][4];
  #pragma unroll
  for (int n = 0; n < NO; ++n)
    #pragma unroll
    for (int e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.0f;
  unsigned qstart = 0;
  if (causal) {
    const long first = (long)k0 - ((long)tk - (long)tq);
    qstart = first > 0 ? (unsigned)first / BQ * BQ : 0;
  }
  const unsigned mt = w / WPM, n0 = w % WPM * 4;  // this warp's dQ tile: rows mt*16.., column tiles n0..n0+3

  for (unsigned r = 0; r < rep; ++r) {
    const unsigned bh = bi * h + gi * rep + r;
    float* dqh = dq_acc + (size_t)bh * tq * D;
    for (unsigned q0 = qstart; q0 < tq; q0 += BQ) {
      // document mask: this and every later query tile start their documents past this key tile
      if (attn_lo(docs, bi, q0, tq, tk) >= k0 + BK) break;
      __syncthreads();  // the previous tile's readers of qs/dos/dst are done (and ks/vs are loaded)
      attn_tile_load<T, D, DP>(qs, q + (size_t)bh * tq * ldq, q0, BQ, tq, ldq);
      attn_tile_load<T, D, DP>(dos, dout + (size_t)bh * tq * ldq, q0, BQ, tq, ldq);
      for (unsigned i = threadIdx.x; i < (unsigned)BQ; i += blockDim.x) {
        const bool in = q0 + i < tq;
        lse_s[i] = in ? lse[((size_t)bh * tq + q0 + i) * ldl] * 1.4426950408889634f : -INFINITY;  // log2 domain
        delta_s[i] = in ? delta[(size_t)bh * tq + q0 + i] : 0.0f;
        lo_s[i] = attn_lo(docs, bi, q0 + i, tq, tk);
      }
      __syncthreads();
      // every query of the tile sees all 16 keys of this warp: no mask (and every such row has a finite lse)
      const bool full = kw0 + 16 <= tk && q0 + BQ <= tq && (!causal || (long)(kw0 + 15) <= attn_qpos(q0, tq, tk)) &&
                        kw0 >= attn_lo(docs, bi, q0 + BQ - 1 < tq ? q0 + BQ - 1 : q0, tq, tk);
      float st[NS][4], dpt[NS][4];  // S^T and dP^T: the warp's 16 keys x BQ queries
      #pragma unroll
      for (int n = 0; n < NS; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.0f;
      #pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        uint32_t ka[4], va[4];
        ldmatrix_x4(ka, &ks[w * 16 + l % 8 + (l / 8) % 2 * 8][kk * 16 + l / 16 * 8]);
        ldmatrix_x4(va, &vs[w * 16 + l % 8 + (l / 8) % 2 * 8][kk * 16 + l / 16 * 8]);
        #pragma unroll
        for (int n = 0; n < NS; ++n) {
          uint32_t qb[2], db[2];  // queries n*8.. (n) x d kk*16.. (k), from the rows of Q and dO
          ldmatrix_x2(qb, &qs[n * 8 + l % 8][kk * 16 + (l / 8) % 2 * 8]);
          ldmatrix_x2(db, &dos[n * 8 + l % 8][kk * 16 + (l / 8) % 2 * 8]);
          mma_16816<T>(st[n], ka, qb);
          mma_16816<T>(dpt[n], va, db);
        }
      }
      #pragma unroll
      for (int n = 0; n < NS; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const unsigned kj = key[e / 2], qc = n * 8 + 2 * t + (e & 1), qi = q0 + qc;
          const bool ok = full || (qi < tq && kj < tk && lse_s[qc] != -INFINITY &&
                                   (!causal || (long)kj <= attn_qpos(qi, tq, tk)) && kj >= lo_s[qc]);
          const float p = ok ? exp2f(st[n][e] * sl2 - lse_s[qc]) : 0.0f;
          st[n][e] = p;
          dpt[n][e] = p * (dpt[n][e] - delta_s[qc]);  // dS^T
        }
      #pragma unroll
      for (int kt = 0; kt < BQ / 16; ++kt) {
        const uint32_t pa[4] = {pack2<T>(st[2 * kt][0], st[2 * kt][1]), pack2<T>(st[2 * kt][2], st[2 * kt][3]),
                                pack2<T>(st[2 * kt + 1][0], st[2 * kt + 1][1]),
                                pack2<T>(st[2 * kt + 1][2], st[2 * kt + 1][3])};
        const uint32_t sa[4] = {pack2<T>(dpt[2 * kt][0], dpt[2 * kt][1]), pack2<T>(dpt[2 * kt][2], dpt[2 * kt][3]),
                                pack2<T>(dpt[2 * kt + 1][0], dpt[2 * kt + 1][1]),
                                pack2<T>(dpt[2 * kt + 1][2], dpt[2 * kt + 1][3])};
        #pragma unroll
        for (int n = 0; n < NO; n += 2) {
          uint32_t b[4];  // queries kt*16.. (k) x d n*8.., (n+1)*8.. (n), transposed from the rows
          ldmatrix_x4_trans(b, &dos[kt * 16 + l % 8 + (l / 8) % 2 * 8][n * 8 + l / 16 * 8]);
          mma_16816<T>(dva[n], pa, b);
          mma_16816<T>(dva[n + 1], pa, b + 2);
          ldmatrix_x4_trans(b, &qs[kt * 16 + l % 8 + (l / 8) % 2 * 8][n * 8 + l / 16 * 8]);
          mma_16816<T>(dka[n], sa, b);
          mma_16816<T>(dka[n + 1], sa, b + 2);
        }
      }
      #pragma unroll
      for (int n = 0; n < NS; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) dst[w * 16 + g + (e >= 2 ? 8 : 0)][n * 8 + 2 * t + (e & 1)] = store_as<T>(dpt[n][e]);
      __syncthreads();
      float dqa[4][4];
      #pragma unroll
      for (int n = 0; n < 4; ++n) dqa[n][0] = dqa[n][1] = dqa[n][2] = dqa[n][3] = 0.0f;
      #pragma unroll
      for (int kt = 0; kt < BK / 16; ++kt) {
        uint32_t a[4];  // dS rows mt*16.. (m) x keys kt*16.. (k), transposed from dS^T's rows
        ldmatrix_x4_trans(a, &dst[kt * 16 + l % 8 + l / 16 * 8][mt * 16 + (l / 8) % 2 * 8]);
        #pragma unroll
        for (int n = 0; n < 4; n += 2) {
          uint32_t b[4];  // K keys kt*16.. (k) x d (n0+n)*8.. (n), transposed from K's rows
          ldmatrix_x4_trans(b, &ks[kt * 16 + l % 8 + (l / 8) % 2 * 8][(n0 + n) * 8 + l / 16 * 8]);
          mma_16816<T>(dqa[n], a, b);
          mma_16816<T>(dqa[n + 1], a, b + 2);
        }
      }
      #pragma unroll
      for (int n = 0; n < 4; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const unsigned qi = q0 + mt * 16 + g + (e >= 2 ? 8 : 0);
          if (qi < tq && dqa[n][e] != 0.0f)
            atomicAdd(&dqh[(size_t)qi * D + (n0 + n) * 8 + 2 * t + (e & 1)], scale * dqa[n][e]);
        }
    }
  }
  #pragma unroll
  for (int n = 0; n < NO; ++n)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const unsigned kj = key[e / 2];
      if (kj < tk) {
        const size_t at = kvoff + (size_t)kj * D + n * 8 + 2 * t + (e & 1);
        dk[at] = store_as<T>(scale * dka[n][e]);
        dv[at] = store_as<T>(dva[n][e]);
      }
    }
}

#define ATTN_FWD_PARAMS(T)                                                                                 \
  (const T* q, const T* k, const T* v, T* o, float* lse, const unsigned* docs, unsigned nb, unsigned h,      \
   unsigned hkv, unsigned tq, unsigned tk, float scale, int causal, unsigned ldo, unsigned ldl)
#define ATTN_FWD_ARGS (q, k, v, o, lse, docs, nb, h, hkv, tq, tk, scale, causal, ldo, ldl)
#define ATTN_BWD_PARAMS(T)                                                                                   \
  (const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,                  \
   const unsigned* docs, float* dq_acc, T* dk, T* dv, unsigned nb, unsigned h, unsigned hkv, unsigned tq,     \
   unsigned tk, float scale, int causal, unsigned ldq, unsigned ldl)
#define ATTN_BWD_ARGS (q, k, v, dout, lse, delta, docs, dq_acc, dk, dv, nb, h, hkv, tq, tk, scale, causal, ldq, ldl)
#define ATTN_DELTA_PARAMS(T) (const T* o, const T* dout, float* delta, unsigned rows, unsigned d, unsigned ld)
#define ATTN_DELTA_ARGS (o, dout, delta, rows, d, ld)
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

#define ATTN_TC_KERNELS_D(sfx, T, D)                                                                     \
  extern "C" __global__ void __launch_bounds__(ATTN_NT) attn_fwd_tc_##sfx##_d##D ATTN_FWD_PARAMS(T) {   \
    attn_fwd_tc_impl<T, D> ATTN_FWD_ARGS;                                                               \
  }                                                                                                     \
  EMU_ENTRY(attn_fwd_tc_##sfx##_d##D, ATTN_FWD_PARAMS(T), ATTN_FWD_ARGS)                                \
  extern "C" __global__ void __launch_bounds__(ATTN_NT, 1) attn_bwd_tc_##sfx##_d##D ATTN_BWD_PARAMS(T) {\
    attn_bwd_tc_impl<T, D> ATTN_BWD_ARGS;                                                               \
  }                                                                                                     \
  EMU_ENTRY(attn_bwd_tc_##sfx##_d##D, ATTN_BWD_PARAMS(T), ATTN_BWD_ARGS)

ATTN_KERNELS(f32, float)
ATTN_KERNELS(bf16, bf16)
ATTN_KERNELS(f16, __half)
ATTN_TC_KERNELS_D(bf16, bf16, 64)
ATTN_TC_KERNELS_D(bf16, bf16, 128)
ATTN_TC_KERNELS_D(f16, __half, 64)
ATTN_TC_KERNELS_D(f16, __half, 128)
