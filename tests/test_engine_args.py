"""The vToken engine arguments: defaults, CLI group, clear start-up errors.

Runs in-process against the environment's patched vLLM, building only configs
(no engine): `EngineArgs.create_engine_config()` reads the model's config.json.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not os.environ.get("VTOKEN_MODEL_DIR"), reason="run through scripts/test.sh"
)


def make_config(**kwargs):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=os.environ["VTOKEN_MODEL_DIR"], block_size=16, max_model_len=512, **kwargs
    )
    return args.create_engine_config()


def test_default_is_idle():
    cfg = make_config().vtoken_config
    assert cfg.kv_eviction_policy == "none"
    assert not cfg.enabled and not cfg.compaction


def test_policy_sets_up_and_turns_async_scheduling_off():
    cfg = make_config(
        kv_eviction_policy="streamingllm",
        kv_budget_tokens=128,
        kv_eviction_config={"num_sinks": 8},
        kv_reclaim="naive",
    )
    assert cfg.vtoken_config.enabled and not cfg.vtoken_config.compaction
    assert cfg.vtoken_config.policy_knobs() == {"num_sinks": 8}
    assert cfg.scheduler_config.async_scheduling is False


def test_a_budget_past_max_model_len_is_warned_about(caplog):
    make_config(kv_eviction_policy="h2o", kv_budget_tokens=4096)  # max_model_len 512
    assert "--kv-budget-tokens 4096 >= --max-model-len 512" in caplog.text


@pytest.mark.parametrize("policy", ["h2o", "streamingllm", "scissorhands", "random"])
def test_a_policy_without_a_budget_evicts_only_requests_that_ask(policy):
    cfg = make_config(kv_eviction_policy=policy).vtoken_config
    assert cfg.enabled and cfg.kv_budget_tokens is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kv_eviction_policy": "lru", "kv_budget_tokens": 8}, "kv_eviction_policy"),
        ({"kv_eviction_policy": "h2o", "kv_budget_tokens": 0}, "kv_budget_tokens"),
        (
            {"kv_eviction_policy": "h2o", "kv_budget_tokens": 64, "kv_reclaim": "x"},
            "kv_reclaim",
        ),
        (
            {
                "kv_eviction_policy": "h2o",
                "kv_budget_tokens": 64,
                "kv_reclaim_threshold": 1.5,
            },
            "kv_reclaim_threshold",
        ),
        (
            {
                "kv_eviction_policy": "h2o",
                "kv_budget_tokens": 64,
                "kv_reclaim_threshold": 0.0,
            },
            "kv_reclaim_threshold",
        ),
        (
            {
                "kv_eviction_policy": "streamingllm",
                "kv_budget_tokens": 64,
                "kv_eviction_config": {"num_sink": 4},
            },
            "num_sink",
        ),
        *(
            (
                {
                    "kv_eviction_policy": "random",
                    "kv_budget_tokens": 64,
                    "kv_eviction_config": {"seed": seed},
                },
                '"seed" must be a non-negative integer',
            )
            for seed in (-1, "abc", None, 1.5, True)
        ),
        # Past int64 it was taken and ended the engine core at the first
        # request (found by review).
        (
            {"kv_eviction_policy": "h2o", "kv_budget_tokens": 2**63},
            "less than or equal to 2147483647",
        ),
        (
            {"kv_eviction_policy": "snapkv", "kv_budget_tokens": 32},
            "window (32) must be < budget (32)",
        ),
        ({"kv_budget_tokens": 64}, "--kv-budget-tokens without --kv-eviction-policy"),
        ({"kv_eviction_config": {"seed": 1}}, "--kv-eviction-config without"),
        ({"kv_reclaim": "naive"}, "--kv-reclaim without"),
        ({"kv_reclaim_threshold": 0.5}, "--kv-reclaim-threshold without"),
        # Taken and ignored before 2026-12-06 (found by review).
        (
            {
                "kv_eviction_policy": "h2o",
                "kv_budget_tokens": 64,
                "kv_reclaim": "naive",
                "kv_reclaim_threshold": 0.5,
            },
            "--kv-reclaim-threshold with --kv-reclaim naive does nothing",
        ),
    ],
)
def test_bad_values_fail_at_start_up(kwargs, message):
    with pytest.raises(Exception) as err:
        make_config(**kwargs)
    assert message in str(err.value)


def test_unsupported_combination_names_what_and_why():
    with pytest.raises(Exception) as err:
        make_config(
            kv_eviction_policy="h2o",
            kv_budget_tokens=64,
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 2,
            },
        )
    assert "does not support speculative decoding" in str(err.value)


@pytest.mark.parametrize(
    "model_kind, what",
    [("multimodal", "multimodal models"), ("encoder-decoder", "encoder-decoder")],
)
def test_models_the_read_was_not_built_for_are_refused(model_kind, what):
    """SmolLM2 is neither, so its model config is made to say it is."""
    from types import SimpleNamespace

    vllm_config = make_config(kv_eviction_policy="h2o", kv_budget_tokens=64)
    model = vllm_config.model_config
    if model_kind == "multimodal":
        model.multimodal_config = SimpleNamespace()
    else:
        model.hf_config.is_encoder_decoder = True
        model.__dict__.pop("is_encoder_decoder", None)  # a cached_property
    with pytest.raises(ValueError, match=f"does not support {what}"):
        vllm_config.vtoken_config.verify_and_update_config(vllm_config)


def test_an_install_without_numba_is_refused(monkeypatch):
    import importlib.util

    vllm_config = make_config(kv_eviction_policy="h2o", kv_budget_tokens=64)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, *a: None if n == "numba" else find_spec(n, *a),
    )
    with pytest.raises(ValueError, match="does not support an install without numba"):
        vllm_config.vtoken_config.verify_and_update_config(vllm_config)


def test_kv_offloading_is_refused():
    """vLLM turns --kv-offloading-size into a KV connector after vToken's
    check has run, so it is refused by name (it passed, found by review)."""
    with pytest.raises(Exception, match="does not support --kv-offloading-size"):
        make_config(
            kv_eviction_policy="h2o", kv_budget_tokens=64, kv_offloading_size=1.0
        )
    assert make_config(kv_offloading_size=1.0).kv_transfer_config  # vLLM's own


def test_an_fp8_kv_cache_is_refused_on_cpu():
    with pytest.raises(
        Exception,
        match="does not support --kv-cache-dtype fp8: vLLM's CPU attention has no fp8",
    ):
        make_config(kv_eviction_policy="h2o", kv_budget_tokens=64, kv_cache_dtype="fp8")


@pytest.mark.parametrize(
    "cache_dtype, on_gpu, has_fp8, refused",
    [
        ("auto", False, False, None),
        ("auto", True, False, None),
        ("fp8", True, True, None),  # TRITON_ATTN's read takes the layers' scales
        ("fp8_e4m3", True, True, None),
        ("fp8", True, False, "GPUs with fp8 only (CUDA: compute capability 8.9"),
        ("fp8", False, False, "CPU attention has no fp8"),
        ("fp8_e4m3", False, False, "CPU attention has no fp8"),
        ("fp8_e5m2", True, True, "e4m3 fp8 caches"),
        ("fp8_inc", True, True, "e4m3 fp8 caches"),
        ("bfloat16", True, True, "leave it auto"),
        ("float16", False, False, "leave it auto"),
    ],
)
def test_the_kv_cache_dtypes_the_read_takes(cache_dtype, on_gpu, has_fp8, refused):
    """The start-up check's table (its CPU refusal through the engine
    arguments above; GPU platforms cannot be built here)."""
    from vllm.vtoken.config import cache_dtype_refused

    why = cache_dtype_refused(cache_dtype, on_gpu, has_fp8)
    assert why is None if refused is None else refused in why


@pytest.mark.parametrize("has_fp8", [True, False])
def test_a_gpu_takes_an_fp8_cache_where_it_has_fp8(monkeypatch, has_fp8):
    """The start-up check on a CUDA-alike platform (faked on this CPU
    config): vLLM's supports_fp8 decides, asked for an fp8 cache only."""
    from types import SimpleNamespace

    import vllm.platforms
    from vllm.vtoken.config import _ATTENTION_OP

    vllm_config = make_config(kv_eviction_policy="h2o", kv_budget_tokens=64)
    # As on CUDA: attention splits the graphs (the GPU path's own check).
    vllm_config.compilation_config.splitting_ops = [_ATTENTION_OP]
    asked = []
    gpu = SimpleNamespace(
        is_cuda_alike=lambda: True,
        is_cpu=lambda: False,
        supports_fp8=lambda: asked.append(1) or has_fp8,
    )
    monkeypatch.setattr(vllm.platforms, "current_platform", gpu, raising=False)
    check = vllm_config.vtoken_config.verify_and_update_config
    check(vllm_config)  # auto: not asked
    assert not asked
    vllm_config.cache_config.cache_dtype = "fp8"
    if has_fp8:
        check(vllm_config)
    else:
        with pytest.raises(ValueError, match="--kv-cache-dtype fp8: .*GPUs with fp8"):
            check(vllm_config)
    assert asked == [1]


