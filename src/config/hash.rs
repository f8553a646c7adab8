//! The config hash that `state.json`, a run directory and a sweep's `sweep-run.json` check a run
//! against: what `RunConfig::hash` hashes and why (its doc comment is the one description), and
//! `without_defaults`, the table of the keys that matter it is computed from.
use super::sections::RunConfig;
use anyhow::{Context, Result};
use serde::Serialize;

/// One step of a key path in a TOML document.
#[derive(Clone, Debug)]
enum Seg {
    Key(String),
    Index(usize),
}

/// `cfg` as a TOML table of only the keys that matter: a key is left out when the value its absence
/// gives (serde's default) is the value it has. Found by trial, deepest keys first, so a section left
/// with no keys is left out too where the section has a default (each section's `Default` is its empty
/// table, a test holds it); what serde cannot default stays. What `RunConfig::hash` hashes.
pub fn without_defaults<T: Serialize + serde::de::DeserializeOwned + PartialEq>(cfg: &T) -> Result<toml::Table> {
    let full = toml::Table::try_from(cfg).context("cannot serialize the config")?;
    let same = |t: &toml::Table| toml::Value::Table(t.clone()).try_into::<T>().is_ok_and(|c| &c == cfg);
    fn paths(v: &toml::Value, at: &mut Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    at.push(Seg::Key(k.clone()));
                    out.push(at.clone());
                    paths(v, at, out);
                    at.pop();
                }
            }
            toml::Value::Array(a) => {
                for (i, v) in a.iter().enumerate().filter(|(_, v)| v.is_table()) {
                    at.push(Seg::Index(i));
                    paths(v, at, out); // the element itself is never removed: a list keeps its length
                    at.pop();
                }
            }
            _ => {}
        }
    }
    fn remove(v: &mut toml::Value, path: &[Seg]) -> bool {
        match (v, path) {
            (toml::Value::Table(t), [Seg::Key(k)]) => t.remove(k).is_some(),
            (toml::Value::Table(t), [Seg::Key(k), rest @ ..]) => t.get_mut(k).is_some_and(|v| remove(v, rest)),
            (toml::Value::Array(a), [Seg::Index(i), rest @ ..]) => a.get_mut(*i).is_some_and(|v| remove(v, rest)),
            _ => false,
        }
    }
    let root = toml::Value::Table(full);
    let mut all = vec![];
    paths(&root, &mut vec![], &mut all);
    all.sort_by_key(|p| std::cmp::Reverse(p.len())); // stable: document order within a depth
    let mut work = root;
    for p in &all {
        let mut trial = work.clone();
        if remove(&mut trial, p) && trial.as_table().is_some_and(&same) {
            work = trial;
        }
    }
    match work {
        toml::Value::Table(t) => Ok(t),
        _ => unreachable!("the root stays a table"),
    }
}

impl RunConfig {
    /// The config hash: the hex sha256 of `toml::to_string` of `without_defaults(self)`, the table of only
    /// the keys whose values differ from what their absence gives (not the resolved TOML text, which
    /// prints every key), so a key added to harpe later with a default leaves the hash of every existing
    /// recipe as it was. `results_only`: the `[dist]` table left out first (how a run is computed, never
    /// what it computes), the hash a resume at another world size checks.
    pub fn hash(&self, results_only: bool) -> Result<String> {
        let mut t = without_defaults(self)?;
        if results_only {
            t.remove("dist");
        }
        Ok(crate::util::sha256_hex(toml::to_string(&t)?.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::sections::*;

    /// `without_defaults` leaves out a section whose keys are all at their defaults, so a section's
    /// `Default` (what its absence gives) must be what an empty `[section]` gives, or a recipe with
    /// the empty section and one without it would hash alike while differing.
    #[test]
    fn an_absent_section_is_the_empty_section() {
        fn same<T: serde::de::DeserializeOwned + Default + PartialEq + std::fmt::Debug>(name: &str) {
            let empty: T = toml::from_str("").unwrap_or_else(|e| panic!("[{name}] = {{}}: {e}"));
            assert_eq!(empty, T::default(), "[{name}]: Default differs from the serde defaults of its keys");
        }
        same::<ModelSection>("model");
        same::<DataSection>("data");
        same::<TrainSection>("train");
        same::<OptimSection>("optim");
        same::<ScheduleSection>("schedule");
        same::<CheckpointSection>("checkpoint");
        same::<DistSection>("dist");
        same::<LogSection>("log");
        same::<EvalSection>("eval");
    }
}
