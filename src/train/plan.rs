//! `harpe plan`: per-GPU memory by term and the step time of a run before it starts, whether it fits,
//! and when it does not, the cheapest change that does.
//!
//! Reference: the budget this reproduces (Llama-2-7B at 128K on 8 x 80 GB; docs/VALIDATION.md), Rajbhandari et
//! al. 2020 (ZeRO: 2 B bf16 weight + 2 B bf16 grad + 12 B fp32 master/m/v per parameter, stage s shards
//! the last s of them), Jacobs et al. 2023 (DeepSpeed-Ulysses: activations / P, four all-to-alls per
//! layer), Korthikanti et al. 2022 (activations counted tensor by tensor per layer), Chen et al. 2016
//! (checkpointing), `model::flops_per_token` (6N + 12·L·C·T, the FLOPs the MFU column uses).
//! The non-obvious decisions:
//! - Two device modes, one activation count. `gpu` models harpe's CUDA path (bf16, flash attention, the
//!   chunked loss: nothing T x T or T x V); `cpu` models the CPU path as it is (f32 everywhere). On both,
//!   candle's autograd keeps every op output of a layer until that layer's backward returns: `layer_graph`
//!   counts those tensors op by op for a `LayerPath` (the paths differ only in RoPE's and attention's
//!   copies), and tests/plan_graph_memory.rs checks the count against the allocator in bf16 on the CPU.
//!   The backward's temporaries are counted on the bf16/CUDA paths; on the CPU f32 path they and the
//!   process baseline are *calibrated* constants, measured as documented at `CPU_BWD_*` and
//!   `CPU_BASELINE_BYTES` and checked by tests/stage_train/plan_memory.rs.
//! - The activation peak is layer inputs + max(recompute working set, loss working set): the loss runs
//!   before any segment is recomputed, and `train::step` drops the last segment's graph after the loss's
//!   backward, so their buffers are never alive together.
//! - Step time = max(compute, ZeRO collectives) + Ulysses all-to-alls: ZeRO traffic is bucketed and
//!   overlaps compute; the all-to-alls sit between the projections and attention, so they do not.
//!   Compute counts the recomputed forward; `mfu` is the achieved fraction of peak on those FLOPs.
//! - "Cheapest change" = the candidate (checkpoint every layer, micro-batch 1 with more accumulation,
//!   higher ZeRO stage, SP degree, more GPUs) that fits with the fewest GPU-seconds per token.
//!
//! What this file does not do: tensor/pipeline parallelism, CPU offload, the data loader's prefetch,
//! fragmentation beyond the stated margin; it predicts, the training loop measures (`metrics.jsonl`).
use crate::config::ZeroStage;
use crate::config::{Checkpointing, DistSection, RunConfig, StageBatch};
use crate::device::ComputeDtype;
use crate::model::config::LlamaConfig;
use anyhow::{anyhow, bail, Result};
use serde::Serialize;

pub const GIB: f64 = (1u64 << 30) as f64;
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

/// Hardware a plan is made for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuKind {
    A100,
    H100,
    H200,
    /// harpe's CPU path (host memory, f32)
    Cpu,
}

