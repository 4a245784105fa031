"""The runner-to-attention hand-off (`vllm.vtoken.context.TokenRead`).

The same live tokens laid out as vLLM's CPU cache and as its TRITON_ATTN cache:
`cpu_forward` and `triton_forward` (Triton under TRITON_INTERPRET=1, on CPU) give
the same output and feed the score accumulator the same attention mass, over two
layers reading through the one plan the worker builds per step. And the
host part of the TRITON_ATTN plan: slots to rows, the token table.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.runtime.interpreter import run_under_interpreter

_SETUP = """
    from vllm.vtoken.context import TokenRead
    from vllm.vtoken.cpu_attention import build_cpu_read_plan, cpu_forward
    from vllm.vtoken.scores import ScoreAccumulator
    from vllm.vtoken.triton_attention import triton_forward
    from vllm.vtoken.triton_plan import build_triton_read_plan

    def fold(scores, indptr, qsl, norm):  # requests a, b, c; keys by token
        idx = np.concatenate([np.arange(n) for n in np.diff(indptr)])
        scores.finish_step(list("abc"), indptr, idx, qsl, norm)

    gen = torch.Generator().manual_seed(3)
    N, H, Hq, B, D = 10, 2, 4, 16, 32
    lens, q_lens = [37, 12, 20], [1, 5, 20]   # decode, chunk, full prefill
    slots = torch.randperm(N * B, generator=gen)[: sum(lens)]
    k = torch.randn(len(slots), H, D, generator=gen)
    v = torch.randn(len(slots), H, D, generator=gen)
    # CPU_ATTN layout [2, N, H, B, D], K transposed inside each page.
    cpu = torch.zeros(2, N, H, B, D)
    n, b = slots // B, slots % B
    cpu[0].view(N, H, D, B)[n, :, :, b] = k
    cpu[1][n, :, b, :] = v
    # TRITON_ATTN layout [N, 2, B, H, D].
    tri = torch.zeros(N, 2, B, H, D)
    tri[n, 0, b], tri[n, 1, b] = k, v
    indptr = np.concatenate([[0], np.cumsum(lens)])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    q = torch.randn(int(qsl[-1]), Hq, D, generator=gen)
