# Sourced by the scripts: where the environment, caches and model live, and the
# process environment the CPU engine needs. Override any path with its variable.
VTOKEN_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export VTOKEN_REPO
export VTOKEN_VENV=${VTOKEN_VENV:-$VTOKEN_REPO/.venv}
export VTOKEN_CACHE=${VTOKEN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vtoken}
export VTOKEN_MODEL_DIR=${VTOKEN_MODEL_DIR:-$VTOKEN_CACHE/models/SmolLM2-135M-Instruct}
export VTOKEN_SHAREGPT=${VTOKEN_SHAREGPT:-$VTOKEN_CACHE/data/ShareGPT_V3_repaired.json}
export VTOKEN_PRISTINE=${VTOKEN_PRISTINE:-$VTOKEN_CACHE/pristine-$(head -n1 "$VTOKEN_REPO/VLLM_VERSION")}
VTOKEN_PY=$VTOKEN_VENV/bin/python
VTOKEN_TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

vtoken_has_cuda() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# A fresh venv at $1, with the pip the lock files are made with.
vtoken_new_venv() { rm -rf "$1"; python3 -m venv "$1"; "$1/bin/pip" install -q --upgrade pip==25.3; }

# The CPU worker refuses to start without tcmalloc and Intel OpenMP preloaded.
vtoken_runtime_env() {
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false
  if ! vtoken_has_cuda; then
    local iomp=$VTOKEN_VENV/lib/libiomp5.so
    case ":${LD_PRELOAD:-}:" in *libtcmalloc*) ;; *) export LD_PRELOAD=$VTOKEN_TCMALLOC:$iomp${LD_PRELOAD:+:$LD_PRELOAD} ;; esac
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
    export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
  fi
}

# Apply the series (patches + overlay) to the vLLM that Python $1 imports, unless
# that exact series is already there intact (anything else of vToken's, an older
# series, a half-finished apply, a vLLM reinstalled over it, is reversed first).
# Sets VTOKEN_SITE (the folder holding vllm/) and VTOKEN_SERIES (the series hash).
vtoken_apply_series() {
  VTOKEN_SITE=$("$1" -c 'import importlib.util as u, os; print(os.path.dirname(list(u.find_spec("vllm").submodule_search_locations)[0]))')
  VTOKEN_SERIES=$("$VTOKEN_REPO/apply.sh" --print-hash)
  local have=$(sed -n 's/^hash //p' "$VTOKEN_SITE/.vtoken/manifest" 2>/dev/null || true)
  if [ "$have" != "$VTOKEN_SERIES" ] || ! "$VTOKEN_REPO/apply.sh" --verify "$VTOKEN_SITE"; then
    [ ! -d "$VTOKEN_SITE/.vtoken" ] || "$VTOKEN_REPO/apply.sh" --reverse "$VTOKEN_SITE" >&2
    "$VTOKEN_REPO/apply.sh" "$VTOKEN_SITE" >&2
  else
    echo "[setup] patches up to date ($VTOKEN_SERIES) in $VTOKEN_SITE" >&2
  fi
}
