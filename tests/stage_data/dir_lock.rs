//! One writer per directory, with real processes: while one process holds `DIR/.lock`, `harpe train`,
//! `prepare-data` and `eval-niah` on DIR exit 1 naming the holder's pid and host; once the holder is
//! killed (SIGKILL, no cleanup) the directory is free again.
use crate::common::harpe_cmd;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

const HOLD_ENV: &str = "HARPE_TEST_HOLD_LOCK";

/// Not a test on its own: the holder process `holds_the_lock_of_another_process` starts (it re-runs
/// this test binary with `--ignored --exact dir_lock::lock_holder`). Takes the lock, says so, then sleeps.
#[test]
#[ignore = "helper process of dir_lock tests"]
fn lock_holder() {
    let dir = std::env::var(HOLD_ENV).expect("run by holds_the_lock_of_another_process");
    let _lock = harpe::util::lock_dir(Path::new(&dir), "lock test holder").unwrap();
    println!("LOCKED {}", std::process::id());
    std::thread::sleep(std::time::Duration::from_secs(60));
}

// The child is handed to the caller, which kills and waits for it; the lint cannot see that.
#[allow(clippy::zombie_processes)]
fn spawn_holder(dir: &Path) -> (Child, u32) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "dir_lock::lock_holder", "--nocapture", "--test-threads", "1"])
        .env(HOLD_ENV, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            let status = child.wait().unwrap();
            panic!("holder exited ({status}) before taking the lock");
        }
        // libtest may print "test lock_holder ... " on the same line first.
        if let Some(i) = line.find("LOCKED ") {
            return (child, line[i + 7..].trim().parse().unwrap());
        }
    }
}

/// `harpe ARGS`: the exit code and stderr.
fn harpe_code(args: &[&str]) -> (Option<i32>, String) {
    let o = harpe_cmd().args(args).output().unwrap();
    (o.status.code(), String::from_utf8_lossy(&o.stderr).to_string())
}

#[test]
fn holds_the_lock_of_another_process() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let d = dir.to_str().unwrap();
    let (mut holder, pid) = spawn_holder(&dir);
    assert_ne!(pid, std::process::id());
    let host = harpe::util::host_name();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/tiny-cpu.toml");
    let missing = tmp.path().join("missing.jsonl");
    let m = missing.to_str().unwrap();
    for args in [
        vec!["train", "--config", config, "--out", d],
        vec!["prepare-data", "--input", m, "--tokenizer", m, "--out", d],
        vec!["eval-niah", "--prepare-only", "--tokenizer", m, "--out", d],
    ] {
        let (code, err) = harpe_code(&args);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains("is in use") && err.contains(&format!("pid {pid}")), "{args:?}: {err}");
        assert!(err.contains(&format!("host {host}")) && err.contains("lock test holder"), "{err}");
        assert!(err.contains("hint:"), "{err}");
    }
    // The same process-level refusal from the library, for sweeps.
    let e = harpe::util::lock_dir(&dir, "sweep").unwrap_err().to_string();
    assert!(e.contains(&format!("pid {pid}")), "{e}");

    // Killed without any cleanup: the kernel drops the lock with the process, the stale file stays.
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert!(dir.join(".lock").exists());
    let (code, err) = harpe_code(&["eval-niah", "--prepare-only", "--tokenizer", m, "--out", d]);
    assert_eq!(code, Some(1));
    assert!(!err.contains("is in use") && err.contains("missing.jsonl"), "got past the lock: {err}");
    let lock = harpe::util::lock_dir(&dir, "test").unwrap();
    let info = std::fs::read_to_string(lock.path()).unwrap();
    assert!(info.contains(&format!("pid={}\n", std::process::id())) && info.contains("command=test\n"), "{info}");
}
