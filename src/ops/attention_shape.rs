//! The attention op's shapes and tiles, shared by everything that runs it: the problem sizes
//! (`AttnDims`), the shape rules the kernels need (`check_dims`), the head dims they are instantiated for,
//! and which tiles run (`AttnKernel`, with the tile heights the launchers derive their grids from).
//!
//! Reference: kernels/attention.cu (`ATTN_NT`, `ATTN_TC_NT`, `AttnTile<D>`, `AttnTc<D>`).
//! The non-obvious decision: this file imports nothing of the crate. The op (`ops::attention`), its GEMM
//! blocks (`ops::attention_gemm`), its CUDA launcher (`ops::attention_cuda`) and the host emulator
//! (`ops::emu::attention`) all read these types, so they live below all of them: the emulator depends on
//! the op's types, never the op on the emulator, and no two of those files import each other back.
//! Does not: run anything (the implementations live in the files named above).
use candle_core::{bail, Result};

/// Problem sizes shared by forward and backward: q (B, H, Tq, D), k and v (B, Hkv, Tk, D).
/// The softmax scale and the masks of one attention call: causal or not, and an optional document mask
/// (causal only) in the form the implementation reads: per key position (B*Tk) the start of its document
/// on the host (`D` = `[u32]`, `DocStarts::host`: the emulated kernels) or as a device tensor (`D` =
/// `Tensor`, `DocStarts::tensor`: the CUDA launchers).
#[derive(Debug)]
pub struct AttnMask<'a, D: ?Sized = [u32]> {
    pub scale: f32,
    pub causal: bool,
    pub docs: Option<&'a D>,
}

impl<'a, D: ?Sized> AttnMask<'a, D> {
    pub fn new(scale: f32, causal: bool, docs: Option<&'a D>) -> AttnMask<'a, D> {
        AttnMask { scale, causal, docs }
    }
}

// by hand: a derive would ask `D: Clone`, which `[u32]` is not (only the reference is copied)
impl<D: ?Sized> Clone for AttnMask<'_, D> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<D: ?Sized> Copy for AttnMask<'_, D> {}

#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub b: usize,
    pub h: usize,
    pub hkv: usize,
    pub tq: usize,
    pub tk: usize,
    pub d: usize,
}

impl AttnDims {
    /// Keys query row `i` may see: 0..limit.
    pub(crate) fn limit(&self, causal: bool, i: usize) -> usize {
        if causal {
            (self.tk - self.tq + i + 1).min(self.tk)
        } else {
            self.tk
        }
    }

    /// First key query row `i` of sequence `bi` may see under the document mask `docs` (B*Tk, per key its
    /// document's start): the start of its own document; 0 without a mask (a mask is only defined with
    /// causal attention and ignored without it).
    #[inline]
    pub(crate) fn first_key(&self, causal: bool, docs: Option<&[u32]>, bi: usize, i: usize) -> usize {
        let hi = self.limit(causal, i);
        match docs {
            Some(ds) if causal && hi > 0 => ds[bi * self.tk + hi - 1] as usize,
            _ => 0,
        }
    }
}

/// Threads per block of the FMA tiles and the row kernels (delta, dQ convert) (`ATTN_NT` in kernels/attention.cu).
pub const ATTN_THREADS: u32 = 128;
/// Threads per block of the tensor-core tiles, forward and backward: 8 warps (`ATTN_TC_NT`).
pub const ATTN_TC_THREADS: u32 = 256;
/// Head dims the kernels are instantiated for (FMA tiles; the tensor-core tiles take 64 and 128).
pub const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];
/// Head dims of the tensor-core kernels.
pub const TC_HEAD_DIMS: [usize; 2] = [64, 128];

/// Which tiles of kernels/attention.cu run: the FMA reference tiles or the tensor-core (mma.sync) tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKernel {
    /// plain FMA loops over shared memory (every dtype and head dim; the readable reference)
    Fma,
    /// sm_80 mma.sync m16n8k16 + ldmatrix (bf16/f16 inputs, D = 64 or 128, 16-byte aligned inputs)
    TensorCore,
}

impl AttnKernel {
    /// The fastest kernel for a storage type of `elem_bytes` bytes and head dim `d`.
    pub fn best(elem_bytes: usize, d: usize) -> AttnKernel {
        if elem_bytes == 2 && TC_HEAD_DIMS.contains(&d) {
            AttnKernel::TensorCore
        } else {
            AttnKernel::Fma
        }
    }

    /// Query rows per forward block (`AttnTile<D>::BQ` / `AttnTc<D>::BQ` in the kernel).
    pub fn fwd_rows(self, d: usize) -> usize {
        match self {
            AttnKernel::Fma => fma_tile(d),
            AttnKernel::TensorCore => 128,
        }
    }

    /// Threads per block of this kernel's forward and backward tiles.
    pub fn threads(self) -> u32 {
        match self {
            AttnKernel::Fma => ATTN_THREADS,
            AttnKernel::TensorCore => ATTN_TC_THREADS,
        }
    }

    /// Keys per backward block (`AttnTile<D>::BK` / `AttnTc<D>::BKB`).
    pub fn bwd_keys(self, d: usize) -> usize {
        match self {
            AttnKernel::Fma => fma_tile(d),
            AttnKernel::TensorCore => 64,
        }
    }

    /// Kernel-name stem: `attn_fwd` or `attn_fwd_tc` (and `attn_bwd`, `attn_bwd_tc`).
    pub fn stem(self, pass: &str) -> String {
        match self {
            AttnKernel::Fma => format!("attn_{pass}"),
            AttnKernel::TensorCore => format!("attn_{pass}_tc"),
        }
    }

