//! CPU attention op timing: the GEMM-block kernel (`CpuKernel::Gemm`) against the scalar reference
//! loops (`CpuKernel::Reference`), forward and forward + backward, for training shapes (Tq = Tk),
//! chunked prefill and single-token decode (Tq < Tk), GQA and MHA, and GFLOP/s of the causal work.
//!
//!     RAYON_NUM_THREADS=2 cargo bench --bench attention_cpu [-- --quick] [--gemm-only] [--shape B,H,Hkv,Tq,Tk] [--d D] [--fwd-only]
//!
//! FLOPs counted: causal forward 2 GEMMs of B H Tq Tk_eff D MACs (Tk_eff = keys a row sees on average),
//! backward 5 (the recomputed S, dV, dP, dQ, dK); a MAC is 2 FLOPs; GFLOP/s is of forward + backward, or of
//! the forward alone with `--fwd-only`. Not a test: numbers only.
use candle_core::Var;
use harpe::ops::attention::{attention_with, CpuKernel};
mod timing;
use timing::time;
#[path = "../tests/common/ops.rs"]
mod ops_common;
use ops_common::randn;

fn main() {
    harpe::device::init_cpu_runtime(); // as `harpe` itself runs
    let quick = std::env::args().any(|a| a == "--quick");
    // `--d N`: head dim (default 32)
    let d: usize = std::env::args().skip_while(|a| a != "--d").nth(1).map_or(32, |s| s.parse().expect("--d N"));
    let only_gemm = std::env::args().any(|a| a == "--gemm-only"); // for profiling the fast path alone
    let fwd_only = std::env::args().any(|a| a == "--fwd-only"); // inference: forward alone (GFLOP/s of it)
                                                                // `--shape B,H,Hkv,Tq,Tk`: that shape alone
    let pick: Option<Vec<usize>> = std::env::args()
        .skip_while(|a| a != "--shape")
        .nth(1)
        .map(|s| s.split(',').map(|x| x.parse().expect("--shape B,H,Hkv,Tq,Tk")).collect());
    let mut shapes = vec![(2, 8, 4, 256, 256), (2, 8, 8, 256, 256), (2, 8, 4, 1024, 1024), (2, 8, 8, 1024, 1024)];
    if !quick {
        shapes.extend([(2, 8, 4, 4096, 4096), (1, 8, 4, 256, 4096), (1, 8, 4, 1, 4096), (1, 8, 8, 1, 4096)]);
    }
    if let Some(p) = &pick {
        shapes = vec![(p[0], p[1], p[2], p[3], p[4])];
    }
    println!(
        "{:<34} {:>10} {:>9} {:>12} {:>9} {:>8}",
        "shape (B,H,Hkv,Tq,Tk,D)", "kernel", "fwd ms", "fwd+bwd ms", "GFLOP/s", "x ref"
    );
    for &(b, h, hkv, tq, tk) in &shapes {
        let q = Var::from_tensor(&randn(&[b, h, tq, d], 1, 1.0)).expect("var");
        let k = Var::from_tensor(&randn(&[b, hkv, tk, d], 2, 1.0)).expect("var");
        let v = Var::from_tensor(&randn(&[b, hkv, tk, d], 3, 1.0)).expect("var");
        let scale = 1.0 / (d as f32).sqrt();
        // keys a causal row sees, on average
        let tk_eff = (tk - tq) as f64 + (tq as f64 + 1.0) / 2.0;
        let macs = (b * h * tq * d) as f64 * tk_eff;
        let reps = if pick.is_some() {
            if tq * tk > 1 << 22 {
                7
            } else {
                50
            }
        } else if tq * tk > 1 << 22 {
            3
        } else {
            7
        };
        let mut ref_total = None;
        for kernel in [CpuKernel::Reference, CpuKernel::Gemm] {
            if kernel == CpuKernel::Reference && (only_gemm || tq * tk > 1 << 22) {
                continue; // minutes of scalar loops
            }
            let fwd = time(reps, || {
                attention_with(q.as_tensor(), k.as_tensor(), v.as_tensor(), scale, true, None, kernel).expect("fwd");
            });
            let total = if fwd_only {
                f64::NAN
            } else {
                time(reps, || {
                    let o = attention_with(q.as_tensor(), k.as_tensor(), v.as_tensor(), scale, true, None, kernel)
                        .expect("fwd");
                    o.sum_all().and_then(|s| s.backward()).expect("bwd");
                })
            };
            let gflops = if fwd_only { 2.0 * macs * 2.0 / fwd / 1e9 } else { 2.0 * macs * 7.0 / total / 1e9 };
            let x = match (kernel, ref_total) {
                (CpuKernel::Gemm, Some(r)) => format!("{:.1}", r / total),
                _ => "-".into(),
            };
            if kernel == CpuKernel::Reference {
                ref_total = Some(total);
            }
            println!(
                "{:<34} {:>10} {:>9.2} {:>12.2} {:>9.1} {:>8}",
                format!("({b},{h},{hkv},{tq},{tk},{d})"),
                format!("{kernel:?}"),
                fwd * 1e3,
                total * 1e3,
                gflops,
                x
            );
        }
    }
}
