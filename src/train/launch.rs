//! `harpe train`'s start: the backend `[dist]` names — one rank in this thread (`single`),
//! `dist.world_size` rank threads sharing a `Local` group (`local`), or this process as one rank of a
//! process group (`nccl` on GPUs, `gloo` on CPUs; started by `--nproc-per-node`, torchrun or srun) —
//! each running the same loop (`training_loop::run_rank`), after `harpe plan`'s arithmetic says the run
//! fits the world the launcher started.
//!
//! The non-obvious decision: a process rank reports how it ended to the group (a normal end, or its own
//! error or panic), so the other ranks stop naming it instead of waiting for the collective timeout.
use super::args::TrainArgs;
use super::training_loop::run_rank;
use crate::comms::local::{spawn_local, LocalComm, LocalGroup};
use crate::comms::sequence::SpGroup;
use crate::comms::Comm;
use crate::config::{Backend, RunConfig};
use crate::device::DeviceSpec;
use crate::launch::spawn::{launch_if_asked, NodeArgs};
use anyhow::{anyhow, bail, Context, Result};
use std::sync::Arc;

/// Run `harpe train`: one rank in this thread (`single`), or `dist.world_size` rank threads sharing a
/// `Local` group (`local`), each running the same loop on its slice of every global batch.
pub fn run(args: TrainArgs) -> Result<()> {
    crate::testing::hooks().check()?;
    crate::model::attention::refuse_for_training(args.attention)?;
    let origin = args.config.display().to_string();
    let cfg = RunConfig::load(&args.config, &args.sets())?.cfg;
    // the driver and glibc this build needs, before any weight is read (and before workers are spawned)
    crate::floors::check_for(&cfg.train.device)
        .with_context(|| format!("{origin}: train.device = \"{}\"", cfg.train.device))?;
    let dist = &cfg.dist;
    if let Some(n) = args.nproc_per_node {
        return spawn_workers(&origin, n, dist.backend, &args.nodes);
    }
    launch_if_asked(None, &args.nodes)?; // the node flags without --nproc-per-node are refused
    match dist.backend {
        Backend::Local => {
            let world = dist.world_size.max(1);
            // the rank threads share this process's device
            plan_check(&cfg, &origin, args.force, Ranks { world, sharing: world, device: cfg.train.device })?;
            let sp = cfg.dist.sp_degree.max(1);
            // one more Local group per sequence-parallel group (ranks d*P..(d+1)*P) for the all-to-alls
            let mut sp_handles: Vec<Option<LocalComm>> = vec![];
            if sp > 1 {
                for _ in 0..world / sp {
                    sp_handles.extend(LocalGroup::new(sp, dist.timeout())?.handles().into_iter().map(Some));
                }
            }
            let sp_handles = std::sync::Mutex::new(sp_handles);
            let rank_main = |lc: Arc<LocalComm>| {
                let taken = sp_handles
                    .lock()
                    .map_err(|_| anyhow!("internal: poisoned lock"))?
                    .get_mut(lc.rank())
                    .and_then(Option::take);
                let group = taken.map(|h| SpGroup::Local(Arc::new(h)));
                let res = run_rank(&args, Comm::Local(lc, sp), group.clone());
                if let (Err(e), Some(g)) = (&res, &group) {
                    g.abort(&format!("returned an error: {e:#}")); // its sequence-parallel peers stop too
                }
                res
            };
            spawn_local(world, dist.timeout(), rank_main).map_err(|e| {
                anyhow!(
                    "{e}\nhint: the error of the rank that failed first is the cause; the others stopped because of it"
                )
            })?;
            Ok(())
        }
        Backend::Single => {
            plan_check(&cfg, &origin, args.force, Ranks { world: 1, sharing: 1, device: cfg.train.device })?;
            let comm = Comm::from_config(&cfg.dist, &origin)?;
            crate::device::as_pool_worker(|| run_rank(&args, comm, None))
        }
        Backend::Nccl | Backend::Gloo => run_process_rank(&args, &cfg, &origin),
    }
}

/// The ranks a plan check is for: how many in all, how many share one device's memory, and which device
/// this process measures.
struct Ranks {
    world: usize,
    sharing: usize,
    device: DeviceSpec,
}

