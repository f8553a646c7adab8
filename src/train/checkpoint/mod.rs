//! Checkpoints: `RUN/checkpoints/step_000500/` with HF-layout weights, one optimizer shard per rank
//! (fp32 master, m, v), `state.json`, and a `DONE` marker; written atomically, newest complete one wins.
//!
//! Reference: llm.c `train_gpt2.cu` (DONE
//! marker, bit-exact resume).
//! The non-obvious decisions: the commit protocol is the N-rank one, and one rank is its special case:
//! rank 0 clears and creates ONE temp dir per step, `checkpoints/.tmp-step_N/` (a name every rank
//! derives, not a per-process one); barrier; every rank writes and fsyncs its own
//! `optim-RRRRR-of-WWWWW.safetensors` into it; a barrier that also agrees on success; rank 0 alone
//! writes the HF model, `state.json` and `DONE` (last), fsyncs and renames the directory to `step_N`
//! (atomic on one file system); a final barrier. The parts one rank does alone while the others wait
//! (every rank's shard write, rank 0's commit) are not waited for inside one collective bounded by
//! `dist.timeout_s`: the ranks meet every second in a small collective until every rank's part is done
//! (`agree_within`), each part bounded by its own limit sized by its bytes (`wait_bound`: 120 s plus the
//! bytes at a conservative 25 MiB/s, never less than `dist.timeout_s`), so a large model's commit on a
//! slow disk cannot time the group out and a hung disk still ends the save with an error. A crash or a
//! full disk at any point leaves the previous checkpoints as they were and never a `step_N` without `DONE`; a failure on any rank fails the save on
//! every rank. Old checkpoints are pruned only after the new one is complete. Resume reads the fp32
//! master weights from the optimizer shard (not the possibly-bf16 HF weights), which is what makes it
//! bit-identical. The shard file format is unchanged from format 1. Resume re-shards: every rank reads
//! the shards of whatever world size wrote the checkpoint and takes its own flat range (a slice
//! computation), so a 4-rank checkpoint continues on 2 ranks or 1 exactly; a rank reads only the
//! bytes of its own range, with positional reads (`OptimShard`), and the resumed optimizer is built
//! from them directly (`read_optim_range`, no initial weights: train/session.rs). A shard is streamed
//! to its file in 32 MiB pieces copied from the (device) buffers one at a time
//! (`model::weights::write_safetensors`), so a save never holds a whole shard in host memory.
//! Reading the shards back is `checkpoint/read.rs`.
//! What this file does not do: decide when to save (train/training_loop.rs) or write the weights' bytes
//! (`model::weights::save_model_dir`, passed in as a closure).
use crate::checksum::{Checksums, FileSum};
use crate::comms::{Comm, Mesh};
use crate::flatbuf::FlatBuf;
use crate::model::rope::RopeScheme;
use crate::model::weights::{write_safetensors_summed, StreamSrc, WrittenFiles, STREAM_CHUNK_BYTES};
use crate::optim::adamw::AdamW;
use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub mod consolidate;
mod read;
pub use read::{load_optim, read_optim_range, read_optim_shard, read_optim_shards, stitch_optim, OptimShard, Stitched};

/// Version of `state.json` and the optimizer shard layout.
pub const FORMAT: u32 = 1;
/// Name of the completion marker.
pub const DONE: &str = "DONE";
/// Name of the checksum manifest: every other file's length and block CRC32Cs, written before `DONE`.
pub const CHECKSUMS: &str = "checksums.json";
/// Suffix of a rank's checksum file beside its optimizer shard in the temp dir, merged into `CHECKSUMS` by
/// rank 0's commit (the ranks may be processes, so the sums travel through the shared directory).
const SUMS_SUFFIX: &str = ".sums.json";