impl GpuKind {
    const NAMES: [(&'static str, GpuKind); 4] =
        [("a100", GpuKind::A100), ("h100", GpuKind::H100), ("h200", GpuKind::H200), ("cpu", GpuKind::Cpu)];

    /// Parse a name (`a100`, `h100`, `h200`, `cpu`), naming the nearest valid one when unknown.
    pub fn parse(s: &str) -> Result<GpuKind> {
        let low = s.trim().to_ascii_lowercase();
        if let Some((_, k)) = Self::NAMES.iter().find(|(n, _)| *n == low) {
            return Ok(*k);
        }
        let nearest = Self::NAMES.iter().min_by_key(|(n, _)| edit_distance(n, &low)).map(|(n, _)| *n).unwrap_or("a100");
        bail!("--gpu: unknown GPU `{s}` (known: a100, h100, h200, cpu)\nhint: the nearest known name is `{nearest}`; other GPUs: pass --gpu-mem, --peak-tflops and --link-gbs with the closest kind")
    }

    /// The kind of a CUDA device from its driver name ("NVIDIA H200", "NVIDIA A100-SXM4-80GB"); `None`
    /// for other GPUs (the caller keeps the measured memory and states the assumed peak).
    pub fn from_device_name(name: &str) -> Option<GpuKind> {
        let low = name.to_ascii_lowercase();
        [("a100", GpuKind::A100), ("h100", GpuKind::H100), ("h200", GpuKind::H200)]
            .into_iter()
            .find(|(n, _)| low.contains(n))
            .map(|(_, k)| k)
    }

    pub fn name(&self) -> &'static str {
        Self::NAMES.iter().find(|(_, k)| k == self).map(|(n, _)| *n).unwrap_or("?")
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            cur.push((prev[j] + (ca != *cb) as usize).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// One device and what is assumed about running on it.
#[derive(Clone, Debug, Serialize)]
pub struct Gpu {
    pub kind: GpuKind,
    /// memory of one device in bytes
    pub mem_bytes: u64,
    /// dense peak TFLOP/s in the compute dtype
    pub peak_tflops: f64,
    /// achieved fraction of peak on the FLOPs executed (recompute included)
    pub mfu: f64,
    /// intra-node interconnect, GB/s per GPU both directions together (NVLink: A100 600, H100/H200 900)
    pub link_gbs: f64,
    /// inter-node bandwidth per GPU and direction in GB/s (200 Gb/s InfiniBand per GPU = 25)
    pub inter_node_gbs: f64,
    /// GPUs sharing the fast interconnect
    pub gpus_per_node: usize,
    /// fraction of memory kept free for fragmentation and transient spikes
    pub margin: f64,
}

impl Gpu {
    /// The stated defaults of a kind: A100 SXM 80 GB (312 TFLOP/s bf16, NVLink 600 GB/s), H100 SXM 80 GB
    /// (989, 900), H200 141 GB (989, 900); `cpu`: this machine's memory, 0.05 TFLOP/s f32; MFU 0.4
    /// (0.5 on CPU), margin 10%, 8 GPUs per node.
    pub fn new(kind: GpuKind) -> Gpu {
        let (mem_bytes, peak_tflops, link_gbs, mfu) = match kind {
            GpuKind::A100 => (81920u64 << 20, 312.0, 600.0, 0.4),
            GpuKind::H100 => (81559u64 << 20, 989.0, 900.0, 0.4),
            GpuKind::H200 => (143771u64 << 20, 989.0, 900.0, 0.4),
            GpuKind::Cpu => (host_memory_bytes().unwrap_or(16 << 30), 0.05, 0.0, 0.5),
        };
        Gpu { kind, mem_bytes, peak_tflops, mfu, link_gbs, inter_node_gbs: 25.0, gpus_per_node: 8, margin: 0.10 }
    }

    fn is_cpu(&self) -> bool {
        self.kind == GpuKind::Cpu
    }
}

fn host_memory_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

/// Parse a memory size: `80GiB`, `80GB`, `81920MiB`, `141e9B`, or a bare number of GiB.
pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "gib" | "g" => GIB,
        "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => (1u64 << 20) as f64,
        "tib" => (1u64 << 40) as f64,
        u => bail!("--gpu-mem `{s}`: unknown unit `{u}`\nhint: write e.g. 80GiB, 80GB or 81920MiB"),
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| anyhow!("--gpu-mem `{s}`: `{}` is not a number\nhint: write e.g. 80GiB", num.trim()))?;
    if !(v.is_finite() && v > 0.0) {
        bail!("--gpu-mem `{s}` must be positive\nhint: write e.g. 80GiB");
    }
    Ok((v * mult) as u64)
}

/// How the run is spread over devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct World {
    /// devices in all (data-parallel x sequence-parallel)
    pub gpus: usize,
    /// which training state is sharded (`config::ZeroStage`)
    pub zero_stage: ZeroStage,
    /// Ulysses sequence-parallel degree P (divides the kv heads and `gpus`)
    pub sp_degree: usize,
}

/// What of the model the plan needs (from config.json or `[model.init]`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Arch {
    pub params: u64,
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub tied: bool,
}

