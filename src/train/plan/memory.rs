//! The memory side of a plan: the named terms of one rank's bytes (model state by ZeRO stage,
//! activations, communication buffers, fixed overhead), and the activation count they rest on —
//! `layer_graph`, what candle's autograd keeps of one decoder layer op by op, and the backward's
//! temporaries (calibrated on the CPU f32 path). Apart from the step time (`time.rs`), which reads the
//! same `Sizes`.
use super::inputs::{Arch, Gpu, StageShape, World, GIB};
use crate::config::{Checkpointing, ZeroStage};
use serde::Serialize;

/// Per-GPU fixed overhead of the CUDA path: CUDA context and kernels (~0.6 GiB), cuBLAS workspaces,
/// NCCL channel buffers and the caching allocator's slack (~1.4 GiB): 2 GiB.
const GPU_FIXED_BYTES: u64 = 2 << 30;
/// ZeRO gradient bucket of the CUDA path (double-buffered): 64 MiB of gradient elements each.
const BUCKET_BYTES: u64 = 64 << 20;
/// Resident bytes of a `harpe train` process besides its model, state and activations (binary, libc and
/// rayon runtime, tokenizer, dataset index, allocator arenas): 23.5 MiB, calibrated (see below; 17.5 MiB
/// in the calibration before).
pub const CPU_BASELINE_BYTES: u64 = 47 << 19;
/// candle's backward temporaries per token of one recomputed layer (the sums of gradients, the fused
/// SwiGLU's packed gradient, matmul gradients and the gemm crate's packing buffers) together with what
/// glibc's allocator keeps resident between steps, in f32 elements per unit of the MLP width I and of the
/// hidden size C. Fitted by `scripts/calibrate_cpu_plan.py` (2 repeats) after the training step stopped
/// keeping the last segment's graph through the recompute: the fit moved from 3.6 and 8.8 (whose plan had
/// counted that graph twice over the peak) to 5.3 and 14.3, the largest residual of the fitted runs
/// 6.4 MiB. Method of the script: a least-squares fit of the smallest peak RSS of 2-step `harpe train`
/// runs of MHA configs (C 128/256, I 512/1024, L 4/8, T 1024) after subtracting every enumerated term;
/// validated on a GQA config of other sizes by tests/stage_train/plan_memory.rs.
pub const CPU_BWD_PER_I: f64 = 5.3;
pub const CPU_BWD_PER_C: f64 = 14.3;

/// One memory term.
#[derive(Clone, Debug, Serialize)]
pub struct Term {
    pub name: &'static str,
    pub bytes: u64,
    pub note: String,
}

/// The sizes every term of `plan_stage` reads (floats, as the formulas use them).
pub(super) struct Sizes {
    pub(super) cpu: bool,
    /// parameters, ranks, Ulysses degree, ZeRO stage
    pub(super) n: f64,
    pub(super) w: f64,
    pub(super) p: usize,
    pub(super) z: ZeroStage,
    /// hidden, layers; query and kv widths (heads x head_dim)
    pub(super) c: f64,
    pub(super) l: usize,
    pub(super) hd: f64,
    pub(super) kvd: f64,
    /// bytes per weight/activation element and per gradient element
    pub(super) wb: f64,
    pub(super) gb: f64,
    /// tokens per rank per micro-batch
    pub(super) tl: f64,
    /// layers per checkpoint segment, segments, layers of the last segment
    pub(super) seg: usize,
    pub(super) n_seg: usize,
    pub(super) last_seg: usize,
    /// the attention kernels the run trains with (`Gpu::attention`)
    pub(super) attn: super::inputs::AttnKernelKind,
}

impl Sizes {
    pub(super) fn of(arch: &Arch, shape: &StageShape, world: &World, gpu: &Gpu) -> Sizes {
        let p = world.sp_degree.max(1);
        let l = arch.layers;
        let seg = shape.checkpointing.segment_len(l);
        let n_seg = l.div_ceil(seg);
        Sizes {
            cpu: gpu.is_cpu(),
            n: arch.params as f64,
            w: world.gpus as f64,
            p,
            z: world.zero_stage,
            c: arch.hidden as f64,
            l,
            hd: (arch.heads * arch.head_dim) as f64,
            kvd: (arch.kv_heads * arch.head_dim) as f64,
            wb: if shape.bf16 { 2.0 } else { 4.0 },
            // gradients: fp32 on every device (FlatBuf), accumulated over micro-batches and reduce-scattered
            // in fp32 (Megatron's main_grad: 2 + 4 + 12 = 18 B/param; the 7B-at-128K budget has bf16 gradients, 16 B)
            gb: 4.0,
            tl: (shape.micro_batch * shape.seq_len.div_ceil(p)) as f64,
            seg,
            n_seg,
            last_seg: l - (n_seg - 1) * seg,
            attn: gpu.attention.kernel,
        }
    }