/// Everything besides tensors that resuming needs (`state.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    pub format: u32,
    /// optimizer steps completed in total
    pub step: u64,
    /// stage the next step belongs to
    pub stage: usize,
    /// steps completed inside that stage
    pub stage_step: u64,
    /// training tokens consumed so far
    pub tokens_seen: u64,
    /// the data loader's cursor inside the current stage (its own JSON form)
    pub data_cursor: serde_json::Value,
    /// the run's seed; after initialization the only randomness is the data order, held by the cursor
    pub seed: u64,
    /// the config hash without `[dist]` (`RunConfig::hash`, via `session::results_hash`)
    pub config_hash: String,
    /// RoPE scheme the weights were trained with at this point
    pub rope: RopeScheme,
    /// steps skipped for a NaN/inf loss or gradient so far
    pub skipped_steps: u64,
}

impl TrainState {
    /// The state of a run before its first step.
    pub fn new(seed: u64, config_hash: &str, rope: RopeScheme) -> TrainState {
        TrainState {
            format: FORMAT,
            step: 0,
            stage: 0,
            stage_step: 0,
            tokens_seen: 0,
            data_cursor: serde_json::Value::Null,
            seed,
            config_hash: config_hash.to_string(),
            rope,
            skipped_steps: 0,
        }
    }
}

/// Directory name of the checkpoint after `step` steps.
pub fn step_dir_name(step: u64) -> String {
    format!("step_{step:06}")
}

/// File name of a rank's optimizer shard (global rank of the mesh).
pub fn optim_file(mesh: &Mesh) -> String {
    format!("optim-{:05}-of-{:05}.safetensors", mesh.rank(), mesh.world())
}

fn fsync_path(p: &Path) -> Result<()> {
    std::fs::File::open(p)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("fsync {} failed\nhint: is the disk full or the file system read-only?", p.display()))
}

fn write_file(p: &Path, bytes: &[u8]) -> Result<FileSum> {
    let mut f = std::fs::File::create(p)
        .with_context(|| format!("cannot create {}\nhint: check that the run directory is writable", p.display()))?;
    f.write_all(bytes).with_context(|| format!("writing {} failed\nhint: is the disk full?", p.display()))?;
    f.sync_all().with_context(|| format!("fsync {} failed\nhint: is the disk full?", p.display()))?;
    Ok(FileSum::of_bytes(bytes))
}

/// Write this rank's optimizer state (master, m, v and the step count / range in the metadata) as
/// `path`, streamed from its buffers in pieces of `chunk_bytes` (`write_safetensors`); returns the
/// largest piece held on the host and the file's checksums.
pub fn write_optim_shard(path: &Path, o: &AdamW, chunk_bytes: usize) -> Result<(usize, FileSum)> {
    write_optim_file(path, o.master(), o.m(), o.v(), o.t(), o.range(), chunk_bytes)
}

/// The optimizer shard file for `range` of the flat space (format 1: f32 `master`, `m`, `v`).
fn write_optim_file(
    path: &Path,
    master: &FlatBuf,
    m: &FlatBuf,
    v: &FlatBuf,
    t: u64,
    range: std::ops::Range<usize>,
    chunk_bytes: usize,
) -> Result<(usize, FileSum)> {
    let srcs = [("master", master), ("m", m), ("v", v)].map(|(k, b)| (k.to_string(), StreamSrc::Flat(b)));
    // one metadata entry holding a JSON object: a HashMap with several keys would serialize in a
    // random order and make identical states give different bytes
    let info = serde_json::json!({"format": FORMAT, "t": t, "range_start": range.start, "range_end": range.end});
    let meta: HashMap<String, String> = [("harpe_optim".to_string(), info.to_string())].into();
    write_safetensors_summed(path, &srcs, Some(meta), chunk_bytes)
        .with_context(|| format!("cannot write the optimizer state {}", path.display()))
}

/// The floor of a save part's wait bound: directory syncs and renames, a network file system's latency.
pub const WAIT_FLOOR_S: f64 = 120.0;
/// The disk bandwidth a save part's wait bound assumes (bytes/s): conservative for a shared network file
/// system under several writers; a local NVMe disk writes 50-100 times faster.
pub const WAIT_BYTES_PER_S: f64 = 25.0 * 1024.0 * 1024.0;

