//! The attention seam: every decoder layer of `Llama` calls attention through an `AttentionImpl` that the
//! caller chooses (train, eval), so a CUDA kernel or a sequence-parallel wrapper plugs in without
//! `model/` knowing about devices or ranks.
//!
//! Reference: torchtitan's `parallelize_llama` (parallelism applied to a single-device model from
//! outside). The non-obvious decision: a closed enum for what `model/`+`ops/` provide,
//! plus one `Custom` arm holding a trait object, because comms/ (which `model/` must not import)
//! provides the Ulysses all-to-all wrapper and it is chosen at run time. Every arm computes the same
//! function: causal (or full) GQA softmax(q k^T * scale) v with q (B, H, Tq, D), k, v (B, Hkv, Tk, D);
//! `attend_doc` the same under a per-document causal mask of packed sequences (`ops::attention::DocStarts`,
//! `train.document_mask`). Every built-in arm does document masks; a `Custom` one says whether it can
//! (`AttentionFn::supports_document_mask`, default no), so the trainer refuses before the first step.
//! `Flash2` (FlashAttention-2's own forward and backward, `ops::flash2`, `--features flash-attn`) is the
//! default where it runs (CUDA, bf16/f16, head dim 64/128: `for_train`, `for_eval`); `CandleFlash`
//! (candle-flash-attn's forward alone) is forward only: the evaluation commands may choose it with
//! `--attention` (`AttentionChoice`) and `harpe train` refuses it (`refuse_for_training`).
//! Not done here: the kernels themselves (ops/), the sequence-parallel wrapper (comms/).
use crate::ops::attention::{attention, attention_blocked, attention_with, CpuKernel, DocStarts};
use crate::ops::attention_shape::HEAD_DIMS;
use crate::ops::{candle_flash, flash2};
use candle_core::{bail, DType, Device, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// `[train] attention`: which attention kernels a CUDA run trains with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TrainAttention {
    /// FlashAttention-2's own kernels where the build has them (`--features flash-attn`) and they take the
    /// model (CUDA, bf16/f16, head dim 64 or 128); harpe's otherwise
    #[default]
    Auto,
    /// harpe's own kernels (kernels/attention.cu; every dtype and head dim)
    Harpe,
    /// FlashAttention-2's own forward and backward (an error where they cannot run)
    Flash2,
}

impl TrainAttention {
    /// `Auto`: left out of the resolved config, so configs hashed before this key keep their hash.
    pub fn is_auto(&self) -> bool {
        *self == TrainAttention::Auto
    }
}

/// Query rows per block of the blocked reference by default.
pub const DEFAULT_BLOCK: usize = 256;

/// An attention implementation provided from outside `model/` (e.g. comms' sequence-parallel wrapper).
pub trait AttentionFn: Send + Sync + std::fmt::Debug {
    /// Same contract as `AttentionImpl::attend`.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, causal: bool) -> Result<Tensor>;

    /// Same contract as `AttentionImpl::attend_doc`; the default refuses (no document masks).
    fn attend_doc(&self, _q: &Tensor, _k: &Tensor, _v: &Tensor, _scale: f32, _docs: &DocStarts) -> Result<Tensor> {
        bail!("attention {self:?} cannot apply a document mask\nhint: set train.document_mask = false, or implement AttentionFn::attend_doc")
    }

    /// Whether `attend_doc` works (checked by the trainer before the first step).
    fn supports_document_mask(&self) -> bool {
        false
    }
}

/// Which attention the decoder layers run.
#[derive(Clone, Debug, Default)]
pub enum AttentionImpl {
    /// `ops::attention`: the flash-style op with its own backward op, on CPU as GEMM blocks (the default).
    #[default]
    Cpu,
    /// `ops::attention_with(.., CpuKernel::Reference)`: the same op running its scalar reference loops (tests,
    /// debugging).
    CpuReference,
    /// `ops::attention` on a CUDA device: the flash kernels of kernels/attention.cu (tensor cores for
    /// bf16/f16 at D = 64, 128), forward and backward. The same op as `Cpu`; on a CPU tensor it runs the
    /// CPU loops; a head dim the kernels do not take runs `attention_blocked`.
    Flash,
    /// `ops::attention_blocked`: query blocks against all keys from plain candle ops (any device; the GPU
    /// reference the flash kernels are checked against).
    Blocked { block: usize },
    /// `ops::candle_flash`: candle-flash-attn's FlashAttention-2 forward (CUDA, `--features flash-attn`,
    /// bf16/f16, D 64/128; document masks through its varlen entry). NOT differentiable (the crate has no
    /// backward): evaluation and generation only.
    CandleFlash,
    /// `ops::flash2`: FlashAttention-2's own forward and backward kernels (CUDA, `--features flash-attn`,
    /// bf16/f16, D 64/128, causal with Tq = Tk; document masks through its varlen entry). Differentiable; full
    /// attention runs `Flash`'s op, and Tq < Tk (KV-cached generation, no gradient) `CandleFlash`'s forward.
    Flash2,
    /// Provided by the caller (sequence-parallel wrapper, experiments).
    Custom(Arc<dyn AttentionFn>),
}

