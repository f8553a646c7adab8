//! NLTK's Punkt sentence splitter with its English model: `nltk.sent_tokenize(text)`, byte for byte.
//!
//! Reference: Kiss & Strunk (2006), "Unsupervised Multilingual Sentence Boundary Detection"; the
//! inference half of NLTK 3.9.1 `nltk/tokenize/punkt.py` (`PunktSentenceTokenizer.span_tokenize` with
//! `realign_boundaries=True`, `PunktLanguageVars`, `PunktToken`, first and second annotation passes,
//! orthographic heuristic). RULER splits its essay haystacks with it (`niah.py`: `sent_tokenize`), so
//! the five essay tasks need it to reproduce RULER's prompts. The English parameters (abbreviation
//! types, collocations, sentence starters, orthographic contexts) are NLTK's `punkt_tab/english`, in
//! NLTK's own file format under `punkt_english/` (see its README for origin and licence), embedded
//! with `include_str!`. `tests/data/punkt_nltk.json` (made by `scripts/make_punkt_fixtures.py` with
//! NLTK) holds the splits this file must reproduce.
//!
//! The non-obvious decision: NLTK's regular expressions are hand-written here as small scanners
//! instead of a regex engine, each next to the pattern it implements, because the behaviour that
//! matters is Python's (leftmost-first alternation, lazy `\S+?` with look-ahead, `finditer` over a
//! zero-width look-ahead, code-point slicing). Offsets are byte offsets into the same `&str`, which is
//! equivalent to Python's code-point offsets because every cut lands on a char boundary.
//! Character classes follow Python's `str` semantics: `\s` = `str.isspace()`, `\d` = Unicode `Nd`
//! (approximated by `char::is_numeric` outside ASCII, which also admits `No`/`Nl`), `\w` = alphanumeric
//! or `_`; `str.lower()` = Rust's `to_lowercase` (both full mappings, both with final sigma).
//! Not here: training Punkt (the English model is fixed), NLTK 3.10's curly-quote realignment (RULER
//! ran NLTK 3.9.x), word tokenization for any other purpose.

use anyhow::{bail, Result};
use std::collections::{HashMap, HashSet};
use std::sync::OnceLock;

const ORTHO_BEG_UC: u32 = 1 << 1;
const ORTHO_MID_UC: u32 = 1 << 2;
const ORTHO_UNK_UC: u32 = 1 << 3;
const ORTHO_BEG_LC: u32 = 1 << 4;
const ORTHO_MID_LC: u32 = 1 << 5;
const ORTHO_UNK_LC: u32 = 1 << 6;
const ORTHO_UC: u32 = ORTHO_BEG_UC | ORTHO_MID_UC | ORTHO_UNK_UC;
const ORTHO_LC: u32 = ORTHO_BEG_LC | ORTHO_MID_LC | ORTHO_UNK_LC;

/// Learned Punkt parameters (NLTK's `PunktParameters`).
pub struct Punkt {
    abbrev_types: HashSet<String>,
    collocations: HashSet<(String, String)>,
    sent_starters: HashSet<String>,
    ortho_context: HashMap<String, u32>,
}

/// NLTK's `TabDecoder.txt2list`: one entry per line, only the final `\n` of a line removed.
fn tab_lines(text: &str) -> impl Iterator<Item = &str> {
    let body = text.strip_suffix('\n').unwrap_or(text);
    body.split('\n').filter(move |_| !text.is_empty())
}

