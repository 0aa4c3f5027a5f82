#!/usr/bin/env bash
# The checks a contributor runs before committing, and CI runs before the
# tests: lint, formatting and types. Run after scripts/setup.sh.
# ruff covers the whole repository: src, tests, scripts, examples, and (the
# formatter) the Python blocks of the Markdown files; not .venv, nor what
# .gitignore names.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
echo "checks passed: ruff (lint, format) and mypy"
