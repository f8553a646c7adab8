//! FlashAttention-2's launch parameters for `ops::flash2`, computed in plain Rust: every size, stride, scale,
//! window and workspace length that upstream's `csrc/flash_attn/flash_api.cpp` (release 2.8.3: `mha_fwd`,
//! `mha_varlen_fwd`, `mha_bwd`, `mha_varlen_bwd`, `set_params_fprop`, `set_params_dgrad`) puts into
//! `Flash_fwd_params` / `Flash_bwd_params` for the same shapes, so that `cargo test` checks them on any
//! machine; the C side (third_party/candle-flash-attn/kernels/flash_api.cu, `harpe_fa2_args`) copies the
//! struct field by field.
//!
//! Layouts (harpe always hands FA2 contiguous tensors): q, O, dO, dQ (B*T, H, D); k, v (B*T, Hkv, D); dK, dV
//! as FA2 writes them, (B*T, H, D) — one gradient per query head, summed over a kv head's group afterwards,
//! as `mha_bwd` does for GQA. Dense (no `cu_seqlens`): the rows are (B, T) and lse is (B, H, T); varlen
//! (`cu_seqlens`, the documents of packed sequences): B is the number of documents, T the longest, and lse
//! is (H, B*T) (`unpadded_lse`).
//! The non-obvious decision: causal is FA2's "window (left = seqlen_k, right = 0)" form, as
//! `set_params_fprop` rewrites it, not (-1, 0); the kernels read both the flag and the window.
//! Not here: dropout, ALiBi, softcapping, local windows, the deterministic backward (harpe's build does not
//! compile them; the values are FA2's "off" ones).
use std::f32::consts::LOG2_E;

/// One attention call's shape, as FA2 sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fa2Shape {
    /// Sequences (dense) or documents (varlen).
    pub b: usize,
    /// Query heads H and kv heads Hkv.
    pub h: usize,
    pub hkv: usize,
    /// Head dim D.
    pub d: usize,
    /// Tokens per sequence (dense) or the longest document (varlen).
    pub max_seqlen: usize,
    /// All query (= key) rows: B*T.
    pub total: usize,
    /// Documents through `cu_seqlens` (FA2's varlen entry) rather than B equal sequences.
    pub varlen: bool,
    pub causal: bool,
    pub scale: f32,
    pub is_bf16: bool,
}

/// `mha_*`'s `round_multiple`.
fn round_multiple(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// The parameters `harpe_fa2_args` carries (third_party/candle-flash-attn/kernels/flash_api.cu: the same
/// fields in the same order; `harpe_fa2_args_size` guards the size). Pointers are device addresses, 0 =
/// null; strides are in elements.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Fa2Args {
    pub q_ptr: u64,
    pub k_ptr: u64,
    pub v_ptr: u64,
    pub o_ptr: u64,
    pub softmax_lse_ptr: u64,
    pub do_ptr: u64,
    pub dq_ptr: u64,
    pub dk_ptr: u64,
    pub dv_ptr: u64,
    pub dq_accum_ptr: u64,
    pub dsoftmax_sum: u64,
    pub cu_seqlens_q: u64,
    pub cu_seqlens_k: u64,
    pub rng_state: u64,
    pub q_batch_stride: i64,
    pub k_batch_stride: i64,
    pub v_batch_stride: i64,
    pub o_batch_stride: i64,
    pub q_row_stride: i64,
    pub k_row_stride: i64,
    pub v_row_stride: i64,
    pub o_row_stride: i64,
    pub q_head_stride: i64,
    pub k_head_stride: i64,
    pub v_head_stride: i64,
    pub o_head_stride: i64,
    pub do_batch_stride: i64,
    pub dq_batch_stride: i64,
    pub dk_batch_stride: i64,
    pub dv_batch_stride: i64,
    pub do_row_stride: i64,
    pub dq_row_stride: i64,
    pub dk_row_stride: i64,
    pub dv_row_stride: i64,
    pub do_head_stride: i64,
    pub dq_head_stride: i64,
    pub dk_head_stride: i64,
    pub dv_head_stride: i64,
    pub dq_accum_split_stride: i64,
    pub b: i32,
    pub h: i32,
    pub h_k: i32,
    pub h_h_k_ratio: i32,
    pub d: i32,
    pub d_rounded: i32,
    pub seqlen_q: i32,
    pub seqlen_k: i32,
    pub seqlen_q_rounded: i32,
    pub seqlen_k_rounded: i32,
    pub total_q: i32,
    pub window_size_left: i32,
    pub window_size_right: i32,
    pub scale_softmax: f32,
    pub scale_softmax_log2: f32,
    pub softcap: f32,
    pub p_dropout: f32,
    pub rp_dropout: f32,
    pub scale_softmax_rp_dropout: f32,
    pub p_dropout_in_uint8_t: i32,
    pub is_bf16: i32,
    pub is_causal: i32,
    pub unpadded_lse: i32,
    pub deterministic: i32,
}