impl Punkt {
    /// NLTK's English model (`nltk.sent_tokenize(text)` = `Punkt::english().tokenize(text)`).
    pub fn english() -> &'static Punkt {
        static EN: OnceLock<Punkt> = OnceLock::new();
        EN.get_or_init(|| {
            Punkt::from_tab(
                include_str!("punkt_english/abbrev_types.txt"),
                include_str!("punkt_english/collocations.tab"),
                include_str!("punkt_english/sent_starters.txt"),
                include_str!("punkt_english/ortho_context.tab"),
            )
            .unwrap_or_else(|e| panic!("the embedded Punkt English model is corrupt (a build defect): {e:#}"))
        })
    }

    /// Parse the four files of an NLTK `punkt_tab/<language>/` directory.
    pub fn from_tab(abbrev: &str, colloc: &str, starters: &str, ortho: &str) -> Result<Punkt> {
        let mut collocations = HashSet::new();
        for (i, l) in tab_lines(colloc).enumerate() {
            match l.split_once('\t') {
                Some((a, b)) if !b.contains('\t') => collocations.insert((a.to_string(), b.to_string())),
                _ => bail!(
                    "collocations.tab line {}: expected two tab-separated words, got {l:?}\nhint: use NLTK's punkt_tab files unchanged",
                    i + 1
                ),
            };
        }
        let mut ortho_context = HashMap::new();
        for (i, l) in tab_lines(ortho).enumerate() {
            let parsed = l.split_once('\t').and_then(|(k, v)| Some((k, v.parse::<u32>().ok()?)));
            match parsed {
                Some((k, v)) => ortho_context.insert(k.to_string(), v),
                None => bail!(
                    "ortho_context.tab line {}: expected `type<TAB>integer`, got {l:?}\nhint: use NLTK's punkt_tab files unchanged",
                    i + 1
                ),
            };
        }
        Ok(Punkt {
            abbrev_types: tab_lines(abbrev).map(str::to_string).collect(),
            collocations,
            sent_starters: tab_lines(starters).map(str::to_string).collect(),
            ortho_context,
        })
    }

    /// The sentences of `text` (NLTK `tokenize(text)`): slices of `text`.
    pub fn tokenize<'t>(&self, text: &'t str) -> Vec<&'t str> {
        self.span_tokenize(text).into_iter().map(|(s, e)| &text[s..e]).collect()
    }

    /// Byte spans of the sentences (NLTK `span_tokenize(text)` with realignment).
    pub fn span_tokenize(&self, text: &str) -> Vec<(usize, usize)> {
        realign_boundaries(text, &self.slices_from_text(text))
    }

    /// `_slices_from_text`: cut after every candidate end whose context holds a sentence break.
    fn slices_from_text(&self, text: &str) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut last_break = 0;
        for (m, context) in potential_end_contexts(text) {
            if self.text_contains_sentbreak(&context) {
                out.push((last_break, m.end));
                last_break = m.next_tok.unwrap_or(m.end);
            }
        }
        out.push((last_break, py_rstrip(text).len()));
        out
    }

    /// `text_contains_sentbreak`: a token other than the last is annotated as a sentence break.
    fn text_contains_sentbreak(&self, text: &str) -> bool {
        let mut toks = tokenize_words(text);
        for t in toks.iter_mut() {
            self.first_pass(t);
        }
        for i in 0..toks.len().saturating_sub(1) {
            let (a, b) = toks.split_at_mut(i + 1);
            self.second_pass(&mut a[i], &b[0]);
            if a[i].sentbreak {
                return true;
            }
        }
        false
    }

    /// `_first_pass_annotation`: sentence-end characters, ellipses, abbreviations by type.
    fn first_pass(&self, t: &mut Token) {
        let tok = t.tok;
        if tok == "." || tok == "?" || tok == "!" {
            t.sentbreak = true;
        } else if is_ellipsis(tok) {
            t.ellipsis = true;
        } else if t.period_final && !tok.ends_with("..") {
            let stem = py_lower(&tok[..tok.len() - 1]);
            let last = stem.rsplit('-').next().unwrap_or("");
            if self.abbrev_types.contains(&stem) || self.abbrev_types.contains(last) {
                t.abbr = true;
            } else {
                t.sentbreak = true;
            }
        }
    }

    /// `_second_pass_annotation`: collocations, orthographic and sentence-starter heuristics,
    /// initials and ordinals. `next` has had only its first pass, as in NLTK's pairwise generator.
    fn second_pass(&self, t: &mut Token, next: &Token) {
        if !t.period_final {
            return;
        }
        let typ = t.type_no_period();
        let next_typ = next.type_no_sentperiod();
        let is_initial = is_initial(t.tok);
        if self.collocations.contains(&(typ.to_string(), next_typ.to_string())) {
            t.sentbreak = false;
            t.abbr = true;
            return;
        }
        if (t.abbr || t.ellipsis) && !is_initial {
            if self.ortho_heuristic(next) == Ortho::Starter {
                t.sentbreak = true;
                return;
            }
            if next.first_upper() && self.sent_starters.contains(next_typ) {
                t.sentbreak = true;
                return;
            }
        }
        if is_initial || typ == "##number##" {
            let h = self.ortho_heuristic(next);
            if h == Ortho::NotStarter {
                t.sentbreak = false;
                t.abbr = true;
                return;
            }
            if h == Ortho::Unknown && is_initial && next.first_upper() && self.ortho(next_typ) & ORTHO_LC == 0 {
                t.sentbreak = false;
                t.abbr = true;
            }
        }
    }

    fn ortho(&self, typ: &str) -> u32 {
        self.ortho_context.get(typ).copied().unwrap_or(0)
    }

    /// `_ortho_heuristic`: does `t` start a sentence, judging by the cases it was seen in?
    fn ortho_heuristic(&self, t: &Token) -> Ortho {
        if [";", ":", ",", ".", "!", "?"].contains(&t.tok) {
            return Ortho::NotStarter;
        }
        let oc = self.ortho(t.type_no_sentperiod());
        if t.first_upper() && oc & ORTHO_LC != 0 && oc & ORTHO_MID_UC == 0 {
            return Ortho::Starter;
        }
        if t.first_lower() && (oc & ORTHO_UC != 0 || oc & ORTHO_BEG_LC == 0) {
            return Ortho::NotStarter;
        }
        Ortho::Unknown
    }
}