impl Arch {
    /// From an HF config.
    pub fn from_llama(c: &LlamaConfig) -> Arch {
        Arch {
            params: c.num_params() as u64,
            vocab: c.vocab_size,
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            layers: c.num_hidden_layers,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            tied: c.tie_word_embeddings,
        }
    }

    /// The architecture of a run: `[model] path`/config.json, or `[model.init]`.
    pub fn of_run(cfg: &RunConfig, origin: &str) -> Result<Arch> {
        if let Some(dir) = &cfg.model.path {
            let p = dir.join("config.json");
            if !p.exists() {
                bail!(
                    "{origin}: model.path {} has no config.json\nhint: point [model] path at an HF model directory (config.json is enough for a plan), e.g. --set model.path=configs/arch/llama-2-7b",
                    dir.display()
                );
            }
            let c = LlamaConfig::from_file(&p)?;
            return Ok(Arch::from_llama(&c));
        }
        let a =
            cfg.model.init.as_ref().ok_or_else(|| {
                anyhow!("{origin}: [model] has neither path nor init\nhint: see configs/tiny-cpu.toml")
            })?;
        let mut c = LlamaConfig::tiny(a.vocab_size, crate::model::rope::RopeScheme::Default { theta: 10000.0 });
        c.hidden_size = a.hidden_size;
        c.intermediate_size = a.intermediate_size;
        c.num_hidden_layers = a.num_hidden_layers;
        c.num_attention_heads = a.num_attention_heads;
        c.num_key_value_heads = a.num_key_value_heads.unwrap_or(a.num_attention_heads);
        c.head_dim = a.head_dim.unwrap_or(a.hidden_size / a.num_attention_heads.max(1));
        c.tie_word_embeddings = a.tie_word_embeddings;
        Ok(Arch::from_llama(&c))
    }

    /// Parameters of one decoder layer.
    pub fn layer_params(&self) -> u64 {
        let (c, i, d) = (self.hidden as u64, self.intermediate as u64, self.head_dim as u64);
        let (h, hkv) = (self.heads as u64, self.kv_heads as u64);
        2 * c * h * d + 2 * c * hkv * d + 3 * c * i + 2 * c
    }
}

/// The per-sequence shape of one stage.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StageShape {
    pub seq_len: usize,
    pub micro_batch: usize,
    pub tokens_per_step: usize,
    #[serde(serialize_with = "ser_ckpt")]
    pub checkpointing: Checkpointing,
    pub loss_chunk: usize,
    pub bf16: bool,
}

fn ser_ckpt<S: serde::Serializer>(c: &Checkpointing, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(&ckpt_name(c))
}

pub fn ckpt_name(c: &Checkpointing) -> String {
    match c {
        Checkpointing::None => "none".into(),
        Checkpointing::EveryLayer => "every-layer".into(),
        Checkpointing::Every(k) => format!("every {k}"),
    }
}

/// One memory term.
#[derive(Clone, Debug, Serialize)]
pub struct Term {
    pub name: &'static str,
    pub bytes: u64,
    pub note: String,
}

