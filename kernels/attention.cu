// attention.cu — causal GQA flash attention (FlashAttention-2), forward and backward, f32 accumulation.
//
// Layouts: q, o, dq, do (B, H, Tq, D); k, v, dk, dv (B, Hkv, Tk, D); lse, delta (B, H, Tq) f32. k, v, dk,
// dv, dq and delta are contiguous; the rows of o and lse (forward) and of q, do and lse (backward) have a
// stride (`ldo`/`ldq` elements, `ldl` floats), so the kernels read and write the op's packed rows in place:
// the forward's O|lse rows (D + E elements, lse's f32 in the first slots after O) and the backward's
// [q | O | lse | dO | .] rows (3D + 2E), E = 1 for f32 and 8 for 16-bit types (lse's 4 bytes plus padding
// that keeps 16-bit rows 16-byte aligned for cp.async) — `ops::attention_shape::PackedRows`. Nothing is
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
// cores (mma.sync m16n8k16 + ldmatrix + cp.async, bf16/f16, D = 64 and 128, 8 warps; described below).
// The non-obvious decision: correctness first, proven by the host emulation (kernels/emu.h, whose twins of
// mma.sync/ldmatrix reproduce the PTX per-lane fragment layouts; tests/stage_model/attention_emu.rs) before any GPU
// sees it. Grids are 1-D (block index decoded into tile, head, batch) so the same entry macro serves the
// emulator.
// Document masks (packed sequences; `docs` non-null, causal only): docs (B, Tk) u32 holds, per key
// position, where its document starts, so query row i at position p sees keys docs[p] ..= p — one range,
// a lower bound beside the causal upper one (`ops::attention::DocStarts` says why this and not cu_seqlens).
// Starts are non-decreasing in p, so the forward begins at the key tile holding its first row's start (key
// tiles entirely before it are never loaded: the speed point of varlen), and the backward stops at the
// first query tile whose first row's document starts past the key tile's last key.
// Does not: wgmma/TMA (Hopper), cp.async in the FMA tiles (the tensor-core tiles double-buffer with it),
// deterministic dQ (atomics: summation order varies run to run on a GPU), dropout, sliding windows, head dims
// other than 16, 32, 64, 128 (tensor cores: 64, 128).
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

