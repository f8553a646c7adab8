//! scripts/gpu-check.sh, exercised here on CPU: its step plan fits the budget, `sizes` holds
//! bundles to 64 MiB, and its `rehearse` mode (the `run` code with the CPU device and the emulated
//! kernels) writes the report section by section, turns a broken kernel into a FAIL row and exit 1, and
//! keeps every row made before a slow torch or a benchmark stopped half-way by its limit.
//! The whole rehearsal runs in .ci/run; these tests run the preflight and selftest steps of it, with the
//! debug `harpe` this test build made.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu-check.sh")
}

fn gpu_check(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(script());
    c.args(args)
        .env_remove("HARPE_EMU_PERTURB")
        .env_remove("HARPE_GPU_CHECK_STEPS")
        .env_remove("HARPE_GPU_CHECK_BUDGET");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("scripts/gpu-check.sh runs")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// The one report file a rehearsal wrote into `dir`.
fn report(dir: &Path) -> String {
    let files: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "expected one report in {}: {files:?}", dir.display());
    std::fs::read_to_string(&files[0]).unwrap()
}

/// `gpu-check.sh ARGS` (a rehearsal) with the debug harpe, only the step ids `steps`, `extra` in the
/// environment and a fresh output folder: its exit status, output and the one report it wrote.
fn rehearse(args: &[&str], steps: &str, extra: &[(&str, &str)]) -> (Output, String) {
    let out = tempfile::tempdir().unwrap();
    let mut env = vec![
        ("HARPE_BIN", env!("CARGO_BIN_EXE_harpe")),
        ("HARPE_GPU_CHECK_OUT", out.path().to_str().unwrap()),
        ("HARPE_GPU_CHECK_STEPS", steps),
    ];
    env.extend_from_slice(extra);
    let o = gpu_check(args, &env);
    let r = report(out.path());
    (o, r)
}

#[test]
fn the_step_limits_of_each_half_fit_the_budget() {
    for half in [None, Some("--second"), Some("--flash"), Some("--multi")] {
        let args: Vec<&str> = std::iter::once("steps").chain(half).collect();
        let o = gpu_check(&args, &[]);
        let t = text(&o);
        assert!(o.status.success(), "{t}");
        let total: u64 = t
            .lines()
            .find_map(|l| l.strip_prefix("total of the step limits: "))
            .and_then(|l| l.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no total in:\n{t}"));
        assert!(total <= 420, "{half:?}: limits sum to {total} s > 420 s");
        // the first half leaves 15% of the budget for a preflight slower than planned
        if half.is_none() {
            assert!(100 * total <= 85 * 420, "the first half plans {total} s: less than 15% of 420 s left");
            assert!(t.contains(&format!("slack: {} s (", 420 - total)), "{t}");
        }
        assert!(t.starts_with("preflight"), "{half:?}: the preflight is not first:\n{t}");
        // a budget smaller than the plan is refused
        let o = gpu_check(&args, &[("HARPE_GPU_CHECK_BUDGET", "100")]);
        assert!(!o.status.success(), "{half:?}: a 100 s budget was accepted:\n{}", text(&o));
    }
}

#[test]
fn sizes_accepts_a_small_bundle_and_refuses_one_over_64_mib() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("harpe.xz"), vec![7u8; 1 << 20]).unwrap();
    let o = gpu_check(&["sizes", d.path().to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("bundle 1048576 bytes"), "{}", text(&o));
    // a sparse 64 MiB file: with the tracked tree the total is over the limit
    let f = std::fs::File::create(d.path().join("big")).unwrap();
    f.set_len(64 << 20).unwrap();
    let o = gpu_check(&["sizes", d.path().to_str().unwrap()], &[]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("over the 67108864-byte limit"), "{}", text(&o));
}

#[test]
fn rehearsal_reports_each_step_and_a_broken_kernel_fails_its_row_and_the_run() {
    // the preflight alone passes: exit 0, its sections and the summary in the report
    let (o, r) = rehearse(&["rehearse"], "preflight", &[]);
    assert!(o.status.success(), "{}\n{r}", text(&o));
    for section in [
        "## preflight: shared libraries (ldd)",
        "## preflight: harpe --version",
        "## preflight: devices harpe sees",
        "## Summary",
    ] {
        assert!(r.contains(section), "no {section:?} in:\n{r}");
    }
    assert!(r.contains("Run exit code: 0"), "{r}");
}

