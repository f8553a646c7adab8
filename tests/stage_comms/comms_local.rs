//! `Local` (ranks as threads): every collective against a sequential reference for world sizes 1..=5
//! and ragged slices, and failure propagation (error, panic, dropped handle, timeout, mismatch); the
//! NCCL code paths it runs: started collectives on each rank's communication thread, in issue order,
//! weights gathered in their own dtype, and the collective signature check.
use candle_core::{DType, Device, Tensor};
use half::bf16;
use harpe::comms::local::{spawn_local, spawn_local_with, LocalChecks, LocalGroup, ReduceOp, RoundCheck};
use harpe::comms::Comm;
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(60);

/// Rank r's input of length n: distinct, non-integer values so summation order matters in f32.
fn data(rank: usize, n: usize, salt: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((rank * 7919 + i * 104729 + salt as usize) % 1000) as f32 * 0.0137 - 6.1 + rank as f32 * 1e-3)
        .collect()
}

/// Sum of the ranks' slices [lo, lo+len) in rank order (what every rank must return bit-exactly).
fn ref_sum(world: usize, n: usize, salt: u32, lo: usize, len: usize, avg: bool) -> Vec<f32> {
    let bufs: Vec<Vec<f32>> = (0..world).map(|r| data(r, n, salt)).collect();
    (lo..lo + len)
        .map(|k| {
            let mut a = bufs[0][k];
            for b in &bufs[1..] {
                a += b[k];
            }
            if avg {
                a / world as f32
            } else {
                a
            }
        })
        .collect()
}

#[test]
fn every_collective_matches_a_sequential_reference_for_worlds_1_to_5() {
    for world in 1..=5usize {
        let ragged: Vec<usize> = [3usize, 0, 5, 1, 2][..world].to_vec();
        let total: usize = ragged.iter().sum();
        let offs: Vec<usize> = ragged
            .iter()
            .scan(0, |s, &c| {
                let o = *s;
                *s += c;
                Some(o)
            })
            .collect();
        let chunk = 3;
        let res = spawn_local(world, LONG, |c| {
            let r = c.rank();
            // all_reduce sum and avg, an odd length
            let mut a = data(r, 13, 1);
            c.all_reduce(&mut a, ReduceOp::Sum, "sum")?;
            assert_eq!(a, ref_sum(world, 13, 1, 0, 13, false), "all_reduce sum world {world} rank {r}");
            let mut a = data(r, 13, 2);
            c.all_reduce(&mut a, ReduceOp::Avg, "avg")?;
            assert_eq!(a, ref_sum(world, 13, 2, 0, 13, true), "all_reduce avg world {world} rank {r}");
            // reduce_scatter, equal slices
            let input = data(r, 4 * world, 3);
            let mut out = vec![0.0; 4];
            c.reduce_scatter(&input, &mut out, ReduceOp::Sum, "rs")?;
            assert_eq!(out, ref_sum(world, 4 * world, 3, 4 * r, 4, false), "reduce_scatter world {world} rank {r}");
            // reduce_scatter, ragged slices (one rank owns nothing)
            let input = data(r, total, 4);
            let mut out = vec![0.0; ragged[r]];
            c.reduce_scatter_v(&input, &mut out, &ragged, ReduceOp::Avg, "rs_v")?;
            assert_eq!(
                out,
                ref_sum(world, total, 4, offs[r], ragged[r], true),
                "reduce_scatter_v world {world} rank {r}"
            );
            // all_gather, equal and ragged; the in-place ZeRO form
            let mut out = vec![0.0; 2 * world];
            c.all_gather(&data(r, 2, 5), &mut out, "ag")?;
            let want: Vec<f32> = (0..world).flat_map(|q| data(q, 2, 5)).collect();
            assert_eq!(out, want, "all_gather world {world} rank {r}");
            let mine: Vec<f32> = data(r, total, 6)[offs[r]..offs[r] + ragged[r]].to_vec();
            let mut out = vec![0.0; total];
            c.all_gather_v(&mine, &mut out, &ragged, "ag_v")?;
            let want: Vec<f32> =
                (0..world).flat_map(|q| data(q, total, 6)[offs[q]..offs[q] + ragged[q]].to_vec()).collect();
            assert_eq!(out, want, "all_gather_v world {world} rank {r}");
            let mut buf = data(r, total, 6);
            c.all_gather_v_inplace(&mut buf, &ragged, "ag_inplace")?;
            assert_eq!(buf, want, "all_gather_v_inplace world {world} rank {r}");
            // broadcast from the last rank
            let mut b = data(r, 7, 7);
            c.broadcast(&mut b, world - 1, "bc")?;
            assert_eq!(b, data(world - 1, 7, 7), "broadcast world {world} rank {r}");
            // all_to_all: output chunk i = chunk r of rank i's input
            let input = data(r, chunk * world, 8);
            let mut out = vec![0.0; chunk * world];
            c.all_to_all(&input, &mut out, "a2a")?;
            let want: Vec<f32> =
                (0..world).flat_map(|i| data(i, chunk * world, 8)[r * chunk..(r + 1) * chunk].to_vec()).collect();
            assert_eq!(out, want, "all_to_all world {world} rank {r}");
            c.barrier("end")?;
            Ok(r)
        })
        .unwrap_or_else(|e| panic!("world {world}: {e}"));
        assert_eq!(res, (0..world).collect::<Vec<_>>());
    }
}