def test_the_worker_reads_an_fp8_cache_as_its_layers_do():
    """The warm-up's fp8 variants from the attention layers themselves (a
    checkpoint's kv_cache_scheme sets their cache dtype past the flag's
    check): the cache's type, and whether CUDA hands them an fp8 query."""
    from types import SimpleNamespace

    import torch

    from vllm.vtoken.worker import fp8_read_of

    def config(kv_cache_dtype, query_quant, takes_fp8_query=True):
        impl = SimpleNamespace(
            kv_cache_dtype=kv_cache_dtype,
            fp8_dtype=torch.float8_e4m3fn,
            supports_quant_query_input=takes_fp8_query,
        )
        layers = {
            "model.layers.0.mlp": SimpleNamespace(),  # not attention
            "model.layers.0.attn": SimpleNamespace(impl=impl, query_quant=query_quant),
        }
        return SimpleNamespace(
            compilation_config=SimpleNamespace(static_forward_context=layers)
        )

    f8 = torch.float8_e4m3fn
    assert fp8_read_of(config("auto", None), True) == (None, False)
    assert fp8_read_of(config("auto", None), False) == (None, False)
    assert fp8_read_of(config("fp8", object()), True) == (f8, True)  # CUDA
    assert fp8_read_of(config("fp8", None, False), True) == (f8, False)  # ROCm
    with pytest.raises(ValueError, match="GPUs with fp8 only"):
        fp8_read_of(config("fp8", object()), False)


