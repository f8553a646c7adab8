//! Built-in training text: two deterministic synthetic sources for runs with `[data] source =
//! "builtin"`, the demo and the tests, so harpe trains on a machine with no dataset at all.
//!
//! Reference: none (templated text). The non-obvious decision: the text is a pure function of the seed
//! (ChaCha8), so a run on built-in data resumes and reproduces exactly like one on a prepared dataset.
//! What this file does not do: prepare or pack the text (`prepare_from_texts` does).

/// The names the synthetic stories use (the demo's corpus uses them too).
pub const NAMES: [&str; 8] = ["Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana"];

/// Built-in training text for runs with `[data] source = "builtin"`: two deterministic synthetic
/// sources ("stories": templated English sentences; "arithmetic": sums with their results), enough
/// structure for a tiny model's loss to fall within a minute.
pub fn builtin_texts(seed: u64) -> Vec<(String, String)> {
    use rand::{Rng, SeedableRng};
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let names = NAMES;
    let verbs = ["found", "painted", "carried", "lost", "sold", "built", "opened", "cleaned"];
    let things = ["a red box", "the old boat", "a small lamp", "the green door", "a long rope", "the blue cup"];
    let places = ["by the river", "in the garden", "at the market", "near the hill", "in the kitchen"];
    let mut docs = Vec::new();
    for _ in 0..240 {
        let mut s = String::new();
        for _ in 0..r.random_range(6..14) {
            let (n, v) = (names[r.random_range(0..names.len())], verbs[r.random_range(0..verbs.len())]);
            let (t, p) = (things[r.random_range(0..things.len())], places[r.random_range(0..places.len())]);
            s.push_str(&format!("{n} {v} {t} {p}. Then {n} went home. "));
        }
        docs.push(("stories".to_string(), s));
        let mut a = String::new();
        for _ in 0..r.random_range(10..30) {
            let (x, y) = (r.random_range(0..50u32), r.random_range(0..50u32));
            a.push_str(&format!("{x} + {y} = {}. ", x + y));
        }
        docs.push(("arithmetic".to_string(), a));
    }
    docs
}