// ---- Tensor-core path (sm_80 mma.sync m16n8k16 + ldmatrix + cp.async; bf16/f16 inputs, f32 accumulation) ----
// Same math, masks, outputs and launch grids (1-D, decoded the same way) as the FMA kernels above, which stay
// the reference and the path for f32 inputs and small head dims; these run for 16-bit inputs at D = 64, 128.
// 8 warps (ATTN_TC_NT = 256 threads) per block in both passes. Every global -> shared tile is 16-byte
// cp.async copies in commit groups, double-buffered: tile j + 1 is in flight while tile j is computed.
// Forward: BQ = 128 query rows per block, 16 per warp (the warp's Q fragments stay in registers); K/V tiles
// of BK keys (32 at D = 128, 64 at D = 64) in two shared stages (rows padded by 8 elements: conflict-free
// ldmatrix) that reuse the Q tile's rows once every warp holds its Q fragments (so the static shared memory
// stays 34816 B at D = 128); one barrier per K/V tile. Per tile S = Q K^T (A = Q via ldmatrix_x4, B = K rows
// via ldmatrix_x4), masked, online softmax on the C fragments (a row's 4 lanes reduce with two shuffles), P
// re-packed from C to A fragments in registers (the C layout of two 8-column tiles is the A layout of one
// 16-wide k step), O += P V (B = V via ldmatrix_x4_trans). A warp skips the tiles none of its 16 rows can see
// (past its last row's causal limit, wholly before its first row's document start), so a 128-row tile pays
// for the diagonal only in each warp's own 16 x BK corner. P is rounded to the input type before P V (FA2's
// choice); the row sum l is f32. Why 128 rows and 8 warps: a thread holds the registers of 16 rows
// as with 4 warps x 16 rows, while every K/V byte loaded serves twice the queries: the emulated profile's
// forward sectors at T = 256 drop by a third and its roofline bound rises accordingly
// (benches/results/attention-design.md); 32 rows per warp would double the O accumulator (D/2 more
// floats per lane, past 255 registers at D = 128).
// Backward: one block per (b, kv head, BKB = 64 keys). Warp w works on the 16 keys kg = w % 4 and the half
// hf = w / 4: of the BQB queries of a tile for S^T = K Q^T and dP^T = V dO^T (A = K rows via ldmatrix and V
// as A fragments held in registers from the prologue; B = Q/dO rows via ldmatrix_x2), of the D columns for
// dV += P^T dO and dK += dS^T Q (A = P^T, dS^T from shared memory, B via ldmatrix_x4_trans). So a lane keeps
// dK, dV for 16 keys x D/2 columns in C fragments (registers) over all query tiles of the group's heads: half
// the 4-warp layout's accumulators, which is what held D = 128 at 241 registers. P^T = exp(scale S^T - lse),
// dS^T = P^T (dP^T - delta) go to shared memory (one barrier); dQ (BQB x D) = dS K with each warp owning
// 2 of the 8-column tiles (A = dS via ldmatrix_x4_trans of dS^T, B = K via ldmatrix_x4_trans), atomically
// added to the f32 dQ accumulator. Q/dO tiles (and lse, delta) stream through two cp.async stages that reuse
// the V tile's rows: two barriers per query tile. Inputs must be 16-byte aligned (the launcher checks).
// FA2's softmax details in both: scores in the log2 domain (scale folded into log2 e, exp2f; lse stays natural
// log at the boundary), and the mask evaluated only on tiles that straddle the diagonal, a document start or
// the ends of the sequence — a warp whose rows (forward) or keys x queries (backward) lie wholly inside every
// window skips it (`full`). Each dQ element gets one atomicAdd per (query tile, key tile) (the block sums its
// BKB keys first). `EARLY` (template, test-only, host emulation only) moves each cp.async wait after the reads
// it guards: a broken kernel whose tests must fail (tests/stage_model/attention_emu.rs).
#define ATTN_TC_NT 256

template <int D>
struct AttnTc {
  static constexpr int NW = ATTN_TC_NT / 32;                  // warps per block, both passes
  static constexpr int BQ = 16 * NW, BK = D >= 128 ? 32 : 64;  // forward tiles (query rows, keys)
  static constexpr int BKB = 64, BQB = D >= 128 ? 16 : 32;     // backward tiles (keys, queries)
  static constexpr int DP = D + 8;                              // padded shared row (elements)
};

// Rows [r0, r0 + n) of a (rows, D) tensor with row stride `ld` elements (a multiple of 8: 16-byte rows) into a
// padded shared tile, as 16-byte cp.async copies (the caller commits and waits); rows at or past `valid` are
// zero (plain stores).
template <class T, int D, int DP>
__device__ __forceinline__ void attn_tile_async(T (*dst)[DP], const T* src, unsigned r0, int n, unsigned valid,
                                                unsigned ld) {
  for (unsigned e = threadIdx.x; e < (unsigned)n * (D / 8); e += blockDim.x) {
    const unsigned r = e / (D / 8), c = e % (D / 8) * 8;
    if (r0 + r < valid) {
      cp_async16(&dst[r][c], src + (size_t)(r0 + r) * ld + c);
    } else {
      for (int i = 0; i < 8; ++i) dst[r][c + i] = store_as<T>(0.0f);
    }
  }
}