/// `--attention` of the evaluation commands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AttentionChoice {
    /// harpe's own kernels (the device's default: flash kernels on CUDA, GEMM blocks on CPU)
    Harpe,
    /// candle-flash-attn's FlashAttention-2 forward (CUDA, --features flash-attn, bf16/f16, head dim
    /// 64/128; forward only)
    CandleFlash,
    /// FlashAttention-2's own forward and backward (CUDA, --features flash-attn, bf16/f16, head dim 64/128)
    Flash2,
}

impl AttentionChoice {
    /// `[train] attention`'s value for `harpe train --attention` (None: candle-flash, which cannot train).
    pub fn for_train(self) -> Option<TrainAttention> {
        match self {
            AttentionChoice::Harpe => Some(TrainAttention::Harpe),
            AttentionChoice::Flash2 => Some(TrainAttention::Flash2),
            AttentionChoice::CandleFlash => None,
        }
    }
}

/// An error for an attention `harpe train` cannot run: candle-flash-attn has no backward.
pub fn refuse_for_training(choice: Option<AttentionChoice>) -> Result<()> {
    if choice == Some(AttentionChoice::CandleFlash) {
        bail!("harpe train: --attention candle-flash has no backward (candle-flash-attn is forward only; gradients would stop silently)\nhint: train with --attention flash2 (FlashAttention-2's own backward) or harpe; candle-flash is for eval-ppl, eval-loss, eval-niah, eval-tasks and generate");
    }
    Ok(())
}

/// The refusal of `flash2` where it cannot run, naming the limit (build, device, dtype, head dim).
fn flash2_fits(dev: &Device, dtype: DType, head_dim: usize) -> Result<()> {
    if !cfg!(feature = "flash-attn") {
        bail!("{}", flash2::NOT_BUILT);
    }
    if !dev.is_cuda() {
        bail!("--attention flash2 runs on CUDA only, and the device is {dev:?}\nhint: pass --device cuda, or --attention harpe");
    }
    flash2::check_supported(dtype, head_dim)
}

impl AttentionImpl {
    /// The implementation a device runs by default: the GEMM-block op on CPU, the flash kernels on CUDA,
    /// the blocked reference elsewhere (Metal).
    pub fn for_device(dev: &Device) -> AttentionImpl {
        match dev {
            Device::Cpu => AttentionImpl::Cpu,
            Device::Cuda(_) => AttentionImpl::Flash,
            _ => AttentionImpl::Blocked { block: DEFAULT_BLOCK },
        }
    }

    /// The attention `harpe train` runs on `dev` for a model of `dtype` and `head_dim` (`[train] attention`):
    /// `Flash2` when asked (checked: built, CUDA, dtype, head dim) or, for `auto`, where it runs; harpe's
    /// kernels (`for_device`) otherwise.
    pub fn for_train(want: TrainAttention, dev: &Device, dtype: DType, head_dim: usize) -> Result<Self> {
        Ok(match want {
            TrainAttention::Harpe => Self::for_device(dev),
            TrainAttention::Flash2 => {
                flash2_fits(dev, dtype, head_dim)?;
                AttentionImpl::Flash2
            }
            TrainAttention::Auto if flash2::available(dev, dtype, head_dim) => AttentionImpl::Flash2,
            TrainAttention::Auto => Self::for_device(dev),
        })
    }