/// How long the ranks wait for a part of a save that writes `bytes`: `WAIT_FLOOR_S` plus the bytes at
/// `WAIT_BYTES_PER_S`, never less than `timeout` (`dist.timeout_s`). Llama-2-7B's bf16 model files
/// (13.5 GB) get 634 s.
pub fn wait_bound(bytes: u64, timeout: Duration) -> Duration {
    Duration::from_secs_f64(WAIT_FLOOR_S + bytes as f64 / WAIT_BYTES_PER_S).max(timeout)
}

/// What a save needs besides the state: how many checkpoints to keep, the group's collective timeout
/// (`dist.timeout_s`) and the bytes of the model files rank 0 writes (its commit's wait bound).
#[derive(Clone, Copy, Debug)]
pub struct SaveOpts {
    pub keep_last: usize,
    pub timeout: Duration,
    pub model_bytes: u64,
}

/// Save a checkpoint atomically on every rank (all ranks call it with the same `state`) and prune to
/// `opts.keep_last`; returns the final directory. `write_model` writes the HF-layout model files into
/// the directory it is given; only rank 0 calls it.
pub fn save(
    root: &Path,
    state: &TrainState,
    optim: &AdamW,
    comm: &Comm,
    opts: &SaveOpts,
    write_model: &(dyn Fn(&Path) -> Result<WrittenFiles> + Sync),
) -> Result<PathBuf> {
    let mesh = comm.mesh();
    let lead = mesh.rank() == 0;
    let name = step_dir_name(state.step);
    let tmp = root.join(format!(".tmp-{name}"));
    let fin = root.join(&name);
    // 1. rank 0 makes a fresh temp dir; everyone learns whether it exists
    let made = if lead { fresh_dir(root, &tmp) } else { Ok(()) };
    let mut res = agree(comm, made, "creating the checkpoint directory");
    // 2. every rank writes its optimizer shard into it; everyone learns whether all succeeded
    if res.is_ok() {
        let path = tmp.join(optim_file(&mesh));
        let wait = Wait { bound: wait_bound(12 * optim.range().len() as u64, opts.timeout), tick: tick(opts.timeout) };
        res = agree_within(comm, "writing the optimizer shards", wait, || {
            let (_, sum) = write_optim_shard(&path, optim, STREAM_CHUNK_BYTES)?;
            write_file(&sums_file(&path), serde_json::to_string(&sum)?.as_bytes()).map(|_| ())
        });
    }
    // 3. rank 0 writes the model and state, DONE last, and commits by renaming
    if res.is_ok() {
        let wait = Wait { bound: wait_bound(opts.model_bytes, opts.timeout), tick: tick(opts.timeout) };
        res = agree_within(comm, "committing", wait, || match lead {
            true => commit(root, &tmp, &fin, state, write_model),
            false => Ok(()),
        });
    }
    if let Err(e) = res {
        if lead {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        let prev = latest_complete(root).ok().flatten();
        let prev = prev
            .map(|p| format!("the previous checkpoint {} is intact", p.display()))
            .unwrap_or_else(|| "no earlier checkpoint exists".into());
        // what the save needed against what its file system has, for a full disk
        let need = opts.model_bytes + 12 * optim.range().len() as u64 * mesh.world() as u64;
        let free = free_bytes(root).map(|b| format!(", {} free on its file system now", crate::util::human_bytes(b)));
        return Err(e.context(format!(
            "saving checkpoint {} failed; {prev}; a checkpoint of this run needs about {}{}\nhint: free disk space or fix permissions, then rerun with --resume",
            fin.display(),
            crate::util::human_bytes(need),
            free.unwrap_or_default()
        )));
    }
    if lead {
        prune(root, opts.keep_last)?;
    }
    comm.barrier()?;
    Ok(fin)
}

/// Bytes available to this user on the file system of `p` (`statvfs`), if it can be asked.
fn free_bytes(p: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid out-parameter for the call's duration.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

/// Barrier on a step of the save: this rank's own error wins, else "another rank failed".
fn agree(comm: &Comm, mine: Result<()>, what: &str) -> Result<()> {
    let all = comm.all_ok(mine.is_ok())?;
    mine?;
    if !all {
        bail!("another rank failed while {what}");
    }
    Ok(())
}

/// The longest a rank of a save waits inside one collective of `agree_within`: a second, or a quarter of
/// `dist.timeout_s` if that is shorter.
fn tick(timeout: Duration) -> Duration {
    Duration::from_secs(1).min(timeout / 4)
}

/// How long `agree_within` waits for this rank's part (`bound`) and how often the ranks meet (`tick`).
#[derive(Clone, Copy, Debug)]
pub struct Wait {
    pub bound: Duration,
    pub tick: Duration,
}

/// Run `work` (this rank's part of a save step, on a thread of its own) and agree on its success with
/// every rank, like `agree`, but never inside one long collective: while any rank's part runs, the
/// ranks meet every `wait.tick` in an all-reduce of three counters (still working, failed, late), so a
/// long part on one rank (rank 0's commit of a large model) keeps no rank in a collective for
/// `dist.timeout_s`. A part that outlasts `wait.bound` is reported late and every rank fails, naming the
/// bound; that rank itself returns when its part does (a thread cannot be stopped), its peers at once.
pub fn agree_within<F>(comm: &Comm, what: &str, wait: Wait, work: F) -> Result<()>
where
    F: FnOnce() -> Result<()> + Send,
{
    if comm.mesh().world() == 1 {
        return work();
    }
    std::thread::scope(|s| {
        let mut handle = Some(s.spawn(work));
        let mut mine: Option<Result<()>> = None;
        let t0 = Instant::now();
        loop {
            let until = Instant::now() + wait.tick;
            while handle.as_ref().is_some_and(|h| !h.is_finished()) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5).min(until.saturating_duration_since(Instant::now())));
            }
            if let Some(h) = handle.take_if(|h| h.is_finished()) {
                let joined = h.join().unwrap_or_else(|p| {
                    let text =
                        p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
                    Err(anyhow!("panicked while {what}: {}", text.unwrap_or_default()))
                });
                mine = Some(joined);
            }
            let late = mine.is_none() && t0.elapsed() > wait.bound;
            let working = mine.is_none() && !late;
            let failed = mine.as_ref().is_some_and(|m| m.is_err());
            let mut c = [working, failed, late].map(|b| if b { 1.0 } else { 0.0 });
            comm.all_reduce_sum_f64(&mut c)?;
            if late {
                bail!(
                    "rank {} did not finish {what} within {:.1} s (the bound for its bytes: {WAIT_FLOOR_S:.0} s + the bytes at {:.0} MiB/s, at least dist.timeout_s)\nhint: the disk is hung or far slower than that; check the file system of the run directory",
                    comm.mesh().rank(),
                    wait.bound.as_secs_f64(),
                    WAIT_BYTES_PER_S / 1048576.0
                );
            }
            // done when no rank works any more, or at once when one is late (a part still running
            // here is joined when the scope ends)
            if c[0] == 0.0 || c[2] > 0.0 {
                if let Some(Err(e)) = mine {
                    return Err(e);
                }
                if c[1] > 0.0 || c[2] > 0.0 {
                    bail!("another rank failed or was late while {what}");
                }
                return Ok(());
            }
        }
    })
}