#[derive(PartialEq, Eq)]
enum Ortho {
    Starter,
    NotStarter,
    Unknown,
}

/// `PunktToken` (the fields inference reads).
struct Token<'t> {
    tok: &'t str,
    /// Lower-cased, numbers replaced by `##number##`.
    typ: String,
    period_final: bool,
    sentbreak: bool,
    abbr: bool,
    ellipsis: bool,
}

impl<'t> Token<'t> {
    fn new(tok: &'t str) -> Token<'t> {
        let lower = py_lower(tok);
        let typ = if is_numeric(&lower) { "##number##".to_string() } else { lower };
        Token { tok, typ, period_final: tok.ends_with('.'), sentbreak: false, abbr: false, ellipsis: false }
    }

    fn type_no_period(&self) -> &str {
        if self.typ.chars().count() > 1 && self.typ.ends_with('.') {
            &self.typ[..self.typ.len() - 1]
        } else {
            &self.typ
        }
    }

    fn type_no_sentperiod(&self) -> &str {
        if self.sentbreak {
            self.type_no_period()
        } else {
            &self.typ
        }
    }

    fn first_upper(&self) -> bool {
        self.tok.chars().next().is_some_and(char::is_uppercase)
    }

    fn first_lower(&self) -> bool {
        self.tok.chars().next().is_some_and(char::is_lowercase)
    }
}

// ------------------------------------------------------------------------------------------------
// Character classes and token-level patterns (Python `re` on `str`)

/// `\s` on `str` = `str.isspace()`: Unicode White_Space plus the separators 0x1c-0x1f.
fn is_space(c: char) -> bool {
    c.is_whitespace() || ('\x1c'..='\x1f').contains(&c)
}

/// `\d` (Unicode decimal digit; see the header for the non-ASCII approximation).
fn is_digit(c: char) -> bool {
    c.is_ascii_digit() || (!c.is_ascii() && c.is_numeric())
}

/// `[^\W\d]`: a word character that is not a digit (letters and `_`).
fn is_alpha_word(c: char) -> bool {
    c == '_' || (c.is_alphanumeric() && !is_digit(c))
}

fn py_lower(s: &str) -> String {
    s.to_lowercase()
}

fn py_rstrip(s: &str) -> &str {
    s.trim_end_matches(is_space)
}

/// `_RE_NUMERIC = ^-?[\.,]?\d[\d,\.-]*\.?$` (greedy choices are exact here: see the tests).
fn is_numeric(s: &str) -> bool {
    let s = s.strip_prefix('-').unwrap_or(s);
    let s = s.strip_prefix(['.', ',']).unwrap_or(s);
    let mut cs = s.chars();
    cs.next().is_some_and(is_digit) && cs.all(|c| is_digit(c) || matches!(c, ',' | '.' | '-'))
}

/// `_RE_ELLIPSIS = \.\.+$` (anchored by `match`).
fn is_ellipsis(s: &str) -> bool {
    s.len() >= 2 && s.bytes().all(|b| b == b'.')
}

/// `_RE_INITIAL = [^\W\d]\.$` (anchored by `match`): one letter and a period.
fn is_initial(s: &str) -> bool {
    let mut cs = s.chars();
    matches!((cs.next(), cs.next(), cs.next()), (Some(c), Some('.'), None) if is_alpha_word(c))
}

/// `_re_non_word_chars`: `[)";}\]*:@'({[?!]`.
fn is_non_word(c: char) -> bool {
    matches!(c, ')' | '"' | ';' | '}' | ']' | '*' | ':' | '@' | '\'' | '(' | '{' | '[' | '?' | '!')
}

/// `_re_word_start` excludes these: `[^\("`{\[:;&#*@)}\]\-,]`.
fn is_word_start(c: char) -> bool {
    !matches!(c, '(' | '"' | '`' | '{' | '[' | ':' | ';' | '&' | '#' | '*' | '@' | ')' | '}' | ']' | '-' | ',')
}

/// `_re_multi_char_punct = (?:\-{2,}|\.{2,}|(?:\.\s){2,}\.)` at byte `i`: the match end.
fn multi_char_at(s: &str, i: usize) -> Option<usize> {
    let rest = &s[i..];
    for ch in ['-', '.'] {
        let n = rest.len() - rest.trim_start_matches(ch).len();
        if n >= 2 {
            return Some(i + n);
        }
    }
    // (?:\.\s){2,}\. : greedy repeats, then backtrack one repeat if no final period follows.
    let mut reps = Vec::new(); // end offset of each `.\s` repeat
    let mut p = 0;
    loop {
        let mut cs = rest[p..].chars();
        match (cs.next(), cs.next()) {
            (Some('.'), Some(w)) if is_space(w) => {
                p += 1 + w.len_utf8();
                reps.push(p);
            }
            _ => break,
        }
    }
    if reps.len() >= 2 && rest[p..].starts_with('.') {
        return Some(i + p + 1);
    }
    if reps.len() >= 3 {
        return Some(i + reps[reps.len() - 2] + 1);
    }
    None
}

/// `PunktLanguageVars.word_tokenize` (`_word_tokenize_fmt` with `findall`) on one line.
fn word_tokenize(line: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut p = 0;
    while let Some(c) = line[p..].chars().next() {
        if is_space(c) {
            p += c.len_utf8();
            continue;
        }
        let end = if let Some(e) = multi_char_at(line, p) {
            e
        } else if is_word_start(c) {
            // \S+? up to the first position where the look-ahead holds.
            let mut e = p + c.len_utf8();
            while !word_end_at(line, e) {
                e += line[e..].chars().next().map_or(0, char::len_utf8);
            }
            e
        } else {
            p + c.len_utf8()
        };
        out.push(&line[p..end]);
        p = end;
    }
    out
}

/// The look-ahead after `\S+?`: `\s|$|NonWord|MultiChar|,(?=$|\s|NonWord|MultiChar)`.
fn word_end_at(s: &str, e: usize) -> bool {
    let boundary = |i: usize| match s[i..].chars().next() {
        None => true,
        Some(c) => is_space(c) || is_non_word(c) || multi_char_at(s, i).is_some(),
    };
    boundary(e) || (s[e..].starts_with(',') && boundary(e + 1))
}

/// `_tokenize_words`: lines with any non-space character, word-tokenized.
fn tokenize_words(text: &str) -> Vec<Token<'_>> {
    text.split('\n').filter(|line| line.chars().any(|c| !is_space(c))).flat_map(word_tokenize).map(Token::new).collect()
}

