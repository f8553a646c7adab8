//! The selftest's bounds catch a wrong kernel: with one emulated kernel perturbed by 1%
//! through `HARPE_EMU_PERTURB` (ops::emu::perturb: a scaled output, or a wrong mask tile), that
//! kernel's rows FAIL, while without the switch every row passes with margin (err/bound well below 1).
//!
//! One #[test] on purpose: the switch is a process-wide environment variable, and the tests of one
//! binary run on parallel threads.
use harpe::tools::selftest::{self, attention, Check, Dt, Target};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

type CaseFn = fn(&Target, Dt, &mut ChaCha8Rng) -> anyhow::Result<Vec<Check>>;

/// The rows of `fns` (f32 and bf16) and, with `attn`, of attention for `seed`.
fn rows(fns: &[CaseFn], attn: bool, seed: u64) -> Vec<Check> {
    let mut out = Vec::new();
    for f in fns {
        for dt in [Dt::F32, Dt::Bf16] {
            out.extend(f(&Target::Emulated, dt, &mut ChaCha8Rng::seed_from_u64(seed)).unwrap());
        }
    }
    if attn {
        out.extend(attention::checks(&Target::Emulated, &mut ChaCha8Rng::seed_from_u64(seed)).unwrap());
    }
    out
}

fn show(c: &Check) -> String {
    format!("{} {:?} {}: err {:.3e} bound {:.3e} ratio {:.3}", c.kernel, c.dtype, c.case, c.max_err, c.bound, c.ratio)
}

#[test]
fn a_kernel_off_by_one_percent_fails_its_rows_and_correct_kernels_pass_with_margin() {
    std::env::remove_var(harpe::ops::emu::perturb::VAR);
    let every: [CaseFn; 3] = [selftest::rope_checks, selftest::rms_norm_checks, selftest::cross_entropy_checks];
    for seed in [3u64, 4] {
        let all = rows(&every, true, seed);
        for c in &all {
            assert!(c.pass, "seed {seed}, unperturbed: {}", show(c));
            // margin: the bound allows a full ulp for the output's rounding (a correct kernel rounds by at
            // most half of one) and a worst-case f32 term: correct kernels stay near 0.5 at most
            assert!(c.ratio < 0.6, "seed {seed}, unperturbed, little margin: {}", show(c));
        }
        assert!(all.iter().any(|c| c.kernel.ends_with(" lse") && c.dtype == Dt::Bf16), "no bf16 lse row");
    }
    // (switch, the kernel's rows, the rows that must FAIL: kernel name prefix and suffix)
    let (rope, rms, ce): (CaseFn, CaseFn, CaseFn) =
        (selftest::rope_checks, selftest::rms_norm_checks, selftest::cross_entropy_checks);
    let cases: [(&str, &[CaseFn], &str, &str); 6] = [
        ("rope", &[rope], "rope fwd", ""),
        ("rms_norm_fwd", &[rms], "rms_norm fwd", ""),
        ("rms_norm_bwd", &[rms], "rms_norm bwd dx", ""),
        ("cross_entropy", &[ce], "cross_entropy nll", ""),
        ("attention_fwd", &[], "attention", " O"),
        ("attention_fwd:mask", &[], "attention", " lse"),
    ];
    for (switch, fns, prefix, suffix) in cases {
        std::env::set_var(harpe::ops::emu::perturb::VAR, switch);
        for seed in [3u64] {
            let all = rows(fns, fns.is_empty(), seed);
            let hit: Vec<&Check> =
                all.iter().filter(|c| c.kernel.starts_with(prefix) && c.kernel.ends_with(suffix)).collect();
            assert!(!hit.is_empty(), "{switch}: no {prefix}..{suffix} rows");
            // every dtype of the kernel has a failing row (f32 rows fail by far: 1% >> 1e-5)
            for dt in [Dt::F32, Dt::Bf16, Dt::F16] {
                let of_dt: Vec<&&Check> = hit.iter().filter(|c| c.dtype == dt).collect();
                assert!(
                    of_dt.is_empty() || of_dt.iter().any(|c| !c.pass),
                    "{switch}, seed {seed}: no {dt:?} row of {prefix}..{suffix} fails:\n{}",
                    of_dt.iter().map(|c| show(c)).collect::<Vec<_>>().join("\n")
                );
                if let Some(w) = of_dt.iter().max_by(|a, b| a.ratio.total_cmp(&b.ratio)) {
                    println!("{switch}: worst {}", show(w));
                }
            }
            // the other kernels' rows are untouched
            let bystander_fails: Vec<String> =
                all.iter().filter(|c| !c.pass && !(c.kernel.starts_with(prefix))).map(show).collect();
            let allowed = |s: &String| {
                // a perturbed forward feeds the backward and its own rows (rope's bwd launch is the same kernel)
                switch == "rope" || s.starts_with("attention")
            };
            assert!(bystander_fails.iter().all(allowed), "{switch}, seed {seed}: other rows fail: {bystander_fails:?}");
        }
        std::env::remove_var(harpe::ops::emu::perturb::VAR);
    }
}
