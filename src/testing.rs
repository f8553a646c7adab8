//! The test hooks of the multi-rank and long-running paths, read from the environment once per process
//! into one `Hooks` value: the code under test asks `hooks()` and never reads a variable itself.
//!
//! Each hook makes a failure or a delay happen at a chosen rank and step, so the tests of the agreed
//! stop, the failure watchdog and the long collectives are deterministic; none is set in normal use.
//! The non-obvious decision: a hook that is set but malformed is an error at the start of
//! `harpe train` (`Hooks::check`), not a hook silently off — a test that thinks it injected a fault
//! and did not would pass for the wrong reason.
//! Not here: the emulated kernels' perturbation switch (`ops::emu::perturb`), which in-process tests
//! change between selftest runs and so is read per launch.
use anyhow::{bail, Result};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

/// `HARPE_TEST_LATE_SIGNAL=RANK:STEP`: raise the stop flag on rank RANK right after (1-based) step
/// STEP's stop agreement, as a signal landing between the agreement and the loop's check would.
pub const LATE_SIGNAL: &str = "HARPE_TEST_LATE_SIGNAL";
/// `HARPE_FAULT=RANK:STEP:error|panic`: rank RANK fails after a micro-batch of (0-based) step STEP.
pub const FAULT: &str = "HARPE_FAULT";
/// `HARPE_TEST_SLOW_COMMIT=SECONDS`: rank 0's checkpoint commit sleeps SECONDS first.
pub const SLOW_COMMIT: &str = "HARPE_TEST_SLOW_COMMIT";
/// `HARPE_TEST_CHECKPOINT_VIEW=RANK:DIR`: rank RANK sees DIR as the run's checkpoints directory (a
/// stale or node-local file system, in one process of thread ranks).
pub const CHECKPOINT_VIEW: &str = "HARPE_TEST_CHECKPOINT_VIEW";
/// `HARPE_TEST_SLOW_EVAL=SECONDS`: each scored evaluation item sleeps SECONDS.
pub const SLOW_EVAL: &str = "HARPE_TEST_SLOW_EVAL";
/// `HARPE_TEST_SLOW_BENCH_ROW=SECONDS`: `harpe bench model` sleeps SECONDS after each row it prints (a
/// benchmark that scripts/gpu-check.sh's step limit stops half-way).
pub const SLOW_BENCH_ROW: &str = "HARPE_TEST_SLOW_BENCH_ROW";
/// `HARPE_TEST_CUDA_DRIVER=12020`: the CUDA driver's version as `floors` sees it (an old cluster's driver).
pub const FAKE_CUDA_DRIVER: &str = "HARPE_TEST_CUDA_DRIVER";
/// `HARPE_TEST_CUDA_BUILD=13000`: the CUDA release `floors` takes this binary to be built for (lets a CPU
/// build rehearse the driver check where a CUDA run makes it).
pub const FAKE_CUDA_BUILD: &str = "HARPE_TEST_CUDA_BUILD";
/// `HARPE_TEST_GLIBC=2.28`: the glibc version as `floors` sees it.
pub const FAKE_GLIBC: &str = "HARPE_TEST_GLIBC";
/// `HARPE_SELFTEST_SMALL` (any value): `harpe selftest` skips its T = 4096 + 37 attention cases, which
/// take minutes under compute-sanitizer (scripts/gpu-check.sh sets it there).
pub const SELFTEST_SMALL: &str = "HARPE_SELFTEST_SMALL";

/// An injected failure (`HARPE_FAULT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub rank: usize,
    pub step: u64,
    /// panic instead of returning an error
    pub panic: bool,
}

/// Every test hook of this process (all off in normal use).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Hooks {
    pub late_signal: Option<(usize, u64)>,
    pub fault: Option<Fault>,
    pub slow_commit: Option<Duration>,
    pub checkpoint_view: Option<(usize, PathBuf)>,
    pub slow_eval: Option<Duration>,
    pub slow_bench_row: Option<Duration>,
    pub fake_cuda_driver: Option<u32>,
    pub fake_cuda_build: Option<u32>,
    pub fake_glibc: Option<(u32, u32)>,
    pub selftest_small: bool,
    /// the first malformed hook variable: `check` reports it
    pub error: Option<String>,
}

