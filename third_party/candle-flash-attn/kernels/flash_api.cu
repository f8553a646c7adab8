#include "kernels.h"
#include "kernel_helpers.h"
#include "flash_fwd_launch_template.h"

thread_local cudaError_t harpe_flash_error = cudaSuccess;

// harpe: the text of run_mha's return code, for the error src/lib.rs reports.
extern "C" const char *harpe_flash_error_string(int err) {
    return cudaGetErrorString(static_cast<cudaError_t>(err));
}

void run_mha_fwd(Flash_fwd_params &params, cudaStream_t stream) {
  FP16_SWITCH(!params.is_bf16, [&] {
      BOOL_SWITCH(params.is_causal, Is_causal, [&] {
          if (params.block_table != nullptr) {
              // harpe's trimmed copy compiles no split-KV kernels, the only ones that understand paged KV;
              // src/lib.rs refuses a block table before a launch, and this is the backstop.
              harpe_not_compiled("paged KV (block_table) of head dim", int(params.d));
          } else {
              HEADDIM_SWITCH(params.d, [&] {
                  run_mha_fwd_<elem_type, kHeadDim, Is_causal>(params, stream);
              });
          }
      });
  });
}

// harpe: returns the first CUDA error of the launch (0: none), instead of nothing.
extern "C" int run_mha(
    void *q_ptr,
    void *k_ptr,
    void *v_ptr,
    void *o_ptr,
    void *softmax_lse_ptr,
    void *alibi_slopes_ptr,

    int32_t *cu_seqlens_q_ptr,
    int32_t *cu_seqlens_k_ptr,

    uint32_t q_batch_stride,
    uint32_t k_batch_stride,
    uint32_t v_batch_stride,
    uint32_t o_batch_stride,
    uint32_t alibi_slopes_batch_stride,

    uint32_t q_row_stride,
    uint32_t k_row_stride,
    uint32_t v_row_stride,
    uint32_t o_row_stride,

    uint32_t q_head_stride,
    uint32_t k_head_stride,
    uint32_t v_head_stride,
    uint32_t o_head_stride,

    uint32_t b,
    uint32_t h,
    uint32_t h_k,
    uint32_t d,
    uint32_t d_rounded,
    float softmax_scale,

    uint32_t seqlen_q,
    uint32_t seqlen_k,
    uint32_t seqlen_q_rounded,
    uint32_t seqlen_k_rounded,
    uint32_t total_q,

    int is_bf16,
    int is_causal,
    int unpadded_lse,

    int window_size_left,
    int window_size_right,

    float softcap,

    int32_t *block_table_ptr,
    uint32_t block_table_batch_stride,
    int page_block_size,

    int32_t *mm_prefix_ranges_ptr,
    uint32_t mm_prefix_range_batch_stride,
    int max_mm_prefix_ranges,
    void *stream_ptr
) {
    Flash_fwd_params params;
    // Reset the parameters
    memset(&params, 0, sizeof(params));

    // Set the pointers and strides.
    params.q_ptr = q_ptr;
    params.k_ptr = k_ptr;
    params.v_ptr = v_ptr;
    params.o_ptr = o_ptr;

    params.softmax_lse_ptr = softmax_lse_ptr;
    params.alibi_slopes_ptr = alibi_slopes_ptr;

    // All stride are in elements, not bytes.
    params.q_batch_stride = q_batch_stride;
    params.k_batch_stride = k_batch_stride;
    params.v_batch_stride = v_batch_stride;
    params.o_batch_stride = o_batch_stride;
    params.alibi_slopes_batch_stride = alibi_slopes_batch_stride;

    params.q_row_stride = q_row_stride;
    params.k_row_stride = k_row_stride;
    params.v_row_stride = v_row_stride;
    params.o_row_stride = o_row_stride;
    params.q_head_stride = q_head_stride;
    params.k_head_stride = k_head_stride;
    params.v_head_stride = v_head_stride;
    params.o_head_stride = o_head_stride;

    // Set the dimensions.
    params.b = b;
    params.h = h;
    params.h_k = h_k;
    params.h_h_k_ratio = h / h_k;
    params.seqlen_q = seqlen_q;
    params.seqlen_k = seqlen_k;
    params.seqlen_q_rounded = seqlen_q_rounded;
    params.seqlen_k_rounded = seqlen_k_rounded;
    params.total_q = total_q;
    params.d = d;
    params.d_rounded = d_rounded;

    // Set the different scale values.
    if (softcap > 0.0) {
        params.softcap = softmax_scale / softcap;
        params.scale_softmax = softcap;
        params.scale_softmax_log2 = softcap * M_LOG2E;
    } else{
        // Remove potential NaN
        params.softcap = 0.0;
        params.scale_softmax = softmax_scale;
        params.scale_softmax_log2 = softmax_scale * M_LOG2E;
    }

    params.p_dropout = 1.; // probability to keep
    params.p_dropout_in_uint8_t = uint8_t(std::floor(params.p_dropout * 255.0));
    params.rp_dropout = 1.f / params.p_dropout;
    params.scale_softmax_rp_dropout = params.rp_dropout * params.scale_softmax;
    params.is_bf16 = is_bf16;
    params.cu_seqlens_q = cu_seqlens_q_ptr;
    params.cu_seqlens_k = cu_seqlens_k_ptr;
    params.p_ptr = nullptr; // used for `return_softmax`.
    params.seqused_k = nullptr;
    params.block_table = block_table_ptr;
    params.block_table_batch_stride = block_table_batch_stride;
    params.page_block_size = page_block_size;
    params.mm_prefix_ranges = mm_prefix_ranges_ptr;
    params.mm_prefix_range_batch_stride = mm_prefix_range_batch_stride;
    params.max_mm_prefix_ranges = max_mm_prefix_ranges;

    params.is_causal = is_causal;
    params.window_size_left = window_size_left;
    params.window_size_right = window_size_right;

    params.is_seqlens_k_cumulative = true;
    params.num_splits = 1;
    params.unpadded_lse = unpadded_lse;

    cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_ptr);
    // an error left pending by someone else's runtime call is not this launch's
    (void)cudaGetLastError();
    harpe_flash_error = cudaSuccess;
    run_mha_fwd(params, stream);
    return static_cast<int>(harpe_flash_error);
}