/// One process of a multi-process group (`nccl` or `gloo`; started by `--nproc-per-node`, torchrun or
/// srun; alone it is a group of one): the world comes from the launcher, the plan is checked for it
/// (on a GPU, the free memory of this process's own `cuda:LOCAL_RANK`), then the process joins the
/// group and runs the loop.
fn run_process_rank(args: &TrainArgs, cfg: &RunConfig, origin: &str) -> Result<()> {
    use crate::launch::env::{free_port, LaunchEnv, LaunchSource};
    use crate::launch::spawn::place;
    let dist = &cfg.dist;
    let placed = place(dist, origin, LaunchEnv::from_env()?)?;
    let env = match placed.launch {
        Some(env) => env,
        None => LaunchEnv {
            source: LaunchSource::Torchrun,
            rank: 0,
            world_size: 1,
            local_rank: match cfg.train.device {
                DeviceSpec::Cuda(n) => n,
                DeviceSpec::Cpu => 0,
            },
            local_world_size: Some(1),
            master_addr: "127.0.0.1".into(),
            master_port: free_port("127.0.0.1")?,
            run_token: "single".into(),
        },
    };
    // a GPU rank has its device to itself; CPU ranks share the host with the other processes of the node
    let (device, sharing) = match cfg.train.device {
        DeviceSpec::Cuda(_) => (DeviceSpec::Cuda(crate::floors::rank_gpu(env.local_rank)?), 1),
        DeviceSpec::Cpu => (DeviceSpec::Cpu, env.local_world_size.unwrap_or(env.world_size).max(1)),
    };
    plan_check(cfg, origin, args.force, Ranks { world: env.world_size, sharing, device })?;
    let resolved = RunConfig::load(&args.config, &args.sets())?.toml;
    // the collective signature check (`launch::signature`): a window every SIG_EVERY collectives
    let check_every = if dist.check_collectives { crate::launch::signature::SIG_EVERY } else { 0 };
    let joining =
        || format!("{origin}: joining the {} group as rank {} of {}", dist.backend.name(), env.rank, env.world_size);
    let sp = dist.sp_degree.max(1);
    // each arm joins the group and gives the communicator and, with SP, the sequence-parallel group over it
    let joined: Result<(Comm, Option<SpGroup>)> = match dist.backend {
        #[cfg(feature = "nccl")]
        Backend::Nccl => {
            let c = crate::comms::nccl::NcclComm::join(&env, &resolved, dist.timeout(), sp, check_every);
            let c = Arc::new(c.with_context(joining)?);
            Ok((Comm::Nccl(Arc::clone(&c)), (sp > 1).then(|| SpGroup::Nccl(c))))
        }
        #[cfg(feature = "gloo")]
        Backend::Gloo => {
            let c = crate::comms::gloo::GlooComm::join(&env, &resolved, dist.timeout(), sp, check_every);
            let c = Arc::new(c.with_context(joining)?);
            Ok((Comm::Gloo(Arc::clone(&c)), (sp > 1).then(|| SpGroup::Gloo(c))))
        }
        b => {
            let _ = (resolved, check_every, joining, sp);
            Err(anyhow!("{origin}: dist.backend = \"{}\" needs a build with --features {}", b.name(), b.name()))
        }
    };
    let (comm, group) = joined?;
    run_member(args, comm, group)
}

/// Run the loop as one member of a process group (`comm` is `Comm::Nccl` or `Comm::Gloo`) and tell the
/// group how it ended — a normal end, or this rank's error or panic, so the other ranks stop naming it
/// instead of waiting for the timeout.
fn run_member(args: &TrainArgs, comm: Comm, group: Option<SpGroup>) -> Result<()> {
    let member = comm.clone();
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_rank(args, comm, group)));
    match res {
        Ok(Ok(())) => {
            tell_group(&member, None);
            Ok(())
        }
        Ok(Err(e)) => match group_failure(&member) {
            // another rank failed first: its failure is the cause of this error
            Some(f) if f.rank != member.mesh().rank() => Err(e.context(format!(
                "{f}\nhint: rank {} failed first; this rank stopped because of it (its own log says more)",
                f.rank
            ))),
            _ => {
                tell_group(&member, Some(&format!("{e:#}")));
                Err(e)
            }
        },
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".into());
            tell_group(&member, Some(&format!("panicked: {msg}")));
            std::panic::resume_unwind(panic)
        }
    }
}

/// The first failure the process group of `comm` has seen (another rank's or this rank's), if any.
fn group_failure(comm: &Comm) -> Option<crate::launch::signature::GroupFailure> {
    match comm {
        #[cfg(feature = "nccl")]
        Comm::Nccl(c) => c.failure(),
        #[cfg(feature = "gloo")]
        Comm::Gloo(c) => c.failure(),
        _ => None,
    }
}

