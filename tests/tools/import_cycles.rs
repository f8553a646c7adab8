//! The repository's import-circle check: no file of src/ may import a file that imports it back
//! (a circle means a type lives too high). Every `crate::` path in src/ — `use crate::a::{b, c::{d}}`
//! trees (with `self`, `*` and `as`) and inline paths such as `crate::a::b::f(..)` — is resolved to the FILE
//! that defines its longest module prefix (src/a/b.rs, src/a/b/mod.rs, or src/a.rs for a `mod b { .. }`
//! written inline there), giving a graph of files; every strongly connected component of more than one
//! file is a circle, printed with the import lines that close it.
//!
//! Reference: rustc's module-to-file rules (`mod x;` in a.rs is a/x.rs or a/x/mod.rs; in lib.rs or
//! mod.rs the file's own directory); Tarjan's strongly connected components.
//! The non-obvious decisions: the module tree is read from the `mod` declarations starting at
//! src/lib.rs (not guessed from file names), so inline modules resolve to the file holding them; a circle
//! is reported as a whole component (a set of files), because a component is what one fix must break; and
//! `KNOWN_CIRCLES` may hold circles still waiting for their owner, but each entry must exist exactly (the
//! test fails once one is gone, so the list can only shrink) and any circle not listed fails.
//! Run it alone: `cargo test --test tools import_cycles -- --nocapture` (scripts/check-import-cycles.sh).
//! Unit-test code (items under `#[cfg(test)]`) is skipped: a test may use the layers above the code it
//! tests without that being a circle of the code itself.
//! Relative paths (`super::`, `self::`) are resolved against the file's module and the inline modules
//! they sit in. A second check holds the rooms (top-level modules) to the order src/lib.rs declares them
//! in: a room imports only rooms declared before it.
//! Does not: follow a module imported by name and then used as `m::f`, `#[path]` attributes (src/ has none; the module walk fails if a declared file is missing),
//! or src/main.rs (the binary reaches the library as `harpe::`).
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Circles that still exist outside the attention/loss/research area, each with who removes it. Every
/// entry must match one real circle exactly (the files of one component, sorted); remove an entry when its
/// circle is broken — the test fails until you do.
const KNOWN_CIRCLES: &[(&[&str], &str)] = &[];

/// The same for circles between top-level modules (`top_level`).
const KNOWN_LAYER_CIRCLES: &[(&[&str], &str)] = &[];

// ---------------------------------------------------------------- lexer

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