// harpe: FlashAttention-2's forward and backward for training, from parameters harpe computes and tests in
// plain Rust (its src/ops/flash2_params.rs, against what upstream flash_api.cpp's mha_fwd, mha_varlen_fwd,
// mha_bwd and mha_varlen_bwd put into Flash_fwd_params / Flash_bwd_params for the same shapes). This file
// only copies them over, so the values the kernels see are the ones those tests check. The field order is
// harpe_fa2_args's in that Rust file; harpe_fa2_args_size lets the Rust side refuse a struct of another size.
struct harpe_fa2_args {
    // device pointers
    void *q_ptr, *k_ptr, *v_ptr, *o_ptr, *softmax_lse_ptr;
    void *do_ptr, *dq_ptr, *dk_ptr, *dv_ptr, *dq_accum_ptr, *dsoftmax_sum;
    int *cu_seqlens_q, *cu_seqlens_k;
    uint64_t *rng_state;
    // strides, in elements
    int64_t q_batch_stride, k_batch_stride, v_batch_stride, o_batch_stride;
    int64_t q_row_stride, k_row_stride, v_row_stride, o_row_stride;
    int64_t q_head_stride, k_head_stride, v_head_stride, o_head_stride;
    int64_t do_batch_stride, dq_batch_stride, dk_batch_stride, dv_batch_stride;
    int64_t do_row_stride, dq_row_stride, dk_row_stride, dv_row_stride;
    int64_t do_head_stride, dq_head_stride, dk_head_stride, dv_head_stride;
    int64_t dq_accum_split_stride;
    // sizes
    int32_t b, h, h_k, h_h_k_ratio, d, d_rounded;
    int32_t seqlen_q, seqlen_k, seqlen_q_rounded, seqlen_k_rounded, total_q;
    int32_t window_size_left, window_size_right;
    // scales
    float scale_softmax, scale_softmax_log2, softcap;
    float p_dropout, rp_dropout, scale_softmax_rp_dropout;
    // flags (0/1) and the dropout threshold
    int32_t p_dropout_in_uint8_t, is_bf16, is_causal, unpadded_lse, deterministic;
};

extern "C" size_t harpe_fa2_args_size() {
    return sizeof(harpe_fa2_args);
}

