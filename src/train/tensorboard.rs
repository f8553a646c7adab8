//! TensorBoard event files: every `harpe train` run writes `RUN_DIR/tb/events.out.tfevents.*` beside
//! `metrics.jsonl` (`log.tensorboard = true`, the default), so `tensorboard --logdir runs/` shows it live.
//!
//! Reference: TensorFlow's TFRecord framing (`tensorflow/core/lib/io/record_writer.cc`: u64 length LE,
//! masked crc32c of the length, data, masked crc32c of the data; mask = rotr15(crc) + 0xa282ead8) and
//! the `Event` / `Summary` / `SessionLog` messages of `tensorflow/core/util/event.proto` and
//! `framework/summary.proto`, which TensorBoard's loaders read; file names follow
//! `tensorboard/summary/writer/event_file_writer.py` (`events.out.tfevents.{secs}.{host}.{pid}...`).
//! The messages are declared here with `prost`'s derive (only the fields harpe writes), so no `protoc`
//! is needed at build time; the checksum is `checksum::crc32c`. The non-obvious decision: every session
//! (fresh or resumed) opens a new file whose second event is `SessionLog{status: START}` at step
//! `start_step + 1`, which TensorBoard's event accumulator takes as "purge this run's events at or after
//! that step" — so steps a resumed run replays show once, as `MetricsLog::open` keeps them once in
//! `metrics.jsonl`. Non-finite values are written
//! as they are (TensorBoard shows NaN), never dropped.
//! What this file does not do: histograms, images, hparams (metrics.jsonl and the PNGs stay the record).
use crate::train::metrics::{EvalRecord, StepRecord};
use anyhow::{anyhow, bail, Context, Result};
use prost::Message;
use std::path::Path;

/// `tensorflow.Event` (the fields harpe writes).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(oneof = "What", tags = "3, 5, 7")]
    pub what: Option<What>,
}

