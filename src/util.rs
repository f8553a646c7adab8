//! Small shared helpers: atomic file writes, append-only record files, sha256, human-readable and parsed sizes, one-writer directory
//! locks, the host's name and memory, the edit distance that names the nearest valid word.
use anyhow::{anyhow, bail, Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Write `bytes` to `path` atomically: temporary file in the same directory, fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |f| Ok(f.write_all(bytes)?))
}

/// The JSON file `path` as a `T`; a file that does not parse is named with `hint` (what to do about it).
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path, hint: &str) -> Result<T> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| anyhow!("{}: {e}\nhint: {hint}", path.display()))
}

/// A file that whole records are appended to, each flushed. A failed write (a full disk, a quota) does
/// not stop the writer's caller: it is reported once, the file is cut back to its last whole record, and
/// nothing more is written to it (train/metrics.rs says why a training log may fail quietly).
pub struct AppendFile {
    file: std::fs::File,
    path: PathBuf,
    /// bytes of whole records written so far (a failed write is cut back to this)
    len: u64,
    /// a write failed: no more records
    failed: bool,
}

impl AppendFile {
    /// `file`, open for appending at `path`, which holds `len` bytes of whole records.
    pub fn new(file: std::fs::File, path: PathBuf, len: u64) -> AppendFile {
        AppendFile { file, path, len, failed: false }
    }

    /// Append `rec` and flush it; a failure is reported as "writing PATH failed (ERROR); `then`".
    pub fn append(&mut self, rec: &[u8], then: &str) {
        if self.failed {
            return;
        }
        match self.file.write_all(rec).and_then(|_| self.file.flush()) {
            Ok(()) => self.len += rec.len() as u64,
            Err(e) => {
                self.failed = true;
                let _ = self.file.set_len(self.len);
                eprintln!("warning: writing {} failed ({e}); {then}", self.path.display());
            }
        }
    }

    /// Whether a write failed (nothing more is written).
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Write `path` atomically through `write` (given the temporary file): fsync, then rename; on an
/// error the temporary file is removed and `path` is left as it was.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&mut std::fs::File) -> Result<()>) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let res = (|| -> Result<()> {
        let mut f = std::fs::File::create(&tmp).with_context(|| {
            format!("cannot create {}\nhint: check that the directory exists and is writable", tmp.display())
        })?;
        write(&mut f).with_context(|| format!("writing {} failed\nhint: is the disk full?", tmp.display()))?;
        f.sync_all().with_context(|| format!("fsync {} failed", tmp.display()))
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

/// The paths in `dir` that `keep` accepts, in name order; a directory that cannot be listed is reported
/// with `hint` (a `hint: ...` line).
pub fn sorted_entries(dir: &Path, hint: &str, keep: impl Fn(&Path) -> bool) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}\n{hint}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| keep(p))
        .collect();
    v.sort();
    Ok(v)
}

/// Remove the temporary files `write_atomic` leaves in `dir` when its process is killed mid-write
/// (`.NAME.tmp.PID`). Only for a directory this process holds the lock of (`lock_dir`): no other writer
/// can own one of them.
pub fn remove_stale_temps(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let p = entry?.path();
        let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        let pid = name.rsplit_once(".tmp.").map(|(_, pid)| pid).unwrap_or("");
        if name.starts_with('.') && !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()) && p.is_file() {
            std::fs::remove_file(&p).with_context(|| format!("cannot remove the stale {}", p.display()))?;
        }
    }
    Ok(())
}

/// Hex sha256 of a byte slice.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

/// Hex sha256 of a file's contents.
pub fn sha256_file(path: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let mut f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(hex::encode(h.finalize()))
}

/// "1.23 GiB" style formatting of a byte count.
pub fn human_bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}