/// The tokens of Rust source that matter for paths, with their 1-based lines: identifiers, `::` and single
/// punctuation; comments (nested block comments too), string, byte-string, raw-string and char literals
/// are skipped, lifetimes are dropped.
fn lex(src: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = src.chars().collect();
    let (mut i, mut line, mut out) = (0usize, 1usize, Vec::new());
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += (c[i] == '\n') as usize;
                    i += 1;
                }
            }
        } else if (ch == 'r' || (ch == 'b' && at(i + 1) == 'r')) && {
            let j = if ch == 'b' { i + 2 } else { i + 1 };
            let mut k = j;
            while at(k) == '#' {
                k += 1;
            }
            at(k) == '"' && (ch == 'b' || k > j || at(i + 1) == '"')
        } {
            // raw string r"..", r#".."#, br#".."#
            let mut j = if ch == 'b' { i + 2 } else { i + 1 };
            let mut hashes = 0;
            while at(j) == '#' {
                hashes += 1;
                j += 1;
            }
            j += 1; // opening quote
            loop {
                if j >= c.len() {
                    break;
                }
                if c[j] == '"' && (1..=hashes).all(|h| at(j + h) == '#') {
                    j += 1 + hashes;
                    break;
                }
                line += (c[j] == '\n') as usize;
                j += 1;
            }
            i = j;
        } else if ch == '"' || (ch == 'b' && at(i + 1) == '"') {
            let mut j = if ch == 'b' { i + 2 } else { i + 1 };
            while j < c.len() && c[j] != '"' {
                if c[j] == '\\' {
                    j += 1;
                }
                line += (at(j) == '\n') as usize;
                j += 1;
            }
            i = j + 1;
        } else if ch == '\'' || (ch == 'b' && at(i + 1) == '\'') {
            let j = if ch == 'b' { i + 1 } else { i };
            // a char literal 'x' / '\n' / '\u{..}', or a lifetime 'a (no closing quote right after one char)
            if at(j + 1) == '\\' {
                let mut k = j + 3; // past the escaped character (itself maybe a quote)
                while k < c.len() && c[k] != '\'' {
                    k += 1;
                }
                i = k + 1;
            } else if at(j + 2) == '\'' {
                i = j + 3;
            } else {
                i = j + 1;
                while at(i).is_alphanumeric() || at(i) == '_' {
                    i += 1;
                }
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let s = i;
            while at(i).is_alphanumeric() || at(i) == '_' {
                i += 1;
            }
            let mut word: String = c[s..i].iter().collect();
            if word == "r" && at(i) == '#' {
                // raw identifier r#type
                i += 1;
                let s = i;
                while at(i).is_alphanumeric() || at(i) == '_' {
                    i += 1;
                }
                word = c[s..i].iter().collect();
            }
            out.push((Tok::Ident(word), line));
        } else if ch.is_ascii_digit() {
            while at(i).is_alphanumeric() || at(i) == '_' || at(i) == '.' && at(i + 1).is_ascii_digit() {
                i += 1;
            }
        } else if ch == ':' && at(i + 1) == ':' {
            out.push((Tok::Path, line));
            i += 2;
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

// ---------------------------------------------------------------- paths and modules

/// One path found in a file: its segments after `crate` (or after `self`/`super`) and its line.
#[derive(Clone, Debug, PartialEq)]
struct CratePath {
    segs: Vec<String>,
    line: usize,
    /// None for a `crate::` path; for a relative one, the inline modules it sits in and how many
    /// `super`s lead it (0 for `self::`): it resolves against the file's own module path
    rel: Option<(Vec<String>, usize)>,
}

/// What one file declares and references: `mod x;` (with the inline-module path it sits in), inline
/// `mod x { .. }` paths, and every `crate::` path.
#[derive(Debug, Default)]
struct FileScan {
    file_mods: Vec<(Vec<String>, String)>,
    inline_mods: Vec<Vec<String>>,
    paths: Vec<CratePath>,
}

fn ident(t: Option<&(Tok, usize)>) -> Option<&str> {
    match t {
        Some((Tok::Ident(s), _)) => Some(s),
        _ => None,
    }
}

fn punct(t: Option<&(Tok, usize)>, p: char) -> bool {
    matches!(t, Some((Tok::Punct(c), _)) if *c == p)
}

/// Parse a use tree (or an inline path) starting at `toks[*i]`, right after `crate::` or a `::` inside
/// it, pushing every full path (segments after `crate`) it names into `out`.
fn parse_tree(toks: &[(Tok, usize)], i: &mut usize, prefix: &[String], line: usize, out: &mut Vec<CratePath>) {
    if punct(toks.get(*i), '{') {
        *i += 1;
        loop {
            if punct(toks.get(*i), '}') || *i >= toks.len() {
                *i += 1;
                return;
            }
            parse_tree(toks, i, prefix, line, out);
            // skip `as name` up to the next item of the group
            while *i < toks.len() && !punct(toks.get(*i), ',') && !punct(toks.get(*i), '}') {
                *i += 1;
            }
            if punct(toks.get(*i), ',') {
                *i += 1;
            }
        }
    }
    match ident(toks.get(*i)) {
        Some("self") => {
            *i += 1;
            out.push(CratePath { segs: prefix.to_vec(), line, rel: None });
        }
        Some(seg) => {
            let mut p = prefix.to_vec();
            p.push(seg.to_string());
            *i += 1;
            if matches!(toks.get(*i), Some((Tok::Path, _))) {
                *i += 1;
                parse_tree(toks, i, &p, line, out);
            } else {
                out.push(CratePath { segs: p, line, rel: None });
            }
        }
        None => {
            // `*`, or a path that goes on with generics (`crate::a::B::<T>`): the prefix is the module
            if punct(toks.get(*i), '*') {
                *i += 1;
            }
            out.push(CratePath { segs: prefix.to_vec(), line, rel: None });
        }
    }
}

/// Whether `toks` opens with the attribute `#[cfg(test)]`.
fn is_cfg_test(toks: &[(Tok, usize)]) -> bool {
    let want = [Tok::Punct('#'), Tok::Punct('['), Tok::Ident("cfg".into()), Tok::Punct('(')];
    toks.len() >= 7
        && toks[..4].iter().map(|(t, _)| t).eq(want.iter())
        && ident(toks.get(4)) == Some("test")
        && punct(toks.get(5), ')')
        && punct(toks.get(6), ']')
}

/// The index after the item starting at `toks[i]`: past its `;` or its closing brace, whichever ends it.
fn skip_item(toks: &[(Tok, usize)], mut i: usize) -> usize {
    let mut depth = 0usize;
    while i < toks.len() {
        match toks[i].0 {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return i + 1;
                }
            }
            Tok::Punct(';') if depth == 0 => return i + 1,
            _ => {}
        }
        i += 1;
    }
    i
}

