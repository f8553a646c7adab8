//! The training recipe: one serde struct per TOML section, `[[stage]]` tables for multi-stage runs,
//! `--set section.key=value` overrides, validation, and the resolved config with its hash.
//!
//! Reference: torchtitan's one-TOML-per-recipe layout; the HARPE paper's §4.1/§4.4 for the recipes in
//! `configs/`. The non-obvious decisions: every default lives in this folder (`sections.rs`) and nowhere
//! else; overrides are applied to the parsed TOML value before deserializing (`overrides.rs`), so a
//! wrong type from the command line is reported exactly like one in the file (naming the key); the
//! config hash, which `state.json` and the run directory check against, is `RunConfig::hash`
//! (`hash.rs`; its doc comment says what it covers).
//! The files: `sections.rs` (the sections and their defaults), `validate.rs` (the checks serde cannot
//! express), `batch.rs` (tokens, micro-batches and steps per stage), `overrides.rs` (`--set`), `hash.rs`
//! (the config hash), `zero_stage.rs` (`ZeroStage`); this file loads a recipe through them.
//! What this folder does not do: build the model or the data (`train` does).
mod batch;
mod hash;
mod overrides;
mod sections;
mod validate;
mod zero_stage;

pub use batch::{rank_batching, targets_in, StageBatch};
pub use hash::without_defaults;
pub use overrides::apply_override;
pub use sections::*;
pub use validate::{check_buckets, check_window};
pub use zero_stage::{GradReduce, ZeroStage};

use anyhow::{anyhow, Context, Result};
use std::path::Path;

/// A loaded recipe: the config, its resolved TOML text (every key, as saved in the run directory) and
/// its config hash (`RunConfig::hash`).
#[derive(Clone, Debug)]
pub struct Resolved {
    pub cfg: RunConfig,
    pub toml: String,
    pub hash: String,
}

/// Deserialize TOML text into a `RunConfig`; errors name `origin` and the line/key toml points at.
fn parse(text: &str, origin: &str) -> Result<RunConfig> {
    toml::from_str::<RunConfig>(text).map_err(|e| {
        anyhow!("{origin}: {}\nhint: see configs/tiny-cpu.toml for every section and key", e.to_string().trim_end())
    })
}

impl RunConfig {
    /// Read a recipe file, apply `--set` overrides, validate, and resolve.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Resolved> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "cannot read config {}\nhint: pass an existing TOML recipe, e.g. configs/tiny-cpu.toml",
                path.display()
            )
        })?;
        let origin = path.display().to_string();
        Self::from_text(&text, &origin, overrides)
    }

    /// Like `load`, from text (`origin` names it in errors).
    pub fn from_text(text: &str, origin: &str, overrides: &[String]) -> Result<Resolved> {
        let cfg = if overrides.is_empty() {
            parse(text, origin)?
        } else {
            let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
                anyhow!("{origin}: {}\nhint: fix the TOML syntax", e.to_string().trim_end())
            })?;
            for o in overrides {
                apply_override(&mut table, o)?;
            }
            let merged = toml::to_string(&table)?;
            parse(&merged, &format!("{origin} with --set {}", overrides.join(" --set ")))?
        };
        cfg.validate(origin)?;
        let toml = toml::to_string_pretty(&cfg).context("cannot serialize the resolved config")?;
        let hash = cfg.hash(false)?;
        Ok(Resolved { cfg, toml, hash })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[model.init]
vocab_size = 300
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4

[data]
source = "builtin"

[[stage]]
seq_len = 64
steps = 3

[[stage]]
seq_len = 128
tokens = 1000
rope = { scheme = "default", theta = 500000.0 }
"#;

    #[test]
    fn defaults_stages_and_overrides() {
        let r = RunConfig::from_text(BASE, "t.toml", &[]).unwrap();
        assert_eq!(r.cfg.optim.lr, 2e-5);
        assert_eq!(r.cfg.train.activation_checkpointing, Checkpointing::EveryLayer);
        assert_eq!(r.cfg.stage_steps(0), (3, 64));
        assert_eq!(r.cfg.stage_steps(1), (8, 128));
        let o = RunConfig::from_text(
            BASE,
            "t.toml",
            &["optim.lr=1e-3".into(), "stage.1.lr=5e-4".into(), "train.activation_checkpointing={ every = 2 }".into()],
        )
        .unwrap();
        assert_eq!(o.cfg.optim.lr, 1e-3);
        assert_eq!(o.cfg.stages[1].lr, Some(5e-4));
        assert_eq!(o.cfg.train.activation_checkpointing, Checkpointing::Every(2));
        assert_ne!(o.hash, r.hash);
        // the resolved text parses back to the same config
        assert_eq!(RunConfig::from_text(&r.toml, "resolved", &[]).unwrap().cfg, r.cfg);
    }

    #[test]
    fn bad_input_names_the_key_and_hints() {
        let e = format!(
            "{:#}",
            RunConfig::from_text(BASE, "t.toml", &["train.micro_batch_size=\"two\"".into()]).unwrap_err()
        );
        assert!(e.contains("micro_batch_size") && e.contains("hint:"), "{e}");
        let e = format!(
            "{:#}",
            RunConfig::from_text(&format!("{BASE}\n[optim]\nlearning_rate = 1\n"), "t.toml", &[]).unwrap_err()
        );
        assert!(e.contains("learning_rate") && e.contains("t.toml"), "{e}");
        let nob = BASE.replace("steps = 3", "");
        let e = format!("{:#}", RunConfig::from_text(&nob, "t.toml", &[]).unwrap_err());
        assert!(e.contains("stage 0 has no budget") && e.contains("hint:"), "{e}");
        let e = format!("{:#}", RunConfig::from_text(BASE, "t.toml", &["stage.5.lr=1".into()]).unwrap_err());
        assert!(e.contains("out of range"), "{e}");
    }
}
