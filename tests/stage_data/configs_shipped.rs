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

/// The hash of every shipped recipe, pinned: it guards `--resume` and a sweep's finished runs, so a
/// change to harpe that moves it (a new key, a changed serialization) refuses every existing run. Only
/// keys that differ from their defaults enter it (`config::without_defaults`). A recipe edited on
/// purpose gets its new hash here.
const PINNED: &[(&str, &str)] = &[
    ("abf-128k.toml", "2cde60f40c601578dafd78a5477f76273458a110d5f461ba5f06b3969a8f525d"),
    ("abf-multistage-128k.toml", "4234195493a46bc395e3c4e4299f0790b7d19990d9616e8335b04c74af8e984b"),
    ("abf-multistage-16k-128k.toml", "7b9779749b48d00d701e7dd1388eb16b6d4b4d3784dad7990dd58c3587db4c12"),
    ("abf-multistage-8k-32k-128k.toml", "f2b1ad011c9041f829130668701c0bd381b28c0f996d2851a56aa208a3d70475"),
    ("gpu-plan-check.toml", "33fd51987fabec473b5e42e136bac69dccc0860c1a435864b381220668cfac92"),
    ("harpe-128k.toml", "022668e73691cf8b4456393d4a9b89f4fe55fffa6dd5429d60dd916c9c950f68"),
    ("harpe-uniform-asc-128k.toml", "929381f98fcd80cc8e0aca35c0040a85ca884f321ec1b688f324e4c9c07a3e55"),
    ("harpe-uniform-desc-128k.toml", "fd1d1685d44400f82540f6cf593100340817b42dc15e60b2bcd8ad2ae572f3ef"),
    ("pi-128k.toml", "a9ede14d157638e79993c4726ebe8eaf66b150450a98be8a53f55bcbf99b8799"),
    ("smollm2-abf-multistage-32k.toml", "d2e53641e83417e08417526957731cebd8b64a67be41fc66e6b33660e6c690c9"),
    ("smollm2-harpe-32k.toml", "5935069c9270001d4971ed34acc346856922a1c5c815f8ee0b621566d738080a"),
    ("tiny-cpu-eval.toml", "004f7b7e5638ea93a2511196d0ab45ec5e779a93ed958107ce8f472471ea265d"),
    ("tiny-cpu.toml", "ce2ce78e127439b2a9ed4afcbb19775ee13a395348ded492958a04be7a4503dc"),
    ("yarn-128k.toml", "5165a073efc98acf9138134ee8231e55bd1f217493cae94521956047a6821cdb"),
];

#[test]
fn the_shipped_recipes_keep_their_hashes() {
    let mut got = vec![];
    for path in configs() {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        got.push((name.clone(), RunConfig::load(&path, &[]).unwrap().hash));
    }
    let table: String = got.iter().map(|(n, h)| format!("    (\"{n}\", \"{h}\"),\n")).collect();
    let want: Vec<(String, String)> = PINNED.iter().map(|(n, h)| (n.to_string(), h.to_string())).collect();
    assert_eq!(got, want, "the config hashes moved; if on purpose, PINNED becomes:\n{table}");
}

#[test]
fn a_key_at_its_default_does_not_enter_the_hash() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/tiny-cpu.toml");
    let plain = RunConfig::load(&path, &[]).unwrap();
    // a key written at its default value is the same recipe
    let at_default = RunConfig::load(&path, &["schedule.span=stage".into()]).unwrap();
    assert_eq!(at_default.hash, plain.hash);
    assert!(!plain.toml.is_empty() && plain.toml.contains("span"), "the resolved TOML still shows every key");
    // a value that differs does
    let run_span = RunConfig::load(&path, &["schedule.span=run".into()]).unwrap();
    assert_ne!(run_span.hash, plain.hash);
    let other_lr = RunConfig::load(&path, &["optim.lr=3e-4".into()]).unwrap();
    assert_ne!(other_lr.hash, plain.hash);
}

mod later_version {
    //! The same section before and after a release that adds a defaulted key to it.
    use serde::{Deserialize, Serialize};

    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Before {
        pub lr: f64,
        #[serde(default)]
        pub sched: SchedBefore,
    }
    #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct SchedBefore {
        #[serde(default)]
        pub warmup: u64,
    }

    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct After {
        pub lr: f64,
        #[serde(default)]
        pub sched: SchedAfter,
    }
    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct SchedAfter {
        #[serde(default)]
        pub warmup: u64,
        /// the key the later release adds, with its default
        #[serde(default = "one")]
        pub cycles: u32,
    }
    fn one() -> u32 {
        1
    }
    // as config's sections do: Default is what the empty section gives
    impl Default for SchedAfter {
        fn default() -> Self {
            SchedAfter { warmup: 0, cycles: one() }
        }
    }
}

#[test]
fn a_defaulted_key_added_to_a_section_leaves_the_hash_unchanged() {
    use harpe::config::without_defaults;
    use later_version::{After, Before};
    for text in ["lr = 1e-5\n", "lr = 1e-5\n[sched]\nwarmup = 10\n", "lr = 2e-5\n[sched]\nwarmup = 0\n"] {
        let before: Before = toml::from_str(text).unwrap();
        let after: After = toml::from_str(text).unwrap();
        let (b, a) = (without_defaults(&before).unwrap(), without_defaults(&after).unwrap());
        assert_eq!(toml::to_string(&b).unwrap(), toml::to_string(&a).unwrap(), "{text}");
        // and a key that matters stays: lr is required, warmup only when it is not 0
        assert!(b.contains_key("lr"));
        let warm = b.get("sched").and_then(|s| s.get("warmup")).is_some();
        assert_eq!(warm, text.contains("warmup = 10"), "{text}: {b:?}");
    }
    // the serialized forms themselves differ: hashing them whole would move every hash
    let after: After = toml::from_str("lr = 1e-5\n").unwrap();
    let before: Before = toml::from_str("lr = 1e-5\n").unwrap();
    assert_ne!(toml::to_string(&before).unwrap(), toml::to_string(&after).unwrap());
}