#[test]
fn f64_and_bf16_reductions_accumulate_in_rank_order() {
    let world = 3;
    let res = spawn_local(world, LONG, |c| {
        let r = c.rank() as f64;
        let mut a = vec![0.1 + r, 1e-17 * (r + 1.0)];
        c.all_reduce(&mut a, ReduceOp::Sum, "f64")?;
        // bf16 sums accumulate in f32 and round once: 1 + 2^-8 + 2^-8 = 1 + 2^-7 is a bf16 value, while
        // rounding after each addition would give 1 (1 + 2^-8 is a tie that rounds to even, 1).
        let v = if c.rank() == 0 { 1.0 } else { 1.0 / 256.0 };
        let mut b = vec![bf16::from_f32(v); 2];
        c.all_reduce(&mut b, ReduceOp::Sum, "bf16")?;
        Ok((a, b))
    })
    .unwrap();
    let mut want_a = vec![0.0f64; 2];
    for r in 0..world {
        let r = r as f64;
        want_a[0] += 0.1 + r;
        want_a[1] += 1e-17 * (r + 1.0);
    }
    let want_b = bf16::from_f32(1.0 + 1.0 / 128.0);
    assert_ne!(want_b, bf16::from_f32(1.0));
    for (a, b) in &res {
        assert_eq!(a, &want_a);
        assert_eq!(b[0], want_b);
    }
}

#[test]
fn a_rank_that_errors_stops_the_others_naming_it_and_its_last_collective() {
    let t0 = Instant::now();
    let err = spawn_local(4, LONG, |c| {
        let mut g = vec![1.0f32; 8];
        c.all_reduce(&mut g, ReduceOp::Sum, "grads step 0")?;
        if c.rank() == 2 {
            anyhow::bail!("data shard 2 is corrupt");
        }
        c.all_reduce(&mut g, ReduceOp::Sum, "grads step 1")?;
        Ok(())
    })
    .unwrap_err();
    assert!(t0.elapsed() < LONG / 2, "others must not wait for the timeout");
    assert_eq!(err.first.rank, 2);
    assert!(err.first.reason.contains("data shard 2 is corrupt"), "{err}");
    assert!(err.first.doing.contains("after collective #1 all_reduce \"grads step 0\""), "{err}");
    for r in [0, 1, 3] {
        let e = err.per_rank[r].as_deref().expect("the others fail too");
        assert!(e.contains("rank 2 failed") && e.contains("grads step 1"), "rank {r}: {e}");
    }
    assert!(err.to_string().contains("rank 2 failed"), "{err}");
}