/// A first GPU machine at its worst, rehearsed: torch takes 20 s to (fail to) import, a kernel is wrong, and
/// a benchmark hangs after its first row. Every preflight row, every selftest row and the benchmark row
/// measured before the hang are in the report, and the run exits 1 naming both failures.
#[test]
fn a_slow_torch_a_wrong_kernel_and_a_benchmark_cut_half_way_still_leave_every_row() {
    // a torch package whose import sleeps 20 s and then fails, found first on PYTHONPATH
    let fake = tempfile::tempdir().unwrap();
    std::fs::create_dir(fake.path().join("torch")).unwrap();
    std::fs::write(
        fake.path().join("torch/__init__.py"),
        "import time\ntime.sleep(20)\nraise ImportError('a slow, broken torch (the test stand-in)')\n",
    )
    .unwrap();
    let t0 = std::time::Instant::now();
    let (o, r) = rehearse(
        &["rehearse"],
        "preflight,selftest,attention",
        &[
            ("PYTHONPATH", fake.path().to_str().unwrap()),
            ("HARPE_EMU_PERTURB", "rms_norm_fwd"),
            // the benchmark stand-in prints its first row, then hangs past its (shortened) limit
            ("HARPE_TEST_SLOW_BENCH_ROW", "120"),
            ("HARPE_GPU_CHECK_LIMIT_attention", "10"),
        ],
    );
    let all = text(&o);
    assert_eq!(o.status.code(), Some(1), "{all}\n{r}");
    assert!(t0.elapsed().as_secs() >= 20, "the torch row did not wait for torch");
    // every preflight row, the slow torch one an information row that passed with its note
    for section in [
        "## preflight: host (rehearsal)",
        "## preflight: shared libraries (ldd)",
        "## preflight: harpe --version",
        "## preflight: devices harpe sees",
        "## preflight: torch and its SDPA backends",
    ] {
        assert!(r.contains(section), "no {section:?} in:\n{r}");
    }
    assert!(r.contains("torch does not import (ImportError: a slow, broken torch"), "{r}");
    assert!(r.contains("| preflight | preflight: torch and its SDPA backends (information) | PASS | 0 |"), "{r}");
    // every selftest row: RMSNorm's forward rows FAIL, the others PASS
    let rows: Vec<&str> = r.lines().filter(|l| l.starts_with("rms_norm fwd")).collect();
    assert!(
        !rows.is_empty() && rows.iter().all(|l| l.trim_end().ends_with("FAIL")),
        "rms_norm fwd rows:\n{rows:?}\n{r}"
    );
    assert!(r.lines().any(|l| l.starts_with("rope fwd") && l.trim_end().ends_with("PASS")), "{r}");
    assert!(r.contains("| selftest | selftest (emulated kernels, 1 round) | FAIL | 1 |"), "{r}");
    // the benchmark: its first row is in, the second (measured after the hang) is not; it timed out
    assert!(r.lines().any(|l| l.starts_with("decoder layer fwd+bwd")), "{r}");
    assert!(!r.lines().any(|l| l.starts_with("train step")), "{r}");
    assert!(r.contains("(limit 10 s): **TIMEOUT**"), "{r}");
    // the failures named, in the report and on stderr
    assert!(
        r.contains("Failed: selftest (emulated kernels, 1 round) (FAIL); bench attention at T = 8192,32768"),
        "{r}"
    );
    assert!(all.contains("gpu-check: failed: selftest (emulated kernels, 1 round) (FAIL)"), "{all}");
    assert!(all.contains("(rehearsal: CPU decoder layer and step) (TIMEOUT)"), "{all}");
    assert!(r.contains("Run exit code: 1"), "{r}");
}

#[test]
fn flash_half_rehearsal_compares_two_eval_ppl_runs_of_one_model() {
    // `run --flash` (the flash-attn bundle): a head-dim-64 tiny model trained 20 steps, eval-ppl through two
    // attentions, their NLLs compared; in a rehearsal both are harpe's on the CPU, so they agree exactly
    let (o, r) = rehearse(&["rehearse", "--flash"], "flash-ppl", &[]);
    assert!(o.status.success(), "{}\n{r}", text(&o));
    for section in [
        "## tiny config at head dim 64 on the GPU (20 f32 steps)",
        "## eval-ppl bf16, reference: --attention harpe",
        "## eval-ppl bf16, candidate: --attention harpe",
        "## eval-ppl: candle-flash-attn vs harpe's attention (1e-2 relative)",
    ] {
        assert!(r.contains(section), "no {section:?} in:\n{r}");
    }
    let cmp = r.lines().find(|l| l.starts_with("reference nll")).unwrap_or_else(|| panic!("no comparison in:\n{r}"));
    assert!(cmp.contains("(8160 tokens,") && cmp.contains("relative difference 0.00e+00"), "{cmp}");
    assert!(r.contains("Run exit code: 0"), "{r}");
    // an unknown option is refused with the options named
    let o = gpu_check(&["rehearse", "--third"], &[("HARPE_BIN", env!("CARGO_BIN_EXE_harpe"))]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("the options are --second, --flash and --multi"), "{}", text(&o));
}

