#!/usr/bin/env bash
# Run the test suite on the patched engine, after scripts/setup_env.sh; the
# arguments go to pytest, e.g. scripts/test.sh tests/runtime -x
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/env.sh"
"$VTOKEN_REPO/scripts/setup_env.sh"
vtoken_runtime_env
cd "$VTOKEN_REPO"
exec "$VTOKEN_PY" -m pytest -p no:cacheprovider "$@"
