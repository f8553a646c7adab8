#!/usr/bin/env bash
# Print every import circle of src/ (between files and between top-level modules) and fail on any that
# tests/tools/import_cycles.rs does not list as known; the same check `cargo test` runs in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo test --test tools import_cycles -- --nocapture --test-threads 1
