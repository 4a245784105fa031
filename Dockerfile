# vLLM 0.18.0 (CUDA) with the vToken patch series and overlay applied.
#
#   docker build -t vtoken-vllm:0.18.0 .
#   docker run --gpus all -p 8000:8000 vtoken-vllm:0.18.0 \
#       --model HuggingFaceTB/SmolLM2-135M-Instruct \
#       --kv-eviction-policy h2o --kv-budget-tokens 256
#
# The base image's ENTRYPOINT (`vllm serve`) is kept, so `docker run` arguments go
# to `vllm serve`. Only what apply.sh reads is sent to the build (see .dockerignore).
# apply.sh keeps the pristine files in site-packages/.vtoken/, so
# `/opt/vtoken/apply.sh --reverse SITE` inside the image restores stock vLLM.
FROM vllm/vllm-openai:v0.18.0

LABEL org.opencontainers.image.title="vtoken-vllm" \
      org.opencontainers.image.description="vLLM 0.18.0 with vToken: token-level KV-cache eviction with physical reclamation" \
      org.opencontainers.image.version="0.18.0-vtoken" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/vllm/vllm-openai:v0.18.0"

# apply.sh needs patch(1), which the base image lacks. Not pinned (DL3008): the
# version is whatever the base image's Ubuntu release carries, fixed by the pinned
# base tag, and apply.sh uses only long-stable options (-p1 --fuzz=0 --forward).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends patch \
    && rm -rf /var/lib/apt/lists/*

COPY apply.sh VLLM_VERSION /opt/vtoken/
COPY patches/ /opt/vtoken/patches/
COPY vllm_overlay/ /opt/vtoken/vllm_overlay/

# SITE is the folder holding the image's installed vllm/ (found without importing
# vLLM). The dry run fails the build, naming the patch, unless the whole series
# applies with zero fuzz; after applying, --reverse --check verifies every patched
# and overlay file against the manifest, and the import proves the overlay loads
# (and compiles its numba loops into numba's cache, so no server start pays it).
RUN site="$(python3 -c 'import importlib.util as u, os; print(os.path.dirname(list(u.find_spec("vllm").submodule_search_locations)[0]))')" \
    && echo "vLLM site: $site" \
    && bash /opt/vtoken/apply.sh --check "$site" \
    && bash /opt/vtoken/apply.sh "$site" \
    && bash /opt/vtoken/apply.sh --reverse --check "$site" \
    && python3 -c "import vllm.vtoken.table_kernels, vllm.vtoken.read_kernels, \
vllm.vtoken.eviction_kernels, vllm.vtoken.fold_kernels, vllm.vtoken.planner_kernels, \
vllm.vtoken.block_kernels, vllm.vtoken.kv_copy_cpu, vllm.vtoken.policies.selection_kernels, \
vllm.vtoken.prefetch"