/// Module declarations and `crate::` paths of one file's source (items under `#[cfg(test)]` skipped).
fn scan(src: &str) -> FileScan {
    let toks = lex(src);
    let mut fs = FileScan::default();
    // open inline modules: (name, brace depth inside it)
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < toks.len() {
        let (t, line) = &toks[i];
        match t {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|(_, d)| *d > depth) {
                    inline.pop();
                }
            }
            Tok::Punct('#') if is_cfg_test(&toks[i..]) => {
                i = skip_item(&toks, i + 7);
                continue;
            }
            Tok::Ident(w) if w == "mod" => {
                if let Some(name) = ident(toks.get(i + 1)) {
                    let here: Vec<String> = inline.iter().map(|(n, _)| n.clone()).collect();
                    if punct(toks.get(i + 2), ';') {
                        fs.file_mods.push((here, name.to_string()));
                    } else if punct(toks.get(i + 2), '{') {
                        let mut p = here;
                        p.push(name.to_string());
                        fs.inline_mods.push(p);
                        inline.push((name.to_string(), depth + 1));
                        depth += 1;
                        i += 3;
                        continue;
                    }
                }
            }
            Tok::Ident(w)
                if (w == "super" || w == "self")
                    && matches!(toks.get(i + 1), Some((Tok::Path, _)))
                    && !(i > 0 && matches!(toks.get(i - 1), Some((Tok::Path, _)))) =>
            {
                // `super::super::a::b` / `self::a`: count the leading supers, then read the rest as a tree
                let mut up = 0;
                let mut j = i;
                while ident(toks.get(j)) == Some("super") && matches!(toks.get(j + 1), Some((Tok::Path, _))) {
                    up += 1;
                    j += 2;
                }
                if up == 0 {
                    j += 2; // `self::`
                }
                let here: Vec<String> = inline.iter().map(|(n, _)| n.clone()).collect();
                let start = fs.paths.len();
                parse_tree(&toks, &mut j, &[], *line, &mut fs.paths);
                for p in &mut fs.paths[start..] {
                    p.rel = Some((here.clone(), up));
                }
                i = j;
                continue;
            }
            Tok::Ident(w) if w == "crate" => {
                let prev_dollar = i > 0 && punct(toks.get(i - 1), '$');
                let prev_in = i > 0 && ident(toks.get(i - 1)) == Some("in");
                if !prev_dollar && !prev_in && matches!(toks.get(i + 1), Some((Tok::Path, _))) {
                    let mut j = i + 2;
                    parse_tree(&toks, &mut j, &[], *line, &mut fs.paths);
                    i = j;
                    continue;
                }
            }
            _ => {}
        }
        i += 1;
    }
    fs
}

