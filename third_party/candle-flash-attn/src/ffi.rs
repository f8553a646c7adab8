use core::ffi::{c_int, c_void};

extern "C" {
    pub(crate) fn run_mha(
        q_ptr: *const c_void,
        k_ptr: *const c_void,
        v_ptr: *const c_void,
        o_ptr: *const c_void,
        softmax_lse_ptr: *const c_void,
        alibi_slopes_ptr: *const c_void,

        cu_seqlens_q_ptr: *const i32,
        cu_seqlens_k_ptr: *const i32,

        q_batch_stride: u32,
        k_batch_stride: u32,
        v_batch_stride: u32,
        o_batch_stride: u32,
        alibi_slopes_batch_stride: u32,

        q_row_stride: u32,
        k_row_stride: u32,
        v_row_stride: u32,
        o_row_stride: u32,

        q_head_stride: u32,
        k_head_stride: u32,
        v_head_stride: u32,
        o_head_stride: u32,

        b: u32,
        h: u32,
        h_k: u32,
        d: u32,
        d_rounded: u32,
        softmax_scale: f32,

        seqlen_q: u32,
        seqlen_k: u32,
        seqlen_q_rounded: u32,
        seqlen_k_rounded: u32,
        total_q: u32,

        is_bf16: c_int,
        is_causal: c_int,
        unpadded_lse: c_int,

        window_size_left: c_int,
        window_size_right: c_int,

        softcap: f32,

        block_table_ptr: *const i32,
        block_table_batch_stride: u32,
        page_block_size: c_int,

        mm_prefix_ranges_ptr: *const i32,
        mm_prefix_range_batch_stride: u32,
        max_mm_prefix_ranges: c_int,
        stream_ptr: *mut c_void,
    ) -> c_int;

    // harpe: the text of a CUDA error code run_mha returned.
    pub(crate) fn harpe_flash_error_string(err: c_int) -> *const core::ffi::c_char;

    // harpe: FA2's forward and backward from a filled harpe_fa2_args (flash_api.cu).
    pub(crate) fn harpe_fa2_args_size() -> usize;
    pub(crate) fn harpe_mha_fwd(args: *const c_void, stream_ptr: *mut c_void) -> c_int;
    pub(crate) fn run_mha_bwd(args: *const c_void, stream_ptr: *mut c_void) -> c_int;

}
