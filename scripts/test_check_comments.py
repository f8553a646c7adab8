#!/usr/bin/env python3
"""Tests of scripts/check_comments.py's rules, run by .ci/run beside the check itself.

Each case is a small repository in a temporary directory: a copy of the checker in its scripts/, the
files of the case, `git init` so the checker lists them; the test runs it and compares the FILE:LINE
listing. Cases that must fail and cases that must pass, for the `words` rule (tracker items named
without a number) and the `hash` rule (what the config hash covers, described only by the function
that computes it).

Usage: python3 scripts/test_check_comments.py [-v]
"""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def run_checker(files):
    """The checker's (exit code, set of (path, line)) on a repository of `files` (path -> text)."""
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "scripts"))
        shutil.copy(os.path.join(HERE, "check_comments.py"), os.path.join(root, "scripts"))
        for path, text in files.items():
            full = os.path.join(root, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(text)
        subprocess.run(["git", "init", "-q", root], check=True)
        out = subprocess.run([sys.executable, os.path.join(root, "scripts", "check_comments.py")],
                             capture_output=True, text=True)
        hits = set()
        for line in out.stdout.splitlines():
            path, no, _ = line.split(":", 2)
            hits.add((path, int(no)))
        return out.returncode, hits


class Words(unittest.TestCase):
    def test_tracker_words_fail_in_comments_docs_and_messages(self):
        code, hits = run_checker({
            "src/a.rs": "// as the issue asked\n/// the issue's shapes\n// see this ticket\n"
                        "fn f() { bail!(\"the reviewers want this\") }\n",
            "scripts/s.py": '"""Reference: the shape the reviewer reported."""\n',
            "configs/c.toml": "# the reviewers' request\n",
            "docs/NOTES.md": "The Issue says so.\n",
            "CHANGELOG.md": "- done as that ticket asked\n",
            "README.md": "As per reviewers.\n",
        })
        self.assertEqual(code, 1)
        self.assertEqual(hits, {("src/a.rs", 1), ("src/a.rs", 2), ("src/a.rs", 3), ("src/a.rs", 4),
                                ("scripts/s.py", 1), ("configs/c.toml", 1), ("docs/NOTES.md", 1),
                                ("CHANGELOG.md", 1), ("README.md", 1)})

    def test_issue_as_a_verb_or_a_problem_passes(self):
        code, hits = run_checker({
            "src/a.rs": "// the thread that issues a collective, in issue order\n"
                        "// an issue with strided rows: the problem is the copy\n"
                        "// a rank issues its part; issues of the launch are named\n",
            "docs/NOTES.md": "Each rank issues collectives in the same order.\n",
        })
        self.assertEqual((code, hits), (0, set()))

    def test_benchmark_results_and_test_data_are_not_read(self):
        code, hits = run_checker({
            "benches/results/x.md": "the issue's setting\n",
            "tests/fixtures/t.json": "{\"text\": \"the reviewers\"}\n",
        })
        self.assertEqual((code, hits), (0, set()))


class Hash(unittest.TestCase):
    def test_describing_the_hash_elsewhere_fails(self):
        code, hits = run_checker({
            "src/x/mod.rs": "//! the config hash is the sha256 of the resolved TOML text\n"
                            "/// its resolved TOML text and that text's sha256\n"
                            "struct Resolved;\n",
            "src/y.rs": "/// sha256 of the resolved config\npub config_hash: String,\n"
                        "// `RunConfig::hash` of the resolved TOML\nfn other() {}\n",
            "docs/NOTES.md": "The config hash = hash of the resolved config.\n",
        })
        self.assertEqual(code, 1)
        self.assertEqual(hits, {("src/x/mod.rs", 1), ("src/x/mod.rs", 2), ("src/y.rs", 1), ("src/y.rs", 3),
                                ("docs/NOTES.md", 1)})

    def test_the_doc_comment_of_the_hashing_function_may_describe_it(self):
        code, hits = run_checker({
            "src/anywhere/deep.rs": "impl RunConfig {\n"
                                    "    /// sha256 of the resolved TOML's keys that differ from their defaults\n"
                                    "    #[inline]\n"
                                    "    pub fn hash(&self) -> String { todo!() }\n"
                                    "}\n"
                                    "/// SHA-256 of the resolved config text\n"
                                    "pub(crate) fn config_hash<T>(t: &str) -> [u8; 32] { todo!() }\n",
        })
        self.assertEqual((code, hits), (0, set()))

    def test_a_description_above_another_function_fails(self):
        # the exemption is the function's own doc block, not a nearby comment or another function's
        code, hits = run_checker({
            "src/z.rs": "/// sha256 of the resolved TOML\nfn load() {}\n"
                        "// sha256 of the resolved TOML\nfn hash() {}\n",
        })
        self.assertEqual(code, 1)
        self.assertEqual(hits, {("src/z.rs", 1), ("src/z.rs", 3)})

    def test_naming_the_hash_without_describing_it_passes(self):
        code, hits = run_checker({
            "src/a.rs": "// checked against the config hash (`RunConfig::hash`)\n"
                        "// the resolved config with its hash\n",
            "README.md": "Adding `[eval]` to a run in progress changes the config hash.\n",
        })
        self.assertEqual((code, hits), (0, set()))


if __name__ == "__main__":
    unittest.main()