    /// Divides by the world when a ZeRO stage shards the quantity.
    fn shard(&self, on: bool) -> f64 {
        if on {
            self.w
        } else {
            1.0
        }
    }
}

fn add_term(terms: &mut Vec<Term>, name: &'static str, bytes: f64, note: String) {
    terms.push(Term { name, bytes: bytes.max(0.0) as u64, note });
}

/// Weights (and what ZeRO-3 holds gathered), gradients and optimizer state.
pub(super) fn state_terms(sz: &Sizes, arch: &Arch, world: &World, terms: &mut Vec<Term>) {
    let (n, z, wb, gb) = (sz.n, sz.z, sz.wb, sz.gb);
    add_term(
        terms,
        "weights",
        n * wb / sz.shard(z.gathers_weights()),
        format!("{} x {} B{}", arch.params, wb, if z.gathers_weights() { " / world (ZeRO-3)" } else { "" }),
    );
    if z.gathers_weights() && world.gpus > 1 {
        // what ZeRO-3 holds gathered at its peak (train/step.rs): the embedding, final norm and head for
        // the whole micro-batch, the layers of one checkpoint segment (the last one keeps its graph
        // from the forward to its backward; the whole model without checkpointing), and the
        // next layer's prefetch (NCCL and `Local` overlap it with this layer's compute: `Comm::overlaps`)
        let layer = arch.layer_params() as f64;
        let outer = (arch.vocab * arch.hidden) as f64 * if arch.tied { 1.0 } else { 2.0 } + sz.c;
        let held = sz.seg.max(sz.last_seg);
        let prefetch = if held >= sz.l { 0.0 } else { layer };
        add_term(
            terms,
            "gathered_weights",
            (outer + held as f64 * layer + prefetch) * wb,
            format!(
                "ZeRO-3: embedding/norm/head + {held} layer(s) of a checkpoint segment{}",
                if prefetch > 0.0 { " + the next layer's prefetch" } else { "" }
            ),
        );
    }
    add_term(
        terms,
        "gradients",
        n * gb / sz.shard(z.shards_gradients()),
        format!("{gb} B/param{}", if z.shards_gradients() { " / world (ZeRO-2+)" } else { "" }),
    );
    add_term(
        terms,
        "optimizer",
        n * 12.0 / sz.shard(z.shards_optimizer()),
        format!("fp32 master, m, v = 12 B/param{}", if z.shards_optimizer() { " / world (ZeRO-1+)" } else { "" }),
    );
}