#[test]
fn a_panicking_rank_stops_the_others_naming_it() {
    let err = spawn_local(3, LONG, |c| {
        c.barrier("start")?;
        if c.rank() == 1 {
            panic!("index out of bounds in layer 5");
        }
        let mut x = vec![0.0f32; 4];
        c.broadcast(&mut x, 0, "weights")?;
        Ok(())
    })
    .unwrap_err();
    assert_eq!(err.first.rank, 1);
    assert!(err.first.reason.contains("panicked: index out of bounds in layer 5"), "{err}");
    let e0 = err.per_rank[0].as_deref().unwrap();
    assert!(e0.contains("rank 1 failed") && e0.contains("broadcast \"weights\""), "{e0}");
}

#[test]
fn a_handle_dropped_while_panicking_or_early_fails_the_group() {
    // Raw handles on plain threads (no spawn_local): the Drop impl is what tells the others.
    let group = LocalGroup::new(3, LONG).unwrap();
    let mut hs = group.handles().into_iter();
    let (h0, h1, h2) = (hs.next().unwrap(), hs.next().unwrap(), hs.next().unwrap());
    let t0 = Instant::now();
    let w0 =
        std::thread::spawn(move || h0.all_reduce(&mut [1.0f32], ReduceOp::Sum, "loss").map_err(|e| format!("{e:#}")));
    let w1 = std::thread::spawn(move || {
        let _keep = h1;
        panic!("out of memory");
    });
    drop(h2); // rank 2 leaves normally, without entering the collective
    let e0 = w0.join().unwrap().unwrap_err();
    assert!(w1.join().is_err());
    assert!(t0.elapsed() < LONG / 2);
    let f = group.failure().unwrap();
    assert!(f.rank == 1 || f.rank == 2, "{f}");
    assert!(e0.contains(&format!("rank {} failed", f.rank)), "{e0}");
    assert!(f.reason.contains("panicked") || f.reason.contains("left the group"), "{f}");
}

#[test]
fn a_rank_that_never_arrives_times_out_the_others_naming_it() {
    let timeout = Duration::from_millis(1000);
    let err = spawn_local(3, timeout, |c| {
        c.barrier("warmup")?;
        if c.rank() == 2 {
            std::thread::sleep(timeout * 3); // stuck, then returns without the collective
            return Ok(());
        }
        let mut g = vec![0.5f32; 3];
        c.all_reduce(&mut g, ReduceOp::Avg, "grads")?;
        Ok(())
    })
    .unwrap_err();
    assert_eq!(err.first.rank, 2, "{err}");
    assert!(err.first.reason.contains("did not reach collective #2 all_reduce \"grads\""), "{err}");
    assert!(err.first.doing.contains("after collective #1 barrier \"warmup\""), "{err}");
    assert!(err.first.reason.contains("hint:"), "{err}");
    assert!(err.per_rank[0].is_some() && err.per_rank[1].is_some());
}

#[test]
fn ranks_calling_different_collectives_or_counts_get_an_error_not_garbage() {
    let err = spawn_local(2, LONG, |c| {
        let mut x = vec![1.0f32; 4];
        if c.rank() == 0 {
            c.all_reduce(&mut x, ReduceOp::Sum, "a")?;
        } else {
            c.broadcast(&mut x, 0, "a")?;
        }
        Ok(())
    })
    .unwrap_err();
    let e = err.per_rank[0].as_deref().or(err.per_rank[1].as_deref()).unwrap();
    assert!(e.contains("different collectives") && e.contains("all_reduce(") && e.contains("broadcast("), "{e}");

    let err = spawn_local(2, LONG, |c| {
        let counts = if c.rank() == 0 { [2, 2] } else { [1, 3] };
        let mut out = vec![0.0f32; 4];
        c.all_gather_v(&vec![1.0; counts[c.rank()]], &mut out, &counts, "zero shards")?;
        Ok(())
    })
    .unwrap_err();
    assert!(err.to_string().contains("different collectives"), "{err}");
}

#[test]
fn wrong_buffer_sizes_are_refused_with_a_hint() {
    let err = spawn_local(2, LONG, |c| {
        let mut out = vec![0.0f32; 3];
        c.reduce_scatter(&[1.0; 4], &mut out, ReduceOp::Sum, "grads")?;
        Ok(())
    })
    .unwrap_err();
    let e = err.to_string();
    assert!(
        e.contains("reduce_scatter \"grads\"") && e.contains("input has 4 elements, expected 6") && e.contains("hint:"),
        "{e}"
    );
}