/// Memory and time of one stage on one device.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub mode: &'static str,
    pub gpu: Gpu,
    pub world: World,
    pub arch: Arch,
    pub stage: usize,
    pub shape: StageShape,
    #[serde(serialize_with = "ser_terms")]
    pub terms: Vec<Term>,
    /// per GPU
    pub total_bytes: u64,
    /// memory minus the margin
    pub usable_bytes: u64,
    pub fits: bool,
    /// model FLOPs per token (6N + 12·L·C·T, as the MFU column) and executed (causal, with recompute)
    pub flops_per_token: f64,
    pub hw_flops_per_token: f64,
    pub compute_s: f64,
    /// bytes each GPU sends per optimizer step for ZeRO / Ulysses, and their time
    pub zero_comm_bytes: f64,
    pub zero_comm_s: f64,
    pub sp_comm_bytes: f64,
    pub sp_comm_s: f64,
    pub step_time_s: f64,
    pub tokens_per_s: f64,
    /// the whole run (every stage at its own plan), hours
    pub run_hours: f64,
    /// a checkpoint: what one rank writes (its optimizer shard; rank 0 also the HF weights) and how long
    pub checkpoint: CheckpointTime,
    /// when it does not fit: the cheapest change that does
    pub suggestion: Option<Suggestion>,
}

/// A change that makes a run fit.
#[derive(Clone, Debug, Serialize)]
pub struct Suggestion {
    pub change: String,
    pub total_bytes: u64,
    pub tokens_per_s: f64,
    pub gpus: usize,
}

fn ser_terms<S: serde::Serializer>(t: &[Term], s: S) -> std::result::Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(Some(t.len()))?;
    for x in t {
        m.serialize_entry(x.name, &x.bytes)?;
    }
    m.end()
}

impl Plan {
    /// Bytes of a term (0 when absent).
    pub fn term(&self, name: &str) -> u64 {
        self.terms.iter().find(|t| t.name == name).map(|t| t.bytes).unwrap_or(0)
    }

    /// An error when the run will not fit (for `harpe train` at start-up; `--force` skips the check).
    pub fn check_fits(&self) -> Result<()> {
        if self.fits {
            return Ok(());
        }
        let fix = match &self.suggestion {
            Some(s) => format!("{} ({:.1} GiB per GPU)", s.change, s.total_bytes as f64 / GIB),
            None => "no single change found; shorten seq_len or use more memory".into(),
        };
        bail!(
            "stage {} (seq_len {}) needs {:.1} GiB per {} but {:.1} GiB are usable ({:.1} GiB less a {:.0}% margin); largest term: {}\nhint: {fix}; `harpe plan --config ...` shows every term; --force trains anyway",
            self.stage,
            self.shape.seq_len,
            self.total_bytes as f64 / GIB,
            if self.gpu.is_cpu() { "process" } else { "GPU" },
            self.usable_bytes as f64 / GIB,
            self.gpu.mem_bytes as f64 / GIB,
            100.0 * self.gpu.margin,
            self.terms.iter().max_by_key(|t| t.bytes).map(|t| t.name).unwrap_or("?")
        )
    }
}

impl World {
    /// The world as `[dist]` (the one owner of its rules, `DistSection::validate`).
    pub fn dist(&self) -> DistSection {
        DistSection {
            world_size: self.gpus,
            zero_stage: self.zero_stage,
            sp_degree: self.sp_degree,
            ..DistSection::default()
        }
    }
}

/// The shape of stage `i` of a run.
pub fn stage_shape(cfg: &RunConfig, i: usize, gpu: &Gpu) -> StageShape {
    StageShape {
        seq_len: cfg.stages[i].seq_len,
        micro_batch: cfg.train.micro_batch_size,
        tokens_per_step: cfg.tokens_per_step(i),
        checkpointing: cfg.train.activation_checkpointing,
        loss_chunk: cfg.train.loss_chunk_tokens,
        bf16: cfg.train.dtype == ComputeDtype::Bf16 && !gpu.is_cpu(),
    }
}

/// The stage with the longest sequences (the memory peak of the run).
pub fn peak_stage(cfg: &RunConfig) -> usize {
    (0..cfg.stages.len()).max_by_key(|&i| (cfg.stages[i].seq_len, std::cmp::Reverse(i))).unwrap_or(0)
}

