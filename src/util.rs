//! Small shared helpers: atomic file writes, sha256, human-readable sizes.
use anyhow::{Context, Result};
use std::io::Write;
use std::path::Path;

/// Write `bytes` to `path` atomically: temporary file in the same directory, fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    {
        let mut f = std::fs::File::create(&tmp).with_context(|| {
            format!("cannot create {}\nhint: check that the directory exists and is writable", tmp.display())
        })?;
        f.write_all(bytes).with_context(|| format!("writing {} failed\nhint: is the disk full?", tmp.display()))?;
        f.sync_all().with_context(|| format!("fsync {} failed", tmp.display()))?;
    }
    std::fs::rename(&tmp, path).with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
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
