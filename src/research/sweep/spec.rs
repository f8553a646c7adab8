//! The sweep file: a base recipe, named arms, grid axes over any `--set` key, seeds, the evaluation of
//! every run and the `[slurm]` table, resolved into one `RunPlan` per run before anything starts.
//!
//! The non-obvious decision: every run is resolved (`RunConfig::load` with all its overrides) here, and
//! each arm, axis and seed key is first applied alone, so a key that is not a config key, a bad value or
//! a clashing name fails at once, naming it. Not here: running the plans (`local.rs`, `slurm.rs`).
use super::sbatch::SlurmSpec;
use crate::config::RunConfig;
use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The sweep file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepSpec {
    /// name of the sweep (default: the file name without .toml); run directories record it
    #[serde(default)]
    pub name: Option<String>,
    /// base recipe of arms that do not name their own (relative to the sweep file)
    #[serde(default)]
    pub base: Option<PathBuf>,
    /// overrides applied to every run, before the arm's and the axes'
    #[serde(default)]
    pub set: Vec<String>,
    /// seeds; each run sets `seed_key` to one of them
    #[serde(default = "d_seeds")]
    pub seeds: Vec<u64>,
    /// the config key a seed sets
    #[serde(default = "d_seed_key")]
    pub seed_key: String,
    /// full grid: `"optim.lr" = [1e-5, 2e-5]` (keys in sorted order, every combination, for every arm)
    #[serde(default)]
    pub axes: BTreeMap<String, Vec<toml::Value>>,
    /// named arms, compared against each other (default: one arm `base`)
    #[serde(default, rename = "arm")]
    pub arms: Vec<ArmSpec>,
    /// evaluation of every finished run
    #[serde(default)]
    pub eval: EvalSpec,
    /// `#SBATCH` options of `--executor slurm` (an arm's `slurm = {...}` overrides keys for its runs)
    #[serde(default)]
    pub slurm: SlurmSpec,
}

fn d_seeds() -> Vec<u64> {
    vec![0]
}
fn d_seed_key() -> String {
    "train.seed".into()
}

/// `[[arm]]`: one named recipe variant.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArmSpec {
    pub name: String,
    /// its own recipe instead of the sweep's `base` (relative to the sweep file)
    #[serde(default)]
    pub config: Option<PathBuf>,
    /// overrides, as `--set` takes them
    #[serde(default)]
    pub set: Vec<String>,
    /// `#SBATCH` options of this arm's runs, over the sweep's `[slurm]`
    #[serde(default)]
    pub slurm: Option<SlurmSpec>,
}

/// `[eval]`: what runs after training (paths relative to the working directory, as in recipes).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalSpec {
    /// `[[eval.ppl]]`: sliding-window perplexity of held-out text (`harpe eval-ppl`)
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ppl: Vec<PplEval>,
    /// `[eval.loss]`: loss by position bucket on a prepared dataset (`harpe eval-loss`)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<LossEval>,
    /// `[eval.niah]`: passkey / RULER / needle grid at given lengths (`harpe eval-niah`)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub niah: Option<NiahEval>,
}

/// One `eval-ppl` evaluation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PplEval {
    /// metric name (`ppl:<name>`, `nll:<name>`)
    pub name: String,
    pub input: Vec<PathBuf>,
    pub window: usize,
    pub stride: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
}

/// The `eval-loss` evaluation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LossEval {
    pub data: PathBuf,
    pub buckets: Vec<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sequences: Option<usize>,
}

/// The `eval-niah` evaluation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NiahEval {
    /// `--tasks`, e.g. "passkey" or "passkey,noise"
    pub tasks: String,
    pub lengths: Vec<usize>,
    #[serde(default = "d_samples")]
    pub samples: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub essays: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passkey_depths: Option<usize>,
    /// measure lengths beyond max_position_embeddings (extrapolation)
    #[serde(default)]
    pub force: bool,
}

fn d_samples() -> usize {
    20
}

/// One planned run.
#[derive(Clone, Debug)]
pub struct RunPlan {
    /// directory name under the sweep directory: `<group>__seed<k>`
    pub id: String,
    /// arm name plus axis values; what `harpe report` compares
    pub group: String,
    pub seed: u64,
    pub config: PathBuf,
    pub set: Vec<String>,
    pub resolved: RunConfig,
    pub hash: String,
    /// its `#SBATCH` options (`[slurm]` with the arm's keys over it)
    pub slurm: SlurmSpec,
}

