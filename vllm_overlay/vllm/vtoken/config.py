# SPDX-License-Identifier: Apache-2.0
"""Engine arguments of vToken (`--kv-eviction-policy` and friends).

`VTokenConfig` is a vLLM config dataclass: `EngineArgs` copies its fields, the CLI
lists them in their own group with these docstrings as help, and
`VllmConfig.vtoken_config` carries it to the scheduler and the workers. With the
default policy `none` every vToken hook stays idle and vLLM behaves as stock.
(No `from __future__ import annotations` here: vLLM's CLI reads these field
annotations as real types.)
"""

import importlib.metadata
import importlib.util
import sys
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationError, model_validator

from vllm.config.utils import config
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)
# The attention op TRITON_ATTN runs (it takes an output buffer): it must split
# CUDA graphs, i.e. run eagerly, for the token read to be chosen per step.
_ATTENTION_OP = "vllm::unified_attention_with_output"

UNBOUNDED_BUDGET = 2**31 - 1
# Plug-in policies (vllm.vtoken.policies) are choices too, named here without
# importing them: this module is imported with vllm.config.
_PLUGINS = [ep.name for ep in importlib.metadata.entry_points(group="vtoken.policies")]
EvictionPolicyName = Literal[
    (
        "none",
        "h2o",
        "streamingllm",
        "scissorhands",
        "snapkv",
        "random",
        *sorted(_PLUGINS),
    )
]
ReclaimMode = Literal["naive", "vtoken"]


# KV cache dtypes the token read takes besides the model's own ("auto"): an
# fp8 cache in the platform's e4m3 type, on TRITON_ATTN, with the layers'
# scales (triton_attention.KVQuant). The KV copy moves bytes: any dtype.
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")


def cache_dtype_refused(
    cache_dtype: str, on_gpu: bool, gpu_has_fp8: bool = True
) -> str | None:
    """Why vToken refuses `--kv-cache-dtype cache_dtype` on a CUDA-alike
    platform (`on_gpu`; `gpu_has_fp8`: vLLM's current_platform.supports_fp8(),
    on CUDA compute capability 8.9 and later, where Triton reads e4m3) or
    on CPU; None when it takes it."""
    if cache_dtype == "auto":
        return None
    if cache_dtype in FP8_CACHE_DTYPES:
        if not on_gpu:
            return "vLLM's CPU attention has no fp8 KV cache"
        if not gpu_has_fp8:
            return (
                "the token read's Triton kernels read e4m3 on GPUs with fp8 "
                "only (CUDA: compute capability 8.9 and later)"
            )
        return None
    if cache_dtype.startswith("fp8"):
        return (
            "the token read is built and checked for e4m3 fp8 caches "
            f"({', '.join(FP8_CACHE_DTYPES)}, GPU) only"
        )
    return (
        "the token read handles the model's dtype, or fp8 (e4m3) on a GPU: "
        "leave it auto"
    )