/// Remove a stale `tmp` (an interrupted save of the same step) and create it empty.
fn fresh_dir(root: &Path, tmp: &Path) -> Result<()> {
    std::fs::create_dir_all(root)
        .with_context(|| format!("cannot create {}\nhint: check that the run directory is writable", root.display()))?;
    if tmp.exists() {
        std::fs::remove_dir_all(tmp).with_context(|| format!("cannot remove stale {}", tmp.display()))?;
    }
    std::fs::create_dir_all(tmp).with_context(|| format!("cannot create {}\nhint: check permissions", tmp.display()))
}

/// The checksum file written beside optimizer shard `shard`.
fn sums_file(shard: &Path) -> PathBuf {
    let mut name = shard.file_name().unwrap_or_default().to_os_string();
    name.push(SUMS_SUFFIX);
    shard.with_file_name(name)
}

/// Rank 0's part: model files, `state.json`, the checksums of every file (`CHECKSUMS`, merging the
/// ranks' shard sums), fsync everything, `DONE`, rename `tmp` to `fin`.
fn commit(
    root: &Path,
    tmp: &Path,
    fin: &Path,
    state: &TrainState,
    write_model: &dyn Fn(&Path) -> Result<WrittenFiles>,
) -> Result<()> {
    slow_commit_hook();
    let mut sums = Checksums::new();
    sums.files.extend(write_model(tmp)?);
    let st = write_file(&tmp.join("state.json"), serde_json::to_string_pretty(state)?.as_bytes())?;
    sums.files.insert("state.json".into(), st);
    merge_shard_sums(tmp, &mut sums)?;
    write_file(&tmp.join(CHECKSUMS), serde_json::to_string(&sums)?.as_bytes())?;
    for entry in std::fs::read_dir(tmp)? {
        fsync_path(&entry?.path())?;
    }
    write_file(&tmp.join(DONE), format!("step {}\n", state.step).as_bytes())?;
    fsync_path(tmp)?;
    if fin.exists() {
        // a complete checkpoint of the same step (re-saved after a resume) or a leftover: replace it
        let name = fin.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        let old = root.join(format!(".old-{name}"));
        if old.exists() {
            std::fs::remove_dir_all(&old).with_context(|| format!("cannot remove stale {}", old.display()))?;
        }
        std::fs::rename(fin, &old).with_context(|| format!("cannot move aside {}", fin.display()))?;
        std::fs::rename(tmp, fin).with_context(|| format!("cannot rename {} to {}", tmp.display(), fin.display()))?;
        std::fs::remove_dir_all(&old).with_context(|| format!("cannot remove {}", old.display()))?;
    } else {
        std::fs::rename(tmp, fin).with_context(|| format!("cannot rename {} to {}", tmp.display(), fin.display()))?;
    }
    fsync_path(root)
}

