#!/usr/bin/env bash
# The GPU benchmark in one command: experiments 2-5 of scripts/bench_vtoken.py
# (memory, capacity, SLA, overhead) on dummy-weight Llama-3.1-8B and Mistral-7B
# geometries (scripts/dummy_model.py, load_format=dummy: nothing is downloaded),
# sized for one H100/H200 in under 8 minutes (an estimate: ~14 engine starts of
# ~15 s plus the workloads; the script prints each step's time).
#
#   scripts/bench_gpu.sh [--out DIR] [--models "llama-3.1-8b mistral-7b"]
#   scripts/bench_gpu.sh --smoke [--out DIR]    # the same path on CPU, tiny model
#
# Needs a Python with vLLM 0.18.0 (CUDA: e.g. inside the project's Docker image;
# set VTOKEN_GPU_PY to choose it, default python3), the `patch` tool, and write
# access to that vLLM: the series is applied if it is not (or is outdated). The
# overhead experiment compares against a stock twin, a copy of that vLLM with the
# series reversed (apply.sh --reverse), so stock runs with the same CUDA build.
# The twin lives in $VTOKEN_CACHE (default ~/.cache/vtoken), keyed by the series.
# Writes DIR/<model>/*.json + PNGs and meta.json (default docs/bench/gpu), then
# regenerates docs/RESULTS.md, which lists them as GPU sections. --smoke runs
# the CPU path with a two-layer model in a few minutes (tests/e2e runs it).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/env.sh"
cd "$VTOKEN_REPO"

smoke=0 out="" models="llama-3.1-8b mistral-7b"
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) smoke=1 ;;
    --out) out=${2:?--out needs a folder}; shift ;;
    --models) models=${2:?--models needs names}; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "bench_gpu.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
log() { echo "[bench_gpu $(date -u +%H:%M:%S)] $*" >&2; }

if [ "$smoke" = 1 ]; then
  "$VTOKEN_REPO/scripts/setup_env.sh" >&2
  py=$VTOKEN_PY models="tiny-llama" out=${out:-$(mktemp -d)}
  device="CPU ($(nproc) cores; smoke test of the GPU script's path)"
else
  py=${VTOKEN_GPU_PY:-python3} out=${out:-$VTOKEN_REPO/docs/bench/gpu}
  vtoken_has_cuda || { echo "bench_gpu.sh: no GPU (nvidia-smi -L failed); use --smoke on CPU" >&2; exit 1; }
  device=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n1)
fi
vtoken_runtime_env
mkdir -p "$out"
out=$(cd "$out" && pwd)

# --- the patched vLLM, and its stock twin ----------------------------------------
vtoken_apply_series "$py"
site=$VTOKEN_SITE want=$VTOKEN_SERIES
stock=$VTOKEN_CACHE/stock-twin-$want
if [ "$(cat "$stock/.vtoken-twin-of" 2>/dev/null)" != "$site $want" ]; then
  log "building the stock twin of $site in $stock"
  # One twin at a time: those of earlier series are stale (275 MB on CPU).
  mkdir -p "$VTOKEN_CACHE"
  find "$VTOKEN_CACHE" -maxdepth 1 -name 'stock-twin-*' -exec rm -rf {} +
  mkdir -p "$stock"
  cp -a "$site/vllm" "$site/.vtoken" "$stock/"
  ./apply.sh --reverse "$stock" >&2
  echo "$site $want" > "$stock/.vtoken-twin-of"
fi
export VTOKEN_PRISTINE=$stock

# --- sizes -------------------------------------------------------------------------
# Per model: memory (native + H2O naive/vtoken), capacity (bisection per mode),
# SLA (3 servers; llama only) and overhead (llama only). Random prompts: the
# weights are random, so only lengths matter.
if [ "$smoke" = 1 ]; then
  eng='{"load_format": "dummy", "max_model_len": 512}'
  mem=(--requests 4 --prompt-len 64 --gen-len 48 --budget 48)
  cap=(--pools 48 --prompt-len 64 --gen-len 32)
  sla=(--pool 64 --budget 48 --prompt-len 64 --gen-len 16 --num-prompts 4 --rates 4)
  ovh=(--requests 4 --prompt-len 64 --gen-len 16 --repeats 1)
else
  # Eager: a CUDA-graph capture per engine start would not fit the 8 minutes.
  eng='{"load_format": "dummy", "max_model_len": 2048, "gpu_memory_utilization": 0.85, "enforce_eager": true}'
  mem=(--requests 64 --prompt-len 512 --gen-len 512 --budget 512)
  cap=(--pools 1024 --prompt-len 768 --gen-len 256)
  sla=(--pool 2048 --budget 512 --prompt-len 512 --gen-len 256 --num-prompts 96 --rates 8 16)
  ovh=(--requests 64 --prompt-len 512 --gen-len 256 --repeats 2)
fi

t_all=$(date +%s)
for model in $models; do
  dir=$out/$model
  mkdir -p "$dir"
  "$py" scripts/dummy_model.py "$model" "$out/models/$model" >&2
  common=(--model "$out/models/$model" --prompts random --engine-json "$eng" --out-dir "$dir")
  bench() {
    local t0; t0=$(date +%s)
    log "$model: $1"
    "$py" scripts/bench_vtoken.py "$@" "${common[@]}"
    log "$model: $1 took $(( $(date +%s) - t0 )) s"
  }
  bench memory "${mem[@]}" --policies h2o
  bench capacity "${cap[@]}"
  if [ "$model" = "${models%% *}" ]; then  # the first model only: time budget
    bench sla "${sla[@]}"
    bench overhead "${ovh[@]}"
  fi
  "$py" - "$dir/meta.json" "$device" "$model" <<'EOF'
import json, sys, time
path, device, model = sys.argv[1:]
json.dump(
    {
        "command": "scripts/bench_gpu.sh",
        "device": device,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "note": f"{model} geometry with random weights (scripts/dummy_model.py), "
        "random prompts, block size 16.",
    },
    open(path, "w"),
)
EOF
done
log "all done in $(( $(date +%s) - t_all )) s; results in $out"
if [ "$smoke" = 0 ] && [ "$out" = "$VTOKEN_REPO/docs/bench/gpu" ]; then
  "$py" scripts/bench_report.py
fi
