//! `harpe plan`: the memory and step-time model of `train::plan` for a recipe, printed by term (or as
//! JSON), with the cheapest change that fits when the run does not.
//!
//! The non-obvious decision: `dist.world_size`, `dist.zero_stage` and `dist.sp_degree` are taken out of
//! the recipe before it is parsed (`load_config`), so a plan can be asked for any world and stage with
//! flags, whatever backend the recipe names.
use crate::config::{apply_override, RunConfig, ZeroStage};
use crate::device::DeviceSpec;
use crate::train::plan::*;
use crate::util::parse_bytes;
use anyhow::{anyhow, bail, Context, Result};
use std::fmt::Write;
use std::path::PathBuf;

/// `harpe plan`: memory by term, time, fits, and the cheapest fix.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    /// TOML recipe (as for `harpe train`); the model comes from [model] path/config.json or [model.init]
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// devices in all [default: dist.world_size, else 8 GPUs / 1 for cpu]
    #[arg(long, value_name = "N")]
    pub gpus: Option<usize>,
    /// device kind: a100, h100, h200, or cpu (harpe's CPU path) [default: cpu when train.device = "cpu", else a100]
    #[arg(long, value_name = "KIND")]
    pub gpu: Option<String>,
    /// memory of one device, e.g. 80GiB, 40GB, 81920MiB [default: the kind's]
    #[arg(long, value_name = "SIZE")]
    pub gpu_mem: Option<String>,
    /// ZeRO stage 0-3 [default: dist.zero_stage, else 1]
    #[arg(long, value_name = "S")]
    pub zero: Option<ZeroStage>,
    /// Ulysses sequence-parallel degree [default: dist.sp_degree, else 1]
    #[arg(long, value_name = "P")]
    pub sp: Option<usize>,
    /// achieved fraction of peak FLOP/s, recompute included [default: 0.4 on GPUs]
    #[arg(long, value_name = "F")]
    pub mfu: Option<f64>,
    /// dense peak TFLOP/s of one device in the compute dtype [default: the kind's]
    #[arg(long, value_name = "T")]
    pub peak_tflops: Option<f64>,
    /// intra-node interconnect GB/s per GPU, both directions [default: NVLink of the kind]
    #[arg(long, value_name = "GBS")]
    pub link_gbs: Option<f64>,
    /// fraction of device memory kept free [default: 0.10]
    #[arg(long, value_name = "F")]
    pub margin: Option<f64>,
    /// `harpe bench attention --json` output measured on the GPU: its forward+backward rate of the run's
    /// attention kernels replaces the published prior [default: FlashAttention-2's published rate, or
    /// harpe's kernels' estimate]
    #[arg(long, value_name = "FILE")]
    pub attn_bench: Option<PathBuf>,
    /// plan this stage instead of the one with the longest sequences
    #[arg(long, value_name = "I")]
    pub stage: Option<usize>,
    /// override one config value (repeatable); besides train.*/stage.* also dist.zero_stage,
    /// dist.sp_degree, dist.world_size
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// print one JSON object instead of the table
    #[arg(long)]
    pub json: bool,
}

/// The `[dist]` keys plan reads itself (taken out of the TOML before the config is parsed, so that
/// they work whether or not `config` knows them yet).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DistKeys {
    pub world_size: Option<usize>,
    pub zero_stage: Option<ZeroStage>,
    pub sp_degree: Option<usize>,
}

/// Load a recipe with `--set` overrides, taking out `dist.world_size`, `dist.zero_stage` and
/// `dist.sp_degree`.
pub fn load_config(path: &std::path::Path, overrides: &[String]) -> Result<(RunConfig, DistKeys)> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).with_context(|| {
        format!("cannot read config {origin}\nhint: pass an existing TOML recipe, e.g. configs/harpe-128k.toml")
    })?;
    let mut table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| anyhow!("{origin}: {}\nhint: fix the TOML syntax", e.to_string().trim_end()))?;
    for o in overrides {
        apply_override(&mut table, o)?;
    }
    let mut keys = DistKeys::default();
    if let Some(toml::Value::Table(d)) = table.get_mut("dist") {
        let mut int = |k: &str| -> Result<Option<i64>> {
            match d.remove(k) {
                None => Ok(None),
                Some(toml::Value::Integer(v)) if v >= 0 => Ok(Some(v)),
                Some(v) => bail!("{origin}: dist.{k} = {v} is not a non-negative integer\nhint: e.g. dist.{k} = 1"),
            }
        };
        keys.world_size = int("world_size")?.map(|v| v as usize);
        keys.zero_stage = match int("zero_stage")? {
            Some(v) => Some(ZeroStage::from_number(v as u64).map_err(|e| anyhow!("{origin}: {e}"))?),
            None => None,
        };
        keys.sp_degree = int("sp_degree")?.map(|v| v as usize);
        // the backend decides how ranks are started, not what they hold; without world_size a `local`
        // backend would not parse
        d.remove("backend");
    }
    let merged = toml::to_string(&table)?;
    let label =
        if overrides.is_empty() { origin } else { format!("{origin} with --set {}", overrides.join(" --set ")) };
    Ok((RunConfig::from_text(&merged, &label, &[])?.cfg, keys))
}