def test_a_block_size_not_a_power_of_two_is_refused():
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=os.environ["VTOKEN_MODEL_DIR"],
        block_size=48,
        max_model_len=512,
        kv_eviction_policy="h2o",
        kv_budget_tokens=64,
    )
    with pytest.raises(Exception, match="does not support --block-size 48"):
        args.create_engine_config()


@pytest.mark.parametrize(
    "change, what",
    [
        (lambda c: setattr(c.pass_config, "fuse_attn_quant", True), "fuse_attn_quant"),
        (lambda c: setattr(c, "splitting_ops", ["vllm::foo"]), "splitting_ops"),
        # TRITON_ATTN calls the _with_output op: splitting the other captures it.
        (
            lambda c: setattr(c, "splitting_ops", ["vllm::unified_attention"]),
            "splitting_ops",
        ),
    ],
)
def test_cuda_graphs_that_would_capture_attention_are_refused(change, what):
    """The CUDA-only check, run on this CPU config: either setting would put
    vLLM's attention inside a CUDA graph, replaying reads of freed blocks."""
    vllm_config = make_config(kv_eviction_policy="h2o", kv_budget_tokens=64)
    change(vllm_config.compilation_config)

    def refuse(what: str, why: str):
        raise ValueError(f"does not support {what}: {why}")

    with pytest.raises(ValueError, match=what):
        type(vllm_config.vtoken_config)._use_triton_attention(vllm_config, refuse)