// One K/V tile of the forward for this warp's 16 rows (this lane's rows `row`, document starts `lo`): S = Q K^T,
// the mask unless `full`, the online softmax update of (m, lsum, acc) in the log2 domain, O += P V.
template <class T, int D>
__device__ __forceinline__ void attn_fwd_tc_tile(const uint32_t (&qf)[D / 16][4], T (*ks)[D + 8], T (*vs)[D + 8],
                                                 unsigned k0, bool full, const unsigned (&row)[2],
                                                 const unsigned (&lo)[2], unsigned tq, unsigned tk, int causal,
                                                 float sl2, float (&m)[2], float (&lsum)[2], float (&acc)[D / 8][4]) {
  constexpr int BK = AttnTc<D>::BK, KD = D / 16, NS = BK / 8, NO = D / 8;
  const unsigned l = threadIdx.x % 32, t = l % 4;
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
  #pragma unroll
  for (int n = 0; n < NS; ++n)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const unsigned r = row[e / 2], kj = k0 + n * 8 + 2 * t + (e & 1);
      const bool ok = full || (r < tq && kj < tk && (!causal || (long)kj <= attn_qpos(r, tq, tk)) && kj >= lo[e / 2]);
      s[n][e] = ok ? s[n][e] * sl2 : -INFINITY;
      mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
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
}

// The forward's epilogue for this lane's two rows: O = acc / l (0 for a row that saw no key) and
// lse = m ln 2 + ln l (-inf), after summing l over the row's 4 lanes.
template <class T, int D>
__device__ __forceinline__ void attn_fwd_tc_out(T* o, float* lse, size_t row0, const unsigned (&row)[2], unsigned tq,
                                                unsigned ldo, unsigned ldl, const float (&m)[2], float (&lsum)[2],
                                                const float (&acc)[D / 8][4]) {
  const unsigned t = threadIdx.x % 4;
  #pragma unroll
  for (int i = 0; i < 2; ++i) {
    lsum[i] += __shfl_xor_sync(0xffffffffu, lsum[i], 1);
    lsum[i] += __shfl_xor_sync(0xffffffffu, lsum[i], 2);
  }
  #pragma unroll
  for (int n = 0; n < D / 8; ++n)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const unsigned r = row[e / 2];
      const float lv = lsum[e / 2];
      if (r < tq) o[(row0 + r) * ldo + n * 8 + 2 * t + (e & 1)] = store_as<T>(lv > 0.0f ? acc[n][e] / lv : 0.0f);
    }
  #pragma unroll
  for (int i = 0; i < 2; ++i)
    if (t == 0 && row[i] < tq)
      lse[(row0 + row[i]) * ldl] = lsum[i] > 0.0f ? m[i] * 0.6931471805599453f + logf(lsum[i]) : -INFINITY;
}