/// "6.00B" / "2.00M" / "512" style counts.
pub fn human_count(n: u64) -> String {
    let v = n as f64;
    match n {
        _ if n >= 1_000_000_000 => format!("{:.2}B", v / 1e9),
        _ if n >= 1_000_000 => format!("{:.2}M", v / 1e6),
        _ if n >= 10_000 => format!("{:.1}K", v / 1e3),
        _ => n.to_string(),
    }
}

/// Parse a memory size: `80GiB`, `80GB`, `81920MiB`, `141e9B`, or a bare number of GiB (the syntax of
/// `harpe plan --gpu-mem`, which its errors name).
pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "gib" | "g" => (1u64 << 30) as f64,
        "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => (1u64 << 20) as f64,
        "tib" => (1u64 << 40) as f64,
        u => bail!("--gpu-mem `{s}`: unknown unit `{u}`\nhint: write e.g. 80GiB, 80GB or 81920MiB"),
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| anyhow!("--gpu-mem `{s}`: `{}` is not a number\nhint: write e.g. 80GiB", num.trim()))?;
    if !(v.is_finite() && v > 0.0) {
        bail!("--gpu-mem `{s}` must be positive\nhint: write e.g. 80GiB");
    }
    Ok((v * mult) as u64)
}

/// Levenshtein distance of two words (insertions, deletions, substitutions), for naming the nearest valid
/// one in an error.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            cur.push((prev[j] + (ca != *cb) as usize).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// An exclusive advisory lock (`flock`) on `DIR/.lock`, held until dropped.
///
/// One writer per directory: `train` (run directory), `prepare-data --out`, `eval-niah --out` and
/// sweeps hold one for their whole life. The kernel releases an `flock` when its holder exits, however
/// it exits, so a lock left by a killed process never blocks; the file itself stays, holding the last
/// holder's pid, host, command and start time for the message a second process prints.
#[derive(Debug)]
pub struct DirLock {
    _file: std::fs::File,
    path: std::path::PathBuf,
}

impl DirLock {
    /// The lock file (`DIR/.lock`).
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// This machine's host name (`/proc/sys/kernel/hostname`, else `$HOSTNAME`, else "unknown-host").
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "unknown-host".to_string())
}

/// This machine's total memory (`MemTotal` of `/proc/meminfo`); None where it cannot be read.
pub fn host_memory_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

/// Take the lock on `dir` (created if missing) for `command` (e.g. "harpe train"), or fail at once,
/// naming the holder, when another process holds it.
pub fn lock_dir(dir: &Path, command: &str) -> Result<DirLock> {
    use std::fs::TryLockError;
    use std::io::{Read, Seek};
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create {}\nhint: choose a writable directory", dir.display()))?;
    let path = dir.join(".lock");
    let mut file =
        std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).with_context(
            || format!("cannot open lock file {}\nhint: check that {} is writable", path.display(), dir.display()),
        )?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let field = |k: &str| {
                holder
                    .lines()
                    .find_map(|l| l.strip_prefix(&format!("{k}=")))
                    .map(str::to_string)
                    .unwrap_or_else(|| "?".into())
            };
            bail!(
                "{} is in use: `{}` (pid {} on host {}, started at unix time {}) holds {}\nhint: only one process may write a \
                 directory at a time; wait for that process to finish or stop it (a killed process releases the \
                 lock at once), or choose another directory",
                dir.display(),
                field("command"),
                field("pid"),
                field("host"),
                field("started"),
                path.display()
            );
        }
        Err(TryLockError::Error(e)) => {
            return Err(e).with_context(|| {
                format!("cannot lock {}\nhint: the file system of {} must support flock", path.display(), dir.display())
            })
        }
    }
    let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let info = format!("pid={}\nhost={}\ncommand={command}\nstarted={started}\n", std::process::id(), host_name());
    file.set_len(0)
        .and_then(|_| file.rewind())
        .and_then(|_| file.write_all(info.as_bytes()))
        .and_then(|_| file.sync_all())
        .with_context(|| format!("cannot write {}\nhint: is the disk full?", path.display()))?;
    Ok(DirLock { _file: file, path })
}