/// One `period_context_re` match: a `.`, `?` or `!` followed by punctuation or by space and a token.
struct EndMatch {
    start: usize,
    end: usize,
    /// Byte offset of the group `next_tok`, when the look-ahead took the whitespace branch.
    next_tok: Option<usize>,
    after_tok_end: usize,
}

/// `period_context_re().finditer(text)`.
fn period_matches(text: &str) -> Vec<EndMatch> {
    let mut out = Vec::new();
    for (i, c) in text.char_indices() {
        if !matches!(c, '.' | '?' | '!') {
            continue;
        }
        let j = i + 1;
        let Some(n) = text[j..].chars().next() else { continue };
        if is_non_word(n) {
            out.push(EndMatch { start: i, end: j, next_tok: None, after_tok_end: j + n.len_utf8() });
        } else if is_space(n) {
            let k = text.len() - text[j..].trim_start_matches(is_space).len();
            if k < text.len() {
                let m = text.len() - text[k..].trim_start_matches(|c| !is_space(c)).len();
                out.push(EndMatch { start: i, end: j, next_tok: Some(k), after_tok_end: m });
            }
        }
    }
    out
}

/// `_match_potential_end_contexts`: each candidate end with the word before it and the token
/// after it; of overlapping candidates (`acting!!!`) only the last survives.
fn potential_end_contexts(text: &str) -> Vec<(EndMatch, String)> {
    let context =
        |sl: (usize, usize), m: &EndMatch| format!("{}{}", &text[sl.0..sl.1], &text[m.start..m.after_tok_end]);
    let mut out = Vec::new();
    let mut prev_slice = (0usize, 0usize);
    let mut prev: Option<EndMatch> = None;
    for m in period_matches(text) {
        let before = &text[prev_slice.1..m.start];
        // `string.whitespace` (ASCII only); an index of 0 counts as "not found", as in NLTK.
        let idx = before.rfind([' ', '\t', '\n', '\r', '\x0b', '\x0c']).unwrap_or(0);
        let start = if idx != 0 { idx + prev_slice.1 + 1 } else { prev_slice.0 };
        let word = (start, m.start);
        if let Some(pm) = prev.take() {
            if prev_slice.1 <= word.0 {
                let c = context(prev_slice, &pm);
                out.push((pm, c));
            }
        }
        prev = Some(m);
        prev_slice = word;
    }
    if let Some(pm) = prev {
        let c = context(prev_slice, &pm);
        out.push((pm, c));
    }
    out
}