/// The f32 buffers a call needs beside q, k, v, O, dO and the gradients (element counts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fa2Workspace {
    /// The forward's log-sum-exp, saved for the backward: B*H*T (dense) or H*total (varlen).
    pub lse: usize,
    /// The backward's rowsum(dO * O) (`softmax_d`): B*H*round128(T), or H*(total + 128*B).
    pub softmax_d: usize,
    /// The backward's f32 dQ accumulator: B*round128(T)*H*Dr, or (total + 128*B)*H*Dr.
    pub dq_accum: usize,
    /// dK and dV per query head before the GQA sum (each total*H*D elements of the input type; 0 without GQA).
    pub dkv_expanded: usize,
}

impl Fa2Shape {
    /// An error naming the first value the kernels harpe builds cannot take (FA2's own limits first).
    pub fn check(&self) -> Result<(), String> {
        if self.b == 0 || self.h == 0 || self.hkv == 0 || self.d == 0 || self.total == 0 {
            return Err(format!("flash2: an empty shape ({self:?})"));
        }
        if !self.h.is_multiple_of(self.hkv) {
            return Err(format!("flash2: {} query heads are not a multiple of {} kv heads", self.h, self.hkv));
        }
        if !self.varlen && self.b * self.max_seqlen != self.total {
            return Err(format!("flash2: B {} x T {} is not {} rows", self.b, self.max_seqlen, self.total));
        }
        // FA2 keeps sizes and offsets in int and the row pointers' strides in int64; the dq accumulator's
        // rows (total + 128 B) * H * Dr are the largest index a launch forms
        let ws = self.workspace();
        if ws.dq_accum > i32::MAX as usize || self.total * self.h * self.d > i32::MAX as usize {
            return Err(format!(
                "flash2: {} rows x {} heads x D {} is past FA2's int sizes",
                self.total, self.h, self.d
            ));
        }
        Ok(())
    }

    /// `mha_bwd`'s head_size_rounded: D rounded up to 32 (to 64 above 128).
    pub fn d_rounded(&self) -> usize {
        round_multiple(self.d, if self.d <= 128 { 32 } else { 64 })
    }

    /// seqlen rounded up to 128 (FA2's `seqlen_q_rounded`, `seqlen_k_rounded`).
    pub fn seqlen_rounded(&self) -> usize {
        round_multiple(self.max_seqlen, 128)
    }

    /// The workspace lengths `mha_bwd` / `mha_varlen_bwd` allocate (and the forward's lse).
    pub fn workspace(&self) -> Fa2Workspace {
        let (b, h, dr, sr) = (self.b, self.h, self.d_rounded(), self.seqlen_rounded());
        let (lse, softmax_d, dq_accum) = if self.varlen {
            let padded = self.total + 128 * b;
            (h * self.total, h * padded, padded * h * dr)
        } else {
            (b * h * self.max_seqlen, b * h * sr, b * sr * h * dr)
        };
        let dkv_expanded = if self.hkv != self.h { self.total * h * self.d } else { 0 };
        Fa2Workspace { lse, softmax_d, dq_accum, dkv_expanded }
    }

