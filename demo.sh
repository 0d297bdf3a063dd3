#!/usr/bin/env bash
# The demo: tiny verifier, served on loopback by draftline's emulation of `vllm serve` (tiny_server) -> an evaluation set from held-out prompts
# answered by the verifier -> the parent measured on it -> training data answered by the verifier -> finetune
# from the tiny AQ-MedAI-layout parent (DeepSpeed ZeRO-2, 2 ranks; CPU here) -> the child measured on the same
# set -> export + register -> promote to Production (only if it beats its parent there) -> verified pull.
# Tracking: $MLFLOW_TRACKING_URI, else the embedded sqlite:///$PWD/mlflow.db.
set -euo pipefail
cd "$(dirname "$0")"
source .venv/bin/activate
export DRAFTLINE_TINY_DIR="$PWD/work/tiny"
# The tiny demo keeps to its 4 minutes on the in-process engine: real vLLM costs ~30 s a start, five starts here.
# demo_real.sh runs real vLLM; DRAFTLINE_VLLM_PYTHON=.venv-vllm/bin/python ./demo.sh runs this one on it too.
export DRAFTLINE_VLLM_PYTHON=${DRAFTLINE_VLLM_PYTHON:-off}
field() { python -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }
said() {  # evaluate's JSON as one line
  python -c "import json,sys; r=json.load(sys.stdin); print(f\"$1: acceptance length {r['measured_acceptance_length']}\"
    f\" measured (teacher-forced {r['teacher_forced_acceptance_length']}) on {r['prompts']} prompts, lossless:\"
    f\" {r['lossless']}, run {r['run_id']}\")" >&2; }
t0=$SECONDS; lap() { echo "== $1 took $((SECONDS - t0)) s" >&2; t0=$SECONDS; }

[ -f work/tiny/parent/model.safetensors ] || draftline make-tiny work/tiny >/dev/null
port=$(python -c "from draftline.util import free_port; print(free_port())")
python -m tests.kit.tiny_server work/tiny/verifier --port "$port" >work/tiny-server.log 2>&1 &
server=$!; trap 'kill $server 2>/dev/null' EXIT
until curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null; do sleep 0.5; done
endpoint="http://127.0.0.1:$port/v1"
lap "make-tiny + server"

evalset=$(draftline prepare --conversations configs/demo/eval_prompts.jsonl --verifier work/tiny/verifier \
            --name evaluation --regenerate-endpoint "$endpoint" --regenerate-max-tokens 32 --max-length 256 \
          | field data_uri)
data=$(draftline prepare --conversations configs/demo/conversations.jsonl --verifier work/tiny/verifier \
         --regenerate-endpoint "$endpoint" --regenerate-max-tokens 32 --max-samples 64 --max-length 256 \
         | field data_uri)
lap "prepare (evaluation set + training data, answered by the verifier)"
draftline evaluate --target tiny --data "$evalset" --max-new-tokens 24 | said "the parent"
lap "evaluate the parent"
run=$(draftline finetune --data "$data" --eval-data "$evalset" --init tiny --vocab rebuild --gpus 2 --zero-stage 2 \
        --steps 40 --tokens-per-batch 512 --lr 3e-3 --warmup-steps 0 --val-every 10 --save-every 10 | field run_id)
lap "finetune"
draftline evaluate --target "runs:/$run" --data "$evalset" --max-new-tokens 24 | said "the child"
version=$(draftline export --run "$run" --registered-model tiny-drafter | field version)
lap "evaluate the child + export"
draftline promote tiny-drafter "$version" --to Production
draftline pull tiny-drafter --stage Production --dest work/pulled
lap "promote + pull"
echo
echo "Registered models:/tiny-drafter/$version (Production). Open the UI with:"
echo "  mlflow ui --backend-store-uri ${MLFLOW_TRACKING_URI:-sqlite:///$PWD/mlflow.db}"