@config
class VTokenConfig:
    """Token-level KV-cache eviction with physical reclamation (vToken)."""

    kv_eviction_policy: EvictionPolicyName = "none"
    """Token eviction policy. "none" keeps stock vLLM behaviour (hooks idle).
    h2o: heavy hitters by accumulated attention plus a recent window;
    streamingllm: attention sinks plus a recent window; scissorhands: pivotal
    tokens by persistence of importance; snapkv: what the prompt's last queries
    attend to, pooled; random: uniform, seeded. Installed
    packages add policies through the "vtoken.policies" entry point group."""

    kv_budget_tokens: int | None = Field(default=None, gt=0, le=UNBOUNDED_BUDGET)
    """Live tokens kept per request once eviction starts. Prompts longer than
    this are prefilled in full, then evicted down to it. Requests may override
    it (extra_args / vllm_xargs "kv_budget_tokens"); without it, only requests
    that ask for a budget are evicted."""

    kv_eviction_config: dict[str, Any] = Field(default_factory=dict)
    """Policy knobs as JSON, e.g. '{"num_sinks": 4}' for streamingllm,
    '{"recent_ratio": 0.5}' for h2o, '{"seed": 0}' for random. Unknown knobs are
    an error."""

    kv_reclaim: ReclaimMode = "vtoken"
    """How evicted tokens turn into free memory. naive: a block returns to the
    pool only when every token in it is dead (the paper's Naive-Evict). vtoken:
    also move the live tokens of under-used blocks into the request's dead slots
    and free the emptied blocks (blocks the prefix cache can serve are emptied
    into fresh blocks instead, while the pool has them to spare)."""

    kv_reclaim_threshold: float = Field(default=1.0, gt=0.0, le=1.0)
    """A full block whose live-token utilization is below this fraction is a
    compaction source (vtoken mode). The planner empties as many blocks as the
    request's dead slots can absorb, so 1.0 (any block with a dead token) packs
    tightest; lower values move fewer bytes."""

    @property
    def enabled(self) -> bool:
        return self.kv_eviction_policy != "none"

    @property
    def compaction(self) -> bool:
        return self.enabled and self.kv_reclaim == "vtoken"

    @model_validator(mode="after")
    def _validate(self) -> "VTokenConfig":
        if not self.enabled:
            given = [
                flag
                for flag, value, default in (
                    ("--kv-budget-tokens", self.kv_budget_tokens, None),
                    ("--kv-eviction-config", self.kv_eviction_config, {}),
                    ("--kv-reclaim", self.kv_reclaim, "vtoken"),
                    ("--kv-reclaim-threshold", self.kv_reclaim_threshold, 1.0),
                )
                if value != default
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)} without --kv-eviction-policy does nothing: "
                    "choose a policy, or drop the flag"
                )
            return self
        if self.kv_reclaim == "naive" and self.kv_reclaim_threshold != 1.0:
            raise ValueError(
                "--kv-reclaim-threshold with --kv-reclaim naive does nothing: it "
                "chooses the blocks compaction empties; drop it or use vtoken"
            )
        seed = self.kv_eviction_config.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(
                '--kv-eviction-config: "seed" must be a non-negative integer, '
                f"got {seed!r}"
            )
        # Build the policy once so that bad knobs fail at start-up, not mid-run.
        from vllm.vtoken.policies import create_policy

        # Without an engine budget, knobs are checked against any budget here,
        # and against each request's own when it brings one (request_args.py).
        create_policy(
            self.kv_eviction_policy,
            self.kv_budget_tokens or UNBOUNDED_BUDGET,
            self.policy_knobs(),
        )
        if self.kv_budget_tokens is None:
            logger.info(
                "vToken: --kv-eviction-policy %s without --kv-budget-tokens: only "
                "requests that set kv_budget_tokens are evicted.",
                self.kv_eviction_policy,
            )
        return self

    def verify_and_update_config(self, vllm_config: "VllmConfig") -> None:
        """Refuse what vToken does not support; turn off what is not yet safe.

        Raises:
            ValueError: naming the unsupported combination and why.
        """
        import vllm.envs as envs
        from vllm.platforms import current_platform

        def refuse(what: str, why: str) -> None:
            raise ValueError(
                f"--kv-eviction-policy {self.kv_eviction_policy} does not support "
                f"{what}: {why}."
            )

        if current_platform.is_cuda_alike():
            self._use_triton_attention(vllm_config, refuse)
        elif not current_platform.is_cpu():
            refuse(
                f"the {current_platform.device_name} platform",
                "the token-level attention read exists for CPU_ATTN and "
                "TRITON_ATTN only",
            )
        if importlib.util.find_spec("numba") is None:
            refuse(
                "an install without numba",
                "the Token Tables' per-step loops are compiled with it (vLLM "
                "installs it on every platform but s390x)",
            )
        if vllm_config.speculative_config is not None:
            refuse("speculative decoding", "rejected tokens would need un-eviction")
        if vllm_config.kv_transfer_config is not None:
            refuse("KV connectors", "they move blocks vToken is compacting")
        if vllm_config.cache_config.kv_offloading_size is not None:
            # vLLM builds its offloading connector after this check runs.
            refuse(
                "--kv-offloading-size",
                "it offloads blocks through a KV connector, which would move "
                "blocks vToken is compacting",
            )
        parallel = vllm_config.parallel_config
        if (
            parallel.decode_context_parallel_size > 1
            or parallel.prefill_context_parallel_size > 1
        ):
            refuse(
                "context parallelism",
                "it shards a request's tokens across ranks, and a Token Table "
                "holds all of a request's tokens on every rank",
            )
        if (
            parallel.pipeline_parallel_size > 1
            and parallel.distributed_executor_backend == "ray"
        ):
            refuse(
                "pipeline parallelism on the Ray executor",
                "its compiled graph ends a step on the last stage only, where "
                "the stages agree on scores and copies (use the mp executor)",
            )
        if parallel.enable_dbo:
            refuse(
                "--enable-dbo",
                "it runs a step's batch as two micro-batches, and the token "
                "read is built for the whole batch",
            )
        if envs.VLLM_USE_V2_MODEL_RUNNER:
            refuse("VLLM_USE_V2_MODEL_RUNNER=1", "vToken hooks the V1 model runner")
        cache_dtype = vllm_config.cache_config.cache_dtype
        on_gpu = current_platform.is_cuda_alike()
        # (supports_fp8 may read the device: asked for an fp8 cache only.)
        has_fp8 = on_gpu and cache_dtype in FP8_CACHE_DTYPES
        has_fp8 = has_fp8 and current_platform.supports_fp8()
        why = cache_dtype_refused(cache_dtype, on_gpu, has_fp8)
        if why is not None:
            refuse(f"--kv-cache-dtype {cache_dtype}", why)
        block = vllm_config.cache_config.block_size
        if block is not None and block & (block - 1):
            refuse(
                f"--block-size {block}",
                "the token tables find a slot's block by a shift, so the "
                "block size must be a power of two",
            )
        model = vllm_config.model_config
        budget = self.kv_budget_tokens
        if model is not None and budget is not None and budget >= model.max_model_len:
            logger.warning(
                "vToken: --kv-budget-tokens %d >= --max-model-len %d: no request "
                "is evicted unless it sets a smaller kv_budget_tokens (with h2o "
                "or scissorhands every request still reads through the token "
                "table, for its scores).",
                budget,
                model.max_model_len,
            )
        if model is not None:
            if model.get_sliding_window() is not None:
                refuse("sliding-window attention", "its window is positional")
            if model.is_hybrid or model.use_mla or model.is_attention_free:
                refuse("hybrid, MLA or attention-free models", "one KV layout only")
            if model.is_encoder_decoder:
                refuse("encoder-decoder models", "cross-attention KV is not a token")
            if model.runner_type == "pooling":
                refuse(
                    "pooling models",
                    "a pooling step returns before vToken's step ends, so its "
                    "KV moves would never be acknowledged",
                )
            if model.is_multimodal_model:
                refuse(
                    "multimodal models",
                    "untested: a policy would evict image and audio tokens one "
                    "by one, and their prefix-cache keys are the media's hashes",
                )
            if not model.disable_cascade_attn:
                model.disable_cascade_attn = True
        sched = vllm_config.scheduler_config
        if sched.async_scheduling is not False:
            # The scheduler must see a step's acknowledgements before planning
            # the next one (R-KV's async bug #10): schedule one step at a time.
            logger.info("vToken: asynchronous scheduling turned off.")
            sched.async_scheduling = False

    @staticmethod
    def _use_triton_attention(vllm_config: "VllmConfig", refuse) -> None:
        """GPU: TRITON_ATTN reads 1-token pages; attention must run eagerly."""
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        attention = vllm_config.attention_config
        if attention.backend is None:
            attention.backend = AttentionBackendEnum.TRITON_ATTN
        elif attention.backend != AttentionBackendEnum.TRITON_ATTN:
            refuse(
                f"--attention-backend {attention.backend.name}",
                "the token-level read runs on TRITON_ATTN (any page size)",
            )
        compilation = vllm_config.compilation_config
        if compilation.pass_config.fuse_attn_quant:
            refuse(
                "-cc.pass_config.fuse_attn_quant=true",
                "fused attention is captured in a CUDA graph, which would replay "
                "vLLM's read of every block, freed ones included",
            )
        ops = compilation.splitting_ops
        if ops is not None and _ATTENTION_OP not in ops:
            refuse(
                f"splitting_ops {ops}",
                "without attention among them a CUDA graph captures vLLM's "
                "attention, which would read freed blocks",
            )
        # vLLM's kernel offsets into the block table in int32 (row x stride);
        # the token table's stride is a live list's length, up to the model
        # length, not its block count: 16x stock's, for as many rows.
        from vllm.vtoken.triton_plan import token_table_size

        rows = vllm_config.scheduler_config.max_num_seqs
        model_len = vllm_config.model_config.max_model_len
        if token_table_size(rows, model_len) >= 2**31:
            refuse(
                f"--max-num-seqs {rows} with --max-model-len {model_len}",
                "the token table would hold 2^31 entries or more, past the int32 "
                "offsets of vLLM's attention kernel; lower either",
            )
        mode = compilation.cudagraph_mode
        if mode is None or mode.has_full_cudagraphs():
            # Attention is a splitting op: piecewise graphs run it eagerly, so
            # the per-step token table needs no persistent buffer yet.
            compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
        logger.warning(
            "vToken on GPU: TRITON_ATTN with piecewise CUDA graphs. This path is "
            "tested on CPU under the Triton interpreter, not yet on a GPU."
        )

    def policy_knobs(self) -> dict[str, Any]:
        """Knobs for the policy itself (the shared `seed` knob removed)."""
        return {k: v for k, v in self.kv_eviction_config.items() if k != "seed"}

    @property
    def seed(self) -> int:
        return self.kv_eviction_config.get("seed", 0)

    def compute_hash(self) -> str:
        # vToken changes which KV entries attention reads, not the compiled
        # graph: attention is an opaque splitting op.
        return "vtoken-no-graph-factors"


def check_cli_args(args) -> None:
    """`vllm serve`: a bad vToken flag ends the command the way argparse does,
    one line naming the flag and the rule (exit status 2), before the model
    loads. Checks that need the whole engine config come later, as vLLM's own."""
    fields = VTokenConfig.__dataclass_fields__
    try:
        VTokenConfig(**{k: getattr(args, k) for k in fields if hasattr(args, k)})
    except (ValidationError, ValueError) as err:
        sys.stderr.write(f"vllm serve: error: {_one_line(err)}\n")
        raise SystemExit(2) from None


def _one_line(err: Exception) -> str:
    if not isinstance(err, ValidationError):
        return str(err)
    first = err.errors()[0]
    msg = str(first["msg"]).removeprefix("Value error, ")
    loc = [str(part) for part in first["loc"]]
    return f"--{loc[0].replace('_', '-')}: {msg}" if loc else msg
