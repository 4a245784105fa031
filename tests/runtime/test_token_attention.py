"""Attention through the slot map equals dense attention over the live tokens.

Caches are written with vLLM's own CPU writer (`cpu_attn_reshape_and_cache`),
so the oracle is independent of the read path's index math.
"""

from collections import Counter

import numpy as np
import pytest
import torch

from tests.runtime.interpreter import run_under_interpreter
from tests.runtime.reference import token_attention_reference
from vllm.vtoken.copy_executor import KVCopyExecutor
from vllm.vtoken.cpu_attention import build_cpu_read_plan, cpu_token_attention
from vllm.vtoken.triton_attention import (
    attention_mass,
    build_token_table,
    triton_token_attention,
)

ops = pytest.importorskip(
    "vllm._custom_ops",
    reason="vLLM CPU _C ops did not load (see LD_PRELOAD in ENVIRONMENT.md)",
)


class RecordingScores:
    def __init__(self, aggregate="mean", query_window=None):
        self.calls = []
        self.aggregate = aggregate
        self.query_window = query_window

    def add(self, pos, mass):  # pos None: every key, in read order
        pos = torch.arange(mass.numel()) if pos is None else pos.clone()
        self.calls.append((pos, mass.clone()))


def make_batch(
    seed,
    *,
    q_lens,
    ctx_lens,
    heads=2,
    q_heads=4,
    head_dim=32,
    block=16,
    num_blocks=24,
    dead_frac=0.4,
    dtype=torch.float32,
):
    """Random requests: context tokens (some dead) plus query tokens, scattered
    over random slots and written with vLLM's CPU writer.

    Returns a dict with the caches, the query, the slot-map inputs of
    cpu_token_attention and, per request, the dense live K/V (logical order).
    """
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    isa = "vec16" if block % 32 else "vec"
    kv = torch.zeros(2, num_blocks, heads, block, head_dim, dtype=dtype)
    key_cache, value_cache = kv.unbind(0)
    free = rng.permutation(num_blocks * block)
    used, slots, live_k, live_v = 0, [], [], []
    for lq, lc in zip(q_lens, ctx_lens, strict=True):
        total = lq + lc
        k = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
        req_slots = torch.from_numpy(free[used : used + total].copy())
        used += total
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, req_slots, isa)
        live = rng.random(total) >= dead_frac
        live[lc:] = True  # this step's query tokens are always live
        live_t = torch.from_numpy(live)
        slots.append(req_slots[live_t])
        live_k.append(k[live_t])
        live_v.append(v[live_t])
    query = torch.randn(sum(q_lens), q_heads, head_dim, generator=gen).to(dtype)
    return dict(
        kv=kv,
        key_cache=key_cache,
        value_cache=value_cache,
        query=query,
        query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        kv_indptr=np.concatenate([[0], np.cumsum([len(s) for s in slots])]),
        kv_slots=torch.cat(slots),
        live_k=live_k,
        live_v=live_v,
        free_slots=free[used:],
        block=block,
        scale=head_dim**-0.5,
    )


def cpu_read(
    query,
    key_cache,
    value_cache,
    out,
    *,
    query_start_loc,
    kv_indptr,
    kv_slots,
    scale,
    scores=None,
):
    """One layer's read as the worker sets it up: plan, then attention."""
    plan = build_cpu_read_plan(
        query_start_loc, kv_indptr, kv_slots, key_cache.shape[2], key_cache.shape[1]
    )
    cpu_token_attention(query, key_cache, value_cache, out, plan, scale, scores)


def run_cpu(b, scores=None, kv_slots=None):
    out = torch.full_like(b["query"], float("nan"))
    cpu_read(
        b["query"],
        b["key_cache"],
        b["value_cache"],
        out,
        query_start_loc=b["query_start_loc"],
        kv_indptr=b["kv_indptr"],
        kv_slots=b["kv_slots"] if kv_slots is None else kv_slots,
        scale=b["scale"],
        scores=scores,
    )
    return out


def reference(b):
    qsl = b["query_start_loc"]
    return torch.cat(
        [
            token_attention_reference(
                b["query"][qsl[r] : qsl[r + 1]],
                b["live_k"][r],
                b["live_v"][r],
                b["scale"],
            )
            for r in range(len(qsl) - 1)
        ]
    )


