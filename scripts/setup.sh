#!/usr/bin/env bash
# Create .venv and install pita. torch is pinned FIRST so that pip never resolves an
# unpinned torch (which would pull several GB of CUDA packages on a CPU-only machine).
#   TORCH_SPEC   torch requirement to install (default torch==2.13.0)
#   TORCH_INDEX  extra index for a CUDA build, e.g. https://download.pytorch.org/whl/cu128
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ -n "${TORCH_INDEX:-}" ]; then
  pip install -q "$TORCH_SPEC" --extra-index-url "$TORCH_INDEX"
else
  pip install -q "$TORCH_SPEC"
fi
pip install -q -e ".[dev]"
# An editable install leaves pita's own modules uncompiled, and where PYTHONDONTWRITEBYTECODE
# is set (this project's CI machines) Python never caches them: every worker and every run
# would compile them again (0.05-0.1 s of CPU per process). Write the bytecode once here.
python -m compileall -q pita > /dev/null
python -c "import torch, transformers, trl, hydra; print(f'pita env ready: torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}')"
