#!/usr/bin/env bash
# One-command set-up: creates .venv and installs draftline with pinned dependencies.
#   ./setup.sh            runtime + test dependencies
# Safe to re-run; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --progress-bar off --upgrade "pip>=24" setuptools wheel

# 1. torch alone and first: the exact pin takes the CPU build where one is on disk; a range would pull CUDA.
echo "==> torch"
"${PIP[@]}" install -q --progress-bar off "torch==2.13.0"

# 2. everything else, with torch held at the installed version.
echo "==> runtime dependencies"
"${PIP[@]}" install -q --progress-bar off -r requirements.txt -r requirements-dev.txt

# 3. speculators without its declared torchvision/torchaudio (unused, and they break transformers here).
echo "==> speculators (no torchvision/torchaudio)"
"${PIP[@]}" install -q --progress-bar off --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
"${PIP[@]}" uninstall -q -y torchvision torchaudio 2>/dev/null || true

# 4. draftline itself, editable.
echo "==> draftline"
"${PIP[@]}" install -q --progress-bar off --no-deps -e .

"$VENV/bin/python" - <<'PY'
import torch, transformers, mlflow, deepspeed, speculators.version, safetensors  # noqa: F401
from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
print(f"ok: torch {torch.__version__}, transformers {transformers.__version__}, mlflow {mlflow.__version__}, "
      f"deepspeed {deepspeed.__version__}, speculators {speculators.version.version}")
PY
echo "==> done. Activate with: source $VENV/bin/activate"