def test_a_token_table_past_int32_offsets_is_refused():
    """GPU: vLLM's kernel offsets into the block table in int32, and the token
    table's rows are a live list long (up to the model length), so 1,024
    requests of 2M tokens would wrap into other memory (found by review);
    rows 64 entries narrower (the table's rounding) start."""
    vllm_config = make_config(kv_eviction_policy="h2o", kv_budget_tokens=64)
    from vllm.vtoken.config import _ATTENTION_OP  # (once vllm.config is loaded)
    from vllm.vtoken.triton_plan import table_width

    vllm_config.compilation_config.splitting_ops = [_ATTENTION_OP]  # as on a GPU

    def refuse(what: str, why: str):
        raise ValueError(f"does not support {what}: {why}")

    check = type(vllm_config.vtoken_config)._use_triton_attention
    vllm_config.scheduler_config.max_num_seqs = 1024
    vllm_config.model_config.max_model_len = 2 << 20
    assert 1024 * table_width(2 << 20) == 2**31
    with pytest.raises(ValueError, match="--max-num-seqs 1024 with --max-model-len"):
        check(vllm_config, refuse)
    vllm_config.model_config.max_model_len = (2 << 20) - 64
    check(vllm_config, refuse)


@pytest.mark.parametrize(
    "impl, what",
    [
        ({"alibi_slopes": [0.5]}, "ALiBi slopes"),
        ({"logits_soft_cap": 30.0}, "logit soft-capping"),
        ({"sinks": [0.0]}, "attention sinks"),
    ],
)
def test_attention_the_read_does_not_implement_is_refused(impl, what):
    from types import SimpleNamespace

    from vllm.vtoken.worker import refuse_unsupported_attention

    plain = {"alibi_slopes": None, "logits_soft_cap": 0, "sinks": None}
    layers = {
        "model.layers.0.attn": SimpleNamespace(impl=SimpleNamespace(**plain)),
        "model.layers.1.attn": SimpleNamespace(impl=SimpleNamespace(**plain | impl)),
        "model.layers.0.mlp.experts": SimpleNamespace(),  # not attention
    }
    vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers),
        vtoken_config=SimpleNamespace(kv_eviction_policy="h2o"),
    )
    with pytest.raises(ValueError, match=f"{what} \\(layer model.layers.1.attn\\)"):
        refuse_unsupported_attention(vllm_config)
    del layers["model.layers.1.attn"]
    refuse_unsupported_attention(vllm_config)  # plain attention passes


