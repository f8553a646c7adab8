//! The `--set section.key=value` engine: an override is applied to the parsed TOML table before it is
//! deserialized, so a wrong type from the command line is reported exactly like one in the file (naming
//! the key); numeric segments index arrays (`stage.0.lr=1e-5`). Apart from the sections, which never
//! see where a value came from.
use anyhow::{anyhow, bail, Result};

/// Apply one `a.b.c=value` override to a TOML table; `value` is parsed as a TOML value (a bare word
/// that is not valid TOML is taken as a string); numeric path segments index arrays (`stage.0.lr=1e-5`).
pub fn apply_override(root: &mut toml::Table, spec: &str) -> Result<()> {
    let (key, raw) = spec.split_once('=').ok_or_else(|| {
        anyhow!("--set `{spec}` has no `=`\nhint: write --set section.key=value, e.g. --set optim.lr=1e-5")
    })?;
    let key = key.trim();
    let raw = raw.trim();
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").ok_or_else(|| anyhow!("--set {key}: empty value"))?,
        Err(_) => toml::Value::String(raw.to_string()),
    };
    let parts: Vec<&str> = key.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        bail!("--set `{spec}`: empty key segment\nhint: write --set section.key=value");
    }
    let mut cur = root;
    for (i, part) in parts[..parts.len() - 1].iter().enumerate() {
        let path = parts[..=i].join(".");
        let entry = cur.entry(part.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = match entry {
            toml::Value::Table(t) => t,
            toml::Value::Array(a) => {
                let idx: usize = parts.get(i + 1).and_then(|s| s.parse().ok()).ok_or_else(|| {
                    anyhow!("--set {key}: `{path}` is a list\nhint: index it, e.g. --set {path}.0.<key>=value")
                })?;
                let len = a.len();
                let item = a
                    .get_mut(idx)
                    .ok_or_else(|| anyhow!("--set {key}: `{path}` has {len} entries, index {idx} is out of range\nhint: indices start at 0"))?;
                // the index segment is consumed here; the loop continues on the element
                return set_in_element(item, &parts[i + 2..], value, key);
            }
            _ => bail!("--set {key}: `{path}` is not a table\nhint: check the key path against the config file"),
        };
    }
    cur.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

fn set_in_element(item: &mut toml::Value, rest: &[&str], value: toml::Value, key: &str) -> Result<()> {
    let toml::Value::Table(t) = item else {
        bail!("--set {key}: the indexed entry is not a table\nhint: check the key path");
    };
    if rest.is_empty() {
        bail!("--set {key}: missing the key inside the entry\nhint: e.g. --set stage.0.lr=1e-5");
    }
    let mut sub = t.clone();
    apply_override(&mut sub, &format!("{}={}", rest.join("."), value))?;
    *t = sub;
    Ok(())
}