impl Hooks {
    /// The hooks `get(name)` gives (the environment, or a table in tests).
    pub fn from(get: impl Fn(&str) -> Option<String>) -> Hooks {
        let mut h = Hooks::default();
        let mut bad = |name: &str, v: &str, want: &str| {
            h_error(&mut h.error, format!("{name}={v}: expected {want}\nhint: unset {name} (it is a test hook)"))
        };
        if let Some(v) = get(LATE_SIGNAL) {
            match v.split_once(':').map(|(r, s)| (r.parse(), s.parse())) {
                Some((Ok(r), Ok(s))) => h.late_signal = Some((r, s)),
                _ => bad(LATE_SIGNAL, &v, "RANK:STEP"),
            }
        }
        if let Some(v) = get(FAULT) {
            let p: Vec<&str> = v.split(':').collect();
            match (p.len(), p.first().map(|r| r.parse()), p.get(1).map(|s| s.parse()), p.get(2)) {
                (3, Some(Ok(rank)), Some(Ok(step)), Some(&k @ ("error" | "panic"))) => {
                    h.fault = Some(Fault { rank, step, panic: k == "panic" })
                }
                _ => bad(FAULT, &v, "RANK:STEP:error|panic"),
            }
        }
        let seconds = |name: &str, bad: &mut dyn FnMut(&str, &str, &str)| -> Option<Duration> {
            let v = get(name)?;
            match v.parse::<f64>() {
                Ok(s) if s >= 0.0 && s.is_finite() => Some(Duration::from_secs_f64(s)),
                _ => {
                    bad(name, &v, "SECONDS (a number >= 0)");
                    None
                }
            }
        };
        h.slow_commit = seconds(SLOW_COMMIT, &mut bad);
        h.slow_eval = seconds(SLOW_EVAL, &mut bad);
        h.slow_bench_row = seconds(SLOW_BENCH_ROW, &mut bad);
        for (name, slot) in [(FAKE_CUDA_DRIVER, &mut h.fake_cuda_driver), (FAKE_CUDA_BUILD, &mut h.fake_cuda_build)] {
            if let Some(v) = get(name) {
                match v.parse::<u32>() {
                    Ok(n) if n >= 1000 => *slot = Some(n),
                    _ => bad(name, &v, "a CUDA version as the driver writes it, e.g. 12040 for 12.4"),
                }
            }
        }
        if let Some(v) = get(FAKE_GLIBC) {
            match v.split_once('.').map(|(a, b)| (a.parse(), b.parse())) {
                Some((Ok(a), Ok(b))) => h.fake_glibc = Some((a, b)),
                _ => bad(FAKE_GLIBC, &v, "MAJOR.MINOR, e.g. 2.28"),
            }
        }
        h.selftest_small = get(SELFTEST_SMALL).is_some();
        if let Some(v) = get(CHECKPOINT_VIEW) {
            match v.split_once(':').map(|(r, d)| (r.parse(), d)) {
                Some((Ok(r), d)) if !d.is_empty() => h.checkpoint_view = Some((r, PathBuf::from(d))),
                _ => bad(CHECKPOINT_VIEW, &v, "RANK:DIR"),
            }
        }
        h
    }

    /// Fail on a malformed hook variable (called where `harpe train` and `harpe bench model` start).
    pub fn check(&self) -> Result<()> {
        match &self.error {
            Some(e) => bail!("{e}"),
            None => Ok(()),
        }
    }
}

fn h_error(slot: &mut Option<String>, e: String) {
    slot.get_or_insert(e);
}

/// This process's hooks, read from the environment on first use.
pub fn hooks() -> &'static Hooks {
    static HOOKS: OnceLock<Hooks> = OnceLock::new();
    HOOKS.get_or_init(|| Hooks::from(|k| std::env::var(k).ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(pairs: &[(&str, &str)]) -> Hooks {
        Hooks::from(|k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn hooks_parse_and_a_malformed_one_is_an_error() {
        assert_eq!(of(&[]), Hooks::default());
        let h = of(&[(FAULT, "2:3:panic"), (LATE_SIGNAL, "1:2"), (SLOW_EVAL, "0.5"), (CHECKPOINT_VIEW, "1:/x/y")]);
        assert_eq!(of(&[(SLOW_BENCH_ROW, "2")]).slow_bench_row, Some(Duration::from_secs(2)));
        assert!(of(&[(SELFTEST_SMALL, "1")]).selftest_small && !of(&[]).selftest_small);
        assert_eq!(h.fault, Some(Fault { rank: 2, step: 3, panic: true }));
        assert_eq!(h.late_signal, Some((1, 2)));
        assert_eq!(h.slow_eval, Some(Duration::from_millis(500)));
        assert_eq!(h.checkpoint_view, Some((1, PathBuf::from("/x/y"))));
        assert!(h.check().is_ok());
        let f = of(&[(FAKE_CUDA_DRIVER, "12020"), (FAKE_CUDA_BUILD, "13000"), (FAKE_GLIBC, "2.28")]);
        assert_eq!((f.fake_cuda_driver, f.fake_cuda_build, f.fake_glibc), (Some(12020), Some(13000), Some((2, 28))));
        for (k, v) in [
            (FAULT, "2:3:boom"),
            (FAULT, "2:3"),
            (LATE_SIGNAL, "x:2"),
            (SLOW_COMMIT, "-1"),
            (CHECKPOINT_VIEW, "1"),
            (FAKE_CUDA_DRIVER, "12.2"),
            (FAKE_GLIBC, "two"),
        ] {
            let e = of(&[(k, v)]).check().unwrap_err().to_string();
            assert!(e.contains(k) && e.contains("hint:"), "{k}={v}: {e}");
        }
    }
}
