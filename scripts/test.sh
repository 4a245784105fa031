#!/usr/bin/env bash
# Run the test suite on the patched engine, after scripts/setup_env.sh; the
# arguments go to pytest, e.g. scripts/test.sh tests/runtime -x
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/env.sh"
"$VTOKEN_REPO/scripts/setup_env.sh"
# CPU engines for tests, not users: a 1 GiB KV pool (the tests' largest holds
# a few thousand tokens; 4 GiB took ~1 s a start to allocate), and inductor
# trusting the CPU's flags for its ISA (else its first compile, vLLM's CPU
# sampler on the first request that samples, spends ~5 s loading test builds).
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export TORCHINDUCTOR_VEC_ISA_OK=${TORCHINDUCTOR_VEC_ISA_OK:-1}
vtoken_runtime_env
cd "$VTOKEN_REPO"
exec "$VTOKEN_PY" -m pytest -p no:cacheprovider "$@"
