//! Ulysses sequence parallelism: the P ranks of a sequence-parallel group each hold T/P consecutive
//! tokens of the same sequences between attention blocks; around attention an all-to-all over heads
//! gives each rank all T tokens of H/P query heads (and Hkv/P kv heads), and the inverse all-to-all
//! brings the output back to the rank's own tokens.
//!
//! Reference: Jacobs et al. 2023, "DeepSpeed Ulysses" (all-to-all on q, k, v and the attention
//! output). Layout: q (B, H, T/P, D) on every rank -> (B, H/P, T, D); rank p gets
//! query heads p*H/P.. and kv heads p*Hkv/P.., so GQA's head h -> kv head h / (H/Hkv) holds locally too.
//! The non-obvious decisions:
//! - The exchange is one candle custom op (`AllToAll`) on a contiguous (P, ...) tensor whose chunk j
//!   goes to rank j; an equal-chunk all-to-all is its own inverse, so its backward is the same op on
//!   the gradient and autograd carries gradients across ranks. The reshapes around it are plain candle
//!   ops with their own backward.
//! - RoPE is applied before the exchange, on the rank's own tokens at their GLOBAL positions (the
//!   training loop builds each rank's tables from offset sp_rank*T/P), with each head's own base, so
//!   HARPE's per-head bases travel with their heads.
//! - Every rank runs the same graph, so forward and backward meet the collectives in the same order.
//!
//! Under NCCL the exchange is `NcclComm::sp_all_to_all_storage` on the group's own communicator
//! (`cuda_fwd`); `Local` ranks sharing one GPU exchange CUDA tensors through the host.
//! What this file does not do: padding (T must divide by P; refused before any work), ring attention.
use crate::comms::local::LocalComm;
use crate::model::attention::{AttentionFn, AttentionImpl};
use crate::ops::attention::DocStarts;
use candle_core::{CpuStorage, CustomOp1, DType, Error, Layout, Result, Shape, Tensor};
use std::sync::Arc;

/// The ranks that share one sequence.
#[derive(Clone, Debug)]
pub enum SpGroup {
    /// ranks as threads of this process
    Local(Arc<LocalComm>),
    /// processes of an NCCL group (the communicator's sequence-parallel split)
    #[cfg(feature = "nccl")]
    Nccl(Arc<crate::comms::nccl::NcclComm>),
    /// processes of a Gloo group (its sequence-parallel context)
    #[cfg(feature = "gloo")]
    Gloo(Arc<crate::comms::gloo::GlooComm>),
}

impl SpGroup {
    /// Ranks in the group (P).
    pub fn size(&self) -> usize {
        match self {
            SpGroup::Local(c) => c.world_size(),
            #[cfg(feature = "nccl")]
            SpGroup::Nccl(c) => c.sp_degree(),
            #[cfg(feature = "gloo")]
            SpGroup::Gloo(c) => c.sp_degree(),
        }
    }

    /// This rank's place in the group: it holds tokens rank*T/P..(rank+1)*T/P.
    pub fn rank(&self) -> usize {
        match self {
            SpGroup::Local(c) => c.rank(),
            #[cfg(feature = "nccl")]
            SpGroup::Nccl(c) => c.rank() % c.sp_degree(),
            #[cfg(feature = "gloo")]
            SpGroup::Gloo(c) => c.rank() % c.sp_degree(),
        }
    }

    /// Stop the group's other ranks at their next collective (this rank failed outside one).
    pub fn abort(&self, reason: &str) {
        match self {
            SpGroup::Local(c) => c.abort(reason),
            #[cfg(feature = "nccl")]
            SpGroup::Nccl(c) => c.report_failure("outside a collective", reason),
            #[cfg(feature = "gloo")]
            SpGroup::Gloo(c) => c.report_failure("outside a collective", reason),
        }
    }
}