template <class T, int D, bool EARLY>
__device__ void attn_fwd_tc_impl(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                 T* __restrict__ o, float* __restrict__ lse, const unsigned* __restrict__ docs,
                                 unsigned nb, unsigned h, unsigned hkv, unsigned tq, unsigned tk, float scale,
                                 int causal, unsigned ldo, unsigned ldl) {
  using P = AttnTc<D>;
  constexpr int BQ = P::BQ, BK = P::BK, DP = P::DP, KD = D / 16, NO = D / 8;
  constexpr int ROWS = BQ > 4 * BK ? BQ : 4 * BK;
  __shared__ __align__(16) T buf[ROWS][DP];  // the Q tile, then two stages of (K tile, V tile)
  const unsigned l = threadIdx.x % 32, w = threadIdx.x / 32, g = l / 4;
  const unsigned ntiles = (tq + BQ - 1) / BQ;
  const unsigned qt = blockIdx.x % ntiles, bh = blockIdx.x / ntiles, bi = bh / h, hi = bh % h;
  const unsigned kvh = bi * hkv + hi / (h / hkv), q0 = qt * BQ;
  const T* kh = k + (size_t)kvh * tk * D;
  const T* vh = v + (size_t)kvh * tk * D;
  attn_tile_async<T, D, DP>(buf, q + (size_t)bh * tq * D, q0, BQ, tq, D);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  uint32_t qf[KD][4];  // this warp's 16 query rows as A fragments, one per 16-wide k step
  #pragma unroll
  for (int kk = 0; kk < KD; ++kk) ldmatrix_x4(qf[kk], &buf[w * 16 + l % 8 + (l / 8) % 2 * 8][kk * 16 + l / 16 * 8]);
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
  // a key tile inside every row window of this warp's 16 rows needs no mask; row windows grow with the row,
  // so the first row bounds the causal side and the last row the document side
  const unsigned wr0 = q0 + w * 16;
  const bool rows_full = wr0 + 16 <= tq;
  const long wlimit = attn_qpos(wr0, tq, tk);
  const unsigned wlo = rows_full ? attn_lo(docs, bi, wr0 + 15, tq, tk) : 0u;
  // keys this warp's rows see at all, [wfirst, wend): tiles outside are loaded for the other warps only
  const long wend = wr0 >= tq ? 0 : causal ? attn_qpos(wr0 + 15 < tq ? wr0 + 15 : tq - 1, tq, tk) + 1 : (long)tk;
  const unsigned wfirst = attn_lo(docs, bi, wr0, tq, tk);
  __syncthreads();  // every warp holds its Q fragments: the Q rows become the K/V stages
  if (kstart < (unsigned)kend) {
    attn_tile_async<T, D, DP>(buf, kh, kstart, BK, tk, D);
    attn_tile_async<T, D, DP>(buf + BK, vh, kstart, BK, tk, D);
    cp_async_commit();
  }
  unsigned stage = 0;
  for (unsigned k0 = kstart; k0 < (unsigned)kend; k0 += BK, stage ^= 1) {
    if (!EARLY) cp_async_wait<0>();  // this thread's copies of tile k0 have landed ...
    __syncthreads();  // ... and every thread's; every warp is done with tile k0 - BK, whose stage is refilled now
    if (k0 + BK < (unsigned)kend) {
      attn_tile_async<T, D, DP>(buf + (stage ^ 1) * 2 * BK, kh, k0 + BK, BK, tk, D);
      attn_tile_async<T, D, DP>(buf + (stage ^ 1) * 2 * BK + BK, vh, k0 + BK, BK, tk, D);
      cp_async_commit();
    }
    if ((long)k0 < wend && k0 + BK > wfirst) {  // warp-uniform
      const bool full = rows_full && k0 + BK <= tk && (!causal || (long)(k0 + BK - 1) <= wlimit) && k0 >= wlo;
      attn_fwd_tc_tile<T, D>(qf, buf + stage * 2 * BK, buf + stage * 2 * BK + BK, k0, full, row, lo, tq, tk, causal,
                             sl2, m, lsum, acc);
    }
    if (EARLY) cp_async_wait<0>();  // the broken test variant: the wait after the reads it guards
  }
  attn_fwd_tc_out<T, D>(o, lse, (size_t)bh * tq, row, tq, ldo, ldl, m, lsum, acc);
}

