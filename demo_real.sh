#!/usr/bin/env bash
# The real tier: the user's story on a real verifier, SmolLM2-135M-Instruct, on the CPU.
#   general parent: MT-Bench (4 categories) + ShareGPT dummy questions answered by SmolLM2 -> prepare -> finetune
#                   from random init -> export --layout midlayer: our stand-in for AQ-MedAI
#   team traffic:   GSM8K train prompts answered by SmolLM2 -> finetune from that parent (vocab rebuild) ->
#                   evaluate parent and child on held-out GSM8K test prompts (the set promotion reads) and on the
#                   4 held-out MT-Bench categories -> export -> promote to Production (only if the child beats it)
# Needs `./setup.sh --real` (or a built verifier in $DRAFTLINE_CACHE_DIR).
# Tracking: $MLFLOW_TRACKING_URI, else the embedded sqlite:///$PWD/mlflow.db. Prints one JSON summary at the end
# (also written to work/real/summary.json).
set -euo pipefail
cd "$(dirname "$0")"
[ -n "${VIRTUAL_ENV:-}" ] || source .venv/bin/activate
PY=${DRAFTLINE_PYTHON:-python}
dl() { "$PY" -m draftline.cli "$@"; }
field() { "$PY" -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }
t0=$SECONDS; lap() { echo "== $1 took $((SECONDS - t0)) s" >&2; t0=$SECONDS; }
export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-sqlite:///$PWD/mlflow.db}

# Sizes: REAL_SCALE=quick (the default: about half an hour on 2 cores) or full (over an hour; less once the
# parent is cached); docs/results.md gives the measured times. Any REAL_* variable below overrides its preset.
case "${REAL_SCALE:-quick}" in
  quick) p_mt=2  p_share=8  p_ggsm=0   p_gtrain=64  p_geval=16 p_psteps=50  p_csteps=60  p_val=15 p_evp=8  p_evn=48 p_xc=true ;;
  full)  p_mt=10 p_share=40 p_ggsm=200 p_gtrain=768 p_geval=32 p_psteps=400 p_csteps=1200 p_val=100 p_evp=16 p_evn=96 p_xc=false ;;
  *) echo "demo_real.sh: REAL_SCALE is quick or full, not ${REAL_SCALE}" >&2; exit 2 ;;
esac
HELD_OUT=${REAL_HELD_OUT:-reasoning,math,coding,humanities}   # MT-Bench categories the parent never sees
MT_PER_CATEGORY=${REAL_MT_PER_CATEGORY:-$p_mt}  # MT-Bench questions per category (10: all 80)
SHAREGPT=${REAL_SHAREGPT:-$p_share}    # ShareGPT dummy conversations in the parent's data
GENERAL_GSM=${REAL_GENERAL_GSM:-$p_ggsm} # GSM8K train prompts in the parent's data, from the end of the file
GSM_TRAIN=${REAL_GSM_TRAIN:-$p_gtrain} # GSM8K train prompts: the team's traffic
GSM_EVAL=${REAL_GSM_EVAL:-$p_geval}    # GSM8K test prompts: the evaluation set (never trained on)
MAX_TOKENS=${REAL_MAX_TOKENS:-192}     # most tokens per regenerated reply
PARENT_STEPS=${REAL_PARENT_STEPS:-$p_psteps}
CHILD_STEPS=${REAL_CHILD_STEPS:-$p_csteps}
PARENT_LR=${REAL_PARENT_LR:-1e-3}
CHILD_LR=${REAL_CHILD_LR:-1e-3}        # the recipe: benchmarks/results/recipe-smollm2.json says why
read -r -a FINETUNE_ARGS <<<"${REAL_FINETUNE_ARGS:-}"  # more finetune flags for parent and child, e.g. --hidden-noise 0.05
VAL_EVERY=${REAL_VAL_EVERY:-$p_val}    # validation (on the evaluation set, for the child) every N steps
TOKENS=${REAL_TOKENS_PER_BATCH:-1024}  # per rank per step
EVAL_PROMPTS=${REAL_EVAL_PROMPTS:-$p_evp}  # prompts measured by chain speculative decoding, per set
EVAL_NEW=${REAL_EVAL_NEW_TOKENS:-$p_evn}
CROSS_CHECK=${REAL_CROSS_CHECK:-$p_xc}  # also measure in-process beside vLLM (quick: yes; full: it would double evaluation)
BATCH=${REAL_SERVER_BATCH:-32}         # the loopback server batches this many greedy requests per generate
RANKS=${REAL_RANKS:-2}
PRECISION=${REAL_PRECISION:-auto}      # auto: finetune measures bf16 against fp32 on this CPU and picks the faster
CAPTURE_BATCH=${REAL_CAPTURE_BATCH:-2} # conversations per verifier forward when capturing (memory: ~1 GB each)
DRAFT_VOCAB=${REAL_DRAFT_VOCAB:-8192}  # the parent's draft vocabulary (the child rebuilds one of this size)
W=work/real
mkdir -p "$W"

