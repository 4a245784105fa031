#!/usr/bin/env bash
# Serve the real model from the patched engine (an OpenAI-compatible server).
#
#   scripts/run.sh [vllm serve arguments...]
#
# Builds the environment on first use (scripts/setup_env.sh), then runs
# `vllm serve MODEL ...` with the converted SmolLM2-135M-Instruct and block size 16,
# unless the arguments name a model (--model M or a first positional argument).
# Every argument goes to `vllm serve` unchanged, e.g.
#   scripts/run.sh --port 8001 --kv-eviction-policy h2o --kv-budget-tokens 256
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/env.sh"
"$VTOKEN_REPO/scripts/setup_env.sh"
vtoken_runtime_env

model=("$VTOKEN_MODEL_DIR")
defaults=(--block-size 16 --max-model-len 2048 --served-model-name SmolLM2-135M-Instruct)
for a in "$@"; do
  case "$a" in
    --model|--model=*) model=() ;;
    --block-size|--block-size=*|--max-model-len|--max-model-len=*|--served-model-name|--served-model-name=*)
      defaults=() ;;
  esac
done
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then model=(); defaults=(); fi
if ! vtoken_has_cuda; then defaults+=(--dtype bfloat16); fi
exec "$VTOKEN_VENV/bin/vllm" serve "${model[@]}" "${defaults[@]}" "$@"
