//! SIGKILL at 20 seeded random moments of `harpe prepare-data` (each in a run of its own): rerunning the
//! same command completes the dataset, byte for byte the one of the run that was never killed.
use crate::common::kill_at_random_moment;
use rand::SeedableRng;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

fn start(input: &Path, out: &Path) -> std::process::Child {
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/tokenizer.json");
    Command::new(env!("CARGO_BIN_EXE_harpe"))
        .args(["prepare-data", "--quiet", "--seq-len", "16", "--strategy", "original", "--shard-tokens", "65536"])
        .arg("--tokenizer")
        .arg(tok)
        .arg("--input")
        .arg(input)
        .arg("--out")
        .arg(out)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Every file of a finished dataset with its bytes.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file() && e.file_name() != ".lock")
        .map(|e| (e.file_name().to_string_lossy().to_string(), std::fs::read(e.path()).unwrap()))
        .collect();
    v.sort();
    v
}

#[test]
fn sigkill_at_random_moments_then_a_rerun_ends_bit_identical() {
    let d = tempfile::tempdir().unwrap();
    let input = d.path().join("in.txt");
    let text: String =
        (0..60000).map(|i| format!("the state {i} was one of the first and the most new state .\n\n")).collect();
    std::fs::write(&input, text).unwrap();
    let reference = d.path().join("reference");
    assert!(start(&input, &reference).wait().unwrap().success());
    // the time of a run with warm caches (the first one reads the input from the disk)
    let t0 = Instant::now();
    assert!(start(&input, &d.path().join("timed")).wait().unwrap().success());
    let full = t0.elapsed();
    let want = files(&reference);
    assert!(
        want.iter().filter(|f| f.0.starts_with("shard_")).count() >= 4,
        "{:?}",
        want.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(47);
    let mut kills = 0;
    for k in 0..40 {
        if kills == 20 {
            break;
        }
        let out = d.path().join(format!("killed-{k}"));
        let (killed, at) = kill_at_random_moment(&mut start(&input, &out), &mut rng, 0.02..0.8, full);
        kills += usize::from(killed);
        assert!(start(&input, &out).wait().unwrap().success(), "the rerun after kill {k} failed");
        let got = files(&out);
        assert_eq!(got.iter().map(|f| &f.0).collect::<Vec<_>>(), want.iter().map(|f| &f.0).collect::<Vec<_>>());
        for ((n, a), (_, b)) in got.iter().zip(&want) {
            assert!(a == b, "after kill {k} at {at:?}: {n} differs from the uninterrupted run's");
        }
        std::fs::remove_dir_all(&out).unwrap();
    }
    assert_eq!(kills, 20, "{kills} kills");
    eprintln!("20 kills within the {full:?} of an uninterrupted run");
}
