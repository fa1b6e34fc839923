#!/usr/bin/env bash
# The GPU targets of the sampler and the GRPO step, one part per call, each within a 10-minute command limit
# (all five within ~25 minutes on one H100). Each part prints one JSON line (its figures and ratios) as its last line.
# Seen on an H100 (2026-11-25), each with its model build: smoke 4 min, decode 3, compare-0.5b 5, compare-1.5b 4.5
# with --pairs 1 (about 7 with 2), lora-7b 4 (model built on the GPU); on an H200 (2026-11-28) slots-7b 3 (185 s with
# the 7b build), decode 3.5, compare-0.5b 3 with R1_GPU_PAIRS=1. Start the machine once and chain parts that
# fit a call; write each part's log under $OUT so a part cut off still leaves what it printed.
#
#   benchmarks/gpu_acceptance.sh smoke          # benchmarks/gpu_smoke.py on the qwen2.5-0.5b preset
#   benchmarks/gpu_acceptance.sh decode         # our sampler vs transformers' generate (dynamic, static+compiled)
#   benchmarks/gpu_acceptance.sh compare-0.5b   # GRPO step vs TRL 1.16 (bench compare.py --pairs 2; R1_GPU_PAIRS=1;
#                                               # R1_MEMORY_AT_PEAK=PATH: what held our peak, as JSON there)
#   benchmarks/gpu_acceptance.sh compare-1.5b
#   benchmarks/gpu_acceptance.sh lora-7b        # the qwen2.5-7b preset trains with LoRA on one 80 GB GPU
#   benchmarks/gpu_acceptance.sh longtail       # the paged KV cache at budgets 512 to 16384, against the static rows,
#                                               # and against transformers' generate_batch at 2048
#   benchmarks/gpu_acceptance.sh slots-7b       # the 7b preset's rows at once at a 16k budget in 40 GiB of K/V
#
# The peers (TRL's GRPOTrainer, transformers' generate) run from benchmarks/peers/gpu. On a machine with no network:
# copy the wheels that machine lacks (trl, datasets, pydantic, ...; see benchmarks/peers/gpu/README.md) to
# .gpu/wheels, or unpack them into .gpu/site, which goes on PYTHONPATH as it is (no install; .gitignore keeps .gpu/
# out of git).
# Models are built once under $R1_GPU_MODELS (default /tmp/r1-gpu-models). Record the lines in BENCHMARKS.md with
# the GPU's name (`nvidia-smi -L`).
set -euo pipefail
cd "$(dirname "$0")/.."
PART=${1:?"usage: $0 smoke|decode|compare-0.5b|compare-1.5b|lora-7b|longtail|slots-7b"}
PY=${PYTHON:-python}
BENCH=${R1_GPU_BENCH:-benchmarks/peers/gpu}
WHEELS=${R1_GPU_WHEELS:-.gpu/wheels}
SITE=${R1_GPU_SITE:-.gpu/site}
MODELS=${R1_GPU_MODELS:-/tmp/r1-gpu-models}
[ -d "$SITE" ] && PYTHONPATH="$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false HF_HUB_OFFLINE=1