#[test]
fn many_back_to_back_rounds_of_mixed_collectives_stay_in_step() {
    // Fast ranks re-enter the next round while slow ones still read the last one; every round must
    // still see exactly its own deposits. The op and size sequence is the same on every rank.
    let world = 4;
    let res = spawn_local(world, LONG, |c| {
        let r = c.rank();
        for it in 0..400u32 {
            let n = 1 + (it as usize * 7) % 11;
            match it % 4 {
                0 => {
                    let mut a = data(r, n, it);
                    c.all_reduce(&mut a, ReduceOp::Sum, "sum")?;
                    assert_eq!(a, ref_sum(world, n, it, 0, n, false), "round {it}");
                }
                1 => {
                    let mut b = data(r, n, it);
                    c.broadcast(&mut b, it as usize % world, "bc")?;
                    assert_eq!(b, data(it as usize % world, n, it), "round {it}");
                }
                2 => {
                    let mut out = vec![0.0; n * world];
                    c.all_gather(&data(r, n, it), &mut out, "ag")?;
                    assert_eq!(out, (0..world).flat_map(|q| data(q, n, it)).collect::<Vec<_>>(), "round {it}");
                }
                _ => {
                    if (it as usize + r).is_multiple_of(3) {
                        std::thread::yield_now(); // perturb the arrival order
                    }
                    c.barrier("b")?;
                }
            }
        }
        Ok(())
    });
    if let Err(e) = res {
        panic!("{e}");
    }
}

/// Least-squares gradient of `w` over samples `idx` of a fixed toy dataset: sum_i (x_i.w - y_i) x_i.
fn toy_grad(w: &[f32], idx: std::ops::Range<usize>) -> Vec<f32> {
    let d = w.len();
    let mut g = vec![0.0f32; d];
    for i in idx {
        let x: Vec<f32> = (0..d).map(|j| ((i * 31 + j * 17) % 13) as f32 / 13.0 - 0.5).collect();
        let y = (i % 5) as f32 * 0.3 - 0.6;
        let e: f32 = x.iter().zip(w).map(|(a, b)| a * b).sum::<f32>() - y;
        for j in 0..d {
            g[j] += e * x[j];
        }
    }
    g
}

/// k SGD steps on a global batch of `batch` samples split over the ranks, with the ZeRO-1 pattern:
/// gradients reduce-scattered onto ragged owner slices, each rank updates its slice, then the
/// weights are all-gathered in place. Returns the final weights of every rank.
fn zero1_sgd(world: usize, d: usize, batch: usize, steps: usize) -> Vec<Vec<f32>> {
    // ragged ownership: rank r owns about d/world elements, the first rank one fewer
    let mut counts = vec![d / world; world];
    counts[world - 1] += d % world;
    if world > 1 && counts[0] > 0 {
        counts[0] -= 1;
        counts[1] += 1;
    }
    let offs: Vec<usize> = counts.iter().scan(0, |s, &c| Some(std::mem::replace(s, *s + c))).collect();
    spawn_local(world, LONG, |c| {
        let r = c.rank();
        let per = batch / world;
        let mut w = vec![0.1f32; d];
        for step in 0..steps {
            let lo = step * batch + r * per;
            let g = toy_grad(&w, lo..lo + per);
            let mut mine = vec![0.0f32; counts[r]];
            c.reduce_scatter_v(&g, &mut mine, &counts, ReduceOp::Sum, "grads")?;
            for (k, gk) in mine.iter().enumerate() {
                w[offs[r] + k] -= 0.05 * gk / batch as f32;
            }
            c.all_gather_v_inplace(&mut w, &counts, "weights")?;
        }
        Ok(w)
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn zero1_pattern_on_2_and_4_ranks_reaches_the_weights_of_one_rank() {
    let (d, batch, steps) = (23, 8, 5);
    let one = zero1_sgd(1, d, batch, steps).remove(0);
    for world in [2, 4] {
        let ws = zero1_sgd(world, d, batch, steps);
        for (r, w) in ws.iter().enumerate() {
            assert_eq!(w, &ws[0], "world {world}: rank {r} differs from rank 0 (must be bit-identical)");
        }
        for (a, b) in ws[0].iter().zip(&one) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-3), "world {world}: {a} vs one rank {b}");
        }
        assert_ne!(one, vec![0.1f32; d], "the weights moved");
    }
}