/// `re_boundary_realignment = ["')\]}]+?(?:\s+|(?=--)|$)` matched at the start of `s`:
/// (length of the closing punctuation, match end).
fn boundary_realignment(s: &str) -> Option<(usize, usize)> {
    let mut k = 0;
    while s[k..].starts_with(['"', '\'', ')', ']', '}']) {
        k += 1;
        let rest = &s[k..];
        let ws = rest.len() - rest.trim_start_matches(is_space).len();
        if ws > 0 {
            return Some((k, k + ws));
        }
        if rest.starts_with("--") || rest.is_empty() {
            return Some((k, k));
        }
    }
    None
}

/// `_realign_boundaries`: closing quotes and brackets after a break join the sentence before.
fn realign_boundaries(text: &str, slices: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut realign = 0;
    for (i, &(s1, e1)) in slices.iter().enumerate() {
        let s1 = s1 + realign;
        let Some(&(s2, e2)) = slices.get(i + 1) else {
            if s1 < e1 {
                out.push((s1, e1));
            }
            continue;
        };
        match boundary_realignment(if s2 < e2 { &text[s2..e2] } else { "" }) {
            Some((k, end)) => {
                out.push((s1, s2 + k));
                realign = end;
            }
            None => {
                realign = 0;
                if s1 < e1 {
                    out.push((s1, e1));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_patterns_follow_python_re() {
        assert!(is_numeric("1990.") && is_numeric("-.5") && is_numeric("1,000.") && is_numeric("3-4"));
        assert!(!is_numeric("--5") && !is_numeric("v2.0") && !is_numeric(".,5") && !is_numeric("-"));
        assert!(is_initial("J.") && is_initial("é.") && !is_initial("5.") && !is_initial("JR."));
        assert!(is_ellipsis("..") && !is_ellipsis(".") && !is_ellipsis("..a"));
        assert_eq!(multi_char_at(". . . x", 0), Some(5));
        assert_eq!(multi_char_at(". . x", 0), None);
        assert_eq!(multi_char_at(". . . . x", 0), Some(7));
        assert_eq!(multi_char_at(". . . .", 0), Some(7));
        assert_eq!(multi_char_at("--a", 0), Some(2));
    }

    #[test]
    fn word_tokenizer_splits_like_nltk() {
        // Values from nltk.tokenize.punkt.PunktLanguageVars().word_tokenize (NLTK 3.9.1).
        assert_eq!(word_tokenize("Hello, world."), vec!["Hello", ",", "world."]);
        assert_eq!(word_tokenize("(see above.)"), vec!["(", "see", "above.", ")"]);
        assert_eq!(word_tokenize("1,000 wait... --so"), vec!["1,000", "wait", "...", "--", "so"]);
        assert_eq!(word_tokenize("\"Why?\" he said"), vec!["\"", "Why", "?", "\"", "he", "said"]);
    }

    #[test]
    fn param_files_with_bad_lines_are_refused() {
        let e = Punkt::from_tab("", "a\tb\tc", "", "").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("collocations.tab line 1") && e.contains("hint:"), "{e}");
        let e = Punkt::from_tab("", "", "", "x\ty").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("ortho_context.tab line 1") && e.contains("hint:"), "{e}");
    }
}
