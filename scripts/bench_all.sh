#!/usr/bin/env bash
# The CPU-sized benchmark suite on the real patched engine (SmolLM2-135M, block
# size 16), then docs/RESULTS.md from its JSON. About 1.5 hours on 2 cores.
# Extra arguments go to every experiment (e.g. --model DIR --engine-json '{...}').
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/env.sh"
"$VTOKEN_REPO/scripts/setup_env.sh"
vtoken_runtime_env
cd "$VTOKEN_REPO"
bench() { echo "== $*" >&2; "$VTOKEN_PY" scripts/bench_vtoken.py "$@"; }
bench memory --requests 8 --prompt-len 128 --gen-len 256 --budget 128 --repeats 2 "$@"
bench capacity --pools 64 128 --prompt-len 64 --gen-len 128 "$@"
bench capacity --name capacity-long --pools 256 512 --prompt-len 384 --gen-len 128 "$@"
bench overhead --requests 8 --prompt-len 128 --gen-len 128 --repeats 7 "$@"
bench prefix --requests 8 --prompt-len 512 --gen-len 64 --budget 256 "$@"
bench quality --requests 6 --prompt-len 128 --gen-len 96 "$@"
bench sla --pool 96 --budget 128 --gen-len 128 --num-prompts 24 --rates 0.5 1 2 "$@"
tiny=$VTOKEN_CACHE/models/tiny-llama  # scale: dummy weights, a cheap forward
"$VTOKEN_PY" scripts/prepare.py tiny-llama --out "$tiny" >&2
# With VTOKEN_BASELINE (an older series applied to a copy of vLLM, DEVELOPING.md),
# arrivals, scale and history time it too, side by side.
before=${VTOKEN_BASELINE:+--baseline $VTOKEN_BASELINE}
bench arrivals --requests 24 --prompt-len 600 --gen-len 128 --budget 128 --pool 96 \
  --every 20 --policies h2o streamingllm --repeats 2 $before "$@"
bench scale --model "$tiny" --prompts random --batches 64 256 1024 --prompt-len 64 \
  --gen-len 64 --budget 32 --repeats 2 $before
bench kernels --model "$tiny" --prompts random --batches 64 1024 --prompt-len 64 \
  --gen-len 64 --budget 32 --repeats 2
bench history --model "$tiny" --prompts random --requests 256 --prompt-len 64 \
  --gen-len 448 --budget 32 --policies h2o streamingllm --repeats 2 $before
bench parallel --model "$tiny" --prompts random --requests 16 --prompt-len 96 \
  --gen-len 64 --budget 48 --policies h2o streamingllm random --repeats 3
# With VTOKEN_BASELINE_REPO (an older checkout), the planner's too.
"$VTOKEN_PY" scripts/bench_planner.py ${VTOKEN_BASELINE_REPO:+--baseline "$VTOKEN_BASELINE_REPO"}
"$VTOKEN_PY" scripts/bench_cpu_read.py
"$VTOKEN_PY" scripts/bench_report.py