[ -f "$BENCH/make_model.py" ] || { echo "no bench in $BENCH (R1_GPU_BENCH): benchmarks/peers/gpu has it" >&2; exit 2; }
if compgen -G "$WHEELS/*.whl" >/dev/null; then  # what this machine lacks, without an index
  $PY -m pip install -q --no-deps --no-index --find-links "$WHEELS" "$WHEELS"/*.whl
fi

model() {  # the preset's model folder, built once; `model PRESET gpu-bf16` builds it on the GPU in bf16 (7.6B random
  # fp32 weights initialised and written on the CPU take most of a 10-minute call; the 7B part trains bf16 weights)
  if [ ! -f "$MODELS/$1/config.json" ]; then
    if [ "${2:-}" = gpu-bf16 ]; then
      $PY -c "import runpy, sys, torch
torch.set_default_device('cuda'); torch.set_default_dtype(torch.bfloat16)
sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" "$BENCH/make_model.py" "$1" "$MODELS/$1" >&2
    else
      $PY "$BENCH/make_model.py" "$1" "$MODELS/$1" >&2
    fi
  fi
  echo "$MODELS/$1"
}

case "$PART" in
  smoke)
    m=$(model qwen2.5-0.5b)
    out=$($PY benchmarks/gpu_smoke.py "$m" --tokens 256 | tee -a /dev/stderr)
    $PY - "$out" <<'EOF'
import json, sys
rows = [json.loads(l) for l in sys.argv[1].splitlines() if l.startswith("{")]
checks = {r["check"]: {k: v for k, v in r.items() if k != "check"} for r in rows if "check" in r}
print(json.dumps({"part": "smoke", "passed": rows[-1].get("gpu_smoke") == "passed", "device": rows[-1].get("device"),
                  "checks": checks}))
EOF
    ;;
  decode)
    m=$(model qwen2.5-0.5b)
    ours=$($PY benchmarks/decode.py "$m" --batch 128 512 --weights fp32-autocast | tee -a /dev/stderr)
    peer=$($PY "$BENCH/decode_peer.py" "$m" --batch 128 512 | tee -a /dev/stderr)
    $PY - "$ours" "$peer" <<'EOF'
import json, sys
ours = [json.loads(l) for l in sys.argv[1].splitlines() if l.startswith("{")]
peer = [json.loads(l) for l in sys.argv[2].splitlines() if l.startswith("{")]
out = {"part": "decode", "device": ours[0]["device"]}
for o in ours:
    b = o["batch"]
    static = [p for p in peer if p["batch"] == b and p["way"] == "hf-static-compiled"]
    dynamic = [p for p in peer if p["batch"] == b and p["way"] == "hf-dynamic"]
    row = {"ours_ms_per_step": o["ms_per_step"], "ours_tokens_per_s": o["tokens_per_s"]}
    if static:
        row["static_compiled_ms_per_step"] = static[0]["ms_per_step"]
        row["x_static_compiled_tokens_per_s"] = round(o["tokens_per_s"] / static[0]["tokens_per_s"], 2)
    if dynamic:
        row["x_dynamic_tokens_per_s"] = round(o["tokens_per_s"] / dynamic[0]["tokens_per_s"], 2)
    out[f"batch_{b}"] = row
print(json.dumps(out))
EOF
    ;;
  compare-0.5b | compare-1.5b)
    preset=qwen2.5-${PART#compare-}
    $PY "$BENCH/compare.py" --pairs "${R1_GPU_PAIRS:-2}" --preset "$preset" \
      --ours "$PY benchmarks/grpo_step.py --gradient-checkpointing${R1_MEMORY_AT_PEAK:+ --memory-at-peak $R1_MEMORY_AT_PEAK}" \
      | tee -a /dev/stderr | tail -1 \
      | $PY -c "import json,sys; r=json.loads(sys.stdin.read()); print(json.dumps({'part': '$PART', **r}))"
    ;;
  longtail)
    # the paged KV cache at budgets its rows never reach (one length mix, rows capped at 500 tokens), against the
    # static P + budget rows captured steps read before; first one layer's attention alone (0.5b and 7b shapes)
    m=$(model qwen2.5-0.5b)
    $PY benchmarks/paged_attention.py --shapes 0.5b,7b --budgets "${R1_LONGTAIL_BUDGETS:-512,2048,8192,16384}" >&2
    $PY benchmarks/long_budgets.py --model "$m" --device cuda --dtype bfloat16 --clock wall --kv-gib 40 \
      --budgets "${R1_LONGTAIL_BUDGETS:-512,2048,8192,16384}" --ways paged,static --prompts 128 --samples 4 \
      --slots 128 | tee -a /dev/stderr | tail -1 \
      | $PY -c "import json,sys; print(json.dumps({'part': 'longtail', **json.loads(sys.stdin.read())}))"
    # transformers' own continuous batching at a 2048 budget (goal: ours >= 10x): lengths from the end token's
    # output row scaled by 40 (both sample until it comes; on the preset, fp32 on a CPU, 32 rows at a 256 budget:
    # lengths p10 24, p50 77, p90 216, 3 at the budget), the peer stopped after R1_PEER_S seconds
    $PY benchmarks/continuous_batching.py --model "$m" --dtype bfloat16 --before "" --budget 2048 --prompts 64 \
      --samples 4 --slots 128 --eos-scale "${R1_EOS_SCALE:-40}" --peer-timeout "${R1_PEER_S:-150}" \
      | tee -a /dev/stderr | tail -1 \
      | $PY -c "import json,sys; print(json.dumps({'part': 'longtail-peer', **json.loads(sys.stdin.read())}))"
    ;;
  slots-7b)
    # rows decoding at once at a 16k budget in 40 GiB of K/V, R1-like lengths (median 3,000, to 16k), against the
    # rows the static cache it replaced held there (P + 16k positions each); the qwen2.5-7b preset built on the GPU
    m=$(model qwen2.5-7b gpu-bf16)
    $PY benchmarks/long_budgets.py --model "$m" --device cuda --dtype bfloat16 --clock wall --kv-gib 40 \
      --budgets 16384 --ways paged --mix r1 --prompts 128 --samples 4 --slots 512 --max-seconds "${R1_SLOTS_S:-120}" \
      | tee -a /dev/stderr | grep '"way"' | $PY -c "import json,sys; r=json.loads(sys.stdin.read())
print(json.dumps({'part': 'slots-7b', 'live_rows': r['live_rows_median_second_half'],
                  'static_rows': r['static_rows_in_budget'], 'preemptions': r['preemptions'],
                  'x_static': round(r['live_rows_median_second_half'] / r['static_rows_in_budget'], 2),
                  'tokens_per_s': r['tokens_per_s']}))"
    ;;
  lora-7b)
    m=$(model qwen2.5-7b gpu-bf16)
    $PY benchmarks/grpo_step.py "$m" --workload "$BENCH/workload.json" --gradient-checkpointing --lora 16 \
      --weights-dtype bfloat16 | tail -1 | $PY -c "import json,sys; print(json.dumps({'part': 'lora-7b', **json.loads(sys.stdin.read())}))"
    ;;
  *)
    echo "unknown part $PART: smoke|decode|compare-0.5b|compare-1.5b|lora-7b|longtail|slots-7b" >&2
    exit 2
    ;;
esac
