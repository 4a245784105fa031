#!/usr/bin/env bash
# The GPU benchmark (docs/DEVELOPING.md): scripts/bench_vtoken.py's experiments on
# dummy-weight Llama-3.1-8B and Mistral-7B geometries, sized for one H100/H200 in
# about 8 minutes (an estimate), on the vLLM of $VTOKEN_GPU_PY (default python3),
# patched here if need be; stock runs on a twin of it with the series reversed.
# VTOKEN_QUALITY_MODEL=DIR (a real model folder) adds the quality experiment.
#
#   scripts/bench_gpu.sh [--out DIR] [--models "llama-3.1-8b mistral-7b"]
#   scripts/bench_gpu.sh --smoke [--out DIR]    # the same path on CPU, tiny model
#
# Writes DIR/<model>/*.json, PNGs and meta.json (default docs/bench/gpu, and then
# docs/RESULTS.md).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/env.sh"
cd "$VTOKEN_REPO"

smoke=0 out="" models="llama-3.1-8b mistral-7b"
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) smoke=1 ;;
    --out) out=${2:?--out needs a folder}; shift ;;
    --models) models=${2:?--models needs names}; shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "bench_gpu.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
log() { echo "[bench_gpu $(date -u +%H:%M:%S)] $*" >&2; }

# Per model: memory (native + H2O naive/vtoken), capacity (bisection per mode),
# SLA (3 servers; 2 in the smoke) and overhead, these two for the first model
# only (time budget), and with two GPUs TP=2 / PP=2 (parallel). Random
# prompts: the weights are random, so only lengths matter.
if [ "$smoke" = 1 ]; then
  "$VTOKEN_REPO/scripts/setup_env.sh" >&2
  py=$VTOKEN_PY models="tiny-llama" out=${out:-$(mktemp -d)}
  device="CPU ($(nproc) cores; smoke test of the GPU script's path)"
  # Eager as on the GPU: each server would otherwise trace the model (~20 s).
  eng='{"load_format": "dummy", "max_model_len": 512, "enforce_eager": true}'
  mem=(--requests 4 --prompt-len 64 --gen-len 48 --budget 48 --repeats 1)  # one run a mode: the path, not a timing
  cap=(--pools 48 --prompt-len 64 --gen-len 32)
  # Native and vtoken: naive's server takes the same path (~15-25 s of CI).
  # Greedy: vLLM's CPU sampler torch.compiles its random path at a server's
  # first sampled request (~12 s a server here); its CUDA sampler does not.
  sla=(--pool 64 --budget 48 --prompt-len 64 --gen-len 16 --num-prompts 4 --rates 4 --modes native vtoken --temperature 0)
  ovh=(--requests 4 --prompt-len 64 --gen-len 16 --repeats 1)
else
  vtoken_has_cuda || { echo "bench_gpu.sh: no GPU (nvidia-smi -L failed); use --smoke on CPU" >&2; exit 1; }
  py=${VTOKEN_GPU_PY:-python3} out=${out:-$VTOKEN_REPO/docs/bench/gpu}
  device=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n1)
  # Eager: a CUDA-graph capture per engine start would not fit the 8 minutes.
  eng='{"load_format": "dummy", "max_model_len": 2048, "gpu_memory_utilization": 0.85, "enforce_eager": true}'
  mem=(--requests 64 --prompt-len 512 --gen-len 512 --budget 512)
  cap=(--pools 1024 --prompt-len 768 --gen-len 256)
  sla=(--pool 2048 --budget 512 --prompt-len 512 --gen-len 256 --num-prompts 96 --rates 8 16)
  ovh=(--requests 64 --prompt-len 512 --gen-len 256 --repeats 2)
fi
vtoken_runtime_env
out=$(mkdir -p "$out" && cd "$out" && pwd)

vtoken_apply_series "$py"  # the patched vLLM, and then its stock twin
stock=$VTOKEN_CACHE/stock-twin-$VTOKEN_SERIES
if [ "$(cat "$stock/.vtoken-twin-of" 2>/dev/null)" != "$VTOKEN_SITE $VTOKEN_SERIES" ]; then
  log "building the stock twin of $VTOKEN_SITE in $stock"
  rm -rf "$VTOKEN_CACHE"/stock-twin-*  # one at a time: 275 MB on CPU, older ones stale
  mkdir -p "$stock"
  cp -a "$VTOKEN_SITE/vllm" "$VTOKEN_SITE/.vtoken" "$stock/"
  ./apply.sh --reverse "$stock" >&2
  echo "$VTOKEN_SITE $VTOKEN_SERIES" > "$stock/.vtoken-twin-of"
fi
export VTOKEN_PRISTINE=$stock

t_all=$SECONDS
for model in $models; do
  dir=$out/$model
  mkdir -p "$dir"
  "$py" scripts/prepare.py "$model" --out "$out/models/$model" >&2
  bench() {
    local t0=$SECONDS
    log "$model: $1"
    "$py" scripts/bench_vtoken.py "$1" --model "$out/models/$model" --prompts random \
      --engine-json "$eng" --out-dir "$dir" "${@:2}"  # later flags win
    log "$model: $1 took $(( SECONDS - t0 )) s"
  }
  bench memory "${mem[@]}" --policies h2o
  bench capacity "${cap[@]}"
  if [ "$model" = "${models%% *}" ]; then
    bench sla "${sla[@]}"
    bench overhead "${ovh[@]}"
    # Two GPUs or more: TP=2 and PP=2 against one GPU (retained blocks must
    # match; the step time shows the score reduction's cost).
    if [ "$smoke" = 0 ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      bench parallel "${mem[@]}" --policies h2o streamingllm
    fi
    if [ -n "${VTOKEN_QUALITY_MODEL:-}" ]; then  # quality needs real weights
      bench quality --model "$VTOKEN_QUALITY_MODEL" --prompts sharegpt --requests 16 \
        --prompt-len 1024 --gen-len 256 --engine-json "${eng/\"dummy\"/\"auto\"}"
    fi
  fi
  "$py" - "$dir/meta.json" "$device" "$(date -u '+%Y-%m-%d %H:%M UTC')" "$model" <<'EOF'
import json, sys
path, device, date, model = sys.argv[1:]
note = f"{model} geometry with random weights (scripts/prepare.py), random prompts, block size 16."
json.dump({"command": "scripts/bench_gpu.sh", "device": device, "date": date, "note": note}, open(path, "w"))
EOF
done
log "all done in $(( SECONDS - t_all )) s; results in $out"
if [ "$smoke" = 0 ] && [ "$out" = "$VTOKEN_REPO/docs/bench/gpu" ]; then
  "$py" scripts/bench_report.py
fi
