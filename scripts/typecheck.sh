#!/usr/bin/env bash
# Type-check the package as installed: the repository root is the `mleagle` package (package-dir in
# pyproject.toml), so mypy is pointed at a link named `mleagle` to it under build/ (ignored by git).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build/typecheck
ln -sfn ../.. build/typecheck/mleagle
PY="${PYTHON:-.venv/bin/python}"
MYPYPATH=build/typecheck exec "$PY" -m mypy -p mleagle "$@"