SHAPES = {
    "decode": dict(q_lens=[1, 1, 1], ctx_lens=[40, 7, 23]),
    "prefill": dict(q_lens=[9, 5], ctx_lens=[0, 30]),
    "mixed": dict(q_lens=[1, 12, 1, 3], ctx_lens=[50, 20, 0, 9]),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("heads,q_heads,block", [(2, 4, 16), (2, 2, 32), (1, 3, 16)])
def test_matches_dense_reference_with_dead_tokens(shape, heads, q_heads, block):
    for seed in range(3):
        b = make_batch(seed, heads=heads, q_heads=q_heads, block=block, **SHAPES[shape])
        torch.testing.assert_close(run_cpu(b), reference(b), atol=1e-5, rtol=1e-5)


def test_bf16_matches_dense_reference():
    b = make_batch(11, dtype=torch.bfloat16, **SHAPES["mixed"])
    torch.testing.assert_close(
        run_cpu(b).float(), reference(b).float(), atol=2e-2, rtol=2e-2
    )


def test_dead_tokens_are_not_read():
    # Poisoning every slot outside the slot map (dead or unused) changes nothing.
    b = make_batch(5, **SHAPES["mixed"])
    before = run_cpu(b)
    num_blocks, heads, block, head_dim = b["key_cache"].shape
    outside = torch.ones(num_blocks * block, dtype=torch.bool)
    outside[b["kv_slots"]] = False
    dead = outside.nonzero().squeeze(1)
    n, o = dead // block, dead % block
    b["key_cache"].view(num_blocks, heads, head_dim, block)[n, :, :, o] = float("nan")
    b["value_cache"][n, :, o] = float("nan")
    assert torch.equal(run_cpu(b), before)


def test_move_plan_keeps_output_bit_identical():
    b = make_batch(3, **SHAPES["mixed"])
    before = run_cpu(b)
    before_scored = run_cpu(b, scores=RecordingScores())
    slots = b["kv_slots"]
    rng = np.random.default_rng(0)
    moved = rng.choice(len(slots), 25, replace=False)
    src = slots[moved].numpy()
    dst = b["free_slots"][:25]
    ex = KVCopyExecutor([b["kv"]], "cpu", b["block"])
    ex.submit(0, src, dst)
    assert ex.poll() == [0]
    new_slots = slots.clone()
    new_slots[moved] = torch.from_numpy(dst)
    after = run_cpu(b, kv_slots=new_slots)
    assert torch.equal(after, before)
    scored = run_cpu(b, scores=RecordingScores(), kv_slots=new_slots)
    assert torch.equal(scored, before_scored)
    # Poison the old slots: the new slot map must not read them any more.
    src_t = torch.from_numpy(src)
    b["value_cache"][src_t // b["block"], :, src_t % b["block"]] = float("nan")
    assert torch.equal(run_cpu(b, kv_slots=new_slots), before)
    assert torch.isnan(run_cpu(b)).any()


@pytest.mark.parametrize("isa,block", [("vec", 32), ("vec16", 16)])
def test_all_live_matches_vllm_cpu_kernel(isa, block):
    gen = torch.Generator().manual_seed(block)
    heads, q_heads, head_dim, num_blocks = 2, 4, 32, 16
    lens, q_lens = [40, 5, 33], [3, 1, 33]
    kv = torch.zeros(2, num_blocks, heads, block, head_dim)
    key_cache, value_cache = kv.unbind(0)
    width = max(-(-n // block) for n in lens)
    perm = torch.randperm(num_blocks, generator=gen)[: width * len(lens)]
    block_table = perm.view(len(lens), width).to(torch.int32)
    slots = []
    for r, n in enumerate(lens):
        pos = torch.arange(n)
        s = block_table[r][pos // block].long() * block + pos % block
        ops.cpu_attn_reshape_and_cache(
            torch.randn(n, heads, head_dim, generator=gen),
            torch.randn(n, heads, head_dim, generator=gen),
            key_cache,
            value_cache,
            s,
            isa,
        )
        slots.append(s)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), q_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    native = torch.zeros_like(query)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(lens),
        num_heads=q_heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        seq_lens=seq_lens,
        dtype=torch.float32,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=True,
    )
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=native,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=(-1, -1),
        block_table=block_table,
        softcap=0.0,
        scheduler_metadata=metadata,
        s_aux=None,
    )
    ours = torch.zeros_like(query)
    cpu_read(
        query,
        key_cache,
        value_cache,
        ours,
        query_start_loc=qsl.numpy(),
        kv_indptr=np.concatenate([[0], np.cumsum(lens)]),
        kv_slots=torch.cat(slots),
        scale=scale,
    )
    torch.testing.assert_close(ours, native, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "aggregate, window", [("mean", None), ("max", None), ("mean", 2)]
)
def test_scores_mass_equals_dense_attention_mass(aggregate, window):
    """Window (SnapKV): only each request's last `window` queries count."""
    b = make_batch(9, **SHAPES["mixed"])
    rec = RecordingScores(aggregate, window)
    out = run_cpu(b, scores=rec)
    torch.testing.assert_close(out, reference(b), atol=1e-5, rtol=1e-5)
    assert len(rec.calls) == 1
    pos, got = rec.calls[0]
    # One mass per key read, by its position in kv_slots, in any order
    # (decode requests come first): put them back in read order.
    n = b["kv_slots"].numel()
    assert torch.equal(pos.sort().values, torch.arange(n))
    mass = torch.zeros(n, dtype=got.dtype)
    mass[pos] = got
    qsl, expected = b["query_start_loc"], []
    for r in range(len(qsl) - 1):
        q = b["query"][qsl[r] : qsl[r + 1]].double().transpose(0, 1)  # [Hq, Lq, D]
        k = b["live_k"][r].double().transpose(0, 1)
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        logits = q @ k.transpose(1, 2) * b["scale"]
        lq, lk = logits.shape[1:]
        causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        per_head = probs[:, -(window or lq) :].sum(dim=1)  # [Hq, Lk] over queries
        expected.append(per_head.amax(0) if aggregate == "max" else per_head.sum(0))
    torch.testing.assert_close(mass.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)
    if aggregate == "mean" and window is None:  # every query row, head sums to 1
        total = b["query"].shape[0] * b["query"].shape[1]
        assert abs(mass.sum().item() - total) < 1e-3
    # The score module's oracle agrees: same GQA head mapping and causal mask.
    kv_loc = b["kv_indptr"]
    for r in range(len(qsl) - 1):
        q0 = max(qsl[r], qsl[r + 1] - (window or qsl[r + 1]))  # as triton_forward
        want = attention_mass(
            b["query"][q0 : qsl[r + 1]], b["live_k"][r], b["scale"], aggregate
        )
        got = mass[kv_loc[r] : kv_loc[r + 1]]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_requests_without_queries_are_skipped():
    b = make_batch(2, q_lens=[2, 1], ctx_lens=[5, 9])
    # Request 1 contributes no query rows this call: its output rows are untouched.
    b["query_start_loc"] = np.array([0, 2, 2], dtype=np.int32)
    out = torch.zeros_like(b["query"])
    rec = RecordingScores()
    cpu_read(
        b["query"],
        b["key_cache"],
        b["value_cache"],
        out,
        query_start_loc=b["query_start_loc"],
        kv_indptr=b["kv_indptr"],
        kv_slots=b["kv_slots"],
        scale=b["scale"],
        scores=rec,
    )
    assert not out[2].any()
    n0 = int(b["kv_indptr"][1])
    assert torch.equal(rec.calls[0][0], torch.arange(n0))  # request 0's keys


def test_bad_index_arrays_are_caught():
    b = make_batch(1, q_lens=[2], ctx_lens=[3], dead_frac=0.0)
    with pytest.raises(ValueError, match="disagree"):
        cpu_read(
            b["query"],
            b["key_cache"],
            b["value_cache"],
            torch.empty_like(b["query"]),
            query_start_loc=b["query_start_loc"],
            kv_indptr=np.array([0, 4]),
            kv_slots=b["kv_slots"],
            scale=1.0,
        )
    with pytest.raises(ValueError, match="fewer live slots"):
        cpu_read(
            b["query"],
            b["key_cache"],
            b["value_cache"],
            torch.empty_like(b["query"]),
            query_start_loc=np.array([0, 2]),
            kv_indptr=np.array([0, 1]),
            kv_slots=b["kv_slots"][:1],
            scale=1.0,
        )


def test_build_token_table_exact_rows():
    block = 16
    slots = torch.tensor([3, 17, 40, 0, 31])  # req 0: 3 slots, req 1: 2
    table, lens = build_token_table(np.array([0, 3, 5]), slots, block, 64)
    assert table.dtype == torch.int32 and table.shape == (2, 64)
    # slot s -> row (s // B) * 2B + s % B
    assert table[0, :3].tolist() == [3, 33, 72]
    assert table[1, :2].tolist() == [0, 47]
    assert not table[0, 3:].any() and not table[1, 2:].any()
    assert lens.tolist() == [3, 2]
    with pytest.raises(AssertionError, match="multiple of 64"):
        build_token_table(np.array([0, 3, 5]), slots, block, 48)
    with pytest.raises(AssertionError, match="kv_indptr"):
        build_token_table(np.array([0, 3, 6]), slots, block, 64)


_INTERP_CHILD = """
    import vllm._custom_ops as ops
    from vllm.vtoken.cpu_attention import build_cpu_read_plan, cpu_token_attention
    from vllm.vtoken.triton_attention import build_token_table, triton_token_attention

    gen = torch.Generator().manual_seed(0)
    N, H, Hq, B, D = 12, 2, 4, 16, 32
    kv = torch.zeros(2, N, H, B, D)
    kc, vc = kv.unbind(0)
    lens, q_lens = [30, 9, 14], [1, 4, 14]
    slots = torch.randperm(N * B, generator=gen)[: sum(lens)]
    ops.cpu_attn_reshape_and_cache(torch.randn(len(slots), H, D, generator=gen),
                                   torch.randn(len(slots), H, D, generator=gen),
                                   kc, vc, slots, "vec16")
    # Same tokens in the TRITON_ATTN layout [N, 2, B, H, D].
    tri = torch.stack([kc.view(N, H, D, B).permute(0, 3, 1, 2),
                       vc.permute(0, 2, 1, 3)], dim=1).contiguous()
    indptr = np.concatenate([[0], np.cumsum(lens)])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = torch.randn(int(qsl[-1]), Hq, D, generator=gen)
    want = torch.zeros_like(q)
    plan = build_cpu_read_plan(qsl, indptr, slots, B, H)
    cpu_token_attention(q, kc, vc, want, plan, D ** -0.5)
    table, live_lens = build_token_table(indptr, slots, B, 64)
    got = torch.zeros_like(q)
    triton_token_attention(q, tri, got, query_start_loc=torch.from_numpy(qsl),
                           token_table=table, live_lens=live_lens,
                           max_query_len=max(q_lens), max_live_len=max(lens),
                           scale=D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    print("TRITON-ATTN-OK")
"""


def test_triton_token_attention_matches_cpu_path_under_interpreter():
    run_under_interpreter(_INTERP_CHILD, "TRITON-ATTN-OK")


_SPLIT_KV_CHILD = """
    from types import SimpleNamespace

    from vllm.vtoken.staging import HostToDevice
    from vllm.vtoken.triton_attention import triton_forward
    from vllm.vtoken.triton_plan import build_triton_read_plan

    gen = torch.Generator().manual_seed(1)
    N, H, Hq, B, D, S = 12, 2, 4, 16, 32, 4  # S: softmax segments per request
    tri = torch.randn(N, 2, B, H, D, generator=gen)
    lens = [70, 9, 33]  # decode: one query each
    slots = torch.randperm(N * B, generator=gen)[: sum(lens)].numpy()
    indptr = np.concatenate([[0], np.cumsum(lens)])
    qsl = np.arange(4)
    q = torch.randn(3, Hq, D, generator=gen)
    stage = HostToDevice("cpu")
    plan = build_triton_read_plan(qsl, indptr, slots, B, stage=stage)
    read = SimpleNamespace(plan=plan, scores=None)
    two_d = torch.zeros_like(q)
    triton_forward(read, q, tri, two_d, D ** -0.5)
    # vLLM's split-KV buffers, as TritonAttentionMetadata carries them.
    md = SimpleNamespace(
        seq_threshold_3D=8, num_par_softmax_segments=S,
        softmax_segm_output=torch.empty(8, Hq, S, D),
        softmax_segm_max=torch.empty(8, Hq, S),
        softmax_segm_expsum=torch.empty(8, Hq, S),
    )
    md.softmax_segm_max.fill_(float("nan"))  # written by the 3D kernel only
    three_d = torch.zeros_like(q)
    triton_forward(read, q, tri, three_d, D ** -0.5, split_kv=md)
    assert not md.softmax_segm_max[:3].isnan().all(), "the 3D path did not run"
    torch.testing.assert_close(three_d, two_d, atol=1e-5, rtol=1e-5)
    # The table laid in the profile run's reserved buffer (patch 0052), whose
    # entries past each live length hold other rows of the cache: the 3D
    # kernel masks them as the 2D one does, to the bit.
    from vllm.vtoken.triton_plan import reserve_token_table

    buf = reserve_token_table(3, 100, "cpu").random_(1, N * 2 * B, generator=gen)
    stale = build_triton_read_plan(qsl, indptr, slots, B, stage=stage,
                                   table_buffer=buf)
    assert stale.token_table.data_ptr() == buf.data_ptr()
    md.softmax_segm_max.fill_(float("nan"))
    again = torch.zeros_like(q)
    triton_forward(SimpleNamespace(plan=stale, scores=None), q, tri, again,
                   D ** -0.5, split_kv=md)
    assert not md.softmax_segm_max[:3].isnan().all(), "the 3D path did not run"
    torch.testing.assert_close(again, three_d, atol=0, rtol=0)
    print("SPLIT-KV-OK")
"""


def test_decode_takes_the_split_kv_path_with_the_same_output_under_interpreter():
    """With vLLM's split-KV buffers passed (patch 0080), a small decode batch
    runs unified_attention's 3D kernel, and reads what the 2D kernel reads."""
    run_under_interpreter(_SPLIT_KV_CHILD, "SPLIT-KV-OK")


_WARM_UP_CHILD = """
    from types import SimpleNamespace

    import vllm.vtoken.triton_attention as ta
    from vllm.vtoken.scores import ScoreAccumulator
    from vllm.vtoken.triton_attention import split_kv_buffers, warm_up

    N, H, Hq, B, D, S = 4, 2, 4, 16, 32, 4
    forward, seen = ta.triton_forward, []
    def counting(read, q, kv, out, scale, split, kv_quant):
        seen.append(
            (read.plan.live_lens.numel(), q.shape[0], split is not None, q.stride(0))
        )
        assert kv_quant is None  # the model's dtype
        return forward(read, q, kv, out, scale, split, kv_quant)
    ta.triton_forward = counting
    mass, keys = ta.triton_attention_mass, set()
    def scoring(q, kv, plan, *args, **kwargs):
        keys.add(plan.kv_slots.numel())
        return mass(q, kv, plan, *args, **kwargs)
    ta.triton_attention_mass = scoring
    kv = torch.randn(N, 2, B, H, D)
    before = kv.clone()
    builder = SimpleNamespace(
        seq_threshold_3D=8, num_par_softmax_segments=S,
        softmax_segm_output=torch.empty(8, Hq, S, D),
        softmax_segm_max=torch.full((8, Hq, S), float("nan")),
        softmax_segm_expsum=torch.empty(8, Hq, S),
    )
    other = SimpleNamespace(metadata_builders=[SimpleNamespace()])  # not TRITON_ATTN
    groups = [[other, SimpleNamespace(metadata_builders=[builder])]]
    assert split_kv_buffers(groups) is builder and split_kv_buffers([[other]]) is None
    warm_up(kv, Hq, ScoreAccumulator("sum"), split_kv_buffers(groups))
    assert not builder.softmax_segm_max[0].isnan().all(), "the 3D path did not run"
    assert torch.equal(kv, before), "the warm-up wrote the cache"
    # Triton's int variants (1, divisible by 16, neither): decode in 2D and
    # 3D, and prefill, at each request count; each with the query a view of
    # a fused QKV tensor and contiguous (its row stride is one too).
    assert sorted(seen) == sorted(
        [(n, n * q, split, row) for n in (1, 2, 16)
         for q, split in ((1, False), (1, True), (2, False))
         for row in ((Hq + 2 * H) * D, Hq * D)]
        + [(1, 1, False, (Hq + 2 * H) * D), (1, 1, False, Hq * D)]
    ), seen
    # The score kernel's key count too: 1 (one request of one key), 16's
    # multiples (16 requests of two) and neither.
    assert keys == {1, 2, 4, 32}, keys
    print("WARM-UP-OK")
"""


def test_warm_up_runs_the_split_kv_decode_read_under_interpreter():
    """The start-up warm-up compiles decode's 3D variant too, through the
    split-KV buffers of the runner's TRITON_ATTN metadata builder, and leaves
    the cache as it found it."""
    run_under_interpreter(_WARM_UP_CHILD, "WARM-UP-OK")


_FP8_WARM_UP_CHILD = """
    from vllm.vtoken.scores import ScoreAccumulator
    from vllm.vtoken.triton_attention import warm_up

    # An fp8 cache as vLLM allocates it (bytes; no NaN encodings); queries
    # in the model's dtype (ROCm) or quantized to fp8 (CUDA's query_quant).
    raw = torch.randint(0, 120, (4, 2, 16, 2, 32), dtype=torch.uint8)
    before = raw.clone()
    for scores in (None, ScoreAccumulator("sum")):
        for fp8_query in (False, True):
            warm_up(raw, 4, scores, None, torch.float8_e4m3fn, torch.float32,
                    fp8_query)
    assert torch.equal(raw, before), "the warm-up wrote the cache"
    print("FP8-WARM-UP-OK")
"""


def test_the_warm_up_reads_an_fp8_cache_under_interpreter():
    """The worker's start-up warm-up over an fp8 cache (its bytes, read as
    e4m3 with unit scales), with queries of the model's dtype and fp8 ones:
    the read and the score kernel run, and the cache is left as it was."""
    run_under_interpreter(_FP8_WARM_UP_CHILD, "FP8-WARM-UP-OK")


@pytest.mark.gpu
def test_gpu_triton_token_attention_matches_reference():
    b = make_batch(4, **SHAPES["mixed"])
    N, H, B, D = b["key_cache"].shape
    tri = (
        torch.stack(
            [
                b["key_cache"].view(N, H, D, B).permute(0, 3, 1, 2),
                b["value_cache"].permute(0, 2, 1, 3),
            ],
            dim=1,
        )
        .contiguous()
        .cuda()
    )
    table, lens = build_token_table(b["kv_indptr"], b["kv_slots"].cuda(), B, 128)
    q = b["query"].cuda()
    out = torch.zeros_like(q)
    triton_token_attention(
        q,
        tri,
        out,
        query_start_loc=torch.from_numpy(b["query_start_loc"]).cuda(),
        token_table=table,
        live_lens=lens,
        max_query_len=12,
        max_live_len=int(np.diff(b["kv_indptr"]).max()),
        scale=b["scale"],
    )
    # tl.dot may use TF32 on the GPU.
    torch.testing.assert_close(out.cpu(), reference(b), atol=1e-2, rtol=1e-2)


def test_one_plan_serves_every_layer():
    """The worker builds the plan once per step; each layer reads through it."""
    b = make_batch(11, **SHAPES["mixed"])
    plan = build_cpu_read_plan(
        b["query_start_loc"], b["kv_indptr"], b["kv_slots"], b["block"], 2
    )
    assert plan.num_decode and plan.others  # both paths exercised
    outs = []
    for _ in range(2):
        out = torch.full_like(b["query"], float("nan"))
        cpu_token_attention(
            b["query"], b["key_cache"], b["value_cache"], out, plan, b["scale"]
        )
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    torch.testing.assert_close(outs[0], reference(b), atol=1e-5, rtol=1e-5)


def test_per_request_window_rows_count_only_those_rows():
    """SnapKV under chunked prefill: each request counts its own last rows
    (`score_rows`, 0 for a chunk before the prompt's last queries, a decode
    request's one row included). Outputs are unchanged; a request's masses
    are those of a read counting as many rows of it, zero for none."""
    b = make_batch(6, **SHAPES["mixed"])  # requests 0, 2 decode; 1, 3 prefill
    args = (b["query_start_loc"], b["kv_indptr"], b["kv_slots"], b["block"], 2)
    rows = np.array([0, 3, 1, 0])
    plan = build_cpu_read_plan(*args, score_rows=rows)
    out, rec = torch.zeros_like(b["query"]), RecordingScores(query_window=99)
    cpu_token_attention(
        b["query"], b["key_cache"], b["value_cache"], out, plan, b["scale"], rec
    )
    torch.testing.assert_close(out, reference(b), atol=1e-5, rtol=1e-5)
    pos, mass = rec.calls[0]
    for r, n in enumerate(rows.tolist()):
        keys = (pos >= int(b["kv_indptr"][r])) & (pos < int(b["kv_indptr"][r + 1]))
        if n == 0:
            assert (mass[keys] == 0).all(), r
            continue
        one = RecordingScores(query_window=n)
        run_cpu(b, scores=one)
        p1, m1 = one.calls[0]
        want = m1[(p1 >= int(b["kv_indptr"][r])) & (p1 < int(b["kv_indptr"][r + 1]))]
        torch.testing.assert_close(mass[keys], want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("window", [None, 2])
def test_score_only_requests_keep_the_rows_vllm_wrote(window):
    """A request without a dead token is read for its masses only: its output
    rows stay as vLLM's kernel wrote them; the others are overwritten. With a
    query window (SnapKV) a score-only prefill computes its last rows only,
    and its masses are the same."""
    b = make_batch(6, **SHAPES["mixed"])  # requests 0, 2 decode; 1, 3 prefill
    write = np.array([True, False, False, True])
    plan = build_cpu_read_plan(
        b["query_start_loc"], b["kv_indptr"], b["kv_slots"], b["block"], 2, write
    )
    out = torch.full_like(b["query"], 7.0)
    rec = RecordingScores(query_window=window)
    cpu_token_attention(
        b["query"], b["key_cache"], b["value_cache"], out, plan, b["scale"], rec
    )
    qsl, want = b["query_start_loc"], reference(b)
    for r, w in enumerate(write):
        rows = slice(qsl[r], qsl[r + 1])
        if w:
            torch.testing.assert_close(out[rows], want[rows], atol=1e-5, rtol=1e-5)
        else:
            assert (out[rows] == 7.0).all()
    full = RecordingScores(query_window=window)
    run_cpu(b, scores=full)  # the masses do not depend on what is written
    torch.testing.assert_close(rec.calls[0][1], full.calls[0][1], atol=1e-6, rtol=0)


def test_plan_fields_of_a_mixed_batch():
    """The compiled plan build, field by field: a decode, a request without
    keys (vLLM's kernel reads it), a prefill, one without queries this call,
    and a second decode. Decodes are padded to the widest, others listed
    with their keys, and score_pos lists decodes' keys first."""
    B, H = 4, 2
    qsl = np.array([0, 1, 3, 6, 6, 7])  # 1, 2, 3, 0, 1 queries
    kv_loc = np.array([0, 3, 3, 7, 9, 11])  # 3, 0, 4, 2, 2 keys
    slots = np.array([5, 9, 2, 40, 41, 42, 43, 7, 8, 13, 30])
    write = np.array([True, True, False, True, True])
    plan = build_cpu_read_plan(qsl, kv_loc, slots, B, H, write, np.array([1] * 5))
    assert plan.num_decode == 2 and plan.others == [2]
    assert plan.q_rows.tolist() == [0, 6]
    keys = [[5, 9, 2], [13, 30, 5]]  # request 4's padded with slots[0]
    assert (plan.blk * B + plan.off).tolist() == keys
    assert plan.valid.tolist() == [[True] * 3, [True, True, False]]
    assert plan.pad.view(2, 3).tolist() == [[False] * 3, [False, False, True]]
    assert plan.valid_at.tolist() == [0, 1, 2, 3, 4]
    assert plan.q_span is None  # rows 0 and 6: gathered
    v = [(s // B * H + h) * B + s % B for k in keys for h in range(H) for s in k]
    assert plan.v_rows.tolist() == v
    assert plan.other_q == [(3, 6)] and plan.other_loc == [0, 4]
    assert plan.other_slots.tolist() == [40, 41, 42, 43]
    assert plan.score_pos.tolist() == [0, 1, 2, 9, 10, 3, 4, 5, 6]
    assert plan.decode_write is None and plan.other_write == [False]
    assert plan.decode_counted is None and plan.other_rows == [1]
    write[4] = False  # a decode read for its scores only, one not counted
    plan = build_cpu_read_plan(
        qsl, kv_loc, slots, B, H, write, np.array([1, 0, 2, 0, 0])
    )
    assert plan.decode_write.tolist() == [True, False]
    assert plan.decode_counted.tolist() == [True, False]
    assert plan.other_rows == [2]
    # Decodes around a request with keys but no queries this call: not every
    # key is read, so the masses' positions are listed; the narrower decode
    # (first) is padded.
    plan = build_cpu_read_plan([0, 1, 1, 2], [0, 2, 4, 7], slots[:7], B, H)
    assert not plan.scores_in_order and plan.score_pos.tolist() == [0, 1, 4, 5, 6]
    assert plan.valid.tolist() == [[True, True, False], [True] * 3]
    # Index arrays the kernel would read out of bounds with are refused.
    with pytest.raises(ValueError, match="decreases"):
        build_cpu_read_plan([0, 2, 1], [0, 0, 3], slots[:3], B, H)
    with pytest.raises(ValueError, match="disagree"):
        build_cpu_read_plan([], [], slots[:0], B, H, np.zeros(0, bool))


@pytest.mark.parametrize("aggregate", ["mean", "max"])
def test_a_decode_layer_adds_its_masses_in_order_with_no_per_layer_index_work(
    aggregate,
):
    """A read of decodes only: the masses of every key, in read order, go to
    the step buffer as they are (no scatter), the valid entries are gathered
    by positions the plan made once (no nonzero a layer), and the mask and
    head index are the plan's: the same buffer, to the bit, as the scatter
    of the general path, in fewer ops a layer."""
    import dataclasses

    from vllm.vtoken.scores import ScoreAccumulator

    b = make_batch(4, **SHAPES["decode"])
    plan = build_cpu_read_plan(
        b["query_start_loc"], b["kv_indptr"], b["kv_slots"], b["block"], 2
    )
    assert plan.scores_in_order and plan.num_decode == 3
    assert plan.score_pos.numel() == 0  # in order: not written
    general = dataclasses.replace(
        plan, scores_in_order=False, score_pos=torch.arange(b["kv_slots"].numel())
    )
    cpu_token_attention(  # once first: the head index is made once a process
        b["query"], b["key_cache"], b["value_cache"], torch.empty_like(b["query"]),
        plan, b["scale"],
    )  # fmt: skip
    bufs, ops_of = [], []
    for p in (plan, general):
        acc = ScoreAccumulator("sum", aggregate=aggregate)
        acc.begin_step(b["kv_slots"].numel())
        out = torch.full_like(b["query"], float("nan"))
        with torch.profiler.profile() as prof:
            for _ in range(2):  # two layers
                cpu_token_attention(
                    b["query"], b["key_cache"], b["value_cache"], out, p,
                    b["scale"], acc,
                )  # fmt: skip
        torch.testing.assert_close(out, reference(b), atol=1e-5, rtol=1e-5)
        bufs.append(acc._step.clone())
        ops_of.append({e.name for e in prof.events() if e.cpu_parent is None})
    torch.testing.assert_close(bufs[0], bufs[1], atol=0, rtol=0)
    per_layer = {"aten::nonzero", "aten::index_add_", "aten::scatter_reduce_"}
    per_layer |= {"aten::arange", "aten::bitwise_not", "aten::cat"}
    assert not ops_of[0] & per_layer, ops_of[0] & per_layer
    assert ops_of[1] & per_layer  # the general path makes them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_of_decodes_at_their_budget_reads_with_fewer_ops_to_the_bit(dtype):
    """Every request decoding with as many live keys as the others (each at
    its budget): the plan knows its query rows follow one another and that
    nothing is padded, so a layer reads the queries and writes the outputs as
    views, and makes no mask, no scale product and no masses' gather. Output
    and masses are those of the general path (rows gathered, mask, gather)
    to the bit."""
    import dataclasses

    from vllm.vtoken.scores import ScoreAccumulator

    b = make_batch(
        6, q_lens=[1, 1, 1], ctx_lens=[20, 20, 20], dead_frac=0.0, dtype=dtype
    )
    plan = build_cpu_read_plan(
        b["query_start_loc"], b["kv_indptr"], b["kv_slots"], b["block"], 2
    )
    assert plan.q_span == slice(0, 3) and plan.pad is None and plan.valid_at is None
    assert plan.valid is None and plan.scores_in_order and not plan.score_pos.numel()
    r, w = plan.blk.shape
    general = dataclasses.replace(
        plan,
        q_span=None,
        pad=torch.zeros(r, 1, 1, w, dtype=torch.bool),
        valid_at=torch.arange(r * w),
    )
    cpu_token_attention(  # once first: the head index is made once a process
        b["query"], b["key_cache"], b["value_cache"], torch.empty_like(b["query"]),
        plan, b["scale"],
    )  # fmt: skip
    outs, bufs, ops_of = [], [], []
    for p in (plan, general):
        acc = ScoreAccumulator("sum")
        acc.begin_step(b["kv_slots"].numel())
        out = torch.full_like(b["query"], float("nan"))
        with torch.profiler.profile() as prof:
            cpu_token_attention(
                b["query"], b["key_cache"], b["value_cache"], out, p, b["scale"], acc
            )
        outs.append(out)
        bufs.append(acc._step.clone())
        ops_of.append(Counter(e.name for e in prof.events() if e.cpu_parent is None))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0], reference(b), atol=tol, rtol=tol)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    torch.testing.assert_close(bufs[0], bufs[1], atol=0, rtol=0)
    fast, slow = ops_of
    for op in ("aten::masked_fill_", "aten::mul", "aten::index_put_"):
        assert not fast[op] and (slow[op] or op == "aten::mul"), (op, fast, slow)
    assert fast["aten::index"] == 1 and slow["aten::index"] == 2  # K; and queries
    assert fast["aten::index_select"] == 1 < slow["aten::index_select"]  # V; masses
    assert sum(fast.values()) < sum(slow.values())
    # Without scores (StreamingLLM, Random) the masses are not reduced at all.
    out = torch.full_like(b["query"], float("nan"))
    with torch.profiler.profile() as prof:
        cpu_token_attention(
            b["query"], b["key_cache"], b["value_cache"], out, plan, b["scale"]
        )
    torch.testing.assert_close(out, outs[0], atol=0, rtol=0)
    unscored = Counter(e.name for e in prof.events() if e.cpu_parent is None)
    assert fast["aten::sum"] == 1 and not unscored["aten::sum"], unscored


def test_a_decode_step_reads_a_float32_query_that_is_a_view_of_fused_qkv():
    """vLLM's query is a view of the fused qkv projection (its rows strided
    past the keys and values), and float32's .float() copies nothing: the
    decode read of consecutive rows must still read it, as the reference."""
    b = make_batch(7, q_lens=[1, 1, 1], ctx_lens=[12, 12, 12], dead_frac=0.0)
    qkv = torch.randn(3, 4 + 2 * 2, 32)  # [T, Hq + 2 H, D]
    qkv[:, :4] = b["query"]
    b["query"] = qkv[:, :4]
    assert not b["query"].is_contiguous()
    plan = build_cpu_read_plan(
        b["query_start_loc"], b["kv_indptr"], b["kv_slots"], b["block"], 2
    )
    assert plan.q_span == slice(0, 3)
    out = torch.full((3, 4, 32), float("nan"))
    cpu_token_attention(
        b["query"], b["key_cache"], b["value_cache"], out, plan, b["scale"]
    )
    torch.testing.assert_close(out, reference(b), atol=1e-5, rtol=1e-5)