/// Plan a run: memory and time of its longest stage on `world` x `gpu`, the whole run's hours, and when
/// it does not fit the cheapest change that does.
pub fn plan_for(cfg: &RunConfig, world: &World, gpu: &Gpu) -> Result<Plan> {
    let arch = Arch::of_run(cfg, "[model]")?;
    if world.gpus == 0 {
        bail!("--gpus 0: a run needs at least one device\nhint: e.g. --gpus 8");
    }
    world.dist().validate("[dist]", world.gpus, Some(arch.kv_heads), &cfg.stage_batches())?;
    let si = peak_stage(cfg);
    let mut plan = plan_stage(&arch, &stage_shape(cfg, si, gpu), world, gpu);
    plan.stage = si;
    plan.run_hours = (0..cfg.stages.len())
        .map(|i| {
            let p = plan_stage(&arch, &stage_shape(cfg, i, gpu), world, gpu);
            let (steps, per_step) = cfg.stage_steps(i);
            steps as f64 * per_step as f64 / p.tokens_per_s / 3600.0
        })
        .sum();
    if !plan.fits {
        plan.suggestion = suggest(&arch, &plan.shape, world, gpu);
    }
    Ok(plan)
}

/// Memory and time of one stage shape (pure arithmetic; `plan_for` adds the run-level parts): the model
/// state, the activations and the communication buffers as named terms, then the step time.
pub fn plan_stage(arch: &Arch, shape: &StageShape, world: &World, gpu: &Gpu) -> Plan {
    let sz = Sizes::of(arch, shape, world, gpu);
    let mut terms = vec![];
    state_terms(&sz, arch, world, &mut terms);
    activation_terms(&sz, arch, shape, &mut terms);
    comm_terms(&sz, arch, world, gpu, &mut terms);
    let total_bytes: u64 = terms.iter().map(|t| t.bytes).sum();
    let usable_bytes = (gpu.mem_bytes as f64 * (1.0 - gpu.margin)) as u64;
    let t = step_time(&sz, arch, shape, world, gpu);
    Plan {
        mode: if sz.cpu { "cpu" } else { "gpu" },
        gpu: gpu.clone(),
        world: *world,
        arch: arch.clone(),
        stage: 0,
        shape: *shape,
        terms,
        total_bytes,
        usable_bytes,
        fits: total_bytes <= usable_bytes,
        flops_per_token: t.flops_per_token,
        hw_flops_per_token: t.hw_flops_per_token,
        compute_s: t.compute_s,
        zero_comm_bytes: t.zero_comm_bytes,
        zero_comm_s: t.zero_comm_s,
        sp_comm_bytes: t.sp_comm_bytes,
        sp_comm_s: t.sp_comm_s,
        step_time_s: t.step_time_s,
        tokens_per_s: shape.tokens_per_step as f64 / t.step_time_s,
        run_hours: 0.0,
        checkpoint: CheckpointTime::of(arch, shape, world, t.step_time_s),
        suggestion: None,
    }
}

/// Write rate of one process to the run directory's file system assumed for checkpoints, GB/s: a
/// conservative figure for a cluster's parallel file system under 16 concurrent writers (a local NVMe
/// writes 2-5 GB/s).
pub const CHECKPOINT_WRITE_GBS: f64 = 1.0;

/// How long a checkpointed stop takes, for a scheduler's advance warning (Slurm's `--signal=TERM@N`).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct CheckpointTime {
    /// rank 0's bytes: its fp32 master + AdamW m, v shard (12 bytes a parameter over the ranks), then the
    /// HF weights in the compute dtype, which rank 0 writes alone after every shard is on disk
    pub rank0_bytes: f64,
    /// rank 0's bytes at `CHECKPOINT_WRITE_GBS`, seconds
    pub write_s: f64,
    /// warning a stop needs: the signal lands mid-step, the stop is agreed at the end of the next step
    /// (up to 2 steps), then the save; plus a quarter for error, rounded up to whole minutes
    pub stop_lead_s: u64,
}

