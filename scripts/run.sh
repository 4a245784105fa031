#!/usr/bin/env bash
# Serve the real model from the patched engine (an OpenAI-compatible server):
#   scripts/run.sh [vllm serve arguments...]
# Builds the environment on first use (scripts/setup_env.sh), then runs `vllm
# serve` with every argument unchanged, plus defaults for the flags not given:
# SmolLM2-135M-Instruct (unless --model M or a first positional argument names a
# model), block size 16; e.g. scripts/run.sh --kv-eviction-policy h2o
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/env.sh"
"$VTOKEN_REPO/scripts/setup_env.sh"
vtoken_runtime_env
model=("$VTOKEN_MODEL_DIR")
declare -A defaults=([--block-size]=16 [--max-model-len]=2048 [--served-model-name]=SmolLM2-135M-Instruct)
vtoken_has_cuda || defaults[--dtype]=bfloat16
for a in "$@"; do
  case "$a" in --model|--model=*) model=() ;; esac
  unset "defaults[${a%%=*}]" 2>/dev/null || true
done
# A first positional argument is the model (`vllm serve MODEL ...`); vLLM
# wants it first, before the defaults.
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  model=("$1"); shift; unset "defaults[--served-model-name]"
fi
extra=()
for k in "${!defaults[@]}"; do extra+=("$k" "${defaults[$k]}"); done
exec "$VTOKEN_VENV/bin/vllm" serve "${model[@]}" "${extra[@]}" "$@"
