//! What a plan is asked about: the device (`GpuKind`, `Gpu` with its stated peak, links and margin, and the
//! attention kernels' rate on it: `AttnKernelKind`, `AttentionRate`, whose priors `attention.rs` explains), how
//! the run is spread (`World`), the model (`Arch`) and one stage's shape (`StageShape`). Apart from the
//! arithmetic (`memory.rs`, `time.rs`), which reads these and nothing else.
use crate::config::{Checkpointing, DistSection, RunConfig, TrainAttention, ZeroStage};
use crate::model::config::LlamaConfig;
use crate::model::rope::RopeScheme;
use crate::util::edit_distance;
use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use std::path::Path;

pub const GIB: f64 = (1u64 << 30) as f64;

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
    /// the attention kernels the run trains with and their forward+backward rate on this device
    pub attention: AttentionRate,
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
            GpuKind::Cpu => (crate::util::host_memory_bytes().unwrap_or(16 << 30), 0.05, 0.0, 0.5),
        };
        let attention = AttentionRate::prior(AttnKernelKind::Harpe, kind, peak_tflops, mfu);
        Gpu {
            kind,
            mem_bytes,
            peak_tflops,
            mfu,
            link_gbs,
            inter_node_gbs: 25.0,
            gpus_per_node: 8,
            margin: 0.10,
            attention,
        }
    }

    /// This device running `kernel`'s attention at its prior rate (after `peak_tflops` and `mfu` are final).
    pub fn with_attention_prior(mut self, kernel: AttnKernelKind) -> Gpu {
        self.attention = AttentionRate::prior(kernel, self.kind, self.peak_tflops, self.mfu);
        self
    }

    pub(super) fn is_cpu(&self) -> bool {
        self.kind == GpuKind::Cpu
    }

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
    /// the RoPE cos/sin tables a step holds on the device: rows per table (1, or one per kv head under
    /// HARPE) and tables (1, or one per layer with per-layer bases); `Llama::rope_tables`
    pub rope_rows: usize,
    pub rope_tables: usize,
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
            rope_rows: 1,
            rope_tables: 1,
        }
        .with_rope(&c.rope)
    }

    /// The same model under RoPE scheme `rope` (a run's `[rope]` or a stage's replaces the model's).
    pub fn with_rope(mut self, rope: &RopeScheme) -> Arch {
        self.rope_rows = rope.table_rows(self.kv_heads);
        self.rope_tables = if rope.per_layer() { self.layers } else { 1 };
        self
    }

    /// The model as stage `i` of `cfg` trains it (the stage's RoPE scheme, when it sets one).
    pub fn for_stage(&self, cfg: &RunConfig, i: usize) -> Arch {
        match cfg.stage_rope(i) {
            Some(r) => self.clone().with_rope(&r),
            None => self.clone(),
        }
    }

    /// Device bytes of the RoPE tables of `tokens` positions: cos and sin, f32, head_dim / 2 columns.
    pub fn rope_table_bytes(&self, tokens: f64) -> f64 {
        (self.rope_tables * self.rope_rows * self.head_dim / 2) as f64 * tokens * 2.0 * 4.0
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

/// FA2's published forward+backward rate on an A100 SXM (causal, D 128, bf16, long T), TFLOP/s.
pub const FA2_A100_TFLOPS: f64 = 185.0;
/// The same on an H100 SXM (and an H200: the same SMs and clocks), TFLOP/s.
pub const FA2_H100_TFLOPS: f64 = 335.0;
/// harpe's own kernels' forward+backward rate as a fraction of the dense bf16 peak (90 of an A100's 312).
pub const HARPE_PEAK_FRACTION: f64 = 90.0 / 312.0;

/// Which attention kernels the plan counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttnKernelKind {
    /// harpe's own (kernels/attention.cu, `ops::attention`)
    Harpe,
    /// FlashAttention-2's own forward and backward (`ops::flash2`)
    Flash2,
}