impl CheckpointTime {
    fn of(arch: &Arch, shape: &StageShape, world: &World, step_s: f64) -> CheckpointTime {
        let params = arch.params as f64;
        let weight_bytes = if shape.bf16 { 2.0 } else { 4.0 };
        let rank0_bytes = params * 12.0 / world.gpus.max(1) as f64 + params * weight_bytes;
        let write_s = rank0_bytes / (CHECKPOINT_WRITE_GBS * 1e9);
        // f64 to u64 saturates, so a step time the plan cannot bound (infinite) stays a number
        let stop_lead_s = (((2.0 * step_s + write_s) * 1.25 / 60.0).ceil() * 60.0) as u64;
        CheckpointTime { rank0_bytes, write_s, stop_lead_s }
    }
}

/// The sizes every term of `plan_stage` reads (floats, as the formulas use them).
struct Sizes {
    cpu: bool,
    /// parameters, ranks, Ulysses degree, ZeRO stage
    n: f64,
    w: f64,
    p: usize,
    z: ZeroStage,
    /// hidden, layers; query and kv widths (heads x head_dim)
    c: f64,
    l: usize,
    hd: f64,
    kvd: f64,
    /// bytes per weight/activation element and per gradient element
    wb: f64,
    gb: f64,
    /// tokens per rank per micro-batch
    tl: f64,
    /// layers per checkpoint segment, segments, layers of the last segment
    seg: usize,
    n_seg: usize,
    last_seg: usize,
}