    /// An error unless this kernel is instantiated for `elem_bytes`-byte inputs and head dim `d`.
    pub fn check(self, elem_bytes: usize, d: usize) -> Result<()> {
        if self == AttnKernel::TensorCore && (elem_bytes != 2 || !TC_HEAD_DIMS.contains(&d)) {
            bail!(
                "attention kernel: the tensor-core tiles take bf16/f16 inputs with D in {TC_HEAD_DIMS:?}, got {elem_bytes}-byte elements and D = {d}\nhint: use AttnKernel::Fma (or AttnKernel::best)"
            );
        }
        Ok(())
    }
}

/// Query (forward) and key (backward) tile height of the FMA kernels for head dim `d` (`AttnTile<D>`).
pub fn fma_tile(d: usize) -> usize {
    if d >= 128 {
        16
    } else {
        32
    }
}

/// The shape checks every kernel launch makes (CUDA and emulated): head dim, GQA ratio, causal Tk >= Tq,
/// sizes in u32.
pub fn check_dims(dims: AttnDims, causal: bool) -> Result<()> {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    if !HEAD_DIMS.contains(&d) {
        bail!("attention kernel: head dim D = {d} is not one of {HEAD_DIMS:?}\nhint: use the CPU reference (ops::attention) for other head dims");
    }
    if hkv == 0 || h % hkv != 0 {
        bail!("attention kernel: H = {h} query heads is not a multiple of Hkv = {hkv} kv heads\nhint: check num_key_value_heads in config.json");
    }
    if b == 0 || tq == 0 || tk == 0 {
        bail!("attention kernel: empty problem (B {b}, Tq {tq}, Tk {tk})\nhint: skip the call for empty batches");
    }
    if causal && tk < tq {
        bail!("attention kernel: causal attention needs Tk >= Tq, got Tq {tq}, Tk {tk}\nhint: the KV cache must hold the queries' own keys");
    }
    for (what, n) in [("B*H*Tq*D", b * h * tq * d), ("B*Hkv*Tk*D", b * hkv * tk * d)] {
        if u32::try_from(n).is_err() {
            bail!("attention kernel: {what} = {n} does not fit u32\nhint: split the batch");
        }
    }
    Ok(())
}

/// The op's packed row layouts (kernels/attention.cu, "Layouts"): the forward's output rows O | lse (D + E
/// elements of the input type) and the backward's input rows [q | O | lse | dO | d(lse)] (3D + 2E), where lse
/// is one f32 stored in the first slots after O and E = 1 for f32, 8 for 16-bit types (lse's 4 bytes and a
/// pad that keeps every 16-bit row and every part of it 16-byte aligned for the tensor-core tiles' copy16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedRows {
    /// Head dim D.
    pub d: usize,
    /// Bytes per element of the input type (4, or 2 for bf16/f16).
    pub elem_bytes: usize,
}

impl PackedRows {
    /// Slots after O that hold lse (E).
    pub fn lse_slots(&self) -> usize {
        if self.elem_bytes >= 4 {
            1
        } else {
            8
        }
    }

    /// Elements per forward row: D + E.
    pub fn fwd_width(&self) -> usize {
        self.d + self.lse_slots()
    }

    /// Elements per backward row: 3D + 2E.
    pub fn bwd_width(&self) -> usize {
        3 * self.d + 2 * self.lse_slots()
    }

    /// Offset of dO in a backward row (q at 0, O at D, lse at 2D).
    pub fn dout_at(&self) -> usize {
        2 * self.d + self.lse_slots()
    }

    /// A row stride of `width` elements in f32 units (the kernels' `ldl` for lse in these rows).
    pub fn floats(&self, width: usize) -> usize {
        width * self.elem_bytes / 4
    }
}

/// Device memory one attention forward + backward allocates beyond its inputs, its outputs and what
/// autograd saves (the forward's packed O|lse output, `PackedRows::fwd_width` per row, is saved and counted
/// with the activations). One owner: the CUDA launcher allocates `bwd_scratch` exactly, the emulated launcher
/// too (tests/stage_model/attention_emu.rs checks it), and `harpe plan` reports `total` as `attention_workspace`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnWorkspace {
    /// The backward's input rows [q | O | lse | dO | .] in the input type: the op's one packing copy
    /// (`Tensor::cat` in `AttentionFwd::bwd`), read in place by the kernels.
    pub bwd_packed: usize,
    /// delta (one f32 per query row) and the f32 dQ accumulator: the launcher's one scratch allocation.
    pub bwd_scratch: usize,
}

impl AttnWorkspace {
    /// Everything above, in bytes.
    pub fn total(&self) -> usize {
        self.bwd_packed + self.bwd_scratch
    }

    /// The scratch as f32 elements: delta (the first B*H*Tq) then the dQ accumulator (B*H*Tq*D).
    pub fn scratch_floats(&self) -> usize {
        self.bwd_scratch / 4
    }
}

/// The workspace of attention with sizes `dims` on inputs of `elem_bytes`-byte elements.
pub fn attention_workspace(dims: AttnDims, elem_bytes: usize) -> AttnWorkspace {
    let rows = dims.b * dims.h * dims.tq;
    let layout = PackedRows { d: dims.d, elem_bytes };
    AttnWorkspace { bwd_packed: rows * layout.bwd_width() * elem_bytes, bwd_scratch: rows * (dims.d + 1) * 4 }
}
