#!/usr/bin/env bash
# The checks a contributor runs before committing, and CI runs before the
# tests: lint, formatting and types. Run after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check src tests
.venv/bin/ruff format --check src tests
.venv/bin/mypy
echo "checks passed: ruff (lint, format) and mypy"
