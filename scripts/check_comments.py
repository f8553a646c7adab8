#!/usr/bin/env python3
"""Comment and doc hygiene, run by scripts/check-comments.sh: comments and docs are written for a reader
who has only this repository, so they say the why themselves and name files that exist.

Four checks, each failure printed as FILE:LINE so an editor can jump to it:

  refs   an issue-tracker number (the word issue, then a number) or a section pointer into a spec or
         design note that is not in the repository (spec or DESIGN, then a section sign and a number;
         spec A, then a number). The reader can follow neither.
  words  a tracker item named without a number: "the issue", "this issue", "that issue", "issue's",
         the same four with "ticket", and "reviewer(s)" in any form. They point at a discussion the
         reader cannot see; say what was asked and why instead. "issue" as a verb ("a rank issues a
         collective", "in issue order") and after "an" ("an issue with X") passes; to mean a problem,
         write "the problem".
  hash   a description of what the config hash is computed from ("sha256 of the resolved TOML", "hash
         of the resolved config", "the config hash is the sha256 of ...") anywhere but the doc comment
         of the function that computes it (a `///` block on `fn hash(` or `fn ..._hash(`): the rule
         has one owner, and a second description drifts from the code (the hash once changed from the
         TOML text to the keys that differ from their defaults, and comments elsewhere still said text).
  paths  a repository path named in a comment or a doc that does not exist (a file moved or renamed
         and its mentions not updated). Only tokens that start with a top-level directory of this
         repository and end in a file extension or `/` are checked; globs and placeholders
         (`*`, `{a,b}`, `<name>`, `NAME`, one-letter names such as `src/a/b.rs`) are skipped, and
         `FILE:LINE` is checked without the line. URLs and `owner/repo:path` (another repository) are
         not repository paths.

Which text is read: `refs`, `words` and `hash` read every line of the code and prose of src kernels tests
scripts configs benches .ci, build.rs, Cargo.toml and README.md (a user-facing message must not point at a
tracker either); `words` and `hash` also read docs/*.md and CHANGELOG.md. `paths` reads the comments of
Rust/CUDA/C (`//`, `/* */`) and of shell/Python/TOML (`#`) files, and the whole of README.md and docs/*.md. String literals in code are not comments and
are skipped, so a test's file name in a string does not count. Test data (JSON, text and binary
fixtures under tests/golden, tests/data, tests/fixtures) is not read at all.

Usage: check_comments.py [PATH...]   (default: the whole repository; paths restrict the files read)
"""

import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# The checker and its tests name its own patterns; they are not violations of them.
SELF = {"scripts/check-comments.sh", "scripts/check_comments.py", "scripts/test_check_comments.py"}

# Trees read by the `refs` check (README.md is added by name below).
REFS_TREES = ("src/", "kernels/", "tests/", "scripts/", "configs/", "benches/", ".ci/")
REFS_FILES = {"README.md", "build.rs", "Cargo.toml"}
# Measurements name the commit and date they were taken at; that is their data, not a diary.
REFS_SKIP_TREES = ("benches/results/",)

# Trees whose data files are inputs of tests (golden outputs, fixtures), not prose.
DATA_TREES = ("tests/golden/", "tests/data/", "tests/fixtures/")
DATA_EXT = (".json", ".jsonl", ".txt", ".bin", ".safetensors", ".npy", ".csv", ".parquet", ".zst", ".model")

PROSE_EXT = (".md", ".yaml", ".yml")

SLASH_EXT = (".rs", ".cu", ".cuh", ".h", ".c", ".cc", ".cpp")
HASH_EXT = (".sh", ".py", ".toml")

REF_RE = re.compile(r"\bissues?[ ]+#?[0-9]+|\bissue#[0-9]+|\bspec\s*(§|A[0-9]+\b)|\bDESIGN(\.md)?\s*§", re.IGNORECASE)
# Prose read by `words` and `hash` besides the `refs` trees.
PROSE_FILES = {"CHANGELOG.md"}
WORDS_RE = re.compile(r"\b(?:the|this|that)\s+(?:issue|ticket)\b|\b(?:issue|ticket)'s\b|\breviewers?\b", re.IGNORECASE)
# What a hash is computed from, said of the config: "sha256 of the resolved TOML", "`RunConfig::hash` of
# the resolved config", "the config hash is the sha256 of ...", "its resolved TOML text and that text's sha256".
HASH_RE = re.compile(
    r"\b(?:sha-?256|hash|digest)`?\s+(?:of|over)\s+(?:the\s+|its\s+|a\s+run's\s+)?resolved\s+(?:toml|config)"
    r"|\bconfig(?:uration)?[ _]hash\b[^.;]{0,30}?\b(?:is|=)\s+(?:the\s+)?(?:sha-?256|hash|digest)\b"
    r"|\btext's\s+(?:sha-?256|hash|digest)\b",
    re.IGNORECASE)