static void harpe_fill_fwd(Flash_fwd_params &params, const harpe_fa2_args &a) {
    memset(&params, 0, sizeof(params));
    params.q_ptr = a.q_ptr;
    params.k_ptr = a.k_ptr;
    params.v_ptr = a.v_ptr;
    params.o_ptr = a.o_ptr;
    params.softmax_lse_ptr = a.softmax_lse_ptr;
    params.q_batch_stride = a.q_batch_stride;
    params.k_batch_stride = a.k_batch_stride;
    params.v_batch_stride = a.v_batch_stride;
    params.o_batch_stride = a.o_batch_stride;
    params.q_row_stride = a.q_row_stride;
    params.k_row_stride = a.k_row_stride;
    params.v_row_stride = a.v_row_stride;
    params.o_row_stride = a.o_row_stride;
    params.q_head_stride = a.q_head_stride;
    params.k_head_stride = a.k_head_stride;
    params.v_head_stride = a.v_head_stride;
    params.o_head_stride = a.o_head_stride;
    params.b = a.b;
    params.h = a.h;
    params.h_k = a.h_k;
    params.h_h_k_ratio = a.h_h_k_ratio;
    params.d = a.d;
    params.d_rounded = a.d_rounded;
    params.seqlen_q = a.seqlen_q;
    params.seqlen_k = a.seqlen_k;
    params.seqlen_q_rounded = a.seqlen_q_rounded;
    params.seqlen_k_rounded = a.seqlen_k_rounded;
    params.total_q = a.total_q;
    params.cu_seqlens_q = a.cu_seqlens_q;
    params.cu_seqlens_k = a.cu_seqlens_k;
    params.scale_softmax = a.scale_softmax;
    params.scale_softmax_log2 = a.scale_softmax_log2;
    params.softcap = a.softcap;
    params.p_dropout = a.p_dropout;
    params.p_dropout_in_uint8_t = uint8_t(a.p_dropout_in_uint8_t);
    params.rp_dropout = a.rp_dropout;
    params.scale_softmax_rp_dropout = a.scale_softmax_rp_dropout;
    params.rng_state = a.rng_state;
    params.is_bf16 = a.is_bf16 != 0;
    params.is_causal = a.is_causal != 0;
    params.window_size_left = a.window_size_left;
    params.window_size_right = a.window_size_right;
    params.is_seqlens_k_cumulative = true;
    params.num_splits = 1;
    params.unpadded_lse = a.unpadded_lse != 0;
}

// The CUDA error of a call harpe made that this copy cannot run (src/lib.rs refuses it first; this is the
// backstop that keeps a wrong call from launching a kernel that was never compiled).
static int harpe_refuse() {
    return static_cast<int>(cudaErrorNotSupported);
}

extern "C" int harpe_mha_fwd(const harpe_fa2_args *a, void *stream_ptr) {
    if (a->d != 64 && a->d != 128) return harpe_refuse();
    Flash_fwd_params params;
    harpe_fill_fwd(params, *a);
    (void)cudaGetLastError();
    harpe_flash_error = cudaSuccess;
    run_mha_fwd(params, reinterpret_cast<cudaStream_t>(stream_ptr));
    return static_cast<int>(harpe_flash_error);
}

// The backward instantiations this copy compiles: bf16 and fp16, causal, head dims 64 and 128
// (flash_bwd_*.cu); run_mha_bwd refuses anything else before it gets here.
static void run_mha_bwd_dispatch(Flash_bwd_params &params, cudaStream_t stream) {
    FP16_SWITCH(!params.is_bf16, [&] {
        if (params.d == 64) {
            run_mha_bwd_<elem_type, 64, true>(params, stream);
        } else {
            run_mha_bwd_<elem_type, 128, true>(params, stream);
        }
    });
}

// mha_bwd / mha_varlen_bwd's launch (flash_api.cpp), less what harpe does around it: the caller allocates
// dq_accum (f32) and softmax_d, and sums dK, dV over the query heads of a kv head for GQA.
extern "C" int run_mha_bwd(const harpe_fa2_args *a, void *stream_ptr) {
    if (!a->is_causal || (a->d != 64 && a->d != 128) || a->p_dropout != 1.f || a->softcap != 0.f ||
        a->deterministic) {
        return harpe_refuse();
    }
    Flash_bwd_params params;
    harpe_fill_fwd(params, *a);
    params.do_ptr = a->do_ptr;
    params.dq_ptr = a->dq_ptr;
    params.dk_ptr = a->dk_ptr;
    params.dv_ptr = a->dv_ptr;
    params.dq_accum_ptr = a->dq_accum_ptr;
    params.dk_accum_ptr = nullptr;
    params.dv_accum_ptr = nullptr;
    params.dsoftmax_sum = a->dsoftmax_sum;
    params.do_batch_stride = a->do_batch_stride;
    params.dq_batch_stride = a->dq_batch_stride;
    params.dk_batch_stride = a->dk_batch_stride;
    params.dv_batch_stride = a->dv_batch_stride;
    params.do_row_stride = a->do_row_stride;
    params.dq_row_stride = a->dq_row_stride;
    params.dk_row_stride = a->dk_row_stride;
    params.dv_row_stride = a->dv_row_stride;
    params.do_head_stride = a->do_head_stride;
    params.dq_head_stride = a->dq_head_stride;
    params.dk_head_stride = a->dk_head_stride;
    params.dv_head_stride = a->dv_head_stride;
    params.deterministic = a->deterministic != 0;
    params.dq_accum_split_stride = a->dq_accum_split_stride;
    (void)cudaGetLastError();
    harpe_flash_error = cudaSuccess;
    if (params.seqlen_q > 0) {
        run_mha_bwd_dispatch(params, reinterpret_cast<cudaStream_t>(stream_ptr));
    }
    return static_cast<int>(harpe_flash_error);
}