"""

_CHILD = (
    _SETUP
    + """
    outs, accs = [], []
    for forward in ("cpu", "triton"):
        scores = ScoreAccumulator("sum")
        scores.begin_step(len(slots))
        if forward == "cpu":
            plan = build_cpu_read_plan(qsl, indptr, slots, B, H)
        else:
            plan = build_triton_read_plan(qsl, indptr, slots, B, scored=True,
                                          score_group=Hq // H)
        read = TokenRead(query_start_loc=qsl, kv_indptr=indptr, kv_slots=slots,
                         plan=plan, scores=scores)
        out = torch.zeros(len(q), Hq * D)
        for _layer in range(2):  # every layer reads through the one plan
            if forward == "cpu":
                cpu_forward(read, q, cpu[0], cpu[1], out, D ** -0.5)
            else:
                triton_forward(read, q, tri, out, D ** -0.5)
        fold(scores, indptr, qsl, 2.0 * Hq)
        outs.append(out)
        accs.append(np.concatenate([scores.scores(r, np.arange(n))
                                    for r, n in zip("abc", lens)]))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(accs[1], accs[0], atol=1e-5, rtol=1e-5)
    assert accs[0].sum() > 0
    print("TOKEN-READ-OK")
"""
)


def test_cpu_and_triton_reads_agree_under_interpreter():
    run_under_interpreter(_CHILD, "TOKEN-READ-OK")


_MIXED = (
    _SETUP
    + """
    outs, accs = [], []
    # Every request on the read; then request 1 read for its scores only, its
    # rows holding what vLLM's kernel wrote before (here 7.0).
    for write in (np.ones(3, bool), np.array([True, False, True])):
        scores = ScoreAccumulator("sum")
        scores.begin_step(len(slots))
        plan = build_triton_read_plan(qsl, indptr, slots, B, write, scored=True,
                                      score_group=Hq // H)
        read = TokenRead(query_start_loc=qsl, kv_indptr=indptr, kv_slots=slots,
                         plan=plan, scores=scores, with_stock=not write.all())
        out = torch.full((len(q), Hq * D), 7.0)
        triton_forward(read, q, tri, out, D ** -0.5)
        fold(scores, indptr, qsl, 1.0 * Hq)
        outs.append(out)
        accs.append(np.concatenate([scores.scores(r, np.arange(n))
                                    for r, n in zip("abc", lens)]))
    mine = slice(qsl[1], qsl[2])
    assert (outs[1][mine] == 7.0).all()
    others = torch.ones(len(q), dtype=torch.bool)
    others[mine] = False
    torch.testing.assert_close(outs[1][others], outs[0][others], atol=0, rtol=0)
    np.testing.assert_array_equal(accs[1], accs[0])  # request 1 is scored still
    # No request writes: the kernel is skipped, scores are still read.
    plan = build_triton_read_plan(qsl, indptr, slots, B, np.zeros(3, bool))
    assert plan.token_table is None and plan.rows.numel() == 0
    print("MIXED-READ-OK")
"""
)


def test_gpu_read_overwrites_only_the_rows_of_requests_with_a_dead_token():
    run_under_interpreter(_MIXED, "MIXED-READ-OK")


# The same keys and values as an fp8 (e4m3) cache of per-tensor scales, its
# bytes as vLLM allocates them (uint8).
_FP8_CACHE = """
    from vllm.vtoken.triton_attention import KVQuant

    f8 = torch.float8_e4m3fn
    k_scale, v_scale = torch.tensor([0.05]), torch.tensor([0.02])
    k8, v8 = (k / k_scale).to(f8), (v / v_scale).to(f8)
    raw = torch.zeros(N, 2, B, H, D, dtype=torch.uint8)
    raw[n, 0, b], raw[n, 1, b] = k8.view(torch.uint8), v8.view(torch.uint8)
"""

_FP8 = (
    _SETUP
    + _FP8_CACHE
    + """
    # And as a float32 cache of their dequantized values.
    deq = torch.zeros(N, 2, B, H, D)
    deq[n, 0, b], deq[n, 1, b] = k8.float() * k_scale, v8.float() * v_scale

    def read(cache, kv_quant):
        scores = ScoreAccumulator("sum")
        scores.begin_step(len(slots))
        plan = build_triton_read_plan(qsl, indptr, slots, B, scored=True,
                                      score_group=Hq // H)
        read = TokenRead(query_start_loc=qsl, kv_indptr=indptr, kv_slots=slots,
                         plan=plan, scores=scores)
        out = torch.zeros(len(q), Hq * D)
        triton_forward(read, q, cache, out, D ** -0.5, kv_quant=kv_quant)
        fold(scores, indptr, qsl, 1.0 * Hq)
        return out, np.concatenate([scores.scores(r, np.arange(m))
                                    for r, m in zip("abc", lens)])

    want = read(deq, None)
    got = read(raw, KVQuant(f8, k_scale, v_scale))
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=1e-5)
    # The scales count, in the read and in the scores alike.
    one = torch.ones(1)
    off = read(raw, KVQuant(f8, one, one))
    assert not torch.allclose(off[0], want[0], atol=1e-2)
    assert not np.allclose(off[1], want[1], atol=1e-2)
    print("FP8-READ-OK")
"""
)


def test_an_fp8_cache_is_read_with_its_scales_under_interpreter():
    """An fp8 (e4m3) cache as vLLM allocates it (bytes) and the layer's K
    and V scales (patch 0080's `kv_quant_of`): the read and its scores equal
    those over a float32 cache of the dequantized keys and values."""
    run_under_interpreter(_FP8, "FP8-READ-OK")


_FP8_BACKEND = (
    _SETUP
    + _FP8_CACHE
    + """
    from types import SimpleNamespace

    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    from vllm.vtoken.context import set_token_read
    from vllm.vtoken.triton_attention import attention_mass

    # CUDA's way with an fp8 cache: the query quantized to fp8 before the
    # backend (vLLM's query_quant, q_scale 1); the output in the model's dtype.
    q8 = q.to(f8)
    layer = SimpleNamespace(_k_scale=k_scale, _v_scale=v_scale, _q_scale_float=1.0)
    impl = TritonAttentionImpl(Hq, D, D ** -0.5, H, None, None, "fp8")
    T = len(q)
    md = SimpleNamespace(  # the stock kernel's: positional pages (any here)
        use_cascade=False, num_actual_tokens=T,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(lens),
        block_table=torch.arange(3 * 3, dtype=torch.int32).view(3, 3),
        seq_threshold_3D=None, num_par_softmax_segments=None,
        softmax_segm_output=None, softmax_segm_max=None,
        softmax_segm_expsum=None, mm_prefix_range_tensor=None,
    )

    def forward(write=None, direct=False, read_on=True):
        scores = ScoreAccumulator("sum")
        scores.begin_step(len(slots))
        plan = build_triton_read_plan(qsl, indptr, slots, B, write, scored=True,
                                      score_group=Hq // H)
        stock = write is not None and not write.all()
        read = TokenRead(query_start_loc=qsl, kv_indptr=indptr, kv_slots=slots,
                         plan=plan, scores=scores, with_stock=stock)
        out = torch.full((T, Hq, D), 7.0)
        if direct:  # the overlay's read alone, with the quant spelled out
            quant = KVQuant(f8, k_scale, v_scale)
            triton_forward(read, q8, raw, out, D ** -0.5, kv_quant=quant)
        else:  # the patched backend (0080), which must hand the read its quant
            set_token_read(read if read_on else None)
            try:
                impl.forward(layer, q8, None, None, raw, md, out)
            finally:
                set_token_read(None)
        fold(scores, indptr, qsl, 1.0 * Hq)
        return out, np.concatenate([scores.scores(r, np.arange(m))
                                    for r, m in zip("abc", lens)])

    want = forward(direct=True)
    got = forward()  # every request read: the backend returns early
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    np.testing.assert_array_equal(got[1], want[1])
    # Request 1 keeps the stock output; the others are read (the stock
    # kernel first, then the read over its rows, in the model's dtype).
    write = np.array([True, False, True])
    mixed, stock = forward(write), forward(write, read_on=False)
    rows = torch.from_numpy(np.repeat(write, q_lens))
    torch.testing.assert_close(mixed[0][rows], want[0][rows], atol=0, rtol=0)
    torch.testing.assert_close(mixed[0][~rows], stock[0][~rows], atol=0, rtol=0)
    np.testing.assert_array_equal(mixed[1], want[1])  # request 1 scored still
    # Scored as stock's kernel attends: fp8 keys against the fp8 query as
    # they are (its scales apply to a query of the model's dtype only).
    ref = []
    for r in range(3):
        qr, kr = q8[qsl[r]:qsl[r + 1]].float(), k8[indptr[r]:indptr[r + 1]].float()
        ref.append(attention_mass(qr, kr, D ** -0.5).numpy() / Hq)
    np.testing.assert_allclose(want[1], np.concatenate(ref), atol=1e-5, rtol=1e-5)
    print("FP8-BACKEND-OK")
"""
)


def test_the_patched_backend_reads_an_fp8_cache_as_cuda_hands_it_under_interpreter():
    """Patch 0080's TRITON_ATTN forward over an fp8 cache, with the query
    CUDA quantizes to fp8 for it: the read (every request, and some beside
    the stock kernel's output) equals the overlay's with the cache's quant
    spelled out, its output rows in the model's dtype, and the masses are
    those of stock's arithmetic (fp8 keys against the fp8 query)."""
    run_under_interpreter(_FP8_BACKEND, "FP8-BACKEND-OK", timeout=300)


def test_kv_quant_of_reads_stock_s_fp8_settings():
    from types import SimpleNamespace

    from vllm.vtoken.triton_attention import KVQuant, kv_quant_of

    layer = SimpleNamespace(
        _k_scale=torch.tensor([0.5]), _v_scale=torch.tensor([0.25]), _q_scale_float=1.0
    )
    auto = SimpleNamespace(kv_cache_dtype="auto", fp8_dtype=torch.float8_e4m3fn)
    assert kv_quant_of(auto, layer) is None
    fp8 = SimpleNamespace(kv_cache_dtype="fp8", fp8_dtype=torch.float8_e4m3fn)
    got = kv_quant_of(fp8, layer)
    assert isinstance(got, KVQuant) and got.dtype == torch.float8_e4m3fn
    assert got.k_scale is layer._k_scale and got.v_scale is layer._v_scale
    layer._q_scale_float = 2.0  # stock asserts the same on its own path
    with pytest.raises(AssertionError, match="q_scale"):
        kv_quant_of(fp8, layer)


_STALE = (
    _SETUP
    + """
    from vllm.vtoken.triton_plan import reserve_token_table

    def read(plan):
        read = TokenRead(query_start_loc=qsl, kv_indptr=indptr, kv_slots=slots,
                         plan=plan, scores=None)
        out = torch.zeros(len(q), Hq * D)
        triton_forward(read, q, tri, out, D ** -0.5)
        return out

    want = read(build_triton_read_plan(qsl, indptr, slots, B))
    # The reserved buffer as earlier steps leave it, and worse: any row of
    # the cache's view (the worker leaves K row ids only), no padding zeros.
    buf = reserve_token_table(4, 100, "cpu")
    assert buf.shape == (4 * 128,) and buf.dtype == torch.int32 and not buf.any()
    buf.random_(1, N * 2 * B, generator=gen)
    plan = build_triton_read_plan(qsl, indptr, slots, B, table_buffer=buf)
    assert plan.token_table.data_ptr() == buf.data_ptr()  # laid in it
    assert plan.token_table.shape == (3, 64)
    torch.testing.assert_close(read(plan), want, atol=0, rtol=0)
    try:  # a step past the reserve: the invariant, named
        build_triton_read_plan(qsl, indptr, slots, B, table_buffer=buf[:191])
    except AssertionError as err:
        assert "past its reserve" in str(err)
    else:
        raise SystemExit("a table past its buffer was built")
    print("STALE-READ-OK")
"""
)


def test_a_table_laid_in_the_reserved_buffer_reads_past_stale_entries():
    """A step's token table is the first rows x width entries of the buffer
    reserved in vLLM's profile run (patch 0052); the entries past each live
    length keep earlier steps' row ids, which the kernel masks out: the
    output is the fresh, zero-padded table's to the bit."""
    run_under_interpreter(_STALE, "STALE-READ-OK")


@pytest.mark.parametrize("block", [1, 2, 16, 64])
def test_slots_map_to_rows_of_the_one_token_page_view(block):
    """Slot (n, b) is K row n * 2B + b of the [N * 2 * B, 1, H, D] view (the
    formula of division, which the shift replaced)."""
    from vllm.vtoken.triton_plan import slots_to_rows

    slots = np.random.default_rng(block).integers(0, 1 << 20, 5000)
    want = (slots // block) * (2 * block) + slots % block
    np.testing.assert_array_equal(slots_to_rows(slots, block), want)
    got = slots_to_rows(torch.from_numpy(slots), block)
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("write", [None, [True, False, True, True]])
def test_the_token_table_holds_each_written_row_s_keys_then_zeros(write, pack):
    """build_triton_read_plan's table: row r the rows of request r's keys in
    order, then row 0 (a valid address the kernel masks) to a width of 64's
    multiple; requests not written left out."""
    from vllm.vtoken.staging import HostToDevice
    from vllm.vtoken.triton_plan import build_triton_read_plan, slots_to_rows

    lens, qlens, B = [5, 70, 1, 33], [1, 3, 1, 33], 16
    indptr, qsl = np.r_[0, np.cumsum(lens)], np.r_[0, np.cumsum(qlens)]
    slots = np.random.default_rng(0).permutation(4096)[: indptr[-1]]
    plan = build_triton_read_plan(
        qsl, indptr, slots, B, None if write is None else np.array(write),
        stage=HostToDevice("cpu", pack),
    )  # fmt: skip
    kept = [r for r in range(4) if write is None or write[r]]
    table = plan.token_table.numpy()
    width = 128 if 1 in kept else 64  # the longest kept row, to 64's multiple
    assert table.shape == (len(kept), width) and table.dtype == np.int32
    for i, r in enumerate(kept):
        keys = slots_to_rows(slots[indptr[r] : indptr[r + 1]], B)
        np.testing.assert_array_equal(table[i, : lens[r]], keys)
        assert not table[i, lens[r] :].any()
    np.testing.assert_array_equal(plan.live_lens.numpy(), np.array(lens)[kept])
