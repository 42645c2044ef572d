#!/usr/bin/env bash
# Create .venv and install pita. torch is pinned FIRST so that no resolver ever picks an
# unpinned torch (which would pull several GB of CUDA packages on a CPU-only machine).
# uv installs, in half pip's time from nothing (docs/DESIGN.md §8 has the figures), without
# compiling every installed file (scripts/compile_imports.py compiles what is used). uv does
# not read pip's configuration, which may name a folder holding the pinned torch's CPU wheel
# (this project's machines): uv is pointed at that folder when the wheel is there, and pip
# installs torch otherwise. The extras keep the torch installed here (uv leaves an installed
# package that satisfies a requirement).
#   TORCH_SPEC   torch requirement to install (default torch==2.13.0)
#   TORCH_INDEX  extra index for a CUDA build, e.g. https://download.pytorch.org/whl/cu128
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(command -v "${PYTHON:-python3}")  # the system's, found before the venv is on PATH
UV_SPEC="uv==0.13.9"
# The venv starts without pip (ensurepip installs it in 7 s); the system's pip puts uv in it
# (pip >= 22.3: --python), else the venv's own pip from ensurepip does. Then uv adds pip.
[ -d .venv ] || "$PY" -m venv --without-pip .venv
. .venv/bin/activate
if ! python -m uv --version > /dev/null 2>&1; then
  "$PY" -m pip --python .venv/bin/python install -q "$UV_SPEC" 2> /dev/null \
    || { python -m ensurepip > /dev/null && python -m pip install -q "$UV_SPEC"; }
fi
uv pip install -q pip  # the venv's own pip: the CUDA and fallback torch installs below use it
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
LINKS=$(pip config get global.find-links 2>/dev/null || echo "${PIP_FIND_LINKS:-}")
if [ -n "${TORCH_INDEX:-}" ]; then
  pip install -q "$TORCH_SPEC" --extra-index-url "$TORCH_INDEX"
elif [ -n "$LINKS" ] && ls "$LINKS/torch-${TORCH_SPEC#torch==}+cpu-"*.whl > /dev/null 2>&1; then
  uv pip install -q --find-links "$LINKS" "$TORCH_SPEC"
else
  pip install -q "$TORCH_SPEC"
fi
# Bytecode: pip compiles every file it installs (uv only when asked), 20k files; what runs
# and the suite import, a quarter of them, is compiled by importing it once (where
# PYTHONDONTWRITEBYTECODE is set, as on this project's CI machines, nothing else would cache
# it), and pita's own modules whole. scripts/compile_imports.py says why and what (once per
# set of installed packages: its stamp in .venv). Until torch has its bytecode, torch's own
# goes on beside the install of the rest (its outcome is not read: the script imports torch
# again).
TORCH_COMPILE=
if ! ls -d .venv/lib/python3*/site-packages/torch/__pycache__ > /dev/null 2>&1; then
  PYTHONDONTWRITEBYTECODE= python -c "import torch" > /dev/null 2>&1 &
  TORCH_COMPILE=$!
fi
uv pip install -q -e ".[dev]"
[ -z "$TORCH_COMPILE" ] || wait "$TORCH_COMPILE" || true
python -m compileall -q pita > /dev/null
python scripts/compile_imports.py