verifier=$(dl make-verifier smollm2 | field path)
lap "make-verifier"
port=$("$PY" -c "from draftline.util import free_port; print(free_port())")
# The verifier answers the prompts through `vllm serve` (real vLLM, from ./setup.sh --vllm), as on a cluster;
# without that venv, through draftline's emulation of it (tiny_server: transformers, batched greedy requests).
VLLM_PY=${DRAFTLINE_VLLM_PYTHON:-$PWD/.venv-vllm/bin/python}
if [ "${REAL_SERVER:-vllm}" = vllm ] && [ -x "$VLLM_PY" ]; then
  server_kind=vllm
  echo "== regeneration: real vLLM ($VLLM_PY -m vllm.entrypoints.openai.api_server, float32)" >&2
  VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} HF_HUB_OFFLINE=1 setsid "$VLLM_PY" -m vllm.entrypoints.openai.api_server \
    --model "$verifier" --served-model-name smollm2 --dtype float32 --host 127.0.0.1 --port "$port" \
    --max-model-len 2048 --max-num-seqs "$BATCH" >"$W/server.log" 2>&1 &
else
  server_kind=tiny_server
  echo "== regeneration: no vLLM venv (./setup.sh --vllm), so draftline's EMULATION of vllm serve (tiny_server)" >&2
  setsid "$PY" -m tests.kit.tiny_server "$verifier" --port "$port" --served-model-name smollm2 \
    --max-batch "$BATCH" >"$W/server.log" 2>&1 &
fi
server=$!
stop_server() { kill -- -"$server" 2>/dev/null || kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; }
trap stop_server EXIT INT TERM
endpoint="http://127.0.0.1:$port/v1"
"$PY" - "$endpoint" "$server" <<'EOF'
import os, sys, time, urllib.request
for _ in range(1800):
    try:
        urllib.request.urlopen(sys.argv[1] + "/models", timeout=2).read(); break
    except OSError:
        try:
            os.kill(int(sys.argv[2]), 0)
        except OSError:
            sys.exit("the loopback server died while starting: see work/real/server.log")
        time.sleep(0.5)
else:
    sys.exit("the loopback server did not start: see work/real/server.log")
EOF
lap "server up"
regen=(--verifier "$verifier" --batch-size "$CAPTURE_BATCH" --regenerate-endpoint "$endpoint" --regenerate-max-tokens "$MAX_TOKENS"
       --regenerate-concurrency "$BATCH" --regenerate-temperature 0)

# 1. the general parent (stand-in for AQ-MedAI): MT-Bench minus the held-out categories, ShareGPT questions and
#    GSM8K train prompts from the far end of the file (never the team's: those are the first $GSM_TRAIN), as public
#    parents' general data carry maths. Built once per machine and settings, then reused from the cache
#    ($DRAFTLINE_CACHE_DIR/parents, default ~/.cache/draftline/parents; REAL_PARENT_CACHE=0 builds it again).
# MT-Bench, MT_PER_CATEGORY questions of each category: the parent's four, and the held-out evaluation set
"$PY" -c "import collections, json, sys
seen = collections.Counter()
for line in open('configs/demo/mt_bench_questions.jsonl'):
    seen[json.loads(line)['category']] += 1
    if seen[json.loads(line)['category']] <= int(sys.argv[1]):
        print(line.strip())" "$MT_PER_CATEGORY" >"$W/mt_bench.jsonl"