# The function that owns the rule: its `///` block may describe it.
HASH_FN_RE = re.compile(r"^\s*(?:pub(?:\([\w:]+\))?\s+)?fn\s+(?:\w+_)?hash\s*[<(]")

TOP = ("src", "tests", "kernels", "scripts", "configs", "benches", "docs", "third_party", "assets", ".ci")
PATH_EXT = (".rs", ".cu", ".cuh", ".h", ".sh", ".py", ".toml", ".md", ".json", ".txt")
# A path token: one of the top-level directories at a word boundary (not inside a URL or `../x/src/`),
# then path characters. `:` stays in so `FILE:LINE` is seen whole and the line can be cut off.
PATH_RE = re.compile(r"(?<![\w./~:-])((?:%s)/[\w./*{}<>@+:,-]*)" % "|".join(re.escape(t) for t in TOP))
# Upper-case words that stand for a name in a path pattern (`third_party/NAME.patch`, `YYYYMMDD`).
PLACEHOLDER_RE = re.compile(r"(?<![A-Za-z])(NAME|DIR|FILE|PATH|STAGE|TASK|RUN|DATE|YYYY\w*|X|N)(?![a-z])")


def git_files():
    out = subprocess.run(
        ["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True, capture_output=True,
    ).stdout
    # A file moved in the working tree but not yet committed is still listed by --cached: keep what exists.
    return sorted({p for p in out.decode().split("\0") if p and os.path.isfile(os.path.join(ROOT, p))})


def kind(path):
    """'slash', 'hash', 'doc' or None (not read for paths)."""
    if path.endswith(SLASH_EXT):
        return "slash"
    if path.endswith(HASH_EXT):
        return "hash"
    if path == "README.md" or (path.startswith("docs/") and path.endswith(".md")):
        return "doc"
    if "." not in os.path.basename(path) and path.startswith((".ci/", "scripts/")):
        return "hash"  # extensionless scripts (.ci/run)
    return None


def is_data(path):
    return path.startswith(DATA_TREES) and path.endswith(DATA_EXT)


def slash_comments(text):
    """(line, comment text) of every // and /* */ comment, skipping string and char literals."""
    out = []
    i, n, line = 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append((line, text[i + 2:j]))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j
            for k, part in enumerate(text[i + 2:j].split("\n")):
                out.append((line + k, part))
            line += text.count("\n", i, j)
            i = j + 2
        elif c == "r" and re.match(r'r#*"', text[i:i + 8]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = len(re.match(r'r(#*)"', text[i:]).group(1))
            start = i + 2 + hashes
            j = text.find('"' + "#" * hashes, start)
            j = n if j < 0 else j
            line += text.count("\n", i, j)
            i = j + 1 + hashes
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            line += text.count("\n", i, j)
            i = j + 1
        elif c == "'":
            # a char literal ('"', '\'', '\u{..}'); a lifetime ('a) has no closing quote nearby
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'\n])'", text[i:i + 12])
            i += len(m.group(0)) if m else 1
        else:
            i += 1
    return out


def hash_comments(text):
    """(line, comment text) of every # comment in shell, Python or TOML, skipping quoted strings."""
    out = []
    for no, raw in enumerate(text.split("\n"), 1):
        quote = None
        i = 0
        while i < len(raw):
            c = raw[i]
            if quote:
                if c == "\\" and quote == '"':
                    i += 1
                elif c == quote:
                    quote = None
            elif c in "\"'":
                quote = c
            elif c == "#" and (i == 0 or raw[i - 1] in " \t;(") and not raw.startswith("#!", i):
                out.append((no, raw[i + 1:]))
                break
            i += 1
    return out


def doc_lines(text):
    return list(enumerate(text.split("\n"), 1))


def hash_fn_docs(lines):
    """Line numbers (1-based) of the `///` blocks that document a `fn hash(` / `fn ..._hash(`: the one
    place a description of what a hash covers belongs."""
    owned = set()
    block = []
    for no, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("///"):
            block.append(no)
        elif stripped.startswith("#[") and block:
            continue  # attributes between the doc comment and the fn
        else:
            if block and HASH_FN_RE.match(line):
                owned.update(block)
            block = []
    return owned


def line_problems(path, text, refs=True):
    """(line, message) of the `words` and `hash` checks, and of `refs` when `refs`: they read whole lines."""
    lines = text.split("\n")
    owned = hash_fn_docs(lines) if path.endswith(".rs") else set()
    out = []
    for no, line in enumerate(lines, 1):
        m = REF_RE.search(line) if refs else None
        if m:
            out.append((no, f"'{m.group(0)}': points to a tracker or a document outside the repository; "
                        "say the reason itself"))
        m = WORDS_RE.search(line)
        if m:
            out.append((no, f"'{m.group(0)}': names a tracker item or its discussion, which the reader cannot "
                        "see; say what was asked and why (a problem: 'the problem')"))
        m = HASH_RE.search(line)
        if m and no not in owned:
            out.append((no, f"'{m.group(0)}': describes what the config hash covers; only the doc comment of "
                        "the function that computes it may (name it instead: `RunConfig::hash`)"))
    return out


def clean_token(tok):
    tok = re.sub(r":[0-9][0-9,-]*.*$", "", tok)  # FILE:LINE, FILE:12-30
    tok = tok.rstrip(".,;:)]'\"`")
    return tok


def skipped(tok):
    if any(ch in tok for ch in "*{}<>") or "..." in tok or PLACEHOLDER_RE.search(tok):
        return True
    # one-letter names stand for any module or file (`src/a/b.rs`)
    return any(len(part.split(".")[0]) == 1 for part in tok.rstrip("/").split("/")[1:])


def hint(tok, by_name):
    base = os.path.basename(tok.rstrip("/"))
    if tok.endswith("/"):
        cands = [d + "/" for d in by_name.get(base + "/", [])]
    else:
        cands = by_name.get(base, [])
    if cands:
        return "moved? the repository has " + ", ".join(cands[:3])
    return "nothing by that name in the repository: name what replaced it, or drop the path"


def main(argv):
    restrict = [os.path.relpath(os.path.abspath(a), ROOT).rstrip("/") for a in argv]
    files = git_files()
    by_name = {}  # file name -> files, "dir/" -> directories, for the hints
    dirs = set()
    for p in files:
        by_name.setdefault(os.path.basename(p), []).append(p)
        d = os.path.dirname(p)
        while d:
            dirs.add(d)
            d = os.path.dirname(d)
    for d in sorted(dirs):
        by_name.setdefault(os.path.basename(d) + "/", []).append(d)

    def selected(p):
        return not restrict or any(r in (".", "") or p == r or p.startswith(r + "/") for r in restrict)

    fails = []
    for path in files:
        if path in SELF or not selected(path) or is_data(path):
            continue
        k = kind(path)
        # prose and code only: a data file (a word list, a table) may hold the word and a number as data
        in_refs = ((path.startswith(REFS_TREES) or path in REFS_FILES) and not path.startswith(REFS_SKIP_TREES)
                   and (k is not None or path.endswith(PROSE_EXT)))
        in_words = in_refs or k == "doc" or path in PROSE_FILES
        if k is None and not in_words:
            continue
        try:
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue  # binary
        if in_words:
            fails.extend((path, no, msg) for no, msg in line_problems(path, text, refs=in_refs))
        if k is None:
            continue
        chunks = slash_comments(text) if k == "slash" else hash_comments(text) if k == "hash" else doc_lines(text)
        for no, chunk in chunks:
            seen = set()  # `[docs/x.md](docs/x.md)` is one problem
            for m in PATH_RE.finditer(chunk):
                tok = clean_token(m.group(1))
                if tok in seen or skipped(tok) or not (tok.endswith("/") or tok.endswith(PATH_EXT)):
                    continue
                seen.add(tok)
                if not os.path.exists(os.path.join(ROOT, tok)):
                    fails.append((path, no, f"missing path '{tok}' ({hint(tok, by_name)})"))

    for path, no, msg in fails:
        print(f"{path}:{no}: {msg}")
    if fails:
        print(f"check-comments: {len(fails)} problem(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
