"""The step's device work, counted: one upload of the read plan per step, no
host synchronization inside a layer's read and scoring (CUDA only)."""

import numpy as np
import pytest
import torch

from vllm.vtoken.scores import ScoreAccumulator
from vllm.vtoken.staging import HostToDevice
from vllm.vtoken.triton_plan import build_triton_read_plan

LENS, QLENS = [40, 7, 25], [1, 7, 3]  # decode, full prefill, chunk


def step(device: str, write=None, pack=None):
    gen = torch.Generator().manual_seed(0)
    N, B = 8, 16
    slots = torch.randperm(N * B, generator=gen)[: sum(LENS)].numpy()
    indptr = np.r_[0, np.cumsum(LENS)]
    qsl = np.r_[0, np.cumsum(QLENS)]
    stage = HostToDevice(device, pack)
    plan = build_triton_read_plan(
        qsl, indptr, slots, B, write, scored=True, stage=stage
    )
    return stage, plan, slots, qsl, indptr


@pytest.mark.parametrize("pack", [None, True])
@pytest.mark.parametrize("write", [None, np.array([True, False, True])])
def test_the_read_plan_is_one_upload(write, pack):
    """On CPU the arrays serve as they are, or (`pack`, the compile checks)
    packed into one buffer as the GPU's upload lays them out."""
    stage, plan, slots, _, _ = step("cpu", write, pack)
    assert stage.uploads == 1
    if pack:  # one buffer, kv_slots first: its view starts it, aligned
        assert plan.kv_slots.untyped_storage().data_ptr() == plan.kv_slots.data_ptr()
        assert plan.kv_slots.untyped_storage().nbytes() >= 8 << 16
    np.testing.assert_array_equal(plan.kv_slots.numpy(), slots)
    assert plan.score.kv_slots is plan.kv_slots  # the same upload, not a copy
    rows = plan.token_table.shape[0]
    assert rows == (3 if write is None else 2) and plan.live_lens.numel() == rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_host_sync_inside_a_layers_read_and_scores():
    from types import SimpleNamespace

    from vllm.vtoken.triton_attention import triton_forward

    stage, plan, slots, qsl, indptr = step("cuda")
    N, B, H, Hq, D = 8, 16, 2, 4, 64
    kv = torch.randn(N, 2, B, H, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(int(qsl[-1]), Hq, D, device="cuda", dtype=torch.bfloat16)
    acc = ScoreAccumulator("sum", "cuda")
    acc.begin_step(slots.size)
    read = SimpleNamespace(plan=plan, scores=acc)
    out = torch.empty_like(q)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):  # two layers
            triton_forward(read, q, kv, out, D**-0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert stage.uploads == 1


def test_the_profiling_cache_s_worker_goes_with_that_cache(monkeypatch):
    """Patch 0050: the CUDA-graph memory profile builds a small KV cache,
    and with it a VTokenWorker whose copy executor holds its tensors. The
    model runner's cleanup drops that worker too, or the cache would stay
    allocated next to the real one until its own worker replaced it. (The
    upstream cleanup, CUDA calls stubbed: no GPU needed.)"""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    runner = SimpleNamespace(
        kv_caches=[torch.zeros(4)],
        attn_groups=[],
        cache_config=SimpleNamespace(num_gpu_blocks=4),
        compilation_config=SimpleNamespace(static_forward_context={}),
        vtoken=object(),  # the profiling cache's worker
    )
    GPUModelRunner._cleanup_profiling_kv_cache(runner)
    assert runner.kv_caches == [] and runner.vtoken is None


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_lands_the_copies_before_the_allocator_discards_the_cache(
    monkeypatch, level
):
    """Patch 0055: vLLM's sleep discards the KV cache (CuMem unmaps it, in
    driver calls no stream orders) while a batch of KV moves may still be
    copying on vToken's side stream. The worker waits for those copies first.
    (The upstream sleep, CUDA calls stubbed: no GPU needed.)"""
    from types import SimpleNamespace

    from vllm.device_allocator.cumem import CuMemAllocator
    from vllm.v1.worker.gpu_worker import Worker

    calls = []
    allocator = SimpleNamespace(sleep=lambda offload_tags: calls.append("discard"))
    monkeypatch.setattr(CuMemAllocator, "get_instance", lambda: allocator)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (0, 1))
    vtoken = SimpleNamespace(before_sleep=lambda: calls.append("land"))
    model = torch.nn.Module()
    worker = SimpleNamespace(model_runner=SimpleNamespace(vtoken=vtoken, model=model))
    Worker.sleep(worker, level)
    assert calls == ["land", "discard"]
    # vToken off: no worker (None), or a runner without the attribute (V2).
    for runner in (SimpleNamespace(vtoken=None, model=model), SimpleNamespace()):
        calls.clear()
        Worker.sleep(SimpleNamespace(model_runner=runner), 1)
        assert calls == ["discard"]