    /// `set_params_fprop`'s values (pointers 0): sizes, strides of the contiguous layouts above, scales,
    /// the causal window, dropout off.
    pub fn fwd_args(&self) -> Fa2Args {
        let (h, hkv, d, t) = (self.h as i64, self.hkv as i64, self.d as i64, self.max_seqlen as i64);
        // mha_fwd: `if (is_causal) window_size_right = 0`; then set_params_fprop: is_causal = left < 0 &&
        // right == 0, and a negative left beside a non-negative right becomes seqlen_k
        let (left, right) = if self.causal { (self.max_seqlen as i32, 0) } else { (-1, -1) };
        // dense: one sequence per batch row; varlen indexes rows through cu_seqlens and leaves them 0
        let batch = |heads: i64| if self.varlen { 0 } else { t * heads * d };
        // p_dropout = 0: FA2 stores the keep probability 1, and its uint8 threshold floor(1 * 255)
        let p_keep = 1.0f32;
        Fa2Args {
            q_batch_stride: batch(h),
            k_batch_stride: batch(hkv),
            v_batch_stride: batch(hkv),
            o_batch_stride: batch(h),
            q_row_stride: h * d,
            k_row_stride: hkv * d,
            v_row_stride: hkv * d,
            o_row_stride: h * d,
            q_head_stride: d,
            k_head_stride: d,
            v_head_stride: d,
            o_head_stride: d,
            b: self.b as i32,
            h: self.h as i32,
            h_k: self.hkv as i32,
            h_h_k_ratio: (self.h / self.hkv) as i32,
            d: self.d as i32,
            d_rounded: self.d_rounded() as i32,
            seqlen_q: self.max_seqlen as i32,
            seqlen_k: self.max_seqlen as i32,
            seqlen_q_rounded: self.seqlen_rounded() as i32,
            seqlen_k_rounded: self.seqlen_rounded() as i32,
            // mha_varlen_fwd sets total_q; mha_fwd leaves it 0 (params = {})
            total_q: if self.varlen { self.total as i32 } else { 0 },
            window_size_left: left,
            window_size_right: right,
            scale_softmax: self.scale,
            scale_softmax_log2: self.scale * LOG2_E,
            softcap: 0.0,
            p_dropout: p_keep,
            rp_dropout: 1.0 / p_keep,
            scale_softmax_rp_dropout: self.scale / p_keep,
            p_dropout_in_uint8_t: (p_keep * 255.0).floor() as i32,
            is_bf16: self.is_bf16 as i32,
            is_causal: self.causal as i32,
            unpadded_lse: self.varlen as i32,
            ..Fa2Args::default()
        }
    }