/// Activations: saved segment inputs + the larger of the recompute and the loss working sets, and on GPUs
/// one layer's attention workspace.
pub(super) fn activation_terms(sz: &Sizes, arch: &Arch, shape: &StageShape, terms: &mut Vec<Term>) {
    let (tl, wb) = (sz.tl, sz.wb);
    let gib = |b: f64| b / GIB;
    let path = if sz.cpu { LayerPath::CpuF32 } else { LayerPath::Cuda };
    // Ulysses' copies of q, k, v and o per layer, as `comms::sequence` makes them (two with one sequence
    // per micro-batch, where one re-layout of each exchange is a view; three with more)
    let copies = crate::comms::sequence::saved_copies(shape.micro_batch) as f64;
    let sp_copies = if sz.p > 1 { copies * (2.0 * sz.hd + 2.0 * sz.kvd) * wb } else { 0.0 };
    let act = activations(arch, shape, path, (sz.n_seg, sz.seg, sz.last_seg), tl, sp_copies);
    let (inputs, recompute, loss) = (act.inputs, act.recompute, act.loss);
    let ws_note = format!(
        "candle autograd keeps a layer's graph until its backward returns: {:.1}K values/token/layer ({})",
        layer_graph_bytes(arch, path) / wb / 1e3,
        path.name()
    );
    add_term(
        terms,
        "layer_inputs",
        inputs,
        format!("{} saved segment inputs x {tl} tokens x {} x {wb} B", sz.n_seg, arch.hidden),
    );
    // the step's cos/sin tables stay on the device from the forward to the last layer's recompute; one
    // table serves every sequence of the micro-batch (the same positions)
    let rope_tokens = shape.seq_len.div_ceil(sz.p);
    add_term(
        terms,
        "rope_tables",
        arch.rope_table_bytes(rope_tokens as f64),
        format!(
            "cos + sin, f32: {} table(s) x {} row(s) x {rope_tokens} positions x {} columns",
            arch.rope_tables,
            arch.rope_rows,
            arch.head_dim / 2
        ),
    );
    let (ws, which) = if recompute >= loss { (recompute, "recompute") } else { (loss, "loss") };
    add_term(
        terms,
        "working_set",
        ws,
        format!("{which} phase: recompute {:.2} GiB, loss chunk {:.2} GiB; {ws_note}", gib(recompute), gib(loss)),
    );
    if !sz.cpu {
        // one layer's flash-attention backward at a time: the kernel's own workspace (Ulysses: H/p heads over
        // the whole sequence)
        let heads = ((arch.heads / sz.p).max(1), (arch.kv_heads / sz.p).max(1));
        let (bytes, note) = super::attention::workspace(sz.attn, arch, shape, heads, wb);
        add_term(terms, "attention_workspace", bytes, note);
    }
}

/// Collective buffers, Ulysses' re-laid-out q/k/v, and the fixed overhead of a process or a GPU.
pub(super) fn comm_terms(sz: &Sizes, arch: &Arch, world: &World, gpu: &Gpu, terms: &mut Vec<Term>) {
    let (n, gb) = (sz.n, sz.gb);
    // the larger of one layer and the embedding: the group ZeRO 2-3 hands on at a time
    let group = (arch.layer_params() as f64).max((arch.vocab * arch.hidden) as f64);
    if world.gpus > 1 {
        if sz.cpu {
            // Local ranks exchange copies: ZeRO-0's all-reduce and ZeRO-1's reduce-scatter deposit the
            // whole gradient (the all-reduce's result is a second whole copy); ZeRO 2-3 hand on one group (a layer or the embedding/head) at a time to the
            // rank's communication thread, which may still hold the previous group's copy while the next
            // one is handed on (the deferred join, as on an NCCL stream): two groups alive
            let (unit, note) = if !sz.z.shards_optimizer() {
                (2.0 * n, "ZeRO-0's all-reduce: the gradient's copy deposited and the reduced result")
            } else if !sz.z.shards_gradients() {
                (n, "ZeRO-1's reduce-scatter: the gradient's copy deposited")
            } else {
                (2.0 * group, "2 x one layer's gradient copy: one handed to the comm thread, one still in flight")
            };
            add_term(terms, "comm_buckets", unit * gb, note.into());
        } else if !sz.z.shards_gradients() {
            let b = (2.0 * BUCKET_BYTES as f64).min(2.0 * n * gb);
            add_term(terms, "comm_buckets", b, "2 x 64 MiB NCCL buffers (the all-reduce runs in place)".into());
        } else {
            // ZeRO 2-3 hand each group's fp32 gradients on while the previous group's reduce-scatter
            // may still run (ZeroShards::pending): two groups alive
            let note = "2 x one layer's fp32 gradients: one handed on, one still in flight";
            add_term(terms, "comm_buckets", 2.0 * group * gb, note.into());
        }
    }
    if sz.p > 1 {
        let note = "Ulysses: q, k, v in the head-sharded layout";
        add_term(terms, "sp_all_to_all", sz.tl * (sz.hd + 2.0 * sz.kvd) * sz.wb, note.into());
    }
    if gpu.is_cpu() {
        add_term(terms, "fixed_overhead", CPU_BASELINE_BYTES as f64, "harpe process baseline (calibrated)".into());
    } else {
        let note = "CUDA context, cuBLAS workspace, NCCL, allocator slack";
        add_term(terms, "fixed_overhead", GPU_FIXED_BYTES as f64, note.into());
    }
}

