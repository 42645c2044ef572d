#!/usr/bin/env bash
# Create .venv and install pita. torch is pinned FIRST so that no resolver ever picks an
# unpinned torch (which would pull several GB of CUDA packages on a CPU-only machine).
# uv installs, in half pip's time from nothing (docs/DESIGN.md §8 has the figures). uv does
# not read pip's configuration, which may name a folder holding the pinned torch's CPU wheel
# (this project's machines): uv is pointed at that folder when the wheel is there, and pip
# installs torch otherwise. The extras keep the torch installed here (uv leaves an installed
# package that satisfies a requirement).
#   TORCH_SPEC   torch requirement to install (default torch==2.13.0)
#   TORCH_INDEX  extra index for a CUDA build, e.g. https://download.pytorch.org/whl/cu128
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip "uv==0.13.9"
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
LINKS=$(pip config get global.find-links 2>/dev/null || echo "${PIP_FIND_LINKS:-}")
if [ -n "${TORCH_INDEX:-}" ]; then
  pip install -q "$TORCH_SPEC" --extra-index-url "$TORCH_INDEX"
elif [ -n "$LINKS" ] && ls "$LINKS/torch-${TORCH_SPEC#torch==}+cpu-"*.whl > /dev/null 2>&1; then
  uv pip install -q --compile-bytecode --find-links "$LINKS" "$TORCH_SPEC"
else
  pip install -q "$TORCH_SPEC"
fi
# --compile-bytecode: pip writes bytecode at install, uv only when asked; without it, where
# PYTHONDONTWRITEBYTECODE is set every process would compile torch's and transformers' sources
uv pip install -q --compile-bytecode -e ".[dev]"
# An editable install leaves pita's own modules uncompiled, and where PYTHONDONTWRITEBYTECODE
# is set (this project's CI machines) Python never caches them: every worker and every run
# would compile them again (0.05-0.1 s of CPU per process). Write the bytecode once here.
python -m compileall -q pita > /dev/null
python -c "import torch, transformers, trl, hydra; print(f'pita env ready: torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}')"