/// Move every rank's shard checksums (`SUMS_SUFFIX` files) into `sums`, removing the files.
fn merge_shard_sums(tmp: &Path, sums: &mut Checksums) -> Result<()> {
    for entry in std::fs::read_dir(tmp).with_context(|| format!("cannot list {}", tmp.display()))? {
        let p = entry?.path();
        let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        if let Some(shard) = name.strip_suffix(SUMS_SUFFIX) {
            let text = std::fs::read(&p).with_context(|| format!("cannot read {}", p.display()))?;
            let sum: FileSum = serde_json::from_slice(&text).with_context(|| {
                format!("{}: not a checksum file\nhint: a rank's write was damaged; save again", p.display())
            })?;
            sums.files.insert(shard.to_string(), sum);
            std::fs::remove_file(&p).with_context(|| format!("cannot remove {}", p.display()))?;
        }
    }
    Ok(())
}

/// The checksums of checkpoint `dir` (`CHECKSUMS`), or `None` for a checkpoint written before harpe
/// recorded them (it still resumes, unverified).
pub fn load_checksums(dir: &Path) -> Result<Option<Checksums>> {
    let p = dir.join(CHECKSUMS);
    if !p.exists() {
        return Ok(None);
    }
    Checksums::load(&p, &damage_hint(dir)).map(Some)
}

/// The hint of an error about a damaged checkpoint `dir`: resume from the newest complete checkpoint
/// before it, when there is one.
pub fn damage_hint(dir: &Path) -> String {
    let step = load_state_unverified(dir).map(|s| s.step).ok();
    let earlier = dir.parent().and_then(|root| list_complete(root).ok()).and_then(|all| {
        all.into_iter().filter(|(s, p)| p != dir && step.is_none_or(|st| *s < st)).map(|(_, p)| p).next_back()
    });
    match earlier {
        Some(p) => format!(
            "the checkpoint is damaged; resume from the previous one with --resume-from {} (`harpe verify {}` lists every damaged block)",
            p.display(),
            dir.display()
        ),
        None => format!(
            "the checkpoint is damaged and no earlier complete one exists beside it; `harpe verify {}` lists every damaged block; restore it from a copy or train again into a new --out",
            dir.display()
        ),
    }
}

