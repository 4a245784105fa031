#!/usr/bin/env bash
# Print the hash apply.sh records for the current patches/ + vllm_overlay/.
exec "$(dirname "${BASH_SOURCE[0]}")/../apply.sh" --print-hash