// S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys (kg) x BQB/2 queries (half hf) of the query tile at q0,
// then P^T = exp2(S^T scale log2 e - lse log2 e) (masked unless the warp's block of the tile is `full`) and
// dS^T = P^T (dP^T - delta), both written to shared memory (keys x queries, in the input type).
template <class T, int D>
__device__ __forceinline__ void attn_bwd_tc_scores(T (*ks)[D + 8], T (*qs)[D + 8], T (*dos)[D + 8],
                                                   const uint32_t (&vf)[D / 16][4], const float* lse_s,
                                                   const float* delta_s, const unsigned* lo_s,
                                                   T (*pst)[AttnTc<D>::BQB + 8], T (*dst)[AttnTc<D>::BQB + 8],
                                                   const unsigned* docs, unsigned bi, unsigned k0, unsigned q0,
                                                   unsigned tq, unsigned tk, int causal, float sl2) {
  constexpr int QH = AttnTc<D>::BQB / 2, NS = QH / 8, KD = D / 16;
  const unsigned l = threadIdx.x % 32, w = threadIdx.x / 32, kg = w % 4, hf = w / 4, g = l / 4, t = l % 4;
  const unsigned kw0 = k0 + kg * 16, qh0 = hf * QH, qw0 = q0 + qh0;
  // every query of the warp's half sees all 16 of its keys: no mask (and every such row has a finite lse)
  const bool full = kw0 + 16 <= tk && qw0 + QH <= tq && (!causal || (long)(kw0 + 15) <= attn_qpos(qw0, tq, tk)) &&
                    kw0 >= attn_lo(docs, bi, qw0 + QH - 1, tq, tk);
  float st[NS][4], dpt[NS][4];  // S^T and dP^T: the warp's 16 keys x QH queries
  #pragma unroll
  for (int n = 0; n < NS; ++n)
    #pragma unroll
    for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.0f;
  #pragma unroll
  for (int kk = 0; kk < KD; ++kk) {
    uint32_t ka[4];
    ldmatrix_x4(ka, &ks[kg * 16 + l % 8 + (l / 8) % 2 * 8][kk * 16 + l / 16 * 8]);
    #pragma unroll
    for (int n = 0; n < NS; ++n) {
      uint32_t qb[2], db[2];  // queries n*8.. (n) x d kk*16.. (k), from the rows of Q and dO
      ldmatrix_x2(qb, &qs[qh0 + n * 8 + l % 8][kk * 16 + (l / 8) % 2 * 8]);
      ldmatrix_x2(db, &dos[qh0 + n * 8 + l % 8][kk * 16 + (l / 8) % 2 * 8]);
      mma_16816<T>(st[n], ka, qb);
      mma_16816<T>(dpt[n], vf[kk], db);
    }
  }
  #pragma unroll
  for (int n = 0; n < NS; ++n)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const unsigned kj = kw0 + g + (e >= 2 ? 8 : 0), qc = qh0 + n * 8 + 2 * t + (e & 1), qi = q0 + qc;
      const bool ok = full || (qi < tq && kj < tk && lse_s[qc] != -INFINITY &&
                               (!causal || (long)kj <= attn_qpos(qi, tq, tk)) && kj >= lo_s[qc]);
      const float p = ok ? exp2f(st[n][e] * sl2 - lse_s[qc]) : 0.0f;
      st[n][e] = p;
      dpt[n][e] = p * (dpt[n][e] - delta_s[qc]);  // dS^T
    }
  #pragma unroll
  for (int n = 0; n < NS; ++n)
    #pragma unroll
    for (int i = 0; i < 2; ++i) {  // rows g (i = 0) and g + 8: two adjacent queries per 4-byte store
      const unsigned r = kg * 16 + g + 8 * i, c = qh0 + n * 8 + 2 * t;
      sst(reinterpret_cast<uint32_t*>(&pst[r][c]), pack2<T>(st[n][2 * i], st[n][2 * i + 1]));
      sst(reinterpret_cast<uint32_t*>(&dst[r][c]), pack2<T>(dpt[n][2 * i], dpt[n][2 * i + 1]));
    }
}