CACHE=${DRAFTLINE_CACHE_DIR:-$HOME/.cache/draftline}
# the key: every setting that changes the parent, the input files, and draftline's version
parent_key=$( { printf '%s\n' "$(basename "$verifier")" "$HELD_OUT" "$MT_PER_CATEGORY" "$SHAREGPT" "$GENERAL_GSM" \
  "$MAX_TOKENS" "$PARENT_STEPS" "$PARENT_LR" "$TOKENS" "$RANKS" "$PRECISION" "$DRAFT_VOCAB" "$server_kind" \
  "${REAL_FINETUNE_ARGS:-}" "$VAL_EVERY" "$("$PY" -c 'import importlib.metadata as m; print(m.version("draftline"))')"
  sha256sum configs/demo/mt_bench_questions.jsonl configs/demo/sharegpt_dummy_questions.jsonl \
            configs/demo/gsm8k_train_prompts.jsonl; } | sha256sum | cut -c1-16)
cached="$CACHE/parents/smollm2-general-$parent_key"
if [ "${REAL_PARENT_CACHE:-1}" = 1 ] && [ -f "$cached/build.json" ]; then
  parent="$cached/midlayer"
  parent_run=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['finetune_run'])" "$cached/build.json")
  parent_source=cache
  echo "== the general parent from the cache: $cached (REAL_PARENT_CACHE=0 builds it again)" >&2
  lap "general parent (cached)"
else
  parent_t0=$SECONDS
  cat "$W/mt_bench.jsonl" <(head -n "$SHAREGPT" configs/demo/sharegpt_dummy_questions.jsonl) \
      <(tail -n "$GENERAL_GSM" configs/demo/gsm8k_train_prompts.jsonl | head -n "$GENERAL_GSM") >"$W/general_prompts.jsonl"
  drop=$(echo "$HELD_OUT" | sed 's/\([^,]*\)/!\1/g')
  general=$(dl prepare --conversations "$W/general_prompts.jsonl" --categories "$drop" --name general "${regen[@]}" \
              | field data_uri)
  lap "prepare general (regenerate + capture)"
  parent_run=$(dl finetune --data "$general" --init random --draft-vocab-size "$DRAFT_VOCAB" --gpus "$RANKS" \
                 --steps "$PARENT_STEPS" --tokens-per-batch "$TOKENS" --precision "$PRECISION" --lr "$PARENT_LR" \
                 --warmup-steps 20 --val-every "$VAL_EVERY" "${FINETUNE_ARGS[@]}" | field run_id)
  lap "finetune parent from random init"
  parent_export=$(dl export --run "$parent_run" --registered-model smollm2-general-drafter --layout midlayer \
                    | field run_id)
  mkdir -p "$CACHE/parents"
  tmp_parent=$(mktemp -d "$cached.XXXXXX")   # two builds at once never share a half-written directory
  "$PY" -c "import mlflow,sys; mlflow.artifacts.download_artifacts(run_id=sys.argv[1], \
    artifact_path='midlayer', dst_path=sys.argv[2])" "$parent_export" "$tmp_parent" >/dev/null
  "$PY" -c "import json,sys; json.dump(dict(zip(['finetune_run', 'export_run', 'tracking_uri', 'build_s'], \
    sys.argv[1:4] + [int(sys.argv[4])])), open(sys.argv[5], 'w'), indent=2)" "$parent_run" "$parent_export" \
    "$MLFLOW_TRACKING_URI" "$((SECONDS - parent_t0))" "$tmp_parent/build.json"
  rm -rf "$cached" && mv "$tmp_parent" "$cached"   # whole or not at all: a stopped build leaves no parent behind
  parent="$cached/midlayer"
  parent_source=built
  lap "export parent (midlayer layout) into $cached"
