//! The demo's corpus: documents that teach retrieval at the base's short length (passkey documents in
//! the evaluation's own format, facts asked back, associative recall, copying), plus the built-in
//! stories and arithmetic (`data::builtin`).
//!
//! The non-obvious decision: the text is a pure function of the seed (ChaCha8), and the shipped demo
//! base was pretrained on `corpus(1, ..)`: changing a generator changes what that base was taught, so a
//! change here means remaking the base (scripts/make_demo_base.sh).
use crate::data::builtin::NAMES;
use crate::eval::passkey::passkey_prompt;
use rand::{Rng, SeedableRng};

const THINGS: [&str; 6] = ["red box", "old boat", "small lamp", "green door", "long rope", "blue cup"];

/// A passkey document in the evaluation's own format, answered, of at most `max_chars` characters.
fn passkey_doc(r: &mut impl Rng, max_chars: usize) -> String {
    let overhead = passkey_prompt(0, 0.5, 50000).len() + 8;
    let n = r.random_range(0..=max_chars.saturating_sub(overhead).max(1));
    let key: u32 = r.random_range(1..50000);
    format!("{} {key}.", passkey_prompt(n, r.random_range(0.0..=1.0), key))
}

/// A fact stated early and asked back after filler text.
fn facts_doc(r: &mut impl Rng, max_chars: usize) -> String {
    let (name, thing) = (NAMES[r.random_range(0..NAMES.len())], THINGS[r.random_range(0..THINGS.len())]);
    let code: u32 = r.random_range(100..10000);
    let mut s = format!("Note: {name} hid the {thing} behind door {code}. ");
    let target = r.random_range(0..=max_chars.saturating_sub(120).max(1));
    while s.len() < target {
        let (n, t) = (NAMES[r.random_range(0..NAMES.len())], THINGS[r.random_range(0..THINGS.len())]);
        s.push_str(&format!("{n} looked at the {t}. "));
    }
    s.push_str(&format!("Question: behind which door did {name} hide the {thing}? Answer: door {code}."));
    s
}

/// Associative recall (Zoology's MQAR in words): "key: value." pairs, then the keys asked back in a
/// random order, each answered with its value. Every answer is a copy of the digits that followed the
/// same key earlier — the skill passkey retrieval needs, with many examples per document.
fn recall_doc(r: &mut impl Rng, max_chars: usize) -> String {
    const SYL: [&str; 12] = ["ka", "lo", "mi", "ne", "ru", "so", "ti", "vo", "ze", "pa", "gu", "fe"];
    let target = r.random_range(40..=max_chars.max(41));
    let n = (target / 40).clamp(1, 16);
    let mut pairs = Vec::with_capacity(n);
    while pairs.len() < n {
        let key = format!("{}{}{}", SYL[r.random_range(0..12)], SYL[r.random_range(0..12)], SYL[r.random_range(0..12)]);
        if pairs.iter().all(|(k, _)| *k != key) {
            pairs.push((key, r.random_range(10..100000u32)));
        }
    }
    let mut s: String = pairs.iter().map(|(k, v)| format!("{k}: {v}. ")).collect();
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, r.random_range(0..=i));
    }
    for i in order {
        let (k, v) = &pairs[i];
        let q = format!("What is {k}? {k} is {v}. ");
        if s.len() + q.len() > max_chars {
            break;
        }
        s.push_str(&q);
    }
    s
}

/// Copying: random strings of letters and digits, each repeated. Every character after a string's
/// first occurrence is predictable only by finding that occurrence — the gradient that makes induction
/// heads form in small models (Olsson et al. 2022), which the retrieval tasks then reuse.
fn copy_doc(r: &mut impl Rng, max_chars: usize) -> String {
    const ALPHA: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let target = r.random_range(30..=max_chars.max(31));
    let mut s = String::new();
    loop {
        let len = r.random_range(6..24);
        let w: String = (0..len).map(|_| ALPHA[r.random_range(0..ALPHA.len())] as char).collect();
        let piece = vec![w.as_str(); r.random_range(2..4)].join(" ") + ". ";
        if !s.is_empty() && s.len() + piece.len() > target {
            break;
        }
        s.push_str(&piece);
    }
    s
}

/// The built-in corpus for sequences of `seq_len` tokens: passkey, facts, recall, stories (+ arithmetic).
pub fn corpus(seed: u64, seq_len: usize, docs: usize) -> Vec<(String, String)> {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let max = seq_len.saturating_sub(2);
    let mut out = Vec::with_capacity(4 * docs);
    for _ in 0..docs {
        out.push(("passkey".to_string(), passkey_doc(&mut r, max)));
        out.push(("facts".to_string(), facts_doc(&mut r, max)));
        out.push(("recall".to_string(), recall_doc(&mut r, max)));
        out.push(("copy".to_string(), copy_doc(&mut r, max)));
    }
    let stories = crate::data::builtin_texts(seed);
    out.extend(stories.into_iter().take(docs).map(|(s, t)| (s, t.chars().take(max).collect())));
    out
}