impl AttnKernelKind {
    pub fn name(&self) -> &'static str {
        match self {
            AttnKernelKind::Harpe => "harpe",
            AttnKernelKind::Flash2 => "flash2",
        }
    }

    /// The kernels a run with `[train] attention = want` trains a model of `head_dim` with: `auto` plans FA2's
    /// where they take the model (`flash16`: a 16-bit run of a build that has them), `flash2` and `harpe` as
    /// asked (`train` itself refuses flash2 where it cannot run).
    pub fn for_run(want: TrainAttention, flash16: bool, head_dim: usize) -> AttnKernelKind {
        let fits = flash16 && crate::ops::flash2::HEAD_DIMS.contains(&head_dim);
        match want {
            TrainAttention::Harpe => AttnKernelKind::Harpe,
            TrainAttention::Flash2 => AttnKernelKind::Flash2,
            TrainAttention::Auto if fits => AttnKernelKind::Flash2,
            TrainAttention::Auto => AttnKernelKind::Harpe,
        }
    }
}

/// The attention kernel of a plan and its forward+backward rate on one device.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AttentionRate {
    pub kernel: AttnKernelKind,
    /// causal forward+backward TFLOP/s of one device
    pub tflops: f64,
    /// where `tflops` comes from
    pub source: String,
}

impl AttentionRate {
    /// The prior rate of `kernel` on a device of `kind` with dense peak `peak` (TFLOP/s). On the CPU the
    /// attention runs at the same `mfu` of the peak as everything else.
    pub fn prior(kernel: AttnKernelKind, kind: GpuKind, peak: f64, mfu: f64) -> AttentionRate {
        let (tflops, source) = match (kernel, kind) {
            (_, GpuKind::Cpu) => (peak * mfu, "the CPU's peak x mfu, as the rest of the step".to_string()),
            (AttnKernelKind::Flash2, GpuKind::A100) => {
                (FA2_A100_TFLOPS, "FlashAttention-2's published A100 rate".into())
            }
            (AttnKernelKind::Flash2, GpuKind::H100 | GpuKind::H200) => {
                (FA2_H100_TFLOPS, "FlashAttention-2's published H100 rate".into())
            }
            (AttnKernelKind::Harpe, _) => (
                peak * HARPE_PEAK_FRACTION,
                format!("{:.0}% of peak, harpe's kernels by reading", 100.0 * HARPE_PEAK_FRACTION),
            ),
        };
        AttentionRate { kernel, tflops, source }
    }

    /// The measured rate of `kernel` in a `harpe bench attention --json` file: its forward+backward row
    /// of the longest T (the kv-head count closest to `arch`'s when both were measured).
    pub fn from_bench(path: &Path, kernel: AttnKernelKind, arch: &Arch) -> Result<AttentionRate> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "--attn-bench {}: cannot read it\nhint: write it with `harpe bench attention --json > FILE` on the GPU",
                path.display()
            )
        })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            anyhow!(
                "--attn-bench {}: not JSON ({e})\nhint: the file `harpe bench attention --json` prints",
                path.display()
            )
        })?;
        let rows = v.get("rows").and_then(|r| r.as_array()).ok_or_else(|| {
            anyhow!(
                "--attn-bench {}: no \"rows\" list\nhint: the file `harpe bench attention --json` prints",
                path.display()
            )
        })?;
        let field = |r: &serde_json::Value, k: &str| r.get(k).and_then(|x| x.as_f64());
        let best = rows
            .iter()
            .filter(|r| r.get("pass").and_then(|p| p.as_str()) == Some("fwd+bwd"))
            // rows of benches from before the kernel column are harpe's
            .filter(|r| r.get("kernel").and_then(|p| p.as_str()).unwrap_or("harpe") == kernel.name())
            .filter_map(|r| Some((field(r, "t")?, field(r, "hkv")?, field(r, "tflops")?)))
            .max_by(|a, b| {
                let key = |x: &(f64, f64, f64)| (x.0, -(x.1 - arch.kv_heads as f64).abs());
                key(a).partial_cmp(&key(b)).unwrap_or(std::cmp::Ordering::Equal)
            });
        let Some((t, hkv, tflops)) = best else {
            bail!("--attn-bench {}: no fwd+bwd row of the {} kernels\nhint: measure them with a build that has them (`--features flash-attn` for flash2)", path.display(), kernel.name());
        };
        let device = v.get("device").and_then(|d| d.as_str()).unwrap_or("?");
        let source = format!("measured on {device} at T {t}, Hkv {hkv} ({})", path.display());
        Ok(AttentionRate { kernel, tflops, source })
    }
}