// dV += P^T dO and dK += dS^T Q for this warp's 16 keys x D/2 columns (k = the tile's BQB queries); dQ
// (BQB x D) += scale dS K for the warp's 16 x 16 part, one atomicAdd per element (zero sums skipped).
template <class T, int D>
__device__ __forceinline__ void attn_bwd_tc_grads(T (*ks)[D + 8], T (*qs)[D + 8], T (*dos)[D + 8],
                                                  T (*pst)[AttnTc<D>::BQB + 8], T (*dst)[AttnTc<D>::BQB + 8],
                                                  float (&dka)[D / 16][4], float (&dva)[D / 16][4], float* dqh,
                                                  unsigned q0, unsigned tq, float scale) {
  constexpr int BQ = AttnTc<D>::BQB, BK = AttnTc<D>::BKB, NO = D / 16, DQW = D / 16;
  static_assert(BQ / 16 * DQW == AttnTc<D>::NW, "dQ's 16 x 16 tiles must split evenly over the warps");
  const unsigned l = threadIdx.x % 32, w = threadIdx.x / 32, kg = w % 4, hf = w / 4, g = l / 4, t = l % 4;
  #pragma unroll
  for (int kt = 0; kt < BQ / 16; ++kt) {
    uint32_t pa[4], sa[4];  // P^T, dS^T: the warp's 16 keys (m) x queries kt*16.. (k)
    ldmatrix_x4(pa, &pst[kg * 16 + l % 8 + (l / 8) % 2 * 8][kt * 16 + l / 16 * 8]);
    ldmatrix_x4(sa, &dst[kg * 16 + l % 8 + (l / 8) % 2 * 8][kt * 16 + l / 16 * 8]);
    #pragma unroll
    for (int n = 0; n < NO; n += 2) {
      uint32_t b[4];  // queries kt*16.. (k) x d c0.., c0+8.. (n), transposed from the rows of dO and Q
      const unsigned c0 = hf * (D / 2) + n * 8;
      ldmatrix_x4_trans(b, &dos[kt * 16 + l % 8 + (l / 8) % 2 * 8][c0 + l / 16 * 8]);
      mma_16816<T>(dva[n], pa, b);
      mma_16816<T>(dva[n + 1], pa, b + 2);
      ldmatrix_x4_trans(b, &qs[kt * 16 + l % 8 + (l / 8) % 2 * 8][c0 + l / 16 * 8]);
      mma_16816<T>(dka[n], sa, b);
      mma_16816<T>(dka[n + 1], sa, b + 2);
    }
  }
  const unsigned mt = w / DQW, n0 = w % DQW * 2;  // this warp's dQ tile: rows mt*16.., columns n0*8.. (16)
  float dqa[2][4];
  #pragma unroll
  for (int n = 0; n < 2; ++n) dqa[n][0] = dqa[n][1] = dqa[n][2] = dqa[n][3] = 0.0f;
  #pragma unroll
  for (int kt = 0; kt < BK / 16; ++kt) {
    uint32_t a[4], b[4];  // dS rows mt*16.. (m) x keys kt*16.. (k); K keys kt*16.. (k) x d n0*8.. (n)
    ldmatrix_x4_trans(a, &dst[kt * 16 + l % 8 + l / 16 * 8][mt * 16 + (l / 8) % 2 * 8]);
    ldmatrix_x4_trans(b, &ks[kt * 16 + l % 8 + (l / 8) % 2 * 8][n0 * 8 + l / 16 * 8]);
    mma_16816<T>(dqa[0], a, b);
    mma_16816<T>(dqa[1], a, b + 2);
  }
  #pragma unroll
  for (int n = 0; n < 2; ++n)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const unsigned qi = q0 + mt * 16 + g + (e >= 2 ? 8 : 0);
      if (qi < tq && dqa[n][e] != 0.0f) atomicAdd(&dqh[(size_t)qi * D + (n0 + n) * 8 + 2 * t + (e & 1)], scale * dqa[n][e]);
    }
}