    /// The attention of an evaluation command on `dev` for a model of `dtype` and `head_dim`: `choice` when
    /// given (flash2 and candle-flash checked: built, CUDA, dtype, head dim; each refusal names its limit),
    /// else flash2 where it is built and takes the model, else the device's default (`for_device`).
    pub fn for_eval(choice: Option<AttentionChoice>, dev: &Device, dtype: DType, head_dim: usize) -> Result<Self> {
        let fits = || -> Result<()> {
            if !cfg!(feature = "flash-attn") {
                bail!("{}", candle_flash::NOT_BUILT);
            }
            if !dev.is_cuda() {
                bail!("--attention candle-flash runs on CUDA only, and the device is {dev:?}\nhint: pass --device cuda, or --attention harpe");
            }
            candle_flash::check_supported(dtype, head_dim)
        };
        Ok(match choice {
            Some(AttentionChoice::Harpe) => Self::for_device(dev),
            Some(AttentionChoice::CandleFlash) => {
                fits()?;
                AttentionImpl::CandleFlash
            }
            Some(AttentionChoice::Flash2) => {
                flash2_fits(dev, dtype, head_dim)?;
                AttentionImpl::Flash2
            }
            None if flash2::available(dev, dtype, head_dim) => AttentionImpl::Flash2,
            None => Self::for_device(dev),
        })
    }

    /// Attention of q (B, H, Tq, D) over k, v (B, Hkv, Tk, D) -> (B, H, Tq, D); differentiable (except
    /// `CandleFlash`, and `Flash2` where it hands a call to it).
    pub fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, causal: bool) -> Result<Tensor> {
        match self {
            AttentionImpl::Cpu => attention(q, k, v, scale, causal, None),
            // the kernels take head dims 16, 32, 64, 128; other models run the blocked reference
            AttentionImpl::Flash if !HEAD_DIMS.contains(&q.dim(3)?) => {
                attention_blocked(q, k, v, scale, causal, None, DEFAULT_BLOCK)
            }
            AttentionImpl::Flash => attention(q, k, v, scale, causal, None),
            AttentionImpl::CpuReference => attention_with(q, k, v, scale, causal, None, CpuKernel::Reference),
            AttentionImpl::Blocked { block } => attention_blocked(q, k, v, scale, causal, None, *block),
            AttentionImpl::CandleFlash => candle_flash::attention(q, k, v, scale, causal),
            AttentionImpl::Flash2 if causal && q.dim(2)? == k.dim(2)? => flash2::attention(q, k, v, scale, None),
            // FA2's backward is built causal only: a full-attention call keeps harpe's differentiable op
            AttentionImpl::Flash2 if !causal => attention(q, k, v, scale, false, None),
            // KV-cached generation (Tq < Tk): forward only, nothing to differentiate
            AttentionImpl::Flash2 => candle_flash::attention(q, k, v, scale, true),
            AttentionImpl::Custom(f) => f.attend(q, k, v, scale, causal),
        }
    }

    /// Causal attention under a document mask (query i sees keys j <= i of its own document, `docs`
    /// (B, Tk) per key: its document's start); q (B, H, Tq, D), k, v (B, Hkv, Tk, D) -> (B, H, Tq, D).
    pub fn attend_doc(&self, q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, docs: &DocStarts) -> Result<Tensor> {
        match self {
            AttentionImpl::Cpu => attention(q, k, v, scale, true, Some(docs)),
            AttentionImpl::CpuReference => attention_with(q, k, v, scale, true, Some(docs), CpuKernel::Reference),
            AttentionImpl::Flash if !HEAD_DIMS.contains(&q.dim(3)?) => {
                attention_blocked(q, k, v, scale, true, Some(docs), DEFAULT_BLOCK)
            }
            AttentionImpl::Flash => attention(q, k, v, scale, true, Some(docs)),
            AttentionImpl::Blocked { block } => attention_blocked(q, k, v, scale, true, Some(docs), *block),
            AttentionImpl::CandleFlash => candle_flash::attention_doc(q, k, v, scale, docs),
            AttentionImpl::Flash2 => flash2::attention(q, k, v, scale, Some(docs)),
            AttentionImpl::Custom(f) => f.attend_doc(q, k, v, scale, docs),
        }
    }

    /// Whether `attend_doc` works: every built-in arm, a `Custom` one when it says so.
    pub fn supports_document_mask(&self) -> bool {
        match self {
            AttentionImpl::Custom(f) => f.supports_document_mask(),
            _ => true,
        }
    }
}