/// The files of the crate: module path -> file, walked from src/lib.rs through the `mod` declarations;
/// `read(path)` gives a file's text (None: no such file).
struct Crate {
    modules: BTreeMap<Vec<String>, String>,
    scans: BTreeMap<String, FileScan>,
}

fn load_crate(read: &dyn Fn(&str) -> Option<String>) -> Result<Crate, String> {
    let mut modules = BTreeMap::new();
    let mut scans = BTreeMap::new();
    // (module path, file, directory its children live in)
    let mut todo = vec![(Vec::<String>::new(), "src/lib.rs".to_string(), "src".to_string())];
    while let Some((path, file, dir)) = todo.pop() {
        let text =
            read(&file).ok_or_else(|| format!("{file}: cannot read (declared as module {})", path.join("::")))?;
        let fs = scan(&text);
        modules.insert(path.clone(), file.clone());
        for inl in &fs.inline_mods {
            let mut p = path.clone();
            p.extend(inl.iter().cloned());
            modules.entry(p).or_insert_with(|| file.clone());
        }
        for (inside, name) in &fs.file_mods {
            let sub = [dir.clone()].into_iter().chain(inside.iter().cloned()).collect::<Vec<_>>().join("/");
            let (flat, nested) = (format!("{sub}/{name}.rs"), format!("{sub}/{name}/mod.rs"));
            let mut p = path.clone();
            p.extend(inside.iter().cloned());
            p.push(name.clone());
            if read(&flat).is_some() {
                todo.push((p, flat, format!("{sub}/{name}")));
            } else if read(&nested).is_some() {
                todo.push((p, nested, format!("{sub}/{name}")));
            } else {
                return Err(format!("{file}: `mod {name};` has neither {flat} nor {nested}"));
            }
        }
        scans.insert(file, fs);
    }
    Ok(Crate { modules, scans })
}

/// One import between files: (from, to) -> the lines and paths that make it.
type Graph = BTreeMap<(String, String), Vec<(usize, String)>>;

impl Crate {
    /// The file defining the longest module prefix of `segs` (src/lib.rs for items of the root).
    fn resolve(&self, segs: &[String]) -> &str {
        (0..=segs.len()).rev().find_map(|n| self.modules.get(&segs[..n])).map_or("src/lib.rs", |s| s.as_str())
    }

    /// The module path of `file` (its first: a file is one module).
    fn module_of(&self, file: &str) -> Vec<String> {
        self.modules
            .iter()
            .filter(|(_, f)| f.as_str() == file)
            .map(|(m, _)| m.clone())
            .min_by_key(|m| m.len())
            .unwrap_or_default()
    }

    /// `p` as segments after `crate`: relative paths resolved against `file`'s module and inline modules.
    fn absolute(&self, file: &str, p: &CratePath) -> Vec<String> {
        match &p.rel {
            None => p.segs.clone(),
            Some((inline, up)) => {
                let mut base = self.module_of(file);
                base.extend(inline.iter().cloned());
                base.truncate(base.len().saturating_sub(*up));
                base.extend(p.segs.iter().cloned());
                base
            }
        }
    }

    fn graph(&self) -> Graph {
        let mut g = Graph::new();
        for (file, fs) in &self.scans {
            for p in &fs.paths {
                let segs = self.absolute(file, p);
                let to = self.resolve(&segs);
                if to != file {
                    let text = format!("crate::{}", segs.join("::"));
                    g.entry((file.clone(), to.to_string())).or_default().push((p.line, text));
                }
            }
        }
        g
    }
}

/// The graph between top-level modules (src/NAME.rs and every file under src/NAME/ are `NAME`): a circle here is a
/// layer that imports a layer above it and is imported back (config calling into comms while comms reads
/// config sections), even where no two files close the circle themselves.
fn top_level(g: &Graph) -> Graph {
    let unit = |f: &str| {
        let rest = f.strip_prefix("src/").unwrap_or(f);
        let first = rest.split('/').next().unwrap_or(rest);
        first.strip_suffix(".rs").unwrap_or(first).to_string()
    };
    let mut out = Graph::new();
    for ((a, b), uses) in g {
        let (ua, ub) = (unit(a), unit(b));
        if ua != ub {
            out.entry((ua, ub)).or_default().extend(uses.iter().map(|(l, p)| (*l, format!("{p} ({a}:{l})"))));
        }
    }
    out
}

