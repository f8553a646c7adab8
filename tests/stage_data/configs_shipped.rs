//! Every recipe shipped in configs/ parses, validates and resolves, and resolves to what its TOML says
//! (read here independently with the `toml` crate): stages, RoPE schemes, steps and accumulation.
use harpe::config::RunConfig;
use harpe::model::rope::RopeScheme;
use std::path::PathBuf;

fn configs() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_shipped_recipe_resolves_to_what_its_toml_says() {
    let files = configs();
    let names: Vec<String> = files.iter().map(|p| p.file_stem().unwrap().to_string_lossy().to_string()).collect();
    for want in ["harpe-128k", "abf-128k", "abf-multistage-128k", "yarn-128k", "pi-128k", "tiny-cpu"] {
        assert!(names.iter().any(|n| n == want), "configs/{want}.toml is missing: {names:?}");
    }
    for path in &files {
        let name = path.display().to_string();
        let r = RunConfig::load(path, &[]).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let cfg = &r.cfg;
        cfg.validate(&name).unwrap();
        let raw: toml::Table = toml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let stages = raw["stage"].as_array().unwrap();
        assert_eq!(cfg.stages.len(), stages.len(), "{name}");
        let train = raw["train"].as_table().unwrap();
        let micro = train["micro_batch_size"].as_integer().unwrap() as u64;
        for (i, st) in stages.iter().enumerate() {
            let seq = st["seq_len"].as_integer().unwrap() as u64;
            assert_eq!(cfg.stages[i].seq_len as u64, seq, "{name} stage {i}");
            let per_step = train.get("global_batch_tokens").map_or(micro * seq, |g| g.as_integer().unwrap() as u64);
            let (steps, tps) = cfg.stage_steps(i);
            assert_eq!(tps, per_step, "{name} stage {i}: tokens per step");
            let want_steps = match (st.get("steps"), st.get("tokens")) {
                (Some(s), _) => s.as_integer().unwrap() as u64,
                (None, Some(t)) => (t.as_integer().unwrap() as u64).div_ceil(per_step),
                _ => unreachable!("{name}: validated"),
            };
            assert_eq!(steps, want_steps, "{name} stage {i}: steps");
            assert_eq!(cfg.accumulation(i) as u64 * micro * seq, per_step, "{name} stage {i}: whole micro-batches");
        }
        // The resolved TOML saved in the run directory parses back to the same config.
        let again = RunConfig::from_text(&r.toml, "resolved", &[]).unwrap();
        assert_eq!(again.hash, r.hash, "{name}: resolved config is not a fixed point");
    }
}

#[test]
fn the_paper_recipes_carry_their_schemes() {
    let load = |n: &str| {
        RunConfig::load(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("configs/{n}.toml")), &[]).unwrap().cfg
    };
    // HARPE: 32 per-head bases, one 128K stage of 6B tokens at 4M tokens per step (32 x 131072).
    let h = load("harpe-128k");
    match h.rope.as_ref().unwrap() {
        RopeScheme::Harpe { head_bases, .. } => {
            assert_eq!(head_bases.len(), 32);
            assert_eq!(head_bases[0], 1_000_000.0);
        }
        other => panic!("harpe-128k resolves to {}", other.name()),
    }
    assert_eq!(h.stage_steps(0), (1431, 4_194_304));
    assert_eq!(h.accumulation(0), 32);
    assert_eq!(load("abf-128k").rope.as_ref().unwrap().name(), "default");
    assert_eq!(load("yarn-128k").rope.as_ref().unwrap().name(), "yarn");
    assert_eq!(load("pi-128k").rope.as_ref().unwrap().name(), "linear");
    let m = load("abf-multistage-128k");
    let thetas: Vec<f64> = m
        .stages
        .iter()
        .map(|s| match s.rope.as_ref().unwrap() {
            RopeScheme::Default { theta } => *theta,
            other => panic!("{}", other.name()),
        })
        .collect();
    assert_eq!(thetas, vec![1e6, 2e6, 5e6]);
    assert_eq!(m.stages.iter().map(|s| s.seq_len).collect::<Vec<_>>(), vec![32768, 65536, 131072]);
}