/// Check this rank's share of the files of checkpoint `dir` that no rank reads whole at resume (the
/// model files, config, tokenizer, state): their lengths, and every `world`-th block of them (a block
/// counter running over the files in name order) starting at `rank`, so the ranks share the reading.
/// Optimizer shards are checked by the blocks each rank reads (`read.rs`).
pub fn verify_share(dir: &Path, sums: &Checksums, rank: usize, world: usize) -> Result<()> {
    let hint = damage_hint(dir);
    let mut counter = 0usize;
    for (name, sum) in &sums.files {
        if name.starts_with("optim-") {
            continue;
        }
        let p = dir.join(name);
        let f = std::fs::File::open(&p).with_context(|| format!("cannot open {}\nhint: {hint}", p.display()))?;
        sum.check_len(&p, f.metadata()?.len(), &hint)?;
        let n = sum.crc32c.len();
        let mine = (0..n).filter(|b| (counter + b) % world.max(1) == rank);
        sum.verify_blocks(&p, &f, mine, &hint)?;
        counter += n;
    }
    Ok(())
}

/// Test hook of the long-commit test (`testing::SLOW_COMMIT`): rank 0's commit sleeps first, so it
/// outlasts `dist.timeout_s` deterministically.
fn slow_commit_hook() {
    if let Some(d) = crate::testing::hooks().slow_commit {
        std::thread::sleep(d);
    }
}

