#!/usr/bin/env bash
# The mission's verifier family in miniature, on real vLLM (./setup.sh --vllm first): a Kimi-K2-shaped verifier
# (DeepSeek-V3: MLA + routed/shared experts) whose config, model and tokenizer ship as custom code, served by vLLM in
# bf16 -> vLLM answers GSM8K prompts and captures the hidden states (prepare --trust-remote-code --capture-backend
# vllm) -> finetune an MLA drafter (one DeepSeek-V3 MLA layer, as lightseekorg/kimi-k2.5-eagle3-mla) from the
# Kimi-shaped MLA parent (ZeRO-2, 2 ranks, --vocab rebuild) -> the parent and the child measured by vLLM on the same
# held-out set -> export (checked in vLLM) -> promote -> pull -> the pulled drafter served beside the verifier. vLLM
# serves an MLA drafter beside an MLA verifier on every CPU here (a Llama-layer one needs Intel AMX or a GPU).
# About 8 min on 2 cores (seven vLLM starts). Tracking: $MLFLOW_TRACKING_URI, else the embedded sqlite:///$PWD/mlflow.db.
set -euo pipefail
cd "$(dirname "$0")"
source .venv/bin/activate
export DRAFTLINE_TINY_KIMI_DIR="$PWD/work/tiny-kimi"
field() { python -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }
said() {  # evaluate's JSON as one line
  python -c "import json,sys; r=json.load(sys.stdin); print(f\"$1: acceptance length {r['measured_acceptance_length']}\"
    f\" measured on {r['backend']} (teacher-forced {r['teacher_forced_acceptance_length']}) on {r['prompts']} prompts,\"
    f\" lossless: {r['lossless']}\")" >&2; }
t0=$SECONDS; lap() { echo "== $1 took $((SECONDS - t0)) s" >&2; t0=$SECONDS; }

verifier=work/tiny-kimi/verifier
[ -f work/tiny-kimi/parent-mla/model.safetensors ] || draftline make-tiny work/tiny-kimi --family kimi --parent-steps 60 >/dev/null
lap "make-tiny --family kimi"

# the team's serving vLLM, here on loopback: bf16 (vLLM's CPU MLA backend serves no other), the custom code trusted
port=$(python -c "from draftline.util import free_port; print(free_port())")
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
  --model "$verifier" --served-model-name kimi --dtype bfloat16 --trust-remote-code --enforce-eager \
  --max-model-len 1024 --port "$port" >work/kimi-vllm.log 2>&1 &
server=$!; trap 'kill $server 2>/dev/null' EXIT
until curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null; do
  kill -0 $server 2>/dev/null || { echo "vLLM did not start: see work/kimi-vllm.log" >&2; exit 1; }; sleep 1
done
endpoint="http://127.0.0.1:$port/v1"
lap "vllm serve (the verifier)"

common=(--verifier "$verifier" --trust-remote-code --regenerate-endpoint "$endpoint" --regenerate-max-tokens 48
        --max-length 320 --capture-backend vllm)
evalset=$(draftline prepare --conversations configs/demo/gsm8k_test_prompts.jsonl --max-samples 12 --name evaluation \
            "${common[@]}" | field data_uri)
data=$(draftline prepare --conversations configs/demo/gsm8k_train_prompts.jsonl --max-samples 48 "${common[@]}" \
         | field data_uri)
kill $server; trap - EXIT
lap "prepare (answered and captured by vLLM)"
draftline evaluate --target tiny-kimi-mla --data "$evalset" --max-new-tokens 24 | said "the parent"
run=$(draftline finetune --data "$data" --eval-data "$evalset" --init tiny-kimi-mla --vocab rebuild --draft-vocab-size 256 \
        --gpus 2 --zero-stage 2 --steps 100 --tokens-per-batch 512 --lr 3e-3 --warmup-steps 0 --val-every 50 \
      | field run_id)
lap "evaluate the parent + finetune"
draftline evaluate --target "runs:/$run" --data "$evalset" --max-new-tokens 24 | said "the child"
version=$(draftline export --run "$run" --registered-model kimi-drafter | field version)
if draftline promote kimi-drafter "$version" --to Production; then  # the policy compares it with its parent
  draftline pull kimi-drafter --stage Production --dest work/kimi-pulled
else
  echo "not promoted (the line above says why); pulling the version itself" >&2
  draftline pull kimi-drafter --version "$version" --dest work/kimi-pulled
fi
lap "evaluate the child + export + promote + pull"
echo
echo "Registered models:/kimi-drafter/$version, pulled to work/kimi-pulled. Open the UI with:"
echo "  mlflow ui --backend-store-uri ${MLFLOW_TRACKING_URI:-sqlite:///$PWD/mlflow.db}"
