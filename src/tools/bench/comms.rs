//! `harpe bench comms`: the time and bus bandwidth of the collectives the training loop uses, on the
//! backend a run would use: NCCL ranks on GPUs or Gloo ranks on CPUs (`--nproc-per-node N`, torchrun,
//! srun; one process per rank, `--backend`), or rank threads (`Local`, host memory) otherwise.
//!
//! Reference: nccl-tests' PERFORMANCE.md — algorithm bandwidth = bytes per rank / time; bus bandwidth =
//! algbw x 2(n-1)/n for all-reduce and x (n-1)/n for all-gather and reduce-scatter, the number that is
//! comparable with the link's speed (NVLink 600 GB/s on A100 SXM, per direction 300). Sizes are the
//! per-rank buffer of all-reduce and the full (gathered) buffer of all-gather / reduce-scatter, as there.
//! The non-obvious decisions: the operations are the ones ZeRO runs (`Comm::all_reduce_sum` on a flat
//! buffer in place, `all_gather_v_tensor`, `reduce_scatter_v_sum_tensor` with equal counts), through
//! `Comm`, so the numbers include what harpe adds around NCCL; a timed round ends with a barrier, whose
//! host wait comes after every queued collective on the collective stream, so the clock sees them done.
//! Does not: sweep message sizes finely, or time all-to-all (Ulysses) — its volume per step is small
//! next to ZeRO's (harpe plan's `sp_comm_s`).
use crate::comms::local::spawn_local;
use crate::comms::Comm;
use crate::flatbuf::{FlatBuf, Placement};
use crate::launch::env::LaunchEnv;
use crate::launch::spawn::launch_if_asked;
use crate::tools::bench::BenchArgs;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use std::time::Instant;

/// One timed collective.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CommRow {
    /// `all_reduce`, `all_gather` or `reduce_scatter`
    pub op: &'static str,
    /// ranks in the group
    pub ranks: usize,
    /// bytes: the per-rank buffer (all-reduce) or the gathered buffer (all-gather, reduce-scatter)
    pub bytes: usize,
    /// mean milliseconds per call
    pub ms: f64,
    /// algorithm bandwidth, GB/s
    pub algbw: f64,
    /// bus bandwidth, GB/s (comparable with the interconnect's speed)
    pub busbw: f64,
}

/// A named collective to time.
type Timed<'a> = (&'static str, Box<dyn FnMut() -> Result<()> + 'a>);

/// nccl-tests' bus-bandwidth factor of `op` over `n` ranks.
pub fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n.max(1) as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        _ => (n - 1.0) / n,
    }
}

/// Time all-reduce, all-gather and reduce-scatter of `sizes` bytes (f32; rounded down to a multiple of
/// 4 x ranks) on `comm`, whose buffers live on `device`, each for about `seconds` after one warm-up call.
/// Every rank must call this with the same arguments; every rank gets the same rows (its own clock).
pub fn time_collectives(comm: &Comm, device: &Device, sizes: &[usize], seconds: f64) -> Result<Vec<CommRow>> {
    let n = comm.mesh().world();
    let mut rows = vec![];
    for &bytes in sizes {
        let elems = (bytes / 4 / n).max(1) * n;
        let bytes = elems * 4;
        let counts = vec![elems / n; n];
        let mut buf = FlatBuf::zeros_in(elems, &Placement::of(device))?;
        let part = Tensor::zeros(elems / n, DType::F32, device)?;
        let full = Tensor::zeros(elems, DType::F32, device)?;
        let mut ops: [Timed<'_>; 3] = [
            ("all_reduce", Box::new(|| comm.all_reduce_sum(&mut buf))),
            ("all_gather", Box::new(|| comm.all_gather_v_tensor(&part, &counts, "bench").map(drop))),
            ("reduce_scatter", Box::new(|| comm.reduce_scatter_v_sum_tensor(&full, &counts, "bench").map(drop))),
        ];
        for (op, f) in ops.iter_mut() {
            f()?; // warm-up (NCCL sets up its channels on first use)
            comm.barrier()?;
            // every rank runs the same number of calls: rank 0's count from a short probe, shared
            let t0 = Instant::now();
            f()?;
            comm.barrier()?;
            let probe = t0.elapsed().as_secs_f64().max(1e-6);
            let mut iters = [(seconds / probe).clamp(1.0, 10_000.0).floor()];
            if comm.mesh().rank() != 0 {
                iters[0] = 0.0;
            }
            comm.all_reduce_sum_f64(&mut iters)?;
            let iters = iters[0] as usize;
            let t0 = Instant::now();
            for _ in 0..iters {
                f()?;
            }
            comm.barrier()?;
            let s = t0.elapsed().as_secs_f64() / iters as f64;
            let algbw = bytes as f64 / s / 1e9;
            rows.push(CommRow { op, ranks: n, bytes, ms: s * 1e3, algbw, busbw: algbw * bus_factor(op, n) });
        }
    }
    Ok(rows)
}