/// `Event.what`.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    /// "brain.Event:2", the first event of every file
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
    /// tag 7 (6 is the deprecated `log_message`)
    #[prost(message, tag = "7")]
    SessionLog(SessionLog),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` with its `simple_value` (a scalar).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(oneof = "ValueKind", tags = "2")]
    pub value: Option<ValueKind>,
}

/// `Summary.Value.value` (only `simple_value`).
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum ValueKind {
    #[prost(float, tag = "2")]
    SimpleValue(f32),
}

/// `tensorflow.SessionLog`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SessionLog {
    /// 1 = START (TensorBoard purges this run's events at or after the event's step)
    #[prost(int32, tag = "1")]
    pub status: i32,
    #[prost(string, tag = "2")]
    pub checkpoint_path: String,
    #[prost(string, tag = "3")]
    pub msg: String,
}

/// `SessionLog.status` START.
pub const SESSION_START: i32 = 1;

/// TFRecord's masked crc32c.
fn masked_crc(bytes: &[u8]) -> u32 {
    let c = crate::checksum::crc32c(bytes);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One event file, appended and flushed per event.
/// A failed write (a full disk) does not stop training: it is reported once, the file is cut back to its
/// last whole record, and no more events are written this session (metrics.rs states the rule).
pub struct TbWriter {
    out: crate::util::AppendFile,
}

fn wall_time() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

impl TbWriter {
    /// Create a new event file in `dir` (created if missing) for a session starting after `start_step`
    /// optimizer steps, marking the session start so TensorBoard drops older files' later events.
    pub fn create(dir: &Path, start_step: u64) -> Result<TbWriter> {
        std::fs::create_dir_all(dir).with_context(|| {
            format!("cannot create {}\nhint: check that the run directory is writable", dir.display())
        })?;
        let secs = wall_time() as u64;
        let host = crate::util::host_name();
        let pid = std::process::id();
        // a second writer in the same second and process (tests) gets the next free suffix
        let mut n = 0;
        let path = loop {
            let p = dir.join(format!("events.out.tfevents.{secs:010}.{host}.{pid}.{n:03}"));
            if !p.exists() {
                break p;
            }
            n += 1;
        };
        let file = std::fs::OpenOptions::new().create_new(true).append(true).open(&path).with_context(|| {
            format!("cannot create {}\nhint: check that the run directory is writable", path.display())
        })?;
        let mut w = TbWriter { out: crate::util::AppendFile::new(file, path, 0) };
        w.write_event(&Event {
            wall_time: wall_time(),
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        })?;
        let log = SessionLog { status: SESSION_START, checkpoint_path: String::new(), msg: "harpe train".into() };
        w.write_event(&Event {
            wall_time: wall_time(),
            step: start_step as i64 + 1,
            what: Some(What::SessionLog(log)),
        })?;
        Ok(w)
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        self.out.path()
    }

    /// Append one framed event and flush it.
    pub fn write_event(&mut self, e: &Event) -> Result<()> {
        let data = e.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        let mut rec = Vec::with_capacity(data.len() + 16);
        rec.extend_from_slice(&len);
        rec.extend_from_slice(&masked_crc(&len).to_le_bytes());
        rec.extend_from_slice(&data);
        rec.extend_from_slice(&masked_crc(&data).to_le_bytes());
        self.out.append(
            &rec,
            "training goes on, with no more TensorBoard events this session\nhint: free disk space; metrics.jsonl holds the same numbers",
        );
        Ok(())
    }

    /// One event holding every (tag, value) scalar of `step`.
    pub fn scalars(&mut self, step: u64, values: &[(String, f64)]) -> Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        let value = values
            .iter()
            .map(|(tag, v)| SummaryValue { tag: tag.clone(), value: Some(ValueKind::SimpleValue(*v as f32)) })
            .collect();
        self.write_event(&Event {
            wall_time: wall_time(),
            step: step as i64,
            what: Some(What::Summary(Summary { value })),
        })
    }
}

/// The scalars of one training step: loss, lr, grad norm, throughput, MFU, memory, per-source loss.
pub fn step_scalars(r: &StepRecord) -> Vec<(String, f64)> {
    let mut v = vec![
        ("train/loss".to_string(), r.loss),
        ("train/lr".to_string(), r.lr),
        ("train/grad_norm".to_string(), r.grad_norm),
        ("train/tokens_per_s".to_string(), r.tokens_per_s),
        ("train/tflops".to_string(), r.tflops),
        ("train/seq_len".to_string(), r.seq_len as f64),
        ("train/tokens_seen".to_string(), r.tokens_seen as f64),
        ("memory/rss_bytes".to_string(), r.rss_bytes as f64),
        ("memory/step_peak_bytes".to_string(), r.step_peak_bytes as f64),
    ];
    if let Some(m) = r.mfu {
        v.push(("train/mfu".to_string(), m));
    }
    if r.skipped {
        v.push(("train/skipped".to_string(), 1.0));
    }
    v.extend(r.per_source.iter().map(|(k, x)| (format!("train/loss_by_source/{k}"), *x)));
    v
}

/// The scalars of one evaluation during training: every metric it holds.
pub fn eval_scalars(r: &EvalRecord) -> Vec<(String, f64)> {
    let mut v = vec![];
    if let Some(p) = &r.eval.ppl {
        v.push(("eval/ppl".to_string(), p.ppl));
        v.push(("eval/nll".to_string(), p.nll));
    }
    v.extend(r.eval.passkey.iter().map(|(l, s)| (format!("eval/passkey/{l}"), *s)));
    v.extend(r.eval.loss_by_bucket.iter().map(|(b, x)| (format!("eval/loss_by_bucket/{b}"), *x)));
    for (task, m) in &r.eval.tasks {
        v.extend(m.iter().map(|(k, x)| (format!("eval/tasks/{task}/{k}"), *x)));
    }
    v
}

/// Every event of one file, checking the framing and both checksums of each record.
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut out = vec![];
    let mut at = 0usize;
    let bad = |at: usize, what: &str| {
        anyhow!("{}: byte {at}: {what}\nhint: the event file is truncated or damaged", path.display())
    };
    while at < bytes.len() {
        let head = bytes.get(at..at + 12).ok_or_else(|| bad(at, "short record header"))?;
        let (len_b, crc_b) = head.split_at(8);
        let crc_of_len = u32::from_le_bytes([crc_b[0], crc_b[1], crc_b[2], crc_b[3]]);
        if masked_crc(len_b) != crc_of_len {
            bail!(bad(at, "length checksum mismatch"));
        }
        let mut lb = [0u8; 8];
        lb.copy_from_slice(len_b);
        let len = u64::from_le_bytes(lb) as usize;
        let data = bytes.get(at + 12..at + 12 + len).ok_or_else(|| bad(at, "short record"))?;
        let crc = bytes.get(at + 12 + len..at + 16 + len).ok_or_else(|| bad(at, "missing data checksum"))?;
        if masked_crc(data) != u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]) {
            bail!(bad(at, "data checksum mismatch"));
        }
        out.push(Event::decode(data).map_err(|e| bad(at, &format!("not an Event: {e}")))?);
        at += 16 + len;
    }
    Ok(out)
}

/// The scalars TensorBoard shows for `dir`: every event file in name order (TensorBoard's order), a
/// `SessionLog` START at step s dropping the scalars read so far with step >= s; (step, tag, value).
pub fn read_scalars(dir: &Path) -> Result<Vec<(i64, String, f32)>> {
    let files = crate::util::sorted_entries(dir, "hint: pass a run's TensorBoard directory (RUN_DIR/tb)", |p| {
        p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("events.out.tfevents."))
    })?;
    let mut out: Vec<(i64, String, f32)> = vec![];
    for f in files {
        for e in read_events(&f)? {
            match e.what {
                Some(What::Summary(s)) => {
                    for v in s.value {
                        if let Some(ValueKind::SimpleValue(x)) = v.value {
                            out.push((e.step, v.tag, x));
                        }
                    }
                }
                Some(What::SessionLog(l)) if l.status == SESSION_START => out.retain(|(step, _, _)| *step < e.step),
                _ => {}
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_matches_tensorflow() {
        // crc32c("") = 0 -> mask(0) = 0xa282ead8; crc32c("123456789") = 0xe3069283 (RFC 3720 check value)
        assert_eq!(masked_crc(b""), 0xa282_ead8);
        assert_eq!(crate::checksum::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked_crc(b"123456789"), 0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8));
    }

    #[test]
    fn scalars_round_trip_and_damage_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = TbWriter::create(dir.path(), 0).unwrap();
        w.scalars(3, &[("train/loss".into(), 2.5), ("train/lr".into(), f64::NAN)]).unwrap();
        let p = w.path().to_path_buf();
        drop(w);
        let ev = read_events(&p).unwrap();
        assert_eq!(ev[0].what, Some(What::FileVersion("brain.Event:2".into())));
        let s = read_scalars(dir.path()).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].0, s[0].1.as_str(), s[0].2), (3, "train/loss", 2.5));
        assert!(s[1].2.is_nan());
        let mut bytes = std::fs::read(&p).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 0xff;
        std::fs::write(&p, &bytes).unwrap();
        let e = read_events(&p).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch") && e.contains("hint:"), "{e}");
    }
}