/// `AllToAll` over a Gloo group: the storage's f32 or bf16 values `range` as bytes.
#[cfg(feature = "gloo")]
fn gloo_all_to_all(
    c: &crate::comms::gloo::GlooComm,
    s: &CpuStorage,
    range: std::ops::Range<usize>,
    label: &str,
) -> anyhow::Result<CpuStorage> {
    let n = range.len();
    Ok(match s {
        CpuStorage::F32(v) => {
            let b: Vec<u8> = v[range].iter().flat_map(|x| x.to_le_bytes()).collect();
            let o = c.sp_all_to_all_bytes(b, (n, DType::F32), label)?;
            CpuStorage::F32(o.chunks_exact(4).map(|q| f32::from_le_bytes([q[0], q[1], q[2], q[3]])).collect())
        }
        CpuStorage::BF16(v) => {
            let b: Vec<u8> = v[range].iter().flat_map(|x| x.to_le_bytes()).collect();
            let o = c.sp_all_to_all_bytes(b, (n, DType::BF16), label)?;
            CpuStorage::BF16(o.chunks_exact(2).map(|q| half::bf16::from_le_bytes([q[0], q[1]])).collect())
        }
        _ => anyhow::bail!("all_to_all \"{label}\": only f32 and bf16 are supported"),
    })
}

/// Equal-chunk all-to-all of a contiguous tensor whose first dimension is P: chunk j goes to rank j,
/// chunk i of the result came from rank i. Its own inverse, hence its own backward.
#[derive(Clone, Debug)]
struct AllToAll {
    group: SpGroup,
    label: &'static str,
}

impl CustomOp1 for AllToAll {
    fn name(&self) -> &'static str {
        "ulysses-all-to-all"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (lo, hi) = l
            .contiguous_offsets()
            .ok_or_else(|| Error::Msg(format!("all_to_all \"{}\": the input is not contiguous", self.label)))?;
        let err = |e: anyhow::Error| Error::Msg(format!("{e:#}"));
        #[cfg(feature = "gloo")]
        if let SpGroup::Gloo(c) = &self.group {
            return gloo_all_to_all(c, s, lo..hi, self.label).map(|out| (out, l.shape().clone())).map_err(err);
        }
        #[allow(irrefutable_let_patterns)]
        let SpGroup::Local(c) = &self.group
        else {
            return Err(Error::Msg(format!(
                "all_to_all \"{}\": an NCCL group exchanges CUDA tensors only",
                self.label
            )));
        };
        let out = match s {
            CpuStorage::F32(v) => {
                let mut o = vec![0f32; hi - lo];
                c.all_to_all(&v[lo..hi], &mut o, self.label).map_err(err)?;
                CpuStorage::F32(o)
            }
            CpuStorage::BF16(v) => {
                let mut o = vec![half::bf16::ZERO; hi - lo];
                c.all_to_all(&v[lo..hi], &mut o, self.label).map_err(err)?;
                CpuStorage::BF16(o)
            }
            _ => return Err(Error::Msg(format!("all_to_all \"{}\": only f32 and bf16 are supported", self.label))),
        };
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        match &self.group {
            #[cfg(feature = "nccl")]
            SpGroup::Nccl(c) => {
                let out = c.sp_all_to_all_storage(s, l, self.label).map_err(|e| Error::Msg(format!("{e:#}")))?;
                Ok((out, l.shape().clone()))
            }
            // ranks as threads sharing one GPU: through the host (correct, slow; tests and small runs)
            _ => {
                use candle_core::backend::{BackendDevice, BackendStorage};
                let (out, shape) = self.cpu_fwd(&s.to_cpu_storage()?, l)?;
                Ok((s.device().storage_from_cpu_storage(&out)?, shape))
            }
        }
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1(self.clone())?))
    }
}

/// Copies of each exchanged tensor (q, k, v on the way in, the output on the way out) that
/// `heads_to_seq` and `seq_to_heads` make and autograd keeps until the layer's backward: the
/// all-to-all's result and, of the two re-layouts around it, the one that moves a head or token
/// dimension of size > 1; the other only moves the batch dimension, a view with one sequence per
/// micro-batch. The memory plan counts these (`train::plan`); the test below holds the code to them.
pub fn saved_copies(micro_batch: usize) -> usize {
    if micro_batch > 1 {
        3
    } else {
        2
    }
}