def test_wake_up_of_the_kv_cache_writes_vtoken_s_pool_state_again(monkeypatch):
    """Patch 0055: vLLM's wake_up maps the KV cache's pool afresh (the same
    addresses, contents lost); the worker rewrites what it keeps there (the
    copy kernel's layer table) when the KV cache wakes, not the weights
    alone. (The upstream wake_up, CUDA calls stubbed.)"""
    from types import SimpleNamespace

    from vllm.device_allocator.cumem import CuMemAllocator
    from vllm.v1.worker.gpu_worker import Worker

    calls = []
    allocator = SimpleNamespace(wake_up=lambda tags: calls.append(("map", tags)))
    monkeypatch.setattr(CuMemAllocator, "get_instance", lambda: allocator)
    vtoken = SimpleNamespace(after_wake_up=lambda: calls.append("rewrite"))
    worker = SimpleNamespace(
        model_runner=SimpleNamespace(vtoken=vtoken),
        _sleep_saved_buffers={},
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )
    for tags, want in (
        (None, [("map", None), "rewrite"]),
        (["kv_cache"], [("map", ["kv_cache"]), "rewrite"]),
        (["weights"], [("map", ["weights"])]),
    ):
        calls.clear()
        Worker.wake_up(worker, tags)
        assert calls == want, tags
    worker.model_runner = SimpleNamespace()  # vToken off (the V2 runner)
    calls.clear()
    Worker.wake_up(worker, None)
    assert calls == [("map", None)]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_profile_run_holds_the_token_table_through_its_forward(
    monkeypatch, enabled
):
    """Patch 0052: vLLM sizes the KV cache around what its profile run holds
    at its peak, and that run has no token read. The model runner reserves
    the token table's buffer (max_num_seqs x max_model_len, rounded up to 64)
    before the dummy forward and keeps it for the worker; vToken off, none.
    (The upstream profile_run, the forward stubbed; a meta device.)"""
    from types import SimpleNamespace

    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setattr(
        gpu_model_runner, "get_pp_group", lambda: SimpleNamespace(is_last_rank=True)
    )
    held = []

    def dummy_run(num_tokens, is_profile=False):
        held.append(runner.vtoken_token_table)
        return None, None

    runner = SimpleNamespace(
        vllm_config=SimpleNamespace(
            vtoken_config=SimpleNamespace(enabled=enabled),
            scheduler_config=SimpleNamespace(max_num_seqs=3),
            model_config=SimpleNamespace(max_model_len=100),
        ),
        device=torch.device("meta"),
        supports_mm_inputs=False,
        is_pooling_model=False,
        max_num_tokens=8,
        vtoken_token_table=None,
        encoder_cache={},
        _dummy_run=dummy_run,
        _dummy_sampler_run=lambda hidden: None,
        _sync_device=lambda: None,
    )
    GPUModelRunner.profile_run(runner)
    if not enabled:
        assert held == [None] and runner.vtoken_token_table is None
        return
    table = held[0]
    assert table is runner.vtoken_token_table  # kept past the profile
    assert table.device.type == "meta" and table.dtype == torch.int32
    assert table.shape == (3 * 128,)
    GPUModelRunner.profile_run(runner)  # profiled again: the same buffer
    assert held[1] is table
    # The KV cache is built next: its VTokenWorker gets that buffer (the
    # upstream initialize_kv_cache, its steps before vToken's stubbed).
    built = []

    class Worker(gpu_model_runner.VTokenWorker):
        def __init__(self, config, kv_caches, groups, **kw):
            built.append(kw)

    monkeypatch.setattr(gpu_model_runner, "VTokenWorker", Worker)
    monkeypatch.setattr(gpu_model_runner, "prepare_kernel_block_sizes", lambda *a: [])
    nothing = lambda *a: None  # noqa: E731
    runner.__dict__.update(
        may_add_encoder_only_layers_to_kv_cache_config=nothing,
        maybe_add_kv_sharing_layers_to_kv_cache_groups=nothing,
        initialize_attn_backend=nothing,
        initialize_metadata_builders=nothing,
        may_reinitialize_input_batch=nothing,
        initialize_kv_cache_tensors=lambda *a: [],
        speculative_config=None,
        kv_caches=[],
        attn_groups=[],
    )
    runner.vllm_config.vtoken_config.enabled = True
    GPUModelRunner.initialize_kv_cache(runner, SimpleNamespace())
    assert isinstance(runner.vtoken, Worker) and built[0]["token_table"] is table
    # On CPU the read has no table: nothing is reserved.
    runner.device, runner.vtoken_token_table = torch.device("cpu"), None
    GPUModelRunner.profile_run(runner)
    assert held[2] is None
