//! CPU linear-layer GEMM timing (`ops::linear`): forward y = x W^T with W row-major (checkpoint and
//! training layout) and column-major (`Llama::with_inference_layout`), and the backward's two GEMMs
//! (dx = dy W, dW = dy^T x), in GFLOP/s, for the projections of the CPU benchmark grid's models
//! (scripts/bench_train_torch.py): training micro-batches of 2048 tokens, eval windows of 256.
//!
//!     RAYON_NUM_THREADS=2 cargo bench --bench linear_cpu [-- --shape ROWS,IN,OUT] [--reps N]
//!
//! Not a test: numbers only (medians of `reps` calls after one warm-up).
use harpe::ops::linear::{linear_bwd_cpu, linear_fwd_cpu, View};
mod timing;
use timing::time;

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn main() {
    harpe::device::init_cpu_runtime(); // as `harpe` itself runs
    let arg = |name: &str| std::env::args().skip_while(|a| a != name).nth(1);
    let reps: usize = arg("--reps").map_or(9, |s| s.parse().expect("--reps N"));
    let mut shapes = vec![
        (2048, 384, 1024),
        (2048, 1024, 384),
        (2048, 768, 2048),
        (2048, 2048, 768),
        (2048, 768, 768),
        (256, 512, 1376),
        (256, 1376, 512),
        (256, 768, 2048),
        (256, 2048, 768),
    ];
    if let Some(s) = arg("--shape") {
        let p: Vec<usize> = s.split(',').map(|x| x.parse().expect("--shape ROWS,IN,OUT")).collect();
        shapes = vec![(p[0], p[1], p[2])];
    }
    println!(
        "{:<22} {:>14} {:>14} {:>10} {:>10}   (GFLOP/s, {} threads)",
        "(rows, in, out)",
        "fwd W row-maj",
        "fwd W col-maj",
        "bwd dx",
        "bwd dW",
        rayon::current_num_threads()
    );
    for &(rows, inp, out) in &shapes {
        let x = values(rows * inp, 1);
        let w = values(out * inp, 2);
        let dy = values(rows * out, 3);
        let mut wt = vec![0f32; inp * out]; // W column-major: wt[i * out + o] = w[o * inp + i]
        for o in 0..out {
            for i in 0..inp {
                wt[i * out + o] = w[o * inp + i];
            }
        }
        let gflop = 2.0 * (rows * inp * out) as f64 / 1e9;
        let dims = (rows, inp, out);
        let f_row = time(reps, || drop(linear_fwd_cpu(&x, View::row_major(&w, inp), dims)));
        let f_col = time(reps, || drop(linear_fwd_cpu(&x, View { data: &wt, rs: 1, cs: out }, dims)));
        let both = time(reps, || drop(linear_bwd_cpu(&dy, &x, View::row_major(&w, inp), dims)));
        // dx = dy W alone: the forward op's GEMM over W^T as the weight (the same GEMM `linear_bwd_cpu` runs);
        // dW is the backward's time less this
        let dx = time(reps, || drop(linear_fwd_cpu(&dy, View { data: &w, rs: 1, cs: inp }, (rows, out, inp))));
        println!(
            "{:<22} {:>14.0} {:>14.0} {:>10.0} {:>10.0}",
            format!("({rows}, {inp}, {out})"),
            gflop / f_row,
            gflop / f_col,
            gflop / dx,
            gflop / (both - dx).max(1e-9)
        );
    }
}
