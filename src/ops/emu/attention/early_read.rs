//! Test-only: `attention_fwd` and `attention_bwd` of the tensor-core tiles (bf16, D = 64) built with each
//! cp.async wait moved after the reads it guards (kernels/attention.cu `EARLY`): a broken kernel that reads
//! the emulator's poison, which the reference comparisons must catch (tests/stage_model/attention_emu.rs).
//! A file of its own because no caller but that test uses it; it launches through `attention.rs`'s own
//! launchers.
use super::*;

/// The broken forward: (O, lse) as `attention_fwd` returns them.
pub fn fwd(
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    dims: AttnDims,
    scale: f32,
    causal: bool,
) -> Result<(Vec<bf16>, Vec<f32>)> {
    let AttnDims { b, h, tq, d, .. } = dims;
    if d != 64 {
        bail!("attention early_read: built for D = 64 only, got {d}");
    }
    let mut o = vec![bf16::ZERO; b * h * tq * d];
    let mut lse = vec![0f32; b * h * tq];
    let out = FwdOut { o: o.as_mut_ptr(), lse: lse.as_mut_ptr(), ldo: d, ldl: 1 };
    let f = Some(ffi::emu_attn_fwd_tc_early_bf16_d64 as FwdFn<bf16>);
    // SAFETY: o holds B*H*Tq rows of D, lse B*H*Tq values, as `out` says.
    unsafe { fwd_launch(f, AttnKernel::TensorCore, (q, k, v), dims, AttnMask::new(scale, causal, None), out)? };
    Ok((o, lse))
}

/// The broken backward: (dQ, dK, dV) as `attention_bwd` returns them.
#[allow(clippy::type_complexity)]
pub fn bwd(
    (q, k, v): (&[bf16], &[bf16], &[bf16]),
    (o, lse): (&[bf16], &[f32]),
    dout: &[bf16],
    dims: AttnDims,
    scale: f32,
    causal: bool,
) -> Result<(Vec<bf16>, Vec<bf16>, Vec<bf16>)> {
    let AttnDims { b, h, tq, d, .. } = dims;
    if d != 64 {
        bail!("attention early_read: built for D = 64 only, got {d}");
    }
    for (what, n, want) in
        [("q", q.len(), b * h * tq * d), ("o", o.len(), b * h * tq * d), ("dout", dout.len(), b * h * tq * d)]
    {
        check_len(what, n, want)?;
    }
    check_len("lse", lse.len(), b * h * tq)?;
    let inp = BwdIn { q: q.as_ptr(), o: o.as_ptr(), dout: dout.as_ptr(), lse: lse.as_ptr(), ldq: d, ldl: 1 };
    let f = Some(ffi::emu_attn_bwd_tc_early_bf16_d64 as BwdFn<bf16>);
    // SAFETY: q, o, dout hold B*H*Tq rows of D and lse B*H*Tq values (checked), as `inp` says.
    let (flat, _) =
        unsafe { bwd_launch(f, AttnKernel::TensorCore, inp, k, v, dims, AttnMask::new(scale, causal, None))? };
    let (nq, nkv) = (q.len(), k.len());
    Ok((flat[..nq].to_vec(), flat[nq..nq + nkv].to_vec(), flat[nq + nkv..].to_vec()))
}