/// `harpe bench comms`: NCCL ranks when launched (`--nproc-per-node`, torchrun, srun), else `--ranks`
/// rank threads on host memory; rank 0 prints the table (or JSON).
pub fn run(args: &BenchArgs) -> Result<()> {
    if let Some(out) = launch_if_asked(args.nproc_per_node, &Default::default())? {
        if !out.success() {
            bail!(
                "bench comms: rank {} failed first ({})\nhint: its own error is printed above",
                out.first_failure.unwrap_or(0),
                out.exit_code()
            );
        }
        return Ok(());
    }
    let bad = args.comm_mib.iter().find(|m| !(m.is_finite() && **m > 0.0));
    if let Some(m) = bad {
        bail!("--comm-mib {m}: sizes must be positive MiB\nhint: e.g. --comm-mib 1,16,256");
    }
    if !(args.comm_seconds > 0.0 && args.comm_seconds.is_finite()) {
        bail!("--comm-seconds {}: must be a positive number of seconds", args.comm_seconds);
    }
    let sizes: Vec<usize> = args.comm_mib.iter().map(|m| (m * 1048576.0) as usize).collect();
    let timeout = std::time::Duration::from_secs(120);
    let (rows, backend) = match LaunchEnv::from_env()? {
        Some(env) => {
            let gloo = match args.backend.as_deref() {
                Some(b) => b == "gloo",
                None => !cfg!(feature = "nccl"),
            };
            if gloo {
                (gloo_rows(&env, &sizes, args.comm_seconds, timeout)?, "Gloo processes (TCP, host memory)")
            } else {
                (nccl_rows(&env, &sizes, args.comm_seconds, timeout)?, "NCCL")
            }
        }
        None => {
            if args.ranks == 0 {
                bail!("--ranks 0: at least one rank\nhint: e.g. --ranks 4");
            }
            let secs = args.comm_seconds;
            let sz = &sizes;
            let out = spawn_local(args.ranks, timeout, move |lc| {
                time_collectives(&Comm::Local(lc, 1), &Device::Cpu, sz, secs)
            })?;
            (out.into_iter().next().unwrap_or_default(), "Local rank threads (host memory)")
        }
    };
    if rows.is_empty() {
        return Ok(()); // not rank 0
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print_rows(&rows, backend);
    }
    Ok(())
}

/// The rows of one NCCL rank (empty except on rank 0, which prints them).
#[cfg(feature = "nccl")]
fn nccl_rows(env: &LaunchEnv, sizes: &[usize], secs: f64, timeout: std::time::Duration) -> Result<Vec<CommRow>> {
    use crate::comms::nccl::NcclComm;
    let c = std::sync::Arc::new(NcclComm::join(env, "harpe bench comms", timeout, 1, 0)?);
    let comm = Comm::Nccl(std::sync::Arc::clone(&c));
    let rows = time_collectives(&comm, c.device(), sizes, secs);
    match &rows {
        Ok(_) => c.finish(),
        Err(e) => c.report_failure("in bench comms", &format!("{e:#}")),
    }
    Ok(if env.rank == 0 { rows? } else { rows.map(|_| vec![])? })
}

#[cfg(not(feature = "nccl"))]
fn nccl_rows(env: &LaunchEnv, _: &[usize], _: f64, _: std::time::Duration) -> Result<Vec<CommRow>> {
    bail!(
        "bench comms: this process is rank {} of {} (launcher environment), but this harpe was built without NCCL\nhint: build with --features nccl, or run without a launcher for thread ranks (--ranks N)",
        env.rank,
        env.world_size
    )
}

/// The rows of one Gloo rank (empty except on rank 0, which prints them).
#[cfg(feature = "gloo")]
fn gloo_rows(env: &LaunchEnv, sizes: &[usize], secs: f64, timeout: std::time::Duration) -> Result<Vec<CommRow>> {
    use crate::comms::gloo::GlooComm;
    let c = std::sync::Arc::new(GlooComm::join(env, "harpe bench comms", timeout, 1, 0)?);
    let comm = Comm::Gloo(std::sync::Arc::clone(&c));
    let rows = time_collectives(&comm, &Device::Cpu, sizes, secs);
    match &rows {
        Ok(_) => c.finish(),
        Err(e) => c.report_failure("in bench comms", &format!("{e:#}")),
    }
    Ok(if env.rank == 0 { rows? } else { rows.map(|_| vec![])? })
}

#[cfg(not(feature = "gloo"))]
fn gloo_rows(env: &LaunchEnv, _: &[usize], _: f64, _: std::time::Duration) -> Result<Vec<CommRow>> {
    bail!(
        "bench comms: this process is rank {} of {} (launcher environment), but this harpe was built without Gloo\nhint: apt-get install libgloo-dev and build with --features gloo, or run without a launcher for thread ranks (--ranks N)",
        env.rank,
        env.world_size
    )
}

/// The table `harpe bench comms` prints.
pub fn print_rows(rows: &[CommRow], backend: &str) {
    println!("# collectives over {backend} (bus bandwidth as nccl-tests defines it)");
    println!("{:<15} {:>5} {:>12} {:>10} {:>10} {:>10}", "op", "ranks", "bytes", "ms", "algbw GB/s", "busbw GB/s");
    for r in rows {
        println!("{:<15} {:>5} {:>12} {:>10.3} {:>10.2} {:>10.2}", r.op, r.ranks, r.bytes, r.ms, r.algbw, r.busbw);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn bus_factors_are_nccl_tests() {
        assert_eq!(bus_factor("all_reduce", 8), 1.75);
        assert_eq!(bus_factor("all_gather", 8), 0.875);
        assert_eq!(bus_factor("reduce_scatter", 1), 0.0);
    }

    #[test]
    fn local_ranks_time_every_collective_with_the_same_call_count() {
        let out = spawn_local(2, Duration::from_secs(60), |lc| {
            time_collectives(&Comm::Local(lc, 1), &Device::Cpu, &[1 << 12, 1 << 16], 0.02)
        })
        .unwrap();
        for rows in &out {
            assert_eq!(rows.len(), 6);
            let ops: Vec<_> = rows.iter().map(|r| r.op).collect();
            assert_eq!(ops[..3], ["all_reduce", "all_gather", "reduce_scatter"]);
            assert!(rows.iter().all(|r| r.ranks == 2 && r.ms > 0.0 && r.busbw > 0.0), "{rows:?}");
            assert_eq!((rows[0].bytes, rows[3].bytes), (4096, 65536));
        }
    }
}