template <class T, int D, bool EARLY>
__device__ void attn_bwd_tc_impl(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                 const T* __restrict__ dout, const float* __restrict__ lse,
                                 const float* __restrict__ delta, const unsigned* __restrict__ docs,
                                 float* __restrict__ dq_acc, T* __restrict__ dk, T* __restrict__ dv, unsigned nb,
                                 unsigned h, unsigned hkv, unsigned tq, unsigned tk, float scale, int causal,
                                 unsigned ldq, unsigned ldl) {
  using P = AttnTc<D>;
  constexpr int BK = P::BKB, BQ = P::BQB, DP = P::DP, KD = D / 16, NO = D / 16;
  constexpr int QROWS = 4 * BQ > BK ? 4 * BQ : BK;
  __shared__ __align__(16) T ks[BK][DP];
  __shared__ __align__(16) T qv[QROWS][DP];    // the V tile, then two stages of (Q tile, dO tile)
  __shared__ __align__(16) T pst[BK][BQ + 8];  // P^T (keys x queries)
  __shared__ __align__(16) T dst[BK][BQ + 8];  // dS^T
  __shared__ float lse_s[2][BQ], delta_s[2][BQ];
  __shared__ unsigned lo_s[2][BQ];
  const unsigned l = threadIdx.x % 32, w = threadIdx.x / 32, kg = w % 4, hf = w / 4, g = l / 4, t = l % 4;
  const unsigned ntiles = (tk + BK - 1) / BK;
  const unsigned kt0 = blockIdx.x % ntiles, bg = blockIdx.x / ntiles, bi = bg / hkv, gi = bg % hkv;
  const unsigned rep = h / hkv, k0 = kt0 * BK;
  const size_t kvoff = (size_t)bg * tk * D;
  attn_tile_async<T, D, DP>(ks, k + kvoff, k0, BK, tk, D);
  attn_tile_async<T, D, DP>(qv, v + kvoff, k0, BK, tk, D);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  uint32_t vf[KD][4];  // the warp's 16 keys of V as A fragments (dP^T = V dO^T), held: qv takes Q/dO next
  #pragma unroll
  for (int kk = 0; kk < KD; ++kk) ldmatrix_x4(vf[kk], &qv[kg * 16 + l % 8 + (l / 8) % 2 * 8][kk * 16 + l / 16 * 8]);
  float dka[NO][4], dva[NO][4];  // the warp's 16 keys x columns hf*D/2.. (NO tiles of 8)
  #pragma unroll
  for (int n = 0; n < NO; ++n)
    #pragma unroll
    for (int e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.0f;
  unsigned qstart = 0;  // first query row that can see key k0: qpos(i) >= k0
  if (causal) {
    const long first = (long)k0 - ((long)tk - (long)tq);
    qstart = first > 0 ? (unsigned)first / BQ * BQ : 0;
  }
  // query tiles met per head: from qstart until a tile's first row's document starts past this key tile
  unsigned nqt = 0;
  while (qstart + nqt * BQ < tq && attn_lo(docs, bi, qstart + nqt * BQ, tq, tk) < k0 + BK) ++nqt;
  const unsigned total = rep * nqt;  // (head, query tile) pairs, head-major
  // pair `it` into stage `s`: Q and dO rows by cp.async (committed as one group), lse (log2 domain), delta
  // and document starts by plain loads
  auto load = [&](unsigned it, unsigned s) {
    const unsigned q0 = qstart + it % nqt * BQ, bh = bi * h + gi * rep + it / nqt;
    attn_tile_async<T, D, DP>(qv + s * 2 * BQ, q + (size_t)bh * tq * ldq, q0, BQ, tq, ldq);
    attn_tile_async<T, D, DP>(qv + s * 2 * BQ + BQ, dout + (size_t)bh * tq * ldq, q0, BQ, tq, ldq);
    cp_async_commit();
    for (unsigned i = threadIdx.x; i < (unsigned)BQ; i += blockDim.x) {
      const bool in = q0 + i < tq;
      lse_s[s][i] = in ? lse[((size_t)bh * tq + q0 + i) * ldl] * 1.4426950408889634f : -INFINITY;
      delta_s[s][i] = in ? delta[(size_t)bh * tq + q0 + i] : 0.0f;
      lo_s[s][i] = attn_lo(docs, bi, q0 + i, tq, tk);
    }
  };
  __syncthreads();  // every warp holds its V fragments: the V rows become the Q/dO stages
  if (total > 0) load(0, 0);
  const float sl2 = scale * 1.4426950408889634f;  // P = exp2(s scale log2 e - lse log2 e), as in the forward
  for (unsigned it = 0; it < total; ++it) {
    const unsigned s = it & 1, q0 = qstart + it % nqt * BQ, bh = bi * h + gi * rep + it / nqt;
    if (!EARLY) cp_async_wait<0>();  // this thread's copies of pair `it` have landed ...
    __syncthreads();  // ... and every thread's; pair it - 1 is done (its stage, P^T and dS^T are free)
    if (it + 1 < total) load(it + 1, s ^ 1);
    T(*qs)[DP] = qv + s * 2 * BQ;
    T(*dos)[DP] = qs + BQ;
    attn_bwd_tc_scores<T, D>(ks, qs, dos, vf, lse_s[s], delta_s[s], lo_s[s], pst, dst, docs, bi, k0, q0, tq, tk,
                             causal, sl2);
    if (EARLY) cp_async_wait<0>();  // the broken test variant: the wait after the reads it guards
    __syncthreads();                // P^T and dS^T of the whole tile are in shared memory
    attn_bwd_tc_grads<T, D>(ks, qs, dos, pst, dst, dka, dva, dq_acc + (size_t)bh * tq * D, q0, tq, scale);
  }
  #pragma unroll
  for (int n = 0; n < NO; ++n)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const unsigned kj = k0 + kg * 16 + g + (e >= 2 ? 8 : 0);
      if (kj < tk) {
        const size_t at = kvoff + (size_t)kj * D + hf * (D / 2) + n * 8 + 2 * t + (e & 1);
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
  extern "C" __global__ void __launch_bounds__(ATTN_TC_NT) attn_fwd_tc_##sfx##_d##D ATTN_FWD_PARAMS(T) {\
    attn_fwd_tc_impl<T, D, false> ATTN_FWD_ARGS;                                                        \
  }                                                                                                     \
  EMU_ENTRY(attn_fwd_tc_##sfx##_d##D, ATTN_FWD_PARAMS(T), ATTN_FWD_ARGS)                                \
  extern "C" __global__ void __launch_bounds__(ATTN_TC_NT) attn_bwd_tc_##sfx##_d##D ATTN_BWD_PARAMS(T) {\
    attn_bwd_tc_impl<T, D, false> ATTN_BWD_ARGS;                                                        \
  }                                                                                                     \
  EMU_ENTRY(attn_bwd_tc_##sfx##_d##D, ATTN_BWD_PARAMS(T), ATTN_BWD_ARGS)

ATTN_KERNELS(f32, float)
ATTN_KERNELS(bf16, bf16)
ATTN_KERNELS(f16, __half)
ATTN_TC_KERNELS_D(bf16, bf16, 64)
ATTN_TC_KERNELS_D(bf16, bf16, 128)
ATTN_TC_KERNELS_D(f16, __half, 64)
ATTN_TC_KERNELS_D(f16, __half, 128)

// Test-only, host emulation only (never an nvcc entry: an unused inline device function emits no PTX): the
// tensor-core tiles with each cp.async wait moved after the reads it guards (`EARLY`), bf16, D = 64.
__device__ __forceinline__ void attn_fwd_tc_early_bf16_d64 ATTN_FWD_PARAMS(bf16) {
  attn_fwd_tc_impl<bf16, 64, true> ATTN_FWD_ARGS;
}
EMU_ENTRY(attn_fwd_tc_early_bf16_d64, ATTN_FWD_PARAMS(bf16), ATTN_FWD_ARGS)
__device__ __forceinline__ void attn_bwd_tc_early_bf16_d64 ATTN_BWD_PARAMS(bf16) {
  attn_bwd_tc_impl<bf16, 64, true> ATTN_BWD_ARGS;
}
EMU_ENTRY(attn_bwd_tc_early_bf16_d64, ATTN_BWD_PARAMS(bf16), ATTN_BWD_ARGS)
