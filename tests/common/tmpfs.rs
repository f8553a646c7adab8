//! A size-limited tmpfs the test mounts itself (root only), unmounted when the guard drops, also when
//! the test panics. Without root the test is skipped with a message; under CI (`HARPE_CI` or `CI` set,
//! .ci/run sets `HARPE_CI=1`) a mount that fails is a failure, so the full-disk tests cannot go quietly
//! untested there.
use std::path::{Path, PathBuf};
use std::process::Command;

pub struct Tmpfs {
    dir: PathBuf,
    _parent: tempfile::TempDir,
}

fn under_ci() -> bool {
    ["HARPE_CI", "CI"].iter().any(|k| std::env::var(k).is_ok_and(|v| !v.is_empty() && v != "0" && v != "false"))
}

impl Tmpfs {
    /// A tmpfs of `bytes` bytes, or `None` (after printing why) when this process may not mount and
    /// the test does not run under CI.
    pub fn mount(bytes: u64, test: &str) -> Option<Tmpfs> {
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("fs");
        std::fs::create_dir(&dir).unwrap();
        let o = Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"]).arg(&dir).output();
        match o {
            Ok(o) if o.status.success() => Some(Tmpfs { dir, _parent: parent }),
            other => {
                let why = match other {
                    Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
                    Err(e) => e.to_string(),
                };
                assert!(!under_ci(), "{test}: cannot mount a tmpfs under CI ({why}); CI runs as root");
                eprintln!("SKIPPED {test}: cannot mount a tmpfs ({why}); run as root to test a full disk");
                None
            }
        }
    }

    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Change its size (a shrink below what it holds fails).
    pub fn resize(&self, bytes: u64) {
        let o = Command::new("mount")
            .args(["-o", &format!("remount,size={bytes}"), "tmpfs"])
            .arg(&self.dir)
            .output()
            .unwrap();
        assert!(o.status.success(), "remount: {}", String::from_utf8_lossy(&o.stderr));
    }

    /// Bytes in use.
    #[allow(dead_code)] // the data stage's test does not ask
    pub fn used(&self) -> u64 {
        let o = Command::new("df").args(["-B1", "--output=used"]).arg(&self.dir).output().unwrap();
        String::from_utf8_lossy(&o.stdout).lines().nth(1).unwrap().trim().parse().unwrap()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // lazy: a file a failed test left open must not keep the mount (and its temp dir) alive
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}