/// Run `harpe plan`.
pub fn run(args: PlanArgs) -> Result<()> {
    let (cfg, keys) = load_config(&args.config, &args.set)?;
    let kind = match &args.gpu {
        Some(s) => GpuKind::parse(s)?,
        None if cfg.train.device == DeviceSpec::Cpu => GpuKind::Cpu,
        None => GpuKind::A100,
    };
    let mut gpu = Gpu::new(kind);
    if let Some(m) = &args.gpu_mem {
        gpu.mem_bytes = parse_bytes(m)?;
    }
    if let Some(f) = args.mfu {
        if !(f > 0.0 && f <= 1.0) {
            bail!("--mfu {f} must be in (0, 1]\nhint: 0.3-0.5 is typical for long-context training");
        }
        gpu.mfu = f;
    }
    // the recipe's log.peak_tflops describes its own device: used only when --gpu does not name another
    let recipe_peak = (args.gpu.is_none() && cfg.log.peak_tflops > 0.0).then_some(cfg.log.peak_tflops);
    if let Some(t) = args.peak_tflops.or(recipe_peak) {
        gpu.peak_tflops = t;
    }
    if let Some(b) = args.link_gbs {
        gpu.link_gbs = b;
    }
    if let Some(m) = args.margin {
        if !(0.0..1.0).contains(&m) {
            bail!("--margin {m} must be in [0, 1)\nhint: e.g. --margin 0.1 keeps 10% free");
        }
        gpu.margin = m;
    }
    // the attention kernels the run trains with, planned as a GPU build (--features flash-attn) runs them
    let arch = Arch::of_run(&cfg, "[model]")?;
    let gpu = attention_for_run(&cfg, &arch, gpu, kind != GpuKind::Cpu, args.attn_bench.as_deref())?;
    let default_gpus = if kind == GpuKind::Cpu { 1 } else { 8 };
    let world = World {
        gpus: args.gpus.or(keys.world_size).unwrap_or(default_gpus),
        zero_stage: args.zero.or(keys.zero_stage).unwrap_or(ZeroStage::Optimizer),
        sp_degree: args.sp.or(keys.sp_degree).unwrap_or(1),
    };
    let mut plan = plan_for(&cfg, &world, &gpu)?;
    if let Some(si) = args.stage {
        if si >= cfg.stages.len() {
            bail!("--stage {si}: the config has {} stage(s)\nhint: stages count from 0", cfg.stages.len());
        }
        let arch = arch.for_stage(&cfg, si);
        let run_hours = plan.run_hours;
        plan = plan_stage(&arch, &stage_shape(&cfg, si, &gpu), &world, &gpu);
        plan.stage = si;
        plan.run_hours = run_hours;
        if !plan.fits {
            plan.suggestion = suggest(&arch, &plan.shape, &world, &gpu);
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print!("{}", render(&plan));
    }
    Ok(())
}

/// The plan as a text table.
pub fn render(p: &Plan) -> String {
    // one unit for the table: GiB for real models, MiB for the tiny ones
    let (unit, div) = if p.total_bytes as f64 >= GIB { ("GiB", GIB) } else { ("MiB", (1u64 << 20) as f64) };
    let mut s = String::new();
    let params = if p.arch.params >= 1_000_000_000 {
        format!("{:.2}B", p.arch.params as f64 / 1e9)
    } else {
        format!("{:.2}M", p.arch.params as f64 / 1e6)
    };
    let dev = if p.mode == "cpu" { "process (cpu, f32)".to_string() } else { format!("{} GPU", p.gpu.kind.name()) };
    let _ = writeln!(
        s,
        "plan: {params} params, stage {} at T={} x micro-batch {}, checkpointing {}, {} x {}, ZeRO-{}, SP {}",
        p.stage,
        p.shape.seq_len,
        p.shape.micro_batch,
        ckpt_name(&p.shape.checkpointing),
        p.world.gpus,
        dev,
        p.world.zero_stage,
        p.world.sp_degree
    );
    render_terms(&mut s, p, unit, div);
    render_time(&mut s, p, div);
    s
}

/// The memory table: a row per term and the total.
fn render_terms(s: &mut String, p: &Plan, unit: &str, div: f64) {
    let gib = |b: u64| b as f64 / div;
    let _ = writeln!(
        s,
        "\n| memory per {} | {unit} | how |\n|---|---:|---|",
        if p.mode == "cpu" { "process" } else { "GPU" }
    );
    for t in &p.terms {
        let _ = writeln!(s, "| {} | {:.2} | {} |", t.name, gib(t.bytes), t.note);
    }
    let _ = writeln!(
        s,
        "| **total** | **{:.2}** | of {:.1} GiB, {:.1} GiB usable with a {:.0}% margin: {} |",
        gib(p.total_bytes),
        p.gpu.mem_bytes as f64 / GIB,
        p.usable_bytes as f64 / GIB,
        100.0 * p.gpu.margin,
        if p.fits { "FITS" } else { "DOES NOT FIT" }
    );
}

/// The time lines and, when the run does not fit, the cheapest change that does.
fn render_time(s: &mut String, p: &Plan, div: f64) {
    let gib = |b: u64| b as f64 / div;
    let _ = writeln!(
        s,
        "\ntime: {:.4} PFLOP per step ({:.3} GFLOP/token executed), compute {:.3} s/step at {:.0}% of {} TFLOP/s (the attention at its rate below); ZeRO traffic {:.2} GB/GPU/step ({:.2} s = {:.1}% of the compute, overlapped); Ulysses all-to-all {:.2} GB ({:.2} s = {:.1}%, not overlapped)",
        p.hw_flops_per_token * p.shape.tokens_per_step as f64 / 1e15,
        p.hw_flops_per_token / 1e9,
        p.compute_s,
        100.0 * p.gpu.mfu,
        p.gpu.peak_tflops,
        p.zero_comm_bytes / 1e9,
        p.zero_comm_s,
        100.0 * p.zero_comm_s / p.compute_s.max(1e-12),
        p.sp_comm_bytes / 1e9,
        p.sp_comm_s,
        100.0 * p.sp_comm_s / p.compute_s.max(1e-12),
    );
    let a = &p.gpu.attention;
    let _ = writeln!(
        s,
        "attention: {} at {:.0} TFLOP/s forward+backward ({}); its backward workspace is the attention_workspace row",
        match a.kernel {
            AttnKernelKind::Flash2 => "FlashAttention-2's kernels (flash2)",
            AttnKernelKind::Harpe => "harpe's kernels (harpe)",
        },
        a.tflops,
        a.source
    );
    let _ = writeln!(
        s,
        "step {:.2} s for {} tokens = {:.0} tokens/s ({:.0} per device); whole run {:.1} h",
        p.step_time_s,
        p.shape.tokens_per_step,
        p.tokens_per_s,
        p.tokens_per_s / p.world.gpus as f64,
        p.run_hours
    );
    let c = &p.checkpoint;
    if p.step_time_s.is_finite() {
        let _ = writeln!(
            s,
            "stop: up to 2 steps + a checkpoint write ({:.1} GB on rank 0 in {:.0} s at {} GB/s) -> Slurm --signal=TERM@{}",
            c.rank0_bytes / 1e9,
            c.write_s,
            CHECKPOINT_WRITE_GBS,
            c.stop_lead_s
        );
    } else {
        let _ = writeln!(s, "stop: no lead time for Slurm's --signal (this plan cannot bound the step time)");
    }
    match (&p.suggestion, p.fits) {
        (_, true) => {}
        (Some(g), false) => {
            let _ = writeln!(
                s,
                "cheapest change that fits: {} -> {:.2} GiB per device, {:.0} tokens/s on {} devices",
                g.change,
                gib(g.total_bytes),
                g.tokens_per_s,
                g.gpus
            );
        }
        (None, false) => {
            let _ = writeln!(s, "no single change fits: shorten seq_len or use devices with more memory");
        }
    }
}
