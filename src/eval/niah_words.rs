//! RULER's word keys: `sorted(set(f"{adj}-{noun}"))` over wonderwords 2.2.0's adjective and noun lists
//! (6,175,260 words), indexed without materialising the list.
//!
//! Reference: `NVIDIA/RULER:scripts/data/synthetic/niah.py` (`WORDS`), wonderwords 2.2.0's
//! `adjectivelist.txt` / `nounlist.txt` (embedded from `words/`, MIT).
//!
//! The non-obvious decision: an index is mapped to its word through blocks of adjectives; only the few
//! adjectives that are prefixes of others (`high`, `high-pitched`, `highfalutin`) need an explicit
//! sorted block, every other adjective's words are `adj-noun` in noun order.
//! Not here: drawing a key (`niah::NeedleType::generate`).
use std::sync::OnceLock;

const ADJECTIVES: &str = include_str!("words/adjectivelist.txt");
const NOUNS: &str = include_str!("words/nounlist.txt");

enum WordBlock {
    /// An adjective that is no prefix of another: its words are `adj-noun` in noun order.
    Plain(&'static str),
    /// Adjectives sharing a root prefix (`high`, `high-pitched`, `highfalutin`): sorted explicitly.
    Family(Vec<String>),
}

/// `sorted(set(f"{adj}-{noun}"))` over the embedded wonderwords lists, indexed without materialising.
pub struct WordList {
    nouns: Vec<&'static str>,
    blocks: Vec<WordBlock>,
    /// Start index of each block in the sorted list; `starts[blocks.len()]` is the total.
    starts: Vec<usize>,
}

impl WordList {
    /// The process-wide list built from the embedded files.
    pub fn get() -> &'static WordList {
        static WORDS: OnceLock<WordList> = OnceLock::new();
        WORDS.get_or_init(|| WordList::build(ADJECTIVES, NOUNS))
    }

    fn build(adj_text: &'static str, noun_text: &'static str) -> WordList {
        let mut adjs: Vec<&str> = adj_text.lines().map(str::trim_end).collect();
        let mut nouns: Vec<&str> = noun_text.lines().map(str::trim_end).collect();
        adjs.sort_unstable();
        adjs.dedup();
        nouns.sort_unstable();
        nouns.dedup();
        let mut blocks = Vec::new();
        let mut starts = vec![0];
        let mut i = 0;
        while i < adjs.len() {
            let root = adjs[i];
            let mut j = i + 1;
            // Sorted order keeps every adjective that starts with `root` right after it.
            while j < adjs.len() && adjs[j].starts_with(root) {
                j += 1;
            }
            let block = if j == i + 1 {
                WordBlock::Plain(root)
            } else {
                let mut words: Vec<String> =
                    adjs[i..j].iter().flat_map(|a| nouns.iter().map(move |n| format!("{a}-{n}"))).collect();
                words.sort_unstable();
                words.dedup();
                WordBlock::Family(words)
            };
            let len = match &block {
                WordBlock::Plain(_) => nouns.len(),
                WordBlock::Family(w) => w.len(),
            };
            starts.push(starts[starts.len() - 1] + len);
            blocks.push(block);
            i = j;
        }
        WordList { nouns, blocks, starts }
    }

    /// Number of distinct words (6,175,260 for wonderwords 2.2.0).
    pub fn len(&self) -> usize {
        self.starts[self.blocks.len()]
    }

    /// Always false (the embedded lists are not empty); present for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `i`-th word of the sorted list.
    pub fn word(&self, i: usize) -> String {
        let b = self.starts.partition_point(|&s| s <= i) - 1;
        let off = i - self.starts[b];
        match &self.blocks[b] {
            WordBlock::Plain(adj) => format!("{adj}-{}", self.nouns[off]),
            WordBlock::Family(words) => words[off].clone(),
        }
    }
}