/// Strongly connected components of more than one file, each sorted, in sorted order (Tarjan).
fn circles(g: &Graph) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&String> = g.keys().flat_map(|(a, b)| [a, b]).collect();
    let idx: BTreeMap<&String, usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let names: Vec<&String> = nodes.into_iter().collect();
    let mut adj = vec![Vec::new(); names.len()];
    for (a, b) in g.keys() {
        adj[idx[a]].push(idx[b]);
    }
    struct T<'a> {
        adj: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(t: &mut T, v: usize) {
        t.index[v] = Some(t.next);
        t.low[v] = t.next;
        t.next += 1;
        t.stack.push(v);
        t.on[v] = true;
        for k in 0..t.adj[v].len() {
            let w = t.adj[v][k];
            match t.index[w] {
                None => {
                    visit(t, w);
                    t.low[v] = t.low[v].min(t.low[w]);
                }
                Some(iw) if t.on[w] => t.low[v] = t.low[v].min(iw),
                _ => {}
            }
        }
        if Some(t.low[v]) == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            t.out.push(comp);
        }
    }
    let n = names.len();
    let mut t =
        T { adj: &adj, index: vec![None; n], low: vec![0; n], on: vec![false; n], stack: vec![], next: 0, out: vec![] };
    for v in 0..n {
        if t.index[v].is_none() {
            visit(&mut t, v);
        }
    }
    let mut out: Vec<Vec<String>> = t
        .out
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut c: Vec<String> = c.into_iter().map(|i| names[i].clone()).collect();
            c.sort();
            c
        })
        .collect();
    out.sort();
    out
}

/// A circle for people: its files (or modules), then every import between two of them with its first
/// line and path.
fn describe(circle: &[String], g: &Graph) -> String {
    let mut s = format!("circle of {}: {}\n", circle.len(), circle.join(" <-> "));
    for ((a, b), uses) in g {
        if circle.contains(a) && circle.contains(b) {
            let (line, path) = &uses[0];
            let more = if uses.len() > 1 { format!(" (+{} more)", uses.len() - 1) } else { String::new() };
            let from = if a.ends_with(".rs") { format!("{a}:{line}") } else { a.clone() };
            s += &format!("  {from} -> {b}   {path}{more}\n");
        }
    }
    s
}

/// The verdict: Err with every unlisted circle and every listed circle that no longer exists.
fn check(found: &[Vec<String>], known: &[(&[&str], &str)], g: &Graph) -> Result<(), String> {
    let mut errs = String::new();
    for c in found {
        if !known.iter().any(|(k, _)| k.iter().copied().eq(c.iter().map(|s| s.as_str()))) {
            errs += &format!("new import circle (a type lives too high; move it down):\n{}", describe(c, g));
        }
    }
    for (k, owner) in known {
        if !found.iter().any(|c| k.iter().copied().eq(c.iter().map(|s| s.as_str()))) {
            errs += &format!(
                "KNOWN_CIRCLES lists {k:?} ({owner}), but no such circle exists any more: remove the entry (or, if it \
                 only shrank, replace it by the circle printed above)\n"
            );
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs
            + "hint: tests/tools/import_cycles.rs explains the check; `cargo test --test tools import_cycles -- --nocapture`\n")
    }
}

fn repo_reader() -> impl Fn(&str) -> Option<String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    move |p: &str| std::fs::read_to_string(root.join(Path::new(p))).ok()
}

#[test]
fn src_has_no_import_circles_beyond_the_known_ones() {
    let krate = load_crate(&repo_reader()).unwrap_or_else(|e| panic!("{e}"));
    let g = krate.graph();
    let found = circles(&g);
    for c in &found {
        println!("{}", describe(c, &g));
    }
    if let Err(e) = check(&found, KNOWN_CIRCLES, &g) {
        panic!("{e}");
    }
}