#[test]
fn started_collectives_run_on_while_their_rank_computes() {
    // rank 1 issues its part only after rank 0 has returned from its `_start` calls: were they
    // blocking (as before the communication threads), rank 0 would wait in the first one for rank 1,
    // which waits for rank 0, until the group's timeout
    let (tx, rx) = mpsc::channel::<()>();
    let (tx, rx) = (Mutex::new(tx), Mutex::new(rx));
    let counts = [2usize, 3];
    let out = spawn_local(2, Duration::from_secs(20), |c| {
        let comm = Comm::Local(c, 1);
        let r = comm.mesh().rank();
        let mine = Tensor::from_vec(data(r, counts[r], 5), counts[r], &Device::Cpu)?;
        let full = Tensor::from_vec(data(r, 5, 6), 5, &Device::Cpu)?;
        if r == 0 {
            let g = comm.all_gather_v_tensor_start(&mine, &counts, "prefetch")?;
            let s = comm.reduce_scatter_v_sum_tensor_start(&full, &counts, "grads")?;
            assert!(!g.is_ready() && !s.is_ready(), "Local exchanges run beside the compute");
            tx.lock().unwrap().send(()).unwrap(); // the compute goes on while both are under way
            return Ok((g.wait()?.to_vec1::<f32>()?, s.wait()?.to_vec1::<f32>()?));
        }
        rx.lock().unwrap().recv_timeout(Duration::from_secs(30))?;
        let g = comm.all_gather_v_tensor(&mine, &counts, "prefetch")?;
        let s = comm.reduce_scatter_v_sum_tensor(&full, &counts, "grads")?;
        Ok((g.to_vec1::<f32>()?, s.to_vec1::<f32>()?))
    })
    .map_err(|e| e.to_string())
    .unwrap();
    let gathered: Vec<f32> = data(0, 2, 5).into_iter().chain(data(1, 3, 5)).collect();
    for (r, (g, s)) in out.iter().enumerate() {
        assert_eq!(g, &gathered, "rank {r}");
        let lo = [0, 2][r];
        assert_eq!(s, &ref_sum(2, 5, 6, lo, counts[r], false), "rank {r}");
    }
}

#[test]
fn a_blocking_collective_runs_after_the_collectives_started_before_it() {
    // rank 0 starts a gather, then calls a blocking all-reduce and a barrier; rank 1 calls the same
    // three blocking. Were rank 0's blocking calls to overtake its started gather, the first round would
    // pair an all-reduce with an all-gather: an error under the default (descriptor) round check
    let out = spawn_local(2, LONG, |c| {
        let comm = Comm::Local(c, 1);
        let r = comm.mesh().rank();
        let mine = Tensor::from_vec(data(r, 4, 7), 4, &Device::Cpu)?;
        let mut s = [r as f64 + 1.0];
        let g = if r == 0 {
            let g = comm.all_gather_v_tensor_start(&mine, &[4, 4], "w")?;
            comm.all_reduce_sum_f64(&mut s)?;
            comm.barrier()?;
            g.wait()?
        } else {
            let g = comm.all_gather_v_tensor(&mine, &[4, 4], "w")?;
            comm.all_reduce_sum_f64(&mut s)?;
            comm.barrier()?;
            g
        };
        Ok((g.to_vec1::<f32>()?, s[0]))
    })
    .map_err(|e| e.to_string())
    .unwrap();
    for (g, s) in out {
        assert_eq!(g, data(0, 4, 7).into_iter().chain(data(1, 4, 7)).collect::<Vec<_>>());
        assert_eq!(s, 3.0);
    }
}