#[test]
fn flash_half_rehearsal_compares_the_training_losses_of_two_attentions() {
    // `run --flash` trains the head-dim-64 tiny model in bf16 with --attention harpe and with --attention
    // flash2 and compares the losses; in a rehearsal both runs are harpe's on the CPU, so they agree exactly
    let (o, r) = rehearse(&["rehearse", "--flash"], "flash-train", &[]);
    assert!(o.status.success(), "{}\n{r}", text(&o));
    for section in [
        "## tiny config bf16 at head dim 64, --attention harpe (20 steps)",
        "## training losses: --attention harpe vs harpe (2e-2 relative)",
    ] {
        assert!(r.contains(section), "no {section:?} in:\n{r}");
    }
    assert!(r.contains("FlashAttention-2 is CUDA-only"), "{r}");
    assert!(r.contains("Run exit code: 0"), "{r}");
}

/// The 128K attention step's limit from 32K rows as `harpe bench attention` prints them: per shape one
/// untimed forward plus a warm-up and a timed call of each pass (and of candle-flash-attn's forward where
/// built), x16 (quadratic in T), +20 s setup, +30 %.
#[test]
fn the_128k_limit_comes_from_the_32k_rows_before_it() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("report.md");
    let rows = "fwd 8192 8 1.0\nfwd 32768 8 20.000\nbwd 32768 8 50.000\nfwd+bwd 32768 8 70.000\n\
                fwd 32768 32 20.000\nbwd 32768 32 50.000\nfwd+bwd 32768 32 70.000\n";
    std::fs::write(&f, format!("an earlier step's rows:\nfwd 32768 8 999.0\n{rows}")).unwrap();
    let o = gpu_check(&["_size_128k", f.to_str().unwrap(), "3"], &[]);
    // 2 shapes x 16 x (3 x 20 + 2 x 50 + 2 x 70) ms = 9.6 s; (9.6 + 20) x 1.3 = 38.48
    assert_eq!(text(&o).trim(), "38", "{}", text(&o));
    // a flash-attn build's fwd rows end with candle-flash-attn's forward (ms), two more calls per shape
    let full = "fwd 32768 8 20.000 150.0 48% - - 10.000\nbwd 32768 8 50.000\nfwd+bwd 32768 8 70.000\n";
    std::fs::write(&f, full).unwrap();
    let o = gpu_check(&["_size_128k", f.to_str().unwrap(), "1"], &[]);
    // 16 x (60 + 100 + 140 + 20) ms = 5.12 s; (5.12 + 20) x 1.3 = 32.66
    assert_eq!(text(&o).trim(), "33", "{}", text(&o));
    // FlashAttention-2's own rows: a warm-up and a timed call of fa2-fwd and of fa2-fwd+bwd (fa2-bwd is their
    // difference, not a call of its own)
    let fa2 = format!("{full}fa2-fwd 32768 8 50.000\nfa2-bwd 32768 8 100.000\nfa2-fwd+bwd 32768 8 150.000\n");
    std::fs::write(&f, fa2).unwrap();
    let o = gpu_check(&["_size_128k", f.to_str().unwrap(), "1"], &[]);
    // 16 x (60 + 100 + 140 + 20 + 100 + 300) ms = 11.52 s; (11.52 + 20) x 1.3 = 40.98
    assert_eq!(text(&o).trim(), "41", "{}", text(&o));
    // no 32K rows: nothing (the step is skipped with a note)
    std::fs::write(&f, "fwd 8192 8 1.0\n").unwrap();
    let o = gpu_check(&["_size_128k", f.to_str().unwrap(), "1"], &[]);
    assert!(o.status.success() && text(&o).trim().is_empty(), "{}", text(&o));
}

/// `run --multi` on a machine without several GPUs reports every row it cannot run as NEEDS 2+ GPUS (in the
/// report and its summary), never leaving one out, and does not fail the run for it. The machine here has no
/// nvidia-smi, so it counts 0 GPUs: the `run` code path (not the rehearsal's Gloo stand-in) is what runs.
#[test]
fn the_multi_gpu_rows_say_they_need_more_gpus_on_one_device() {
    let out = tempfile::tempdir().unwrap();
    let bundle = tempfile::tempdir().unwrap();
    let o = gpu_check(
        &["run", "--multi"],
        &[
            ("HARPE_BIN", env!("CARGO_BIN_EXE_harpe")),
            ("HARPE_GPU_CHECK_OUT", out.path().to_str().unwrap()),
            ("HARPE_GPU_BUNDLE", bundle.path().to_str().unwrap()),
            ("HARPE_GPU_CHECK_STEPS", "multi,multi-128k"),
        ],
    );
    let r = report(out.path());
    assert!(o.status.success(), "{}\n{r}", text(&o));
    assert_eq!(r.matches("| NEEDS 2+ GPUS |").count(), 5, "{r}");
    assert!(
        r.contains("128K recipe's layout (ZeRO-3, SP 2), 2 steps on N GPUs") && r.contains("(sp2) vs 1 process"),
        "{r}"
    );
    assert!(r.contains("run --multi"), "{r}");
}