/// (B, Hx, T/P, D) -> the all-to-all's contiguous input (P, B, Hx/P, T/P, D): chunk j holds the heads
/// rank j takes.
fn chunks_by_head(x: &Tensor, p: usize) -> Result<Tensor> {
    let (b, hx, tl, d) = x.dims4()?;
    x.reshape((b, p, hx / p, tl, d))?.transpose(0, 1)?.contiguous()
}

/// The all-to-all's result (P, B, Hx/P, T/P, D), chunk i from rank i -> (B, Hx/P, T, D).
fn seq_from_chunks(got: &Tensor) -> Result<Tensor> {
    let (p, b, hp, tl, d) = got.dims5()?;
    got.permute((1, 2, 0, 3, 4))?.reshape((b, hp, p * tl, d))
}

/// (B, H/P, T, D) -> the all-to-all's contiguous input (P, B, H/P, T/P, D): chunk j holds rank j's
/// tokens.
fn chunks_by_seq(o: &Tensor, p: usize) -> Result<Tensor> {
    let (b, hp, t, d) = o.dims4()?;
    o.reshape((b, hp, p, t / p, d))?.permute((2, 0, 1, 3, 4))?.contiguous()
}

/// The all-to-all's result (P, B, H/P, T/P, D), chunk i with rank i's heads -> (B, H, T/P, D).
fn heads_from_chunks(got: &Tensor) -> Result<Tensor> {
    let (p, b, hp, tl, d) = got.dims5()?;
    got.transpose(0, 1)?.reshape((b, p * hp, tl, d))
}

/// q/k/v of this rank's tokens, all heads (B, Hx, T/P, D) -> all tokens of its Hx/P heads (B, Hx/P, T, D).
pub fn heads_to_seq(group: &SpGroup, x: &Tensor, label: &'static str) -> Result<Tensor> {
    let p = group.size();
    let hx = x.dims4()?.1;
    if !hx.is_multiple_of(p) {
        return Err(Error::Msg(format!("sequence parallelism: {hx} heads do not split over {p} ranks")));
    }
    let got = chunks_by_head(x, p)?.apply_op1(AllToAll { group: group.clone(), label })?; // chunk i = rank i's tokens
    seq_from_chunks(&got)
}

/// The attention output of this rank's heads over all tokens (B, H/P, T, D) -> its own tokens with
/// every head (B, H, T/P, D): the inverse of `heads_to_seq`.
pub fn seq_to_heads(group: &SpGroup, o: &Tensor, label: &'static str) -> Result<Tensor> {
    let p = group.size();
    let t = o.dims4()?.2;
    if !t.is_multiple_of(p) {
        return Err(Error::Msg(format!("sequence parallelism: {t} tokens do not split over {p} ranks")));
    }
    let got = chunks_by_seq(o, p)?.apply_op1(AllToAll { group: group.clone(), label })?; // chunk i = rank i's heads
    heads_from_chunks(&got)
}

/// Attention under Ulysses: exchange, the device's attention over all T tokens, exchange back.
#[derive(Debug)]
pub struct Ulysses {
    pub group: SpGroup,
    /// the attention run on (B, H/P, T, D): the device default
    pub inner: AttentionImpl,
}

impl Ulysses {
    /// Exchange, `att` over all T tokens of this rank's heads, exchange back.
    fn around(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        att: impl FnOnce(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        if q.dtype() != k.dtype() || q.dtype() != v.dtype() || !matches!(q.dtype(), DType::F32 | DType::BF16) {
            return Err(Error::Msg("sequence parallelism: q, k, v must share the dtype f32 or bf16".into()));
        }
        let q = heads_to_seq(&self.group, q, "ulysses q")?;
        let k = heads_to_seq(&self.group, k, "ulysses k")?;
        let v = heads_to_seq(&self.group, v, "ulysses v")?;
        let o = att(&q, &k, &v)?; // (B, H/P, T, D)
        seq_to_heads(&self.group, &o, "ulysses o")
    }
}

impl AttentionFn for Ulysses {
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, causal: bool) -> Result<Tensor> {
        self.around(q, k, v, |q, k, v| self.inner.attend(q, k, v, scale, causal))
    }