/// Tell the process group of `comm` how this rank's training loop ended: `None` normally (the peers do
/// not take its closing connection as a failure), `Some(reason)` failed.
fn tell_group(comm: &Comm, failed: Option<&str>) {
    match (comm, failed) {
        #[cfg(feature = "nccl")]
        (Comm::Nccl(c), None) => c.finish(),
        #[cfg(feature = "nccl")]
        (Comm::Nccl(c), Some(reason)) => c.report_failure("in the training loop", reason),
        #[cfg(feature = "gloo")]
        (Comm::Gloo(c), None) => c.finish(),
        #[cfg(feature = "gloo")]
        (Comm::Gloo(c), Some(reason)) => c.report_failure("in the training loop", reason),
        _ => {}
    }
}

/// `harpe plan` before any work: refuse (unless `--force`) a run whose peak memory per rank, as the plan
/// computes it for this config, ZeRO stage, SP degree and world, does not fit the memory of the device
/// this process measures (the host, or its GPU's free memory) shared by the ranks that share it.
fn plan_check(cfg: &RunConfig, origin: &str, force: bool, ranks: Ranks) -> Result<()> {
    use crate::train::plan::{plan_for, Gpu, GpuKind, World};
    let dist = &cfg.dist;
    let Ranks { world: ranks, sharing, device } = ranks;
    let (mut gpu, what) = match device {
        DeviceSpec::Cpu => (Gpu::new(GpuKind::Cpu), "this machine".to_string()),
        DeviceSpec::Cuda(_) => {
            let Some(m) = crate::device::device_memory(&device, &format!("{origin}: train.device"))? else {
                return Ok(());
            };
            let (gpu, _) = Gpu::measured(&m);
            let what = format!(
                "{} ({:.1} of {:.1} GiB free)",
                m.name,
                m.free as f64 / (1u64 << 30) as f64,
                m.total as f64 / (1u64 << 30) as f64
            );
            (gpu, what)
        }
    };
    gpu.mem_bytes /= sharing as u64;
    let arch = crate::train::plan::Arch::of_run(cfg, "[model]")?;
    let gpu = crate::train::plan::attention_for_run(cfg, &arch, gpu, cfg!(feature = "flash-attn"), None)?;
    let world = World { gpus: ranks, zero_stage: dist.zero_stage, sp_degree: dist.sp_degree };
    let plan = plan_for(cfg, &world, &gpu).with_context(|| format!("{origin}: planning the run (harpe plan)"))?;
    crate::train::oom::remember_plan(&plan.terms.iter().map(|t| (t.name, t.bytes)).collect::<Vec<_>>());
    if plan.fits || force {
        return Ok(());
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    bail!(
        "{origin}: the run needs {:.2} GiB per rank at its peak (stage {}, {ranks} rank(s)), more than the {:.2} GiB each of {sharing} rank(s) can use on {what}\nhint: see `harpe plan --config {origin} --gpus {ranks}` for the terms (ZeRO-3, activation checkpointing and shorter stages shrink them); pass --force to start anyway",
        gib(plan.total_bytes),
        plan.stage,
        gib(plan.usable_bytes)
    )
}

/// `--nproc-per-node N`: N worker processes of this command line (without the flag), each joining the
/// process group of `dist.backend` (`nccl`: one per GPU; `gloo`: CPU processes). Checked before anything
/// starts: N >= 1, a multi-process backend, and a build that has it (a build without it refuses the flag
/// and names the thread backend instead of spawning workers that would all fail the same way).
fn spawn_workers(origin: &str, n: usize, backend: Backend, nodes: &NodeArgs) -> Result<()> {
    if n == 0 {
        bail!(
            "--nproc-per-node 0: at least one worker is needed\nhint: --nproc-per-node = number of GPUs on this node"
        );
    }
    if !cfg!(feature = "nccl") && !cfg!(feature = "gloo") {
        bail!(
            "--nproc-per-node {n} starts one process per rank over NCCL (GPUs) or Gloo (CPU), but this harpe was built with neither\nhint: on CPU run the ranks as threads: --set dist.backend=local --set dist.world_size={n}; or build with --features gloo (CPU processes) or --features nccl (GPUs, README \"Build for GPUs\")"
        );
    }
    if !backend.is_multi_process() {
        let have = if cfg!(feature = "nccl") { "nccl" } else { "gloo" };
        bail!(
            "{origin}: --nproc-per-node {n} needs dist.backend = \"nccl\" or \"gloo\" (the workers are separate processes)\nhint: add --set dist.backend={have}"
        );
    }
    let outcome = launch_if_asked(Some(n), nodes)?.ok_or_else(|| anyhow!("internal: no workers were started"))?;
    if !outcome.success() {
        bail!(
            "worker rank {} failed first (exit code {})\nhint: its own error is printed above; the other workers were stopped because of it",
            outcome.first_failure.unwrap_or(0),
            outcome.exit_code()
        );
    }
    Ok(())
}
