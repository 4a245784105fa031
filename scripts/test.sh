#!/usr/bin/env bash
# Run the test suite on the patched engine: builds the environment if missing
# (scripts/setup_env.sh), then pytest. Arguments go to pytest, e.g.
#   scripts/test.sh tests/runtime -x
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/env.sh"
"$VTOKEN_REPO/scripts/setup_env.sh"
vtoken_runtime_env
cd "$VTOKEN_REPO"
exec "$VTOKEN_PY" -m pytest -p no:cacheprovider "$@"
