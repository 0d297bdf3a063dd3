#!/usr/bin/env bash
# The demo: tiny verifier -> prepare -> finetune from the tiny AQ-MedAI-layout parent (DeepSpeed ZeRO-2,
# 2 ranks; CPU here) -> export + register -> promote to Production -> verified pull.
# Tracking: $MLFLOW_TRACKING_URI, else the embedded sqlite:///$PWD/mlflow.db.
set -euo pipefail
cd "$(dirname "$0")"
source .venv/bin/activate
export DRAFTLINE_TINY_DIR="$PWD/work/tiny"
field() { python -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }
t0=$SECONDS; lap() { echo "== $1 took $((SECONDS - t0)) s" >&2; t0=$SECONDS; }

[ -f work/tiny/parent/model.safetensors ] || draftline make-tiny work/tiny >/dev/null
lap "make-tiny"
data=$(draftline prepare --conversations configs/demo/conversations.jsonl --verifier work/tiny/verifier \
         --max-length 256 | field data_uri)
lap "prepare"
run=$(draftline finetune --data "$data" --init tiny --gpus 2 --zero-stage 2 --steps 30 --tokens-per-batch 512 \
        --lr 5e-4 --save-every 10 | field run_id)
lap "finetune"
version=$(draftline export --run "$run" --registered-model tiny-drafter | field version)
lap "export"
draftline promote tiny-drafter "$version" --to Production
draftline pull tiny-drafter --stage Production --dest work/pulled
lap "promote + pull"
echo
echo "Registered models:/tiny-drafter/$version (Production). Open the UI with:"
echo "  mlflow ui --backend-store-uri ${MLFLOW_TRACKING_URI:-sqlite:///$PWD/mlflow.db}"