/// Which implementation each op of a decoder layer runs, and so which tensors candle's autograd keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerPath {
    /// CPU in f32: `ops::linear`, RoPE reading the projections' strided rows, the attention op in f32
    CpuF32,
    /// CPU in bf16/f16: candle's matmul; RoPE and the attention op run in f32 on upcast copies
    CpuHalf,
    /// CUDA: cuBLAS, the RoPE kernel on a contiguous copy, the flash kernels in the run dtype
    Cuda,
}

impl LayerPath {
    pub fn name(&self) -> &'static str {
        match self {
            LayerPath::CpuF32 => "cpu f32",
            LayerPath::CpuHalf => "cpu bf16",
            LayerPath::Cuda => "cuda",
        }
    }
}

/// One tensor (or group of tensors) a decoder layer's autograd graph keeps: values per token and bytes
/// per value.
#[derive(Clone, Debug, PartialEq)]
pub struct Stored {
    pub what: &'static str,
    pub per_token: f64,
    pub bytes: f64,
}

/// What candle's autograd keeps of one decoder layer until its backward returns, op by op as
/// `Llama::layer_body` runs them on `path` with activations of `wb` bytes (every op output that another
/// op reads is kept by that op's node; views share storage). The paths differ only where an op makes
/// copies: RoPE (CPU f32 reads strided rows; CPU bf16 upcasts to f32 and casts back; the CUDA kernel
/// needs contiguous rows) and attention (CPU bf16 upcasts q, k, v to f32; the packed O|lse rows are f32
/// on CPU, the run dtype on CUDA). Nothing of size T x T is kept on any path.
pub fn layer_graph(a: &Arch, path: LayerPath, wb: f64) -> Vec<Stored> {
    let (c, i, h) = (a.hidden as f64, a.intermediate as f64, a.heads as f64);
    let (hd, kvd) = ((a.heads * a.head_dim) as f64, (a.kv_heads * a.head_dim) as f64);
    let s = |what, per_token, bytes| Stored { what, per_token, bytes };
    let packed = |elem: usize| {
        let rows = crate::ops::attention_shape::PackedRows { d: a.head_dim, elem_bytes: elem };
        h * rows.fwd_width() as f64
    };
    let mut v = vec![s("input norm output", c, wb), s("q, k, v projections", hd + 2.0 * kvd, wb)];
    match path {
        LayerPath::CpuF32 => v.push(s("RoPE outputs of q, k", hd + kvd, wb)),
        LayerPath::CpuHalf => {
            v.push(s("RoPE: q, k upcast to f32 and rotated", 2.0 * (hd + kvd), 4.0));
            v.push(s("RoPE outputs cast back", hd + kvd, wb));
        }
        LayerPath::Cuda => v.push(s("RoPE: q, k made contiguous and rotated", 2.0 * (hd + kvd), wb)),
    }
    v.push(s("v made contiguous", kvd, wb));
    match path {
        LayerPath::CpuF32 => v.push(s("attention: packed O|lse rows", packed(4), 4.0)),
        LayerPath::CpuHalf => {
            v.push(s("attention: q, k, v upcast to f32", hd + 2.0 * kvd, 4.0));
            v.push(s("attention: packed O|lse rows (f32)", packed(4), 4.0));
            v.push(s("attention: O cast back", hd, wb));
        }
        LayerPath::Cuda => v.push(s("attention: packed O|lse rows", packed(wb as usize), wb)),
    }
    v.extend([
        s("attention output as (B, T, H*D) rows", hd, wb),
        s("o projection, residual", 2.0 * c, wb),
        s("post-attention norm output", c, wb),
        s("gate, up, fused SwiGLU output", 3.0 * i, wb),
        s("down projection, residual", 2.0 * c, wb),
    ]);
    v
}

/// Bytes per token of `layer_graph`.
pub fn layer_graph_bytes(a: &Arch, path: LayerPath) -> f64 {
    let wb = if path == LayerPath::CpuF32 { 4.0 } else { 2.0 };
    layer_graph_bytes_wb(a, path, wb)
}

fn layer_graph_bytes_wb(a: &Arch, path: LayerPath, wb: f64) -> f64 {
    layer_graph(a, path, wb).iter().map(|t| t.per_token * t.bytes).sum()
}