#[test]
fn top_level_modules_have_no_circles_beyond_the_known_ones() {
    let krate = load_crate(&repo_reader()).unwrap_or_else(|e| panic!("{e}"));
    let g = top_level(&krate.graph());
    let found = circles(&g);
    for c in &found {
        println!("{}", describe(c, &g));
    }
    if let Err(e) = check(&found, KNOWN_LAYER_CIRCLES, &g) {
        panic!("{e}");
    }
}

/// The top-level modules in the order src/lib.rs declares them: the pipeline, lowest room first.
fn rooms(lib: &str) -> Vec<String> {
    lib.lines().filter_map(|l| l.trim().strip_prefix("pub mod ")?.strip_suffix(';').map(String::from)).collect()
}

/// Imports from a room to one declared after it in src/lib.rs (a lower room reaching up), with where.
fn upward(g: &Graph, rooms: &[String]) -> Vec<String> {
    let pos = |u: &str| rooms.iter().position(|r| r == u);
    let mut out = vec![];
    for ((a, b), uses) in g {
        if let (Some(ia), Some(ib)) = (pos(a), pos(b)) {
            if ib > ia {
                out.push(format!("{a} -> {b}: {}", uses[0].1));
            }
        }
    }
    out
}

#[test]
fn rooms_import_only_the_rooms_below_them() {
    let read = repo_reader();
    let krate = load_crate(&read).unwrap_or_else(|e| panic!("{e}"));
    let rooms = rooms(&read("src/lib.rs").expect("src/lib.rs"));
    assert!(rooms.len() > 10 && rooms.contains(&"tools".to_string()), "{rooms:?}");
    let up = upward(&top_level(&krate.graph()), &rooms);
    assert!(
        up.is_empty(),
        "imports from a lower room to a higher one (src/lib.rs declares the rooms lowest first):\n{}\nhint: move the \
         type the lower room needs down into it (or below it)",
        up.join("\n")
    );
}

#[test]
fn an_upward_import_is_found() {
    let mut g = Graph::new();
    g.insert(("data".into(), "model".into()), vec![(3, "crate::model::Llama (src/data/x.rs:3)".into())]);
    g.insert(("model".into(), "data".into()), vec![(4, "crate::data::Loader (src/model/y.rs:4)".into())]);
    let rooms = rooms("pub mod util;\npub mod data;\n// a comment\npub mod model;\n");
    assert_eq!(rooms, ["util", "data", "model"]);
    assert_eq!(upward(&g, &rooms), ["data -> model: crate::model::Llama (src/data/x.rs:3)"]);
}

#[test]
fn relative_paths_resolve_against_the_file_and_its_inline_modules() {
    let read = |p: &str| -> Option<String> {
        match p {
            "src/lib.rs" => Some("pub mod a;\npub mod b;\n".into()),
            "src/a/mod.rs" => Some("pub mod x;\npub mod y;\n".into()),
            "src/a/x.rs" => {
                Some("use super::y::f;\nmod inner { use super::super::super::b::g; fn h() { self::k(); } }\n".into())
            }
            "src/a/y.rs" => Some("pub fn f() {}\n".into()),
            "src/b.rs" => Some("pub fn g() {}\n".into()),
            _ => None,
        }
    };
    let krate = load_crate(&read).unwrap_or_else(|e| panic!("{e}"));
    let g = krate.graph();
    assert!(g.contains_key(&("src/a/x.rs".into(), "src/a/y.rs".into())), "{g:?}");
    assert!(g.contains_key(&("src/a/x.rs".into(), "src/b.rs".into())), "{g:?}");
    assert_eq!(g.len(), 2, "self::k inside `inner` stays in the file: {g:?}");
}