#[test]
fn weights_are_gathered_in_their_own_dtype_and_come_back_exact() {
    // each dtype comes back in its dtype, exact (the dtype on the wire: the signature tests below)
    for dt in [DType::BF16, DType::F16, DType::F32] {
        let out = spawn_local(2, LONG, |c| {
            let comm = Comm::Local(c, 1);
            let r = comm.mesh().rank();
            let t = Tensor::from_vec(data(r, 3, 9), 3, &Device::Cpu)?.to_dtype(dt)?;
            let g = comm.all_gather_v_tensor(&t, &[3, 3], "weights")?;
            anyhow::ensure!(g.dtype() == dt, "gathered {:?} from {dt:?}", g.dtype());
            Ok(g.to_dtype(DType::F32)?.to_vec1::<f32>()?)
        })
        .map_err(|e| e.to_string())
        .unwrap();
        let want: Vec<f32> = (0..2)
            .flat_map(|r| data(r, 3, 9))
            .map(|x| Tensor::new(&[x], &Device::Cpu).unwrap().to_dtype(dt).unwrap().to_dtype(DType::F32).unwrap())
            .map(|t| t.to_vec1::<f32>().unwrap()[0])
            .collect();
        assert!(out.iter().all(|g| g == &want), "{dt:?}: {out:?} vs {want:?}");
    }
}

/// The checks NCCL has: each round checks only what moving the data needs; the signature check
/// compares every 4 collectives.
const AS_NCCL: LocalChecks = LocalChecks { round: RoundCheck::Transport, sig_every: 4 };

#[test]
fn a_same_size_collective_of_another_op_is_stopped_by_the_signature_check_naming_both_ranks() {
    // collective #2: rank 1 reduce-scatters the 16 values rank 0 all-reduces. As under NCCL the round
    // itself goes through (with wrong values); the window's end (#4) stops every rank
    let err = spawn_local_with(2, LONG, AS_NCCL, |c| {
        let mut x = vec![1.0f32; 16];
        c.barrier("one")?;
        if c.rank() == 0 {
            c.all_reduce(&mut x, ReduceOp::Sum, "grads")?;
        } else {
            let mut out = vec![0.0f32; 8];
            c.reduce_scatter(&x, &mut out, ReduceOp::Sum, "grads")?;
        }
        c.barrier("three")?;
        c.barrier("four")?;
        c.barrier("five")?;
        Ok(())
    })
    .unwrap_err();
    let f = err.first.to_string();
    assert_eq!(err.first.rank, 1, "the rank that differs from rank 0 is named: {f}");
    assert!(f.contains("failed at collective #2"), "{f}");
    assert!(f.contains("rank 0 issued #2 all_reduce(16 x f32), rank 1 issued #2 reduce_scatter(16 x f32)"), "{f}");
    assert!(f.contains("hint:"), "{f}");
    for (r, e) in err.per_rank.iter().enumerate() {
        let e = e.as_deref().unwrap_or_else(|| panic!("rank {r} went on"));
        assert!(e.contains("rank 1 failed at collective #2"), "rank {r}: {e}");
    }
}

#[test]
fn the_same_count_in_another_dtype_is_stopped_by_the_signature_check_naming_both_ranks() {
    // collective #4: rank 1 gathers bf16 weights where rank 0 gathers f32 (Local moves a tensor in its
    // own dtype, as NCCL); the window ends there, so the check stops it before the exchange
    let err = spawn_local_with(2, LONG, AS_NCCL, |c| {
        let comm = Comm::Local(c, 1);
        for _ in 0..3 {
            comm.barrier()?;
        }
        let dt = if comm.mesh().rank() == 1 { DType::BF16 } else { DType::F32 };
        comm.all_gather_v_tensor(&Tensor::ones(4, dt, &Device::Cpu)?, &[4, 4], "weights")?;
        Ok(())
    })
    .unwrap_err();
    let f = err.first.to_string();
    assert_eq!(err.first.rank, 1, "{f}");
    assert!(f.contains("rank 0 issued #4 all_gather(8 x f32), rank 1 issued #4 all_gather(8 x bf16)"), "{f}");
    assert!(err.per_rank.iter().all(Option::is_some), "{err}");
}