    /// `set_params_dgrad`'s values: `fwd_args` plus the strides of dO, dQ and the per-query-head dK, dV
    /// (all (rows, H, D)), non-deterministic (dq_accum_split_stride 0).
    pub fn bwd_args(&self) -> Fa2Args {
        let a = self.fwd_args();
        let (h, d, t) = (self.h as i64, self.d as i64, self.max_seqlen as i64);
        let batch = if self.varlen { 0 } else { t * h * d };
        Fa2Args {
            do_batch_stride: batch,
            dq_batch_stride: batch,
            dk_batch_stride: batch,
            dv_batch_stride: batch,
            do_row_stride: h * d,
            dq_row_stride: h * d,
            dk_row_stride: h * d,
            dv_row_stride: h * d,
            do_head_stride: d,
            dq_head_stride: d,
            dk_head_stride: d,
            dv_head_stride: d,
            deterministic: 0,
            dq_accum_split_stride: 0,
            ..a
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(b: usize, h: usize, hkv: usize, d: usize, t: usize, total: usize, varlen: bool) -> Fa2Shape {
        Fa2Shape {
            b,
            h,
            hkv,
            d,
            max_seqlen: t,
            total,
            varlen,
            causal: true,
            scale: 1.0 / (d as f32).sqrt(),
            is_bf16: true,
        }
    }

    #[test]
    fn the_struct_has_the_c_layout() {
        // 14 pointers + 25 int64 strides, then 13 ints, 6 floats, 5 ints: no holes and no tail padding, so
        // harpe_fa2_args has the same size and offsets under any C ABI that aligns int64 to 8 bytes
        assert_eq!(std::mem::size_of::<Fa2Args>(), 14 * 8 + 25 * 8 + 13 * 4 + 6 * 4 + 5 * 4);
        assert_eq!(std::mem::align_of::<Fa2Args>(), 8);
    }

    /// Every field of `harpe_fa2_args` in flash_api.cu, in order, with its offset under the C rules (pointers
    /// and int64 8 bytes, int32 and float 4, each aligned to its size): name and offset of the Rust field alike.
    #[test]
    fn the_c_struct_has_the_same_fields_at_the_same_offsets() {
        let src = include_str!("../../third_party/candle-flash-attn/kernels/flash_api.cu");
        let body = src.split("struct harpe_fa2_args {").nth(1).unwrap().split("};").next().unwrap();
        let mut c = vec![];
        let mut at = 0usize;
        for line in body.lines().map(|l| l.trim()).filter(|l| !l.is_empty() && !l.starts_with("//")) {
            let (ty, names) = line.trim_end_matches(';').split_once(' ').unwrap();
            for name in names.split(',') {
                let name = name.trim();
                let size = if name.starts_with('*') || ty == "int64_t" { 8 } else { 4 };
                at = at.div_ceil(size) * size;
                c.push((name.trim_start_matches('*').to_string(), at));
                at += size;
            }
        }
        macro_rules! rust_fields {
            ($($f:ident),* $(,)?) => { vec![$((stringify!($f).to_string(), std::mem::offset_of!(Fa2Args, $f))),*] };
        }
        let rust = rust_fields!(
            q_ptr,
            k_ptr,
            v_ptr,
            o_ptr,
            softmax_lse_ptr,
            do_ptr,
            dq_ptr,
            dk_ptr,
            dv_ptr,
            dq_accum_ptr,
            dsoftmax_sum,
            cu_seqlens_q,
            cu_seqlens_k,
            rng_state,
            q_batch_stride,
            k_batch_stride,
            v_batch_stride,
            o_batch_stride,
            q_row_stride,
            k_row_stride,
            v_row_stride,
            o_row_stride,
            q_head_stride,
            k_head_stride,
            v_head_stride,
            o_head_stride,
            do_batch_stride,
            dq_batch_stride,
            dk_batch_stride,
            dv_batch_stride,
            do_row_stride,
            dq_row_stride,
            dk_row_stride,
            dv_row_stride,
            do_head_stride,
            dq_head_stride,
            dk_head_stride,
            dv_head_stride,
            dq_accum_split_stride,
            b,
            h,
            h_k,
            h_h_k_ratio,
            d,
            d_rounded,
            seqlen_q,
            seqlen_k,
            seqlen_q_rounded,
            seqlen_k_rounded,
            total_q,
            window_size_left,
            window_size_right,
            scale_softmax,
            scale_softmax_log2,
            softcap,
            p_dropout,
            rp_dropout,
            scale_softmax_rp_dropout,
            p_dropout_in_uint8_t,
            is_bf16,
            is_causal,
            unpadded_lse,
            deterministic,
        );
        assert_eq!(c, rust);
        assert_eq!(at.div_ceil(8) * 8, std::mem::size_of::<Fa2Args>());
    }

    /// Llama-2-7B's attention at T = 1000, B 2, GQA 32/8, as mha_fwd + mha_bwd fill the params for
    /// q (2, 1000, 32, 128), k, v (2, 1000, 8, 128) contiguous, causal, softmax_scale 1/sqrt(128).
    #[test]
    fn dense_gqa_matches_flash_api() {
        let s = shape(2, 32, 8, 128, 1000, 2000, false);
        s.check().unwrap();
        let a = s.bwd_args();
        // q.stride(): (1000*32*128, 32*128, 128, 1); k.stride(): (1000*8*128, 8*128, 128, 1)
        assert_eq!((a.q_batch_stride, a.q_row_stride, a.q_head_stride), (4_096_000, 4096, 128));
        assert_eq!((a.k_batch_stride, a.k_row_stride, a.k_head_stride), (1_024_000, 1024, 128));
        assert_eq!((a.v_batch_stride, a.v_row_stride, a.v_head_stride), (1_024_000, 1024, 128));
        assert_eq!((a.o_batch_stride, a.o_row_stride, a.o_head_stride), (4_096_000, 4096, 128));
        // dk_expanded, dv_expanded: (2, 1000, 32, 128)
        assert_eq!((a.dk_batch_stride, a.dk_row_stride, a.dk_head_stride), (4_096_000, 4096, 128));
        assert_eq!((a.dq_batch_stride, a.do_row_stride, a.dv_head_stride), (4_096_000, 4096, 128));
        assert_eq!((a.b, a.h, a.h_k, a.h_h_k_ratio, a.d, a.d_rounded), (2, 32, 8, 4, 128, 128));
        assert_eq!(
            (a.seqlen_q, a.seqlen_k, a.seqlen_q_rounded, a.seqlen_k_rounded, a.total_q),
            (1000, 1000, 1024, 1024, 0)
        );
        // causal: window (seqlen_k, 0)
        assert_eq!((a.is_causal, a.window_size_left, a.window_size_right), (1, 1000, 0));
        let scale = 1.0 / 128f32.sqrt();
        assert_eq!(a.scale_softmax, scale);
        assert_eq!(a.scale_softmax_log2, scale * std::f32::consts::LOG2_E);
        assert_eq!((a.softcap, a.p_dropout, a.rp_dropout, a.p_dropout_in_uint8_t), (0.0, 1.0, 1.0, 255));
        assert_eq!(a.scale_softmax_rp_dropout, scale);
        assert_eq!((a.unpadded_lse, a.deterministic, a.dq_accum_split_stride, a.is_bf16), (0, 0, 0, 1));
        // softmax_lse (2, 32, 1000); softmax_d (2, 32, 1024); dq_accum (2, 1024, 32, 128);
        // dk_expanded (2, 1000, 32, 128)
        let w = s.workspace();
        assert_eq!(w, Fa2Workspace { lse: 64_000, softmax_d: 65_536, dq_accum: 8_388_608, dkv_expanded: 8_192_000 });
    }

    /// Three documents of 700, 1500 and 800 tokens as mha_varlen_fwd + mha_varlen_bwd see them: q (3000,
    /// 16, 64), k, v (3000, 16, 64), cu_seqlens [0, 700, 2200, 3000], max_seqlen 1500.
    #[test]
    fn varlen_documents_match_flash_api() {
        let s = shape(3, 16, 16, 64, 1500, 3000, true);
        s.check().unwrap();
        let a = s.bwd_args();
        assert_eq!(
            (a.q_batch_stride, a.k_batch_stride, a.o_batch_stride, a.dq_batch_stride, a.dk_batch_stride),
            (0, 0, 0, 0, 0)
        );
        assert_eq!((a.q_row_stride, a.k_row_stride, a.q_head_stride, a.dv_row_stride), (1024, 1024, 64, 1024));
        assert_eq!((a.d, a.d_rounded, a.seqlen_q_rounded, a.seqlen_k_rounded, a.total_q), (64, 64, 1536, 1536, 3000));
        assert_eq!((a.window_size_left, a.window_size_right, a.unpadded_lse), (1500, 0, 1));
        // softmax_lse (16, 3000); softmax_d (16, 3000 + 128*3); dq_accum (3000 + 384, 16, 64); no GQA
        let w = s.workspace();
        assert_eq!(w, Fa2Workspace { lse: 48_000, softmax_d: 54_144, dq_accum: 3_465_216, dkv_expanded: 0 });
    }

    #[test]
    fn head_dims_and_lengths_round_as_flash_api_does() {
        for (d, dr) in [(64, 64), (72, 96), (128, 128), (136, 192), (256, 256)] {
            assert_eq!(shape(1, 1, 1, d, 8, 8, false).d_rounded(), dr, "D {d}");
        }
        for (t, tr) in [(1, 128), (128, 128), (129, 256), (131_072, 131_072)] {
            assert_eq!(shape(1, 1, 1, 64, t, t, false).seqlen_rounded(), tr, "T {t}");
        }
        // not causal: no window at all
        let a = Fa2Shape { causal: false, ..shape(1, 2, 2, 64, 8, 8, false) }.fwd_args();
        assert_eq!((a.is_causal, a.window_size_left, a.window_size_right), (0, -1, -1));
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(shape(1, 6, 4, 64, 8, 8, false).check().unwrap_err().contains("not a multiple of 4 kv heads"));
        assert!(shape(2, 4, 4, 64, 8, 8, false).check().unwrap_err().contains("B 2 x T 8 is not 8 rows"));
        let e = shape(1, 64, 64, 128, 1 << 20, 1 << 20, false).check().unwrap_err();
        assert!(e.contains("past FA2's int sizes"), "{e}");
    }
}