/// Complete checkpoints under `root`, oldest first, as (step, dir).
pub fn list_complete(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    if !root.exists() {
        return Ok(vec![]);
    }
    let mut out = vec![];
    for entry in std::fs::read_dir(root).with_context(|| format!("cannot list {}", root.display()))? {
        let p = entry?.path();
        let step = p
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("step_"))
            .and_then(|s| s.parse::<u64>().ok());
        if let Some(step) = step {
            if p.join(DONE).is_file() {
                out.push((step, p));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The newest complete checkpoint, if any.
pub fn latest_complete(root: &Path) -> Result<Option<PathBuf>> {
    Ok(list_complete(root)?.pop().map(|(_, p)| p))
}

/// Delete all but the newest `keep` complete checkpoints (at least one is always kept), and leftovers
/// of interrupted saves. Called by rank 0 between a commit and the final barrier of `save`, when no
/// other save is in flight.
pub fn prune(root: &Path, keep: usize) -> Result<()> {
    let all = list_complete(root)?;
    let n = all.len().saturating_sub(keep.max(1));
    for (_, p) in &all[..n] {
        std::fs::remove_dir_all(p).with_context(|| format!("cannot delete old checkpoint {}", p.display()))?;
    }
    for entry in std::fs::read_dir(root)? {
        let p = entry?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with(".tmp-") || name.starts_with(".old-") {
            let _ = std::fs::remove_dir_all(&p);
        }
    }
    Ok(())
}

/// Read `state.json` of a checkpoint, checked against its checksums when the checkpoint has them.
pub fn load_state(dir: &Path) -> Result<TrainState> {
    if let Some(sums) = load_checksums(dir)? {
        if let Some(sum) = sums.files.get("state.json") {
            sum.verify_file(&dir.join("state.json"), &damage_hint(dir))?;
        }
    }
    load_state_unverified(dir)
}

fn load_state_unverified(dir: &Path) -> Result<TrainState> {
    let p = dir.join("state.json");
    let text = std::fs::read_to_string(&p)
        .with_context(|| format!("cannot read {}\nhint: the checkpoint is incomplete", p.display()))?;
    let st: TrainState = serde_json::from_str(&text).map_err(|e| {
        anyhow!("{}: line {}: {e}\nhint: the file is damaged or from another harpe version", p.display(), e.line())
    })?;
    if st.format != FORMAT {
        bail!("{}: format {} is not supported (this harpe writes {FORMAT})\nhint: resume with the harpe version that wrote it", p.display(), st.format);
    }
    Ok(st)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comms::zero::{ShardMap, Split};
    use crate::model::layout::ParamLayout;
    use crate::optim::adamw::AdamWHyper;

    fn state(step: u64) -> TrainState {
        TrainState {
            format: FORMAT,
            step,
            stage: 0,
            stage_step: step,
            tokens_seen: step * 10,
            data_cursor: serde_json::json!({"pos": step}),
            seed: 1,
            config_hash: "abc".into(),
            rope: RopeScheme::Default { theta: 10000.0 },
            skipped_steps: 0,
        }
    }

    #[test]
    fn save_resume_prune_and_failed_save_keeps_previous() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("checkpoints");
        let l = ParamLayout::new(&[("w".into(), vec![3])]);
        let hp = AdamWHyper { beta1: 0.9, beta2: 0.95, eps: 1e-8, wd_matrix: 0.0, wd_embedding: 0.0, wd_norm: 0.0 };
        let map = ShardMap::new(&l, 1, Split::Slices);
        let mut o = AdamW::new(&l, &FlatBuf::from_vec(vec![1.0, 2.0, 3.0]), &map, 0, hp).unwrap();
        let model = |p: &Path| -> Result<WrittenFiles> {
            Ok(vec![("model.safetensors".into(), write_file(&p.join("model.safetensors"), b"x")?)])
        };
        let comm = Comm::Single;
        let opts = SaveOpts { keep_last: 2, timeout: Duration::from_secs(60), model_bytes: 1 };
        for step in 1..=4 {
            o.step(&FlatBuf::from_vec(vec![0.1, -0.2, 0.3]), 0.01).unwrap();
            save(&root, &state(step), &o, &comm, &opts, &model).unwrap();
        }
        assert!(root.join("step_000004").join("optim-00000-of-00001.safetensors").is_file());
        let all = list_complete(&root).unwrap();
        assert_eq!(all.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![3, 4]);
        let last = latest_complete(&root).unwrap().unwrap();
        assert_eq!(load_state(&last).unwrap(), state(4));
        let mut o2 = AdamW::new(&l, &FlatBuf::from_vec(vec![0.0; 3]), &map, 0, hp).unwrap();
        load_optim(&last, &comm.mesh(), &mut o2).unwrap();
        assert_eq!((o2.master(), o2.m(), o2.v(), o2.t()), (o.master(), o.m(), o.v(), 4));
        // a directory without DONE is never picked
        std::fs::create_dir_all(root.join("step_000009")).unwrap();
        assert_eq!(latest_complete(&root).unwrap().unwrap(), last);
        // a save that fails half-way leaves the previous checkpoints intact and no step_5
        let failing = |p: &Path| -> Result<WrittenFiles> {
            write_file(&p.join("model.safetensors"), b"partial")?;
            bail!("No space left on device (simulated)")
        };
        let e = format!("{:#}", save(&root, &state(5), &o, &comm, &opts, &failing).unwrap_err());
        assert!(e.contains("step_000004 is intact") && e.contains("hint:"), "{e}");
        assert!(!root.join("step_000005").exists());
        assert_eq!(list_complete(&root).unwrap().len(), 2);
        assert!(std::fs::read_dir(&root).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with(".tmp")));
        // a stale temp dir of the same step (a killed process) is replaced, not reused
        std::fs::create_dir_all(root.join(".tmp-step_000005")).unwrap();
        std::fs::write(root.join(".tmp-step_000005").join("junk"), b"j").unwrap();
        let p5 = save(&root, &state(5), &o, &comm, &opts, &model).unwrap();
        assert!(!p5.join("junk").exists() && p5.join(DONE).is_file());
        assert!(!root.join(".tmp-step_000005").exists());
    }

    /// `agree_within` over 3 thread ranks whose collectives time out after 1 s: rank 0's part of 2.5 s
    /// (longer than the timeout) succeeds on every rank; a part past its own bound fails every rank,
    /// naming the bound on the late rank; a failed part fails every rank with its error on its rank.
    #[test]
    fn a_part_longer_than_the_collective_timeout_is_waited_for_up_to_its_own_bound() {
        use crate::comms::local::spawn_local;
        let run = |bound_ms: u64, part: fn(usize) -> Result<()>| -> Vec<String> {
            spawn_local(3, Duration::from_secs(1), move |lc| {
                let comm = Comm::Local(lc, 1);
                let wait = Wait { bound: Duration::from_millis(bound_ms), tick: Duration::from_millis(50) };
                let rank = comm.mesh().rank();
                Ok(match agree_within(&comm, "committing", wait, || part(rank)) {
                    Ok(()) => "ok".to_string(),
                    Err(e) => format!("{e:#}"),
                })
            })
            .unwrap()
        };
        let slow_lead = |rank: usize| -> Result<()> {
            if rank == 0 {
                std::thread::sleep(Duration::from_millis(2500));
            }
            Ok(())
        };
        assert_eq!(run(10_000, slow_lead), ["ok", "ok", "ok"]);
        let late = run(300, slow_lead);
        assert!(
            late[0].contains("rank 0 did not finish committing within 0.3 s") && late[0].contains("hint:"),
            "{late:?}"
        );
        assert!(late[1..].iter().all(|e| e == "another rank failed or was late while committing"), "{late:?}");
        let failing = |rank: usize| -> Result<()> {
            match rank {
                1 => bail!("No space left on device (simulated)"),
                _ => Ok(()),
            }
        };
        let failed = run(10_000, failing);
        assert!(failed[1].contains("No space left") && failed[0].contains("another rank failed"), "{failed:?}");
        assert!(wait_bound(13_500_000_000, Duration::from_secs(600)).as_secs() == 634);
        assert_eq!(wait_bound(0, Duration::from_secs(600)), Duration::from_secs(600));
    }

    /// The device variant writes the same files as the host one, and either resumes into the other.
    #[test]
    fn device_state_writes_the_same_files_and_resumes_across_placements() {
        use crate::flatbuf::Placement;
        let d = tempfile::tempdir().unwrap();
        let l = ParamLayout::new(&[("w".into(), vec![5]), ("model.norm.weight".into(), vec![2])]);
        let hp = AdamWHyper { beta1: 0.9, beta2: 0.95, eps: 1e-8, wd_matrix: 0.1, wd_embedding: 0.0, wd_norm: 0.0 };
        let map = ShardMap::new(&l, 1, Split::Slices);
        let dp = Placement::Device(candle_core::Device::Cpu);
        let p0 = FlatBuf::from_vec((0..7).map(|i| i as f32 * 0.25 - 1.0).collect());
        let mut host = AdamW::new(&l, &p0, &map, 0, hp).unwrap();
        let mut dev = AdamW::new(&l, &p0.try_clone().unwrap().placed(&dp).unwrap(), &map, 0, hp).unwrap();
        let g = FlatBuf::from_vec(vec![0.3, -0.1, 0.2, 0.0, 0.5, -0.4, 0.1]);
        for _ in 0..3 {
            host.step(&g, 0.01).unwrap();
            dev.step(&g.try_clone().unwrap().placed(&dp).unwrap(), 0.01).unwrap();
        }
        let model = |p: &Path| -> Result<WrittenFiles> {
            Ok(vec![("model.safetensors".into(), write_file(&p.join("model.safetensors"), b"x")?)])
        };
        let comm = Comm::Single;
        let opts = SaveOpts { keep_last: 1, timeout: Duration::from_secs(60), model_bytes: 1 };
        let ph = save(&d.path().join("h"), &state(3), &host, &comm, &opts, &model).unwrap();
        let pd = save(&d.path().join("d"), &state(3), &dev, &comm, &opts, &model).unwrap();
        let f = optim_file(&comm.mesh());
        assert_eq!(std::fs::read(ph.join(&f)).unwrap(), std::fs::read(pd.join(&f)).unwrap(), "same bytes");
        // host checkpoint -> device state, device checkpoint -> host state
        let mut into_dev = AdamW::new(&l, &p0.try_clone().unwrap().placed(&dp).unwrap(), &map, 0, hp).unwrap();
        let mut into_host = AdamW::new(&l, &p0, &map, 0, hp).unwrap();
        load_optim(&ph, &comm.mesh(), &mut into_dev).unwrap();
        load_optim(&pd, &comm.mesh(), &mut into_host).unwrap();
        assert!(matches!(into_dev.master(), FlatBuf::Device(_)) && matches!(into_host.master(), FlatBuf::Host(_)));
        assert_eq!(
            (into_dev.master(), into_dev.m(), into_dev.v(), into_dev.t()),
            (host.master(), host.m(), host.v(), 3)
        );
        assert_eq!((into_host.master(), into_host.v()), (dev.master(), dev.v()));
    }
}