fi
# 2. the team's traffic and the evaluation sets (held out: never trained on)
team=$(dl prepare --conversations configs/demo/gsm8k_train_prompts.jsonl --max-samples "$GSM_TRAIN" --name team-gsm8k \
         "${regen[@]}" | field data_uri)
lap "prepare team traffic (GSM8K train)"
evaluation=$(dl prepare --conversations configs/demo/gsm8k_test_prompts.jsonl --max-samples "$GSM_EVAL" \
               --name evaluation "${regen[@]}" | field data_uri)
mt_held=$(dl prepare --conversations "$W/mt_bench.jsonl" --categories "$HELD_OUT" \
            --name mt-bench-held-out "${regen[@]}" | field data_uri)
lap "prepare evaluation sets (GSM8K test, MT-Bench held out)"
stop_server   # free the cores for training

# 3. the child: finetuned from the parent on the team's traffic, validated on the evaluation set
child_run=$(dl finetune --data "$team" --init "$parent" --vocab rebuild --eval-data "$evaluation" --gpus "$RANKS" \
              --steps "$CHILD_STEPS" --tokens-per-batch "$TOKENS" --precision "$PRECISION" --lr "$CHILD_LR" --warmup-steps 10 --val-every "$VAL_EVERY" "${FINETUNE_ARGS[@]}" \
              | field run_id)
lap "finetune child from the parent"
# measured on a loopback vLLM when the venv is there (evaluate's default), with the in-process chain beside it
ev=(--measured true --max-prompts "$EVAL_PROMPTS" --max-new-tokens "$EVAL_NEW" --cross-check "$CROSS_CHECK")
dl evaluate --target "$parent" --data "$evaluation" "${ev[@]}" >"$W/eval-parent-gsm8k.json"
dl evaluate --target "runs:/$child_run" --data "$evaluation" "${ev[@]}" >"$W/eval-child-gsm8k.json"
dl evaluate --target "$parent" --data "$mt_held" "${ev[@]}" >"$W/eval-parent-mtbench.json"
dl evaluate --target "runs:/$child_run" --data "$mt_held" "${ev[@]}" >"$W/eval-child-mtbench.json"
lap "evaluate parent and child (GSM8K test, MT-Bench held out)"
version=$(dl export --run "$child_run" --registered-model smollm2-gsm8k-drafter | field version)
lap "export child"
promoted=true
dl promote smollm2-gsm8k-drafter "$version" --to Production || promoted=false
lap "promote"

"$PY" - "$W" "$version" "$promoted" "$parent_run" "$child_run" "$server_kind" "$parent" "$parent_source" <<'EOF' | tee "$W/summary.json"
import json, os, sys
w, version, promoted, parent_run, child_run, server_kind, parent, parent_source = sys.argv[1:]
def ev(name):
    r = json.load(open(f"{w}/eval-{name}.json"))
    return {k: r.get(k) for k in ("teacher_forced_acceptance_length", "teacher_forced_walk_acceptance_length",
                                  "measured_acceptance_length", "predicted_acceptance_length",
                                  "inprocess_acceptance_length", "backend", "acceptance_rate_per_position",
                                  "lossless", "prompts", "speedup")}
build = os.path.join(os.path.dirname(parent), "build.json")  # a cached parent's build record
print(json.dumps({"model": f"models:/smollm2-gsm8k-drafter/{version}", "promoted": promoted == "true",
                  "parent": {"path": parent, "source": parent_source,
                             "build": json.load(open(build)) if os.path.isfile(build) else None},
                  "scale": os.environ.get("REAL_SCALE", "quick"), "regeneration_server": server_kind,
                  "parent_finetune_run": parent_run, "child_finetune_run": child_run,
                  "gsm8k_test": {"parent": ev("parent-gsm8k"), "child": ev("child-gsm8k")},
                  "mt_bench_held_out": {"parent": ev("parent-mtbench"), "child": ev("child-mtbench")}}, indent=2))
EOF
echo
echo "Open the UI with:  mlflow ui --backend-store-uri $MLFLOW_TRACKING_URI"