#[test]
fn the_real_crate_is_read_whole() {
    // guards against a parser that silently finds nothing: known modules and imports are there
    let krate = load_crate(&repo_reader()).unwrap_or_else(|e| panic!("{e}"));
    let seg = |s: &str| s.split("::").map(String::from).collect::<Vec<_>>();
    assert_eq!(krate.modules[&seg("ops::attention")], "src/ops/attention.rs");
    assert_eq!(krate.modules[&seg("train::metrics::mem")], "src/train/metrics.rs", "an inline module is its file");
    assert!(krate.modules.len() > 60, "{} modules", krate.modules.len());
    let g = krate.graph();
    let edge = |a: &str, b: &str| g.contains_key(&(a.to_string(), b.to_string()));
    assert!(edge("src/model/loss.rs", "src/ops/linear.rs"));
    assert!(edge("src/ops/emu/attention.rs", "src/ops/attention_shape.rs"));
    // relative paths are followed: `use super::params::..` and `super::{check_len, perturb, ..}`
    assert!(edge("src/train/step.rs", "src/train/params.rs"), "super:: is followed");
    assert!(edge("src/ops/emu/attention.rs", "src/ops/emu/perturb.rs"), "super::{{..}} groups are followed");
    assert!(g.len() > 150, "{} edges", g.len());
}

// ---------------------------------------------------------------- the parser on small strings

fn paths(src: &str) -> Vec<String> {
    scan(src).paths.into_iter().map(|p| p.segs.join("::")).collect()
}

#[test]
fn use_trees_groups_self_globs_and_renames() {
    assert_eq!(paths("use crate::x::{y, z::{w, v as u}};"), ["x::y", "x::z::w", "x::z::v"]);
    assert_eq!(paths("pub use crate::a::{self, b::*};"), ["a", "a::b"]);
    assert_eq!(paths("use crate::a::b as c;\nuse crate::{d, e::f};"), ["a::b", "d", "e::f"]);
    assert_eq!(paths("use crate::a::{\n    b,\n    c::{self, D},\n};"), ["a::b", "a::c", "a::c::D"]);
}

#[test]
fn inline_paths_and_what_is_not_a_path() {
    let src = r##"
        pub(crate) fn f() { crate::util::write_atomic(p, b)?; let x: crate::a::B::<T> = crate::c::D::new(); }
        macro_rules! m { () => { $crate::hidden::f() }; }
        pub(in crate::vis) struct S;
        // crate::commented::out
        /* crate::block /* nested */ crate::still_comment */
        const T: &str = "crate::in_string"; const R: &str = r#"crate::raw " string"#;
        fn lt<'a>(c: char) -> bool { c == '"' || c == '\'' } // a quote char must not open a string
        fn after() { crate::after::quotes(); }
    "##;
    assert_eq!(paths(src), ["util::write_atomic", "a::B", "c::D::new", "after::quotes"]);
    let s = scan(src);
    assert_eq!(s.paths.last().map(|p| p.line), Some(9), "lines are counted through comments and strings");
}

#[test]
fn unit_test_items_are_skipped() {
    let src = "use crate::a::B;\n#[cfg(test)]\nmod tests {\n    use crate::top::T;\n    fn f() { crate::x::y() }\n}\n#[cfg(test)]\nuse crate::t2::U;\nfn g() { crate::c::d() }";
    assert_eq!(paths(src), ["a::B", "c::d"]);
}

#[test]
fn modules_resolve_to_files_including_inline_and_mod_rs() {
    let files: BTreeMap<&str, &str> = [
        ("src/lib.rs", "pub mod a;\npub mod b;\nmod c { pub mod d { pub fn f() {} } }"),
        ("src/a.rs", "pub mod inner;\nmod tests { use crate::b::X; }"),
        ("src/a/inner.rs", "use crate::c::d::f;"),
        ("src/b/mod.rs", "pub struct X; pub fn g() { crate::a::inner::h() }"),
    ]
    .into_iter()
    .collect();
    let read = |p: &str| files.get(p).map(|s| s.to_string());
    let k = load_crate(&read).unwrap();
    let seg = |s: &str| s.split("::").filter(|x| !x.is_empty()).map(String::from).collect::<Vec<_>>();
    assert_eq!(k.resolve(&seg("a::inner::h")), "src/a/inner.rs");
    assert_eq!(k.resolve(&seg("b::X")), "src/b/mod.rs");
    assert_eq!(k.resolve(&seg("c::d::f")), "src/lib.rs", "inline modules live in their file");
    assert_eq!(k.resolve(&seg("a::tests::Y")), "src/a.rs");
    let g = k.graph();
    assert!(g.contains_key(&("src/a/inner.rs".into(), "src/lib.rs".into())));
    assert!(g.contains_key(&("src/a.rs".into(), "src/b/mod.rs".into())));
    // a declared module without its file names both candidates
    let bad = |p: &str| (p == "src/lib.rs").then(|| "mod gone;".to_string());
    let e = load_crate(&bad).err().unwrap_or_default();
    assert!(e.contains("src/gone.rs") && e.contains("src/gone/mod.rs"), "{e}");
}

