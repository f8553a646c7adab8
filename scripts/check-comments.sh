#!/usr/bin/env bash
# Comments and docs name what the repository holds and say the why themselves: fails (exit 1, FILE:LINE
# listings on stdout) on
#   - issue-tracker numbers and section pointers into specs or design notes outside the repository
#     (src kernels tests scripts configs benches .ci, build.rs, Cargo.toml, README.md);
#   - tracker items named without a number ("the issue", "this ticket", "issue's", "reviewer(s)"), and a
#     description of what the config hash covers anywhere but the doc comment of the function that
#     computes it (the same files, docs/*.md and CHANGELOG.md);
#   - repository paths named in comments (`//` in .rs/.cu/.cuh/.h, `#` in .sh/.py/.toml) or in README.md and
#     docs/*.md that do not exist, with the file of the same name where one exists elsewhere.
# Test data (fixtures under tests/golden, tests/data, tests/fixtures) and benches/results/ are not read.
# The rules and what counts as a path: scripts/check_comments.py; their tests: scripts/test_check_comments.py.
#
#   scripts/check-comments.sh            # the whole repository (from any directory)
#   scripts/check-comments.sh kernels    # only the files under the given paths
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
command -v python3 >/dev/null || { echo "check-comments: python3 not found; hint: install Python 3" >&2; exit 2; }
exec python3 "$here/check_comments.py" "$@"