/// Bytes alive in one layer's backward besides its graph, at `tl` tokens. CPU f32: calibrated
/// (`CPU_BWD_PER_*`). Otherwise counted at the two widest points: the MLP's (the gradient of the SwiGLU
/// output, the op's dgate and dup, the gradients of the residual and the norm output, and the f32 block
/// of the SwiGLU backward, `ops::swiglu::BWD_BLOCK`) and, on CPU bf16, attention's (its f32 backward:
/// the padded output gradient, the packed rows, the scratch and dQ|dK|dV; on CUDA that is the
/// `attention_workspace` term).
pub fn backward_temporaries(a: &Arch, path: LayerPath, wb: f64, tl: f64) -> f64 {
    use crate::ops::swiglu::{BWD_BLOCK, BWD_LIVE_F32};
    let (c, i, h) = (a.hidden as f64, a.intermediate as f64, a.heads as f64);
    let (hd, kvd) = ((a.heads * a.head_dim) as f64, (a.kv_heads * a.head_dim) as f64);
    if path == LayerPath::CpuF32 {
        return (CPU_BWD_PER_I * i + CPU_BWD_PER_C * c) * 4.0 * tl;
    }
    let block_rows = (BWD_BLOCK as f64 / i).floor().max(1.0).min(tl);
    let mlp = (3.0 * i + 2.0 * c) * wb * tl + block_rows * i * (BWD_LIVE_F32 * 4) as f64;
    if path == LayerPath::Cuda {
        return mlp;
    }
    let rows = crate::ops::attention_shape::PackedRows { d: a.head_dim, elem_bytes: 4 };
    let per_head = (rows.fwd_width() + rows.bwd_width() + a.head_dim + 1) as f64 * 4.0;
    let attn = (h * per_head + (hd + 2.0 * kvd) * 4.0 + 2.0 * c * wb) * tl;
    mlp.max(attn)
}

/// The activation memory of one rank: saved segment inputs, and the two phases' working sets (bytes).
#[derive(Clone, Copy, Debug)]
pub struct Activations {
    pub inputs: f64,
    /// a recomputed segment's graph + its backward temporaries + its weights' gradients
    pub recompute: f64,
    /// the last segment's graph (kept from the forward) + the loss's backward
    pub loss: f64,
}

/// `Activations` of `shape` on `path` with `tl` tokens per rank, segments `(n_seg, seg, last_seg)`, and
/// `extra` bytes per token per layer (Ulysses' copies).
pub fn activations(
    arch: &Arch,
    shape: &StageShape,
    path: LayerPath,
    (n_seg, seg, last_seg): (usize, usize, usize),
    tl: f64,
    extra: f64,
) -> Activations {
    let wb = if path == LayerPath::CpuF32 || !shape.bf16 && path == LayerPath::Cuda { 4.0 } else { 2.0 };
    let (c, v) = (arch.hidden as f64, arch.vocab as f64);
    let none = matches!(shape.checkpointing, Checkpointing::None);
    let inputs = if none { 0.0 } else { n_seg as f64 * tl * c * wb };
    let g = (layer_graph_bytes_wb(arch, path, wb) + extra) * tl;
    let bwd = backward_temporaries(arch, path, wb, tl);
    // the weights' gradients of a segment (and of the head) as candle returns them, before they are handed on
    let seg_grads = seg as f64 * arch.layer_params() as f64 * wb + v * c * wb;
    let kept = last_seg as f64 * g + c * tl * wb; // the last segment's graph + the final norm's output
    let recompute = if n_seg > 1 { seg as f64 * g + bwd + seg_grads } else { kept + bwd + seg_grads };
    // The loss backward (`model::loss`, before any layer's backward) at its wider point: either a chunk's
    // dlogits while the head's f32 gradient takes the chunk's product into a new sum (the head's f32 copy,
    // the gradient, the product and the sum: 4 x V x C f32), or the chunk's logits (in the activation
    // dtype, then f32) beside its dlogits; + the chunk's f32 input and dh, written in place.
    let chunk = shape.loss_chunk.min(shape.micro_batch * shape.seq_len) as f64;
    let head = v * c * 4.0;
    let logits_copy = if wb < 4.0 { wb } else { 0.0 };
    let widest = (4.0 * head + chunk * v * 4.0).max(2.0 * head + chunk * v * (8.0 + logits_copy));
    let loss_ws = widest + 2.0 * chunk * c * 4.0 + tl * c * wb;
    Activations { inputs, recompute, loss: kept + loss_ws }
}