#[test]
fn a_made_up_circle_is_found_printed_and_judged() {
    let files: BTreeMap<&str, &str> = [
        ("src/lib.rs", "pub mod ops;\npub mod emu;\npub mod util;\npub mod top;"),
        ("src/ops.rs", "use crate::emu::Kernel;\nuse crate::util::h;"),
        ("src/emu.rs", "pub enum Kernel {}\nfn f() { crate::top::g(); }"),
        ("src/top.rs", "pub fn g() { crate::ops::run(); }"),
        ("src/util.rs", "pub fn h() {}"),
    ]
    .into_iter()
    .collect();
    let read = |p: &str| files.get(p).map(|s| s.to_string());
    let g = load_crate(&read).unwrap().graph();
    let found = circles(&g);
    assert_eq!(found, vec![vec!["src/emu.rs".to_string(), "src/ops.rs".into(), "src/top.rs".into()]]);
    let text = describe(&found[0], &g);
    assert!(text.contains("src/ops.rs:1 -> src/emu.rs   crate::emu::Kernel"), "{text}");
    assert!(text.contains("src/top.rs:1 -> src/ops.rs   crate::ops::run"), "{text}");
    assert!(!text.contains("util"), "{text}");
    // unlisted: fails naming it; listed exactly: passes; listed but gone: fails (the list only shrinks)
    let e = check(&found, &[], &g).unwrap_err();
    assert!(e.contains("new import circle") && e.contains("crate::top::g") && e.contains("hint:"), "{e}");
    let listed: &[(&[&str], &str)] = &[(&["src/emu.rs", "src/ops.rs", "src/top.rs"], "test")];
    assert_eq!(check(&found, listed, &g), Ok(()));
    let e = check(&[], listed, &g).unwrap_err();
    assert!(e.contains("no such circle exists any more"), "{e}");
    // a listed circle that shrank is both gone and new
    let smaller: &[(&[&str], &str)] = &[(&["src/emu.rs", "src/ops.rs"], "test")];
    let e = check(&found, smaller, &g).unwrap_err();
    assert!(e.contains("new import circle") && e.contains("no such circle"), "{e}");
}

#[test]
fn a_layer_circle_without_a_file_circle_is_found() {
    let files: BTreeMap<&str, &str> = [
        ("src/lib.rs", "pub mod config;\npub mod comms;"),
        ("src/config.rs", "pub struct Section; fn f() { crate::comms::launch::defaults(); }"),
        ("src/comms/mod.rs", "pub mod launch;\npub mod zero;"),
        ("src/comms/launch.rs", "pub fn defaults() {}"),
        ("src/comms/zero.rs", "use crate::config::Section;"),
    ]
    .into_iter()
    .collect();
    let read = |p: &str| files.get(p).map(|s| s.to_string());
    let g = load_crate(&read).unwrap().graph();
    assert!(circles(&g).is_empty());
    let layers = top_level(&g);
    assert_eq!(circles(&layers), vec![vec!["comms".to_string(), "config".into()]]);
    let text = describe(&circles(&layers)[0], &layers);
    assert!(text.contains("config -> comms   crate::comms::launch::defaults (src/config.rs:1)"), "{text}");
}
