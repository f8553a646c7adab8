//! `harpe consolidate`: a sharded (multi-rank) checkpoint as a plain HF model directory plus ONE
//! optimizer state file, the layout a one-rank run writes, so the result also resumes on one rank.
//!
//! The non-obvious decision: the result is written into a temporary sibling directory and renamed into
//! place, as a checkpoint is; the model files are copied as they are (rank 0 already wrote them whole).
use super::{fresh_dir, optim_file, read_optim_shards, stitch_optim, write_optim_file, DONE};
use crate::comms::Mesh;
use crate::flatbuf::FlatBuf;
use crate::model::weights::STREAM_CHUNK_BYTES;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// `harpe consolidate`: a plain HF model directory plus ONE optimizer state file from a sharded checkpoint.
#[derive(clap::Args, Debug, Clone)]
pub struct ConsolidateArgs {
    /// a complete checkpoint directory, e.g. runs/NAME/checkpoints/step_000500
    #[arg(value_name = "CHECKPOINT")]
    pub checkpoint: PathBuf,
    /// output directory (must not exist yet) [default: CHECKPOINT-consolidated]
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

/// Run `harpe consolidate`: copy the HF model files (config.json, model*.safetensors, the index,
/// tokenizer.json) and state.json, and stitch every rank's optimizer shard into
/// `optim-00000-of-00001.safetensors` (the file a one-rank run writes, so the result also resumes
/// on one rank). The model files are already whole: rank 0 writes them from the gathered weights.
pub fn run(a: ConsolidateArgs) -> Result<()> {
    let dir = &a.checkpoint;
    if !dir.join(DONE).is_file() {
        bail!(
            "{} is not a complete checkpoint (no {DONE} marker)\nhint: pass RUN/checkpoints/step_N of a finished save",
            dir.display()
        );
    }
    let out = a.out.clone().unwrap_or_else(|| {
        let name = dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "checkpoint".into());
        dir.with_file_name(format!("{name}-consolidated"))
    });
    if out.exists() {
        bail!("{} already exists\nhint: choose a new --out directory", out.display());
    }
    let shards = read_optim_shards(dir)?;
    let total = shards.iter().map(|s| s.range.end).max().unwrap_or(0);
    let (master, m, v, t) = stitch_optim(dir, &shards, 0..total)?;
    let tmp = out.with_file_name(format!(
        ".tmp-{}",
        out.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default()
    ));
    fresh_dir(out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")), &tmp)?;
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let p = entry?.path();
        let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        let keep = name == "config.json"
            || name == "tokenizer.json"
            || name == "state.json"
            || (name.starts_with("model") && (name.ends_with(".safetensors") || name.ends_with(".json")));
        if keep {
            std::fs::copy(&p, tmp.join(&name))
                .with_context(|| format!("copying {} into {}\nhint: is the disk full?", p.display(), tmp.display()))?;
        }
    }
    let one = Mesh::single();
    let [master, m, v] = [master, m, v].map(FlatBuf::from_vec);
    write_optim_file(&tmp.join(optim_file(&one)), &master, &m, &v, t, 0..total, STREAM_CHUNK_BYTES)?;
    std::fs::rename(&tmp, &out).with_context(|| format!("cannot rename {} to {}", tmp.display(), out.display()))?;
    println!(
        "consolidated {} optimizer shard(s) ({} parameters, step {t}) and the model into {}",
        shards.len(),
        total,
        out.display()
    );
    Ok(())
}