def test_the_worker_asserts_attention_splits_cuda_graphs():
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode
    from vllm.vtoken.worker import assert_attention_splits_graphs

    def config(mode, ops):
        c = SimpleNamespace(cudagraph_mode=mode, splitting_ops=ops)
        return SimpleNamespace(compilation_config=c)

    attention = ["vllm::unified_attention_with_output"]
    assert_attention_splits_graphs(config(CUDAGraphMode.PIECEWISE, attention))
    assert_attention_splits_graphs(config(CUDAGraphMode.NONE, []))  # eager
    with pytest.raises(AssertionError, match="graph-splitting ops"):
        assert_attention_splits_graphs(config(CUDAGraphMode.PIECEWISE, ["x::y"]))


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--kv-eviction-policy", "h2o", "--kv-eviction-config", '{"x": 1}'],
            "vllm serve: error: h2o: unknown knob(s) ['x']; valid knobs: "
            "['aggregate', 'recent_ratio']",
        ),
        (
            ["--kv-budget-tokens", "64"],
            "vllm serve: error: --kv-budget-tokens without --kv-eviction-policy "
            "does nothing: choose a policy, or drop the flag",
        ),
        (
            ["--kv-eviction-policy", "random", "--kv-reclaim-threshold", "2"],
            "vllm serve: error: --kv-reclaim-threshold: Input should be less than "
            "or equal to 1",
        ),
    ],
)
def test_vllm_serve_refuses_a_bad_flag_in_one_line(flags, line):
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    model = os.environ["VTOKEN_MODEL_DIR"]
    out = subprocess.run(
        [vllm, "serve", model, *flags], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stdout + out.stderr
    assert out.stderr.strip().splitlines()[-1] == line


def test_cli_lists_the_group_and_the_vllm_command_starts():
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    out = subprocess.run(
        [vllm, "serve", "--help=VTokenConfig"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in (
        "--kv-eviction-policy",
        "--kv-budget-tokens",
        "--kv-eviction-config",
        "--kv-reclaim ",
        "--kv-reclaim-threshold",
    ):
        assert flag in out.stdout
    version = subprocess.run([vllm, "--version"], capture_output=True, text=True)
    assert version.returncode == 0, version.stderr[-2000:]
    assert version.stdout.strip().splitlines()[-1] == "0.18.0"


def test_tensor_and_pipeline_parallelism_are_accepted():
    """(Issue 12) Refused before: the ranks now agree on scores and copies."""
    for size in ({"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}):
        cfg = make_config(kv_eviction_policy="h2o", kv_budget_tokens=64, **size)
        assert cfg.vtoken_config.enabled


@pytest.mark.parametrize(
    "kwargs, what",
    [
        ({"prefill_context_parallel_size": 2}, "context parallelism"),
        (
            {"decode_context_parallel_size": 3, "tensor_parallel_size": 3},
            "context parallelism",
        ),
        ({"enable_dbo": True}, "--enable-dbo"),
    ],
)
def test_parallel_layouts_the_tables_cannot_follow_are_refused(kwargs, what):
    with pytest.raises(Exception) as err:
        make_config(kv_eviction_policy="h2o", kv_budget_tokens=64, **kwargs)
    assert f"does not support {what}" in str(err.value)


def test_pipeline_parallelism_on_ray_is_refused():
    """Ray's compiled graph runs sample_tokens on the last stage only, where
    the stages' collectives would wait for ever. (No ray here: the backend is
    set after the config is built, as vLLM would with ray installed.)"""
    cfg = make_config(kv_eviction_policy="h2o", kv_budget_tokens=64)
    cfg.parallel_config.pipeline_parallel_size = 2
    cfg.parallel_config.distributed_executor_backend = "ray"
    with pytest.raises(ValueError, match="pipeline parallelism on the Ray executor"):
        cfg.vtoken_config.verify_and_update_config(cfg)


def test_a_pooling_model_is_refused():
    """(Review) A pooling step returns before the worker's end_step."""
    with pytest.raises(Exception) as err:
        make_config(kv_eviction_policy="h2o", kv_budget_tokens=64, runner="pooling")
    assert "does not support pooling models" in str(err.value)


def test_with_vtoken_off_the_patched_modules_do_not_load_numba():
    """The compiled loops (numba) are imported by the objects built with
    vToken on; importing the patched vLLM (what every engine does) must not."""
    code = (
        "import sys\n"
        "import vllm.v1.core.sched.scheduler, vllm.v1.worker.cpu_model_runner\n"
        "import vllm.v1.attention.backends.cpu_attn, vllm.v1.worker.gpu_model_runner\n"
        "print(sorted(m for m in sys.modules if m == 'numba' or m.endswith('_kernels')"
        " and m.startswith('vllm.vtoken')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