/// Keep letters, digits and `._=+-` (other characters become `-`).
pub(super) fn sanitize(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || "._=+-".contains(c) { c } else { '-' }).collect()
}

/// An axis value as a `--set` value and as a name part.
fn value_text(v: &toml::Value) -> (String, String) {
    let set = v.to_string();
    let name = match v {
        toml::Value::String(s) => s.clone(),
        _ => set.clone(),
    };
    (set, name)
}

/// Every combination of the axes (key order), as (name suffix, overrides).
fn grid(axes: &BTreeMap<String, Vec<toml::Value>>) -> Vec<(String, Vec<String>)> {
    let mut out = vec![(String::new(), vec![])];
    for (k, vals) in axes {
        let mut next = vec![];
        for (name, set) in &out {
            for v in vals {
                let (sv, nv) = value_text(v);
                let mut s = set.clone();
                s.push(format!("{k}={sv}"));
                next.push((format!("{name}__{k}={nv}"), s));
            }
        }
        out = next;
    }
    out
}

impl SweepSpec {
    /// Read and check a sweep file.
    pub fn load(path: &Path) -> Result<SweepSpec> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "cannot read sweep file {}\nhint: pass an existing TOML file, e.g. configs/sweeps/harpe-vs-multistage.toml",
                path.display()
            )
        })?;
        let spec: SweepSpec = toml::from_str(&text).map_err(|e| {
            anyhow!(
                "{}: {}\nhint: see configs/sweeps/harpe-vs-multistage.toml for every key",
                path.display(),
                e.to_string().trim_end()
            )
        })?;
        Ok(spec)
    }

    /// The sweep's name.
    pub fn name_for(&self, path: &Path) -> String {
        self.name.clone().unwrap_or_else(|| {
            path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "sweep".into())
        })
    }

    /// Resolve every run; errors name the sweep file and the offending key, arm or value.
    pub fn plan(&self, path: &Path) -> Result<Vec<RunPlan>> {
        let origin = path.display().to_string();
        let here = path.parent().unwrap_or(Path::new("."));
        self.check_lists(&origin)?;
        let arms = self.arms_or_base();
        check_arm_names(&origin, &arms)?;
        self.slurm.check(&origin, "[slurm]")?;
        for a in &arms {
            if let Some(sl) = &a.slurm {
                sl.check(&origin, &format!("arm `{}` slurm", a.name))?;
            }
        }
        let mut plans = vec![];
        for a in &arms {
            let config = self.arm_config(a, here, &origin)?;
            self.check_keys(a, &config, &origin)?;
            plans.extend(self.arm_runs(a, &config, &origin)?);
        }
        check_distinct_ids(&origin, &plans)?;
        Ok(plans)
    }

    /// The sweep's runs, narrowed to `--only` when given.
    pub fn selected(&self, path: &Path, only: &[String]) -> Result<Vec<RunPlan>> {
        let mut plans = self.plan(path)?;
        if !only.is_empty() {
            plans.retain(|p| only.iter().any(|o| p.id.contains(o.as_str())));
            if plans.is_empty() {
                bail!("--only {} matches no run\nhint: run with --dry-run to list the run ids", only.join(","));
            }
        }
        Ok(plans)
    }

    /// Seeds present and distinct, every axis with at least one value.
    fn check_lists(&self, origin: &str) -> Result<()> {
        if self.seeds.is_empty() {
            bail!("{origin}: `seeds` is empty\nhint: e.g. seeds = [0, 1, 2]");
        }
        if let Some(d) = self.seeds.iter().enumerate().find(|(i, s)| self.seeds[..*i].contains(s)) {
            bail!("{origin}: seed {} is listed twice\nhint: seeds must be distinct", d.1);
        }
        for (k, v) in &self.axes {
            if v.is_empty() {
                bail!("{origin}: axis `{k}` has no values\nhint: give a list, e.g. \"{k}\" = [a, b]");
            }
        }
        Ok(())
    }

    /// The `[[arm]]` tables, or one arm `base` without overrides when there are none.
    fn arms_or_base(&self) -> Vec<ArmSpec> {
        if self.arms.is_empty() {
            vec![ArmSpec { name: "base".into(), config: None, set: vec![], slurm: None }]
        } else {
            self.arms.clone()
        }
    }

    /// The recipe an arm trains: its own `config`, else the sweep's `base`, relative to the sweep file.
    fn arm_config(&self, a: &ArmSpec, here: &Path, origin: &str) -> Result<PathBuf> {
        match a.config.as_ref().or(self.base.as_ref()) {
            Some(c) => Ok(here.join(c)),
            None => bail!(
                "{origin}: arm `{}` has no recipe\nhint: set `base = \"../run.toml\"` at the top, or `config = ...` in the arm",
                a.name
            ),
        }
    }

    /// Apply each arm, axis and seed key alone first, so an unknown key is reported as that key.
    fn check_keys(&self, a: &ArmSpec, config: &Path, origin: &str) -> Result<()> {
        for (what, key, spec) in a
            .set
            .iter()
            .map(|s| ("arm", s.split('=').next().unwrap_or(s).to_string(), s.clone()))
            .chain(self.axes.iter().map(|(k, v)| ("axis", k.clone(), format!("{k}={}", value_text(&v[0]).0))))
            .chain(std::iter::once(("seed_key", self.seed_key.clone(), format!("{}={}", self.seed_key, self.seeds[0]))))
        {
            let mut base_set = self.set.clone();
            if what != "arm" {
                base_set.extend(a.set.iter().cloned());
            }
            base_set.push(spec);
            RunConfig::load(config, &base_set).map_err(|e| {
                anyhow!(
                    "{origin}: {what} key `{key}` (arm `{}`) does not apply to {}: {e:#}\nhint: axis, arm and seed keys are `harpe train --set` keys of the recipe, e.g. optim.lr or stage.0.tokens",
                    a.name,
                    config.display()
                )
            })?;
        }
        Ok(())
    }

    /// One resolved run per grid point and seed of arm `a`.
    fn arm_runs(&self, a: &ArmSpec, config: &Path, origin: &str) -> Result<Vec<RunPlan>> {
        let mut plans = vec![];
        for (suffix, axis_set) in grid(&self.axes) {
            let group = format!("{}{suffix}", a.name);
            for &seed in &self.seeds {
                let mut set = self.set.clone();
                set.extend(a.set.iter().cloned());
                set.extend(axis_set.iter().cloned());
                set.push(format!("{}={seed}", self.seed_key));
                let r = RunConfig::load(config, &set).map_err(|e| {
                    anyhow!("{origin}: run `{group}` seed {seed} does not resolve: {e:#}\nhint: check the arm's and the axes' values")
                })?;
                let id = format!("{}__seed{seed}", sanitize(&group));
                plans.push(RunPlan {
                    id,
                    group: group.clone(),
                    seed,
                    config: config.to_path_buf(),
                    set,
                    resolved: r.cfg,
                    hash: r.hash,
                    slurm: self.slurm.merged(a.slurm.as_ref()),
                });
            }
        }
        Ok(plans)
    }
}

/// Arm names are non-empty and name distinct directories.
fn check_arm_names(origin: &str, arms: &[ArmSpec]) -> Result<()> {
    let mut names: BTreeMap<String, String> = BTreeMap::new();
    for a in arms {
        let key = sanitize(&a.name);
        if a.name.is_empty() {
            bail!("{origin}: an [[arm]] has an empty name\nhint: give every arm a short unique name");
        }
        if let Some(prev) = names.insert(key.clone(), a.name.clone()) {
            bail!(
                "{origin}: arms `{prev}` and `{}` clash (both name the directory `{key}`)\nhint: give every [[arm]] a distinct name",
                a.name
            );
        }
    }
    Ok(())
}

/// No two runs share a directory.
fn check_distinct_ids(origin: &str, plans: &[RunPlan]) -> Result<()> {
    let mut seen = BTreeSet::new();
    for p in plans {
        if !seen.insert(p.id.clone()) {
            bail!(
                "{origin}: two runs would share the directory `{}`\nhint: make arm names and axis values distinct",
                p.id
            );
        }
    }
    Ok(())
}