impl Sizes {
    fn of(arch: &Arch, shape: &StageShape, world: &World, gpu: &Gpu) -> Sizes {
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
fn state_terms(sz: &Sizes, arch: &Arch, world: &World, terms: &mut Vec<Term>) {
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
fn activation_terms(sz: &Sizes, arch: &Arch, shape: &StageShape, terms: &mut Vec<Term>) {
    let (tl, wb) = (sz.tl, sz.wb);
    let gib = |b: f64| b / GIB;
    let path = if sz.cpu { LayerPath::CpuF32 } else { LayerPath::Cuda };
    // Ulysses keeps three copies of q, k, v and of o per layer (the exchange's input and output and the
    // re-laid-out result)
    let sp_copies = if sz.p > 1 { 3.0 * (2.0 * sz.hd + 2.0 * sz.kvd) * wb } else { 0.0 };
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
    let (ws, which) = if recompute >= loss { (recompute, "recompute") } else { (loss, "loss") };
    add_term(
        terms,
        "working_set",
        ws,
        format!("{which} phase: recompute {:.2} GiB, loss chunk {:.2} GiB; {ws_note}", gib(recompute), gib(loss)),
    );
    if !sz.cpu {
        // one layer's flash-attention backward at a time: the op's own workspace function (Ulysses: H/p heads
        // over the whole sequence)
        let dims = crate::ops::attention_shape::AttnDims {
            b: shape.micro_batch,
            h: (arch.heads / sz.p).max(1),
            hkv: (arch.kv_heads / sz.p).max(1),
            tq: shape.seq_len,
            tk: shape.seq_len,
            d: arch.head_dim,
        };
        let aw = crate::ops::attention_shape::attention_workspace(dims, wb as usize);
        add_term(
            terms,
            "attention_workspace",
            aw.total() as f64,
            format!(
                "one layer's attention backward: packed [q|O|lse|dO] rows {:.2} GiB + f32 delta and dQ accumulator {:.2} GiB",
                gib(aw.bwd_packed as f64),
                gib(aw.bwd_scratch as f64)
            ),
        );
    }
}

/// Collective buffers, Ulysses' re-laid-out q/k/v, and the fixed overhead of a process or a GPU.
fn comm_terms(sz: &Sizes, arch: &Arch, world: &World, gpu: &Gpu, terms: &mut Vec<Term>) {
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

/// The time side of a plan.
struct StepTime {
    flops_per_token: f64,
    hw_flops_per_token: f64,
    compute_s: f64,
    zero_comm_bytes: f64,
    zero_comm_s: f64,
    sp_comm_bytes: f64,
    sp_comm_s: f64,
    step_time_s: f64,
}

/// FLOPs with recompute at the stated MFU; collectives over the interconnect.
fn step_time(sz: &Sizes, arch: &Arch, shape: &StageShape, world: &World, gpu: &Gpu) -> StepTime {
    let (n, w, p, l, wb, gb, tl) = (sz.n, sz.w, sz.p, sz.l, sz.wb, sz.gb, sz.tl);
    let flops_per_token = crate::model::flops_per_token(arch.params as usize, l, arch.hidden, shape.seq_len);
    let recomputed = if matches!(shape.checkpointing, Checkpointing::None) { 0 } else { l - sz.last_seg };
    // Executed FLOPs: causal flash attention skips the masked half of 12·L·C·T; recompute repeats the
    // forward (a third) of the recomputed layers.
    let executed = flops_per_token - 6.0 * (l * arch.hidden * shape.seq_len) as f64;
    let hw_flops_per_token = executed * (1.0 + recomputed as f64 / l as f64 / 3.0);
    let tokens = shape.tokens_per_step as f64;
    let compute_s = tokens * hw_flops_per_token / (w * gpu.peak_tflops * 1e12 * gpu.mfu);
    let accum = (tokens / (shape.micro_batch * shape.seq_len) as f64 * p as f64 / w).max(1.0); // per rank
    let ring = (w - 1.0) / w;
    let zero_comm_bytes = if world.gpus > 1 {
        ring * n
            * match sz.z {
                ZeroStage::Replicated => 2.0 * gb,
                ZeroStage::Optimizer => gb + wb,
                ZeroStage::Gradients => gb * accum + wb,
                ZeroStage::Parameters => (2.0 * wb + gb) * accum,
            }
    } else {
        0.0
    };
    let passes = if recomputed > 0 { 3.0 } else { 2.0 };
    let sp_comm_bytes = if p > 1 {
        (p as f64 - 1.0) / p as f64 * tl * (sz.hd + 2.0 * sz.kvd + sz.hd) * wb * l as f64 * passes * accum
    } else {
        0.0
    };
    let bus = |gbs: f64| gbs * 1e9;
    let intra = bus(gpu.link_gbs / 2.0 * 0.8);
    let zero_bw = if world.gpus > gpu.gpus_per_node { bus(gpu.inter_node_gbs * 0.8) } else { intra };
    let zero_comm_s = if zero_comm_bytes > 0.0 { zero_comm_bytes / zero_bw } else { 0.0 };
    let sp_comm_s = if sp_comm_bytes > 0.0 { sp_comm_bytes / intra } else { 0.0 };
    StepTime {
        flops_per_token,
        hw_flops_per_token,
        compute_s,
        zero_comm_bytes,
        zero_comm_s,
        sp_comm_bytes,
        sp_comm_s,
        step_time_s: compute_s.max(zero_comm_s) + sp_comm_s,
    }
}

/// Whether `w` satisfies `[dist]`'s rules for a stage of this shape (suggestions skip those that do not).
fn splits_over_ranks(arch: &Arch, sh: &StageShape, w: &World) -> bool {
    let unit = (sh.micro_batch * sh.seq_len).max(1);
    let stage =
        StageBatch { seq_len: sh.seq_len, micro_batches: sh.tokens_per_step / unit, micro_batch: sh.micro_batch };
    sh.tokens_per_step.is_multiple_of(unit) && w.dist().validate("", w.gpus, Some(arch.kv_heads), &[stage]).is_ok()
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

/// The cheapest change that makes `shape` fit: candidates ordered by GPU-seconds per token.
pub fn suggest(arch: &Arch, shape: &StageShape, world: &World, gpu: &Gpu) -> Option<Suggestion> {
    let mut cands: Vec<(String, StageShape, World)> = vec![];
    if !matches!(shape.checkpointing, Checkpointing::EveryLayer) {
        let s = StageShape { checkpointing: Checkpointing::EveryLayer, ..*shape };
        cands.push(("train.activation_checkpointing = \"every-layer\"".into(), s, *world));
    }
    if shape.micro_batch > 1 {
        let s = StageShape { micro_batch: 1, ..*shape };
        cands.push(("train.micro_batch_size = 1 (more accumulation, same tokens per step)".into(), s, *world));
    }
    let divisors: Vec<usize> = (1..=arch.kv_heads).filter(|d| arch.kv_heads.is_multiple_of(*d)).collect();
    let mut gpus_opts = vec![world.gpus];
    let mut g = world.gpus;
    for _ in 0..6 {
        g *= 2;
        gpus_opts.push(g);
    }
    for &gpus in &gpus_opts {
        for z in ZeroStage::ALL.into_iter().filter(|&z| z >= world.zero_stage) {
            for &p in divisors.iter().filter(|&&p| p >= world.sp_degree && gpus.is_multiple_of(p)) {
                let w = World { gpus, zero_stage: z, sp_degree: p };
                if w == *world {
                    continue;
                }
                let mut what = vec![];
                if z != world.zero_stage {
                    what.push(format!("dist.zero_stage = {z}"));
                }
                if p != world.sp_degree {
                    what.push(format!("dist.sp_degree = {p}"));
                }
                if gpus != world.gpus {
                    what.push(format!("--gpus {gpus}"));
                }
                cands.push((what.join(", "), *shape, w));
            }
        }
    }
    cands
        .into_iter()
        .filter(|(_, s, w)| splits_over_ranks(arch, s, w))
        .map(|(what, s, w)| (what, plan_stage(arch, &s, &w, gpu)))
        .filter(|(_, p)| p.fits)
        .min_by(|(_, a), (_, b)| {
            let cost = |p: &Plan| p.world.gpus as f64 / p.tokens_per_s;
            cost(a).total_cmp(&cost(b)).then(a.world.gpus.cmp(&b.world.gpus))
        })
        .map(|(change, p)| Suggestion {
            change,
            total_bytes: p.total_bytes,
            tokens_per_s: p.tokens_per_s,
            gpus: p.world.gpus,
        })
}

impl Gpu {
    /// A CUDA device as measured now (`device::device_memory`): the kind from the driver's name (its
    /// stated peak and links), memory = the bytes free now. An unknown GPU plans as an A100 and comes
    /// back with `false` (its peak is a guess: say so, or leave MFU out).
    pub fn measured(m: &crate::device::DeviceMemory) -> (Gpu, bool) {
        let kind = GpuKind::from_device_name(&m.name);
        let mut gpu = Gpu::new(kind.unwrap_or(GpuKind::A100));
        gpu.mem_bytes = m.free;
        (gpu, kind.is_some())
    }
}

/// The largest sequence length T, a multiple of `multiple`, at which `shape` (its seq_len set to T,
/// tokens_per_step to micro_batch x T) fits `gpu` by `plan_stage`; `None` when T = `multiple` does not.
/// Every memory term of the plan is non-decreasing in T, so the fitting T form a prefix of the
/// multiples: doubling finds a bound that does not fit, then a binary search (at most 2^20 multiples).
pub fn largest_fitting_tokens(
    arch: &Arch,
    shape: &StageShape,
    world: &World,
    gpu: &Gpu,
    multiple: usize,
) -> Option<usize> {
    let m = multiple.max(1);
    let fits = |k: usize| {
        let s = StageShape { seq_len: k * m, tokens_per_step: shape.micro_batch.max(1) * k * m, ..*shape };
        plan_stage(arch, &s, world, gpu).fits
    };
    if !fits(1) {
        return None;
    }
    // invariant: fits(lo), !fits(hi) (or hi past the cap)
    let (mut lo, mut hi) = (1usize, 2usize);
    while hi <= 1 << 20 && fits(hi) {
        lo = hi;
        hi *= 2;
    }
    if hi > 1 << 20 {
        return Some(lo * m);
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(lo * m)
}