    /// After the exchange a rank holds all T tokens, so `docs` is the GLOBAL sequences' document starts.
    fn attend_doc(&self, q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, docs: &DocStarts) -> Result<Tensor> {
        self.around(q, k, v, |q, k, v| self.inner.attend_doc(q, k, v, scale, docs))
    }

    fn supports_document_mask(&self) -> bool {
        self.inner.supports_document_mask()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comms::local::spawn_local;
    use candle_core::{Device, Var};
    use std::time::Duration;

    /// Deterministic (B, H, T, D) values.
    fn make(b: usize, h: usize, t: usize, d: usize, seed: f32) -> Tensor {
        let n = b * h * t * d;
        let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37 + seed).sin() * 0.8).collect();
        Tensor::from_vec(v, (b, h, t, d), &Device::Cpu).unwrap()
    }

    type Whole<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>;
    type Attend<'a> = &'a (dyn Fn(&dyn AttentionFn, &Tensor, &Tensor, &Tensor) -> Result<Tensor> + Sync);

    /// `whole` on whole sequences, then `attend` over P rank threads each holding T/P tokens (Ulysses
    /// around `inner`): o, dq, dk, dv (loss = sum(o * w)) must agree to 1e-5.
    fn ulysses_equals_one_rank(
        (q, k, v, w): (&Tensor, &Tensor, &Tensor, &Tensor),
        p: usize,
        whole: Whole<'_>,
        inner: AttentionImpl,
        attend: Attend<'_>,
    ) {
        let t = q.dim(2).unwrap();
        let (qv, kv, vv) = (Var::from_tensor(q).unwrap(), Var::from_tensor(k).unwrap(), Var::from_tensor(v).unwrap());
        let o_ref = whole(qv.as_tensor(), kv.as_tensor(), vv.as_tensor()).unwrap();
        let store = (&o_ref * w).unwrap().sum_all().unwrap().backward().unwrap();
        let g = |x: &Var| store.get(x.as_tensor()).unwrap().clone();
        let refs: Vec<Vec<f32>> = [o_ref.clone(), g(&qv), g(&kv), g(&vv)]
            .iter()
            .map(|x| x.flatten_all().unwrap().to_vec1().unwrap())
            .collect();
        let tl = t / p;
        let parts = spawn_local(p, Duration::from_secs(20), |c| {
            let r = c.rank();
            let att = Ulysses { group: SpGroup::Local(c), inner: inner.clone() };
            let mine = |x: &Tensor| Var::from_tensor(&x.narrow(2, r * tl, tl).unwrap()).unwrap();
            let (ql, kl, vl) = (mine(q), mine(k), mine(v));
            let o = attend(&att, ql.as_tensor(), kl.as_tensor(), vl.as_tensor())?;
            let gs = (&o * w.narrow(2, r * tl, tl)?)?.sum_all()?.backward()?;
            let grad = |x: &Var| gs.get(x.as_tensor()).cloned().ok_or_else(|| anyhow::anyhow!("no gradient"));
            Ok([o, grad(&ql)?, grad(&kl)?, grad(&vl)?])
        })
        .unwrap();
        for (i, name) in ["o", "dq", "dk", "dv"].iter().enumerate() {
            let got: Vec<Tensor> = parts.iter().map(|pr| pr[i].clone()).collect();
            let got = Tensor::cat(&got, 2).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let err = got.iter().zip(&refs[i]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < 1e-5, "P = {p}: {name} differs by {err}");
        }
    }

    #[test]
    fn ulysses_attention_forward_and_backward_equal_one_rank() {
        // GQA 4 q heads over 2 kv heads, T = 12 split over P = 2 ranks; causal
        let (b, h, hkv, t, d) = (2, 4, 2, 12, 8);
        let (q, k, v) = (make(b, h, t, d, 0.1), make(b, hkv, t, d, 0.7), make(b, hkv, t, d, 1.3));
        let w = make(b, h, t, d, 2.1); // upstream gradient: loss = sum(o * w)
        let scale = 1.0 / (d as f32).sqrt();
        let whole = |q: &Tensor, k: &Tensor, v: &Tensor| AttentionImpl::CpuReference.attend(q, k, v, scale, true);
        let attend = |a: &dyn AttentionFn, q: &Tensor, k: &Tensor, v: &Tensor| a.attend(q, k, v, scale, true);
        for p in [1usize, 2] {
            ulysses_equals_one_rank((&q, &k, &v, &w), p, &whole, AttentionImpl::CpuReference, &attend);
        }
    }

    #[test]
    fn ulysses_document_mask_uses_the_global_sequence() {
        // documents [0, 5) [5, 6) [6, 12) of sequence 0 and [0, 9) [9, 12) of sequence 1: the second
        // document of each crosses the ranks' T/P = 6 boundary, so local starts would be wrong
        let (b, h, hkv, t, d) = (2, 4, 2, 12, 8);
        let docs = DocStarts::from_starts(&[&[0, 5, 6], &[9]], t, &Device::Cpu).unwrap();
        let (q, k, v) = (make(b, h, t, d, 0.2), make(b, hkv, t, d, 0.9), make(b, hkv, t, d, 1.7));
        let w = make(b, h, t, d, 2.5);
        let scale = 1.0 / (d as f32).sqrt();
        let attend = |a: &dyn AttentionFn, q: &Tensor, k: &Tensor, v: &Tensor| {
            assert!(a.supports_document_mask());
            a.attend_doc(q, k, v, scale, &docs)
        };
        let whole = |q: &Tensor, k: &Tensor, v: &Tensor| AttentionImpl::CpuReference.attend_doc(q, k, v, scale, &docs);
        ulysses_equals_one_rank((&q, &k, &v, &w), 2, &whole, AttentionImpl::Cpu, &attend);
    }

    /// Whether `b` is a view of `a`'s storage (CPU tensors).
    fn shares_storage(a: &Tensor, b: &Tensor) -> bool {
        let ptr = |t: &Tensor| match &*t.storage_and_layout().0 {
            candle_core::Storage::Cpu(c) => c.as_slice::<f32>().unwrap().as_ptr(),
            _ => unreachable!("CPU tensors only"),
        };
        ptr(a) == ptr(b)
    }

    #[test]
    fn the_exchange_makes_the_copies_the_plan_counts() {
        // P = 2, 4 heads, 6 tokens per rank; the all-to-all's result is always a new buffer (a
        // stand-in of the right shape here: the re-layouts after it are what is measured)
        let (p, h, tl, d) = (2, 4, 6, 8);
        for b in [1usize, 2] {
            let copy = |new: bool| usize::from(new);
            let x = make(b, h, tl, d, 0.3);
            let chunks = chunks_by_head(&x, p).unwrap();
            let got = chunks.copy().unwrap();
            let q = seq_from_chunks(&got).unwrap();
            let q_copies = copy(!shares_storage(&x, &chunks)) + 1 + copy(!shares_storage(&got, &q));
            assert_eq!(q_copies, saved_copies(b), "q at micro-batch {b}");
            let o = make(b, h / p, tl * p, d, 0.5);
            let chunks = chunks_by_seq(&o, p).unwrap();
            let got = chunks.copy().unwrap();
            let back = heads_from_chunks(&got).unwrap();
            let o_copies = copy(!shares_storage(&o, &chunks)) + 1 + copy(!shares_storage(&got, &back));
            assert_eq!(o_copies, saved_copies(b), "o at micro-batch {b}");
            assert_eq!(back.dims4().unwrap(), (b, h, tl, d));
        }
    }

    #[test]
    fn heads_that_do_not_split_are_an_error() {
        let r = spawn_local(2, Duration::from_secs(5), |c| {
            let g = SpGroup::Local(c);
            Ok(heads_to_seq(&g, &make(1, 3, 4, 2, 0.0), "q").is_err())
        })
        .unwrap();
        assert!(r.iter().all(|&e| e));
    }
}
