"""Attention mass without materialized probabilities (vllm.vtoken.score_kernel).

The tiled torch path equals the dense reference `attention_mass` to 1e-5; the
Triton kernel (under TRITON_INTERPRET=1, on CPU) equals a float64 reference
over a whole batch in one launch per layer; scoring an 8k-token prefill on the
CPU read path stays under 256 MiB of extra memory, where the dense
probabilities of a 2k-token one already exceed it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.runtime.interpreter import CONFTEST, run_under_interpreter
from vllm.vtoken.score_kernel import (
    attention_mass_tiled,
    build_score_plan,
    tiled_attention,
)
from vllm.vtoken.triton_attention import attention_mass

SHAPES = {  # (Lq, Lk)
    "decode": (1, 45),
    "chunked_prefill": (13, 40),
    "full_prefill": (37, 37),
}
HEADS = [(4, 2), (3, 1), (2, 2)]  # (Hq, Hkv): GQA, odd group, MHA


def qk(seed, lq, lk, hq, hkv, d=16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(lq, hq, d, generator=gen)
    k = torch.randn(lk, hkv, d, generator=gen) * 2  # peaked probabilities
    v = torch.randn(lk, hkv, d, generator=gen)
    return q, k, v


@pytest.mark.parametrize("aggregate", ["mean", "max"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tile_elems", [1, 300, 1 << 22])  # 1 row .. one tile
def test_tiled_mass_equals_dense_reference(aggregate, heads, shape, tile_elems):
    q, k, _ = qk(1, *SHAPES[shape], *heads)
    want = attention_mass(q, k, 0.25, aggregate)
    got = attention_mass_tiled(q, k, 0.25, aggregate, tile_elems=tile_elems)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 4, 100])
@pytest.mark.parametrize("heads", HEADS)
def test_window_counts_the_last_rows_and_output_is_attention(window, heads):
    """SnapKV: with or without the output, the masses of the last `window` rows
    are those of the dense reference over those rows."""
    lq, lk = SHAPES["chunked_prefill"]
    q, k, v = qk(2, lq, lk, *heads)
    hq = heads[0]
    w = min(window, lq)
    want = attention_mass(q[-w:], k, 0.3)
    out = torch.full((hq, lq, q.shape[2]), float("nan"))
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    head = tiled_attention(qh, kh, vh, 0.3, mass_rows=w, out=out, tile_elems=200)
    torch.testing.assert_close(head.sum(0), want, atol=1e-5, rtol=1e-5)
    only = tiled_attention(qh[:, -w:], kh, None, 0.3, tile_elems=200)
    torch.testing.assert_close(only, head, atol=1e-6, rtol=0)
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    dense = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, scale=0.3, enable_gqa=True
    )
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def test_several_requests_each_match_the_reference():
    """Per request of a batch (the CPU read's loop): its own keys and rows."""
    for seed, (lq, lk) in enumerate([(1, 9), (6, 6), (3, 50), (2, 2)]):
        q, k, _ = qk(seed, lq, lk, 4, 2)
        for aggregate in ("mean", "max"):
            torch.testing.assert_close(
                attention_mass_tiled(q, k, 0.2, aggregate, tile_elems=64),
                attention_mass(q, k, 0.2, aggregate),
                atol=1e-5,
                rtol=1e-5,
            )


def test_score_plan_tiles_the_counted_rows():
    # Requests: prefill 20 rows / 30 keys, decode, no keys, no queries, chunk.
    qsl = np.array([0, 20, 21, 25, 25, 28])
    indptr = np.array([0, 30, 40, 40, 45, 52])
    slots = torch.arange(52)
    plan = build_score_plan(qsl, indptr, slots, None, block_q=8)
    first, end, start, count, scratch = plan.tiles.tolist()
    assert first == [0, 8, 16, 20, 25] and end == [20, 20, 20, 21, 28]
    assert start == [0, 0, 0, 30, 45] and count == [30, 30, 30, 10, 7]
    # "max": only the prefill's rows span tiles; its 30 keys are the scratch's.
    assert scratch == [0, 0, 0, -1, -1]
    assert torch.equal(plan.scratch_keys, torch.arange(30))
    assert plan.num_tiles == 5 and plan.tiles.dtype == torch.int32
    assert torch.equal(plan.positions, torch.arange(52))
    win = build_score_plan(qsl, indptr, slots, 2, block_q=8)
    assert win.tiles[0].tolist() == [18, 20, 26] and win.query_window == 2
    assert build_score_plan(qsl, indptr, slots, 1).block_q == 1  # decode-like
    # Per request (SnapKV under chunked prefill): 3 rows, none, -, -, all 3.
    own = build_score_plan(qsl, indptr, slots, np.array([3, 0, 5, 0, 3]), block_q=8)
    assert own.tiles[0].tolist() == [17, 25] and own.tiles[1].tolist() == [20, 28]
    assert own.tiles[4].tolist() == [-1, -1] and own.scratch_keys.numel() == 0
    assert build_score_plan(qsl, indptr, slots, None).block_q == 16
    # Fewer query rows per tile as the query heads of a KV head grow (a
    # program holds rows x group): vLLM's rule; 16 rows of 48 heads took
    # more shared memory than an H100 has.
    blocks = [build_score_plan(qsl, indptr, slots, None, group=g).block_q
              for g in (1, 3, 4, 8, 16, 48, 71)]  # fmt: skip
    assert blocks == [16, 16, 16, 8, 4, 1, 1]
    assert build_score_plan(qsl, indptr, slots, 1, group=48).block_q == 1
    empty = build_score_plan(np.array([0, 3]), np.array([0, 0]), slots[:0], None)
    assert empty.num_tiles == 0 and empty.tiles.shape == (5, 0)


_TRITON_CHILD = """
    import vllm.vtoken.score_triton as st
    from vllm.vtoken.context import TokenRead
    from vllm.vtoken.scores import ScoreAccumulator
    from vllm.vtoken.score_kernel import build_score_plan, triton_attention_mass
    from vllm.vtoken.triton_attention import triton_forward
    from vllm.vtoken.triton_plan import build_triton_read_plan

    def dense64(q, k, scale, aggregate, window):  # [Lq, Hq, D], [Lk, Hkv, D]
        q, k = q.double().transpose(0, 1), k.double().transpose(0, 1)
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        s = q @ k.transpose(1, 2) * scale
        lq, lk = s.shape[1:]
        causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)[:, -(window or lq):]
        head = p.sum(1)
        return head.amax(0) if aggregate == "max" else head.sum(0)

    gen = torch.Generator().manual_seed(7)
    N, B, D = 12, 16, 32
    # decode, chunked prefill, full prefill, no keys (stock), no queries, decode
    q_lens, k_lens = [1, 6, 19, 3, 0, 1], [40, 27, 19, 0, 5, 70]
    qsl = np.r_[0, np.cumsum(q_lens)]
    indptr = np.r_[0, np.cumsum(k_lens)]
    slots = torch.randperm(N * B, generator=gen)[: indptr[-1]]
    for hq, hkv in ((4, 2), (3, 1), (16, 1)):  # 16: 4-row tiles
        cache = torch.randn(N, 2, B, hkv, D, generator=gen)
        q = torch.randn(int(qsl[-1]), hq, D, generator=gen)
        keys = cache[slots // B, 0, slots % B]
        for aggregate in ("mean", "max"):
            for window in (None, 3):
                for block_q in (None, 4):
                    plan = build_score_plan(qsl, indptr, slots, window, block_q,
                                            group=hq // hkv)
                    got = triton_attention_mass(q, cache, plan, 0.3, aggregate,
                                                block_n=16)
                    want = torch.zeros(len(slots), dtype=torch.float64)
                    for r in range(len(q_lens)):
                        k0, k1 = indptr[r], indptr[r + 1]
                        if q_lens[r] and k1 > k0:
                            want[k0:k1] = dense64(q[qsl[r]:qsl[r + 1]],
                                                  keys[k0:k1], 0.3, aggregate,
                                                  window)
                    torch.testing.assert_close(got.double(), want,
                                               atol=1e-5, rtol=1e-5)
    # A plan tiled for a narrower group is refused, not launched too big.
    try:
        triton_attention_mass(q, cache, build_score_plan(qsl, indptr, slots,
                                                         None), 0.3)
        raise SystemExit("a 16-row plan ran for 16 heads per KV head")
    except AssertionError as e:
        assert "query heads per KV head" in str(e), e
    # One launch per layer for the whole batch, through triton_forward.
    launches = []
    kernel = st.score_mass_kernel
    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]
    st.score_mass_kernel = Counting()
    for scored in (True, False):
        acc = ScoreAccumulator("sum")
        acc.begin_step(len(slots))
        plan = build_triton_read_plan(qsl, indptr, slots, B, np.zeros(6, bool),
                                      scored=scored, score_group=hq // hkv)
        assert (plan.score is not None) == scored
        read = TokenRead(query_start_loc=qsl, kv_indptr=indptr, kv_slots=slots,
                         plan=plan, scores=acc, with_stock=True)
        out = torch.zeros(len(q), hq * D)
        if not scored:  # no score plan built per layer (a blocking upload)
            try:
                triton_forward(read, q, cache, out, 0.3)
                raise SystemExit("a scored read ran without its score plan")
            except AssertionError as e:
                assert "scored=True" in str(e), e
            continue
        for _layer in range(3):
            triton_forward(read, q, cache, out, 0.3)
        assert len(launches) == 3, launches
        launches.clear()
        assert not out.any()  # score-only: no request writes
        total = acc._step.sum().item()
        assert abs(total - 3 * hq * (qsl[-1] - 3)) < 1e-3, total  # 3 rows stock
    assert not launches, launches
    # "max" keeps a per-head scratch for the keys of requests whose rows span
    # tiles only (a prefill's): none in a step of decodes, whatever its keys.
    scratches = []
    class Capturing:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                scratches.append(None if args[5] is args[4] else tuple(args[5].shape))
                return kernel[grid](*args, **kwargs)
            return launch
    st.score_mass_kernel = Capturing()
    hq, hkv = 4, 2
    cache = torch.randn(N, 2, B, hkv, D, generator=gen)
    for q_lens in ([1, 1, 1, 1, 1, 1], [1, 6, 19, 3, 0, 1]):
        qsl = np.r_[0, np.cumsum(q_lens)]
        q = torch.randn(int(qsl[-1]), hq, D, generator=gen)
        plan = build_score_plan(qsl, indptr, slots, None, group=hq // hkv)
        triton_attention_mass(q, cache, plan, 0.3, "max", block_n=16)
    # decodes: none; then 16-row tiles: the 19-row prefill's 19 keys only
    assert scratches == [None, (hq, 19)], scratches
    st.score_mass_kernel = kernel
    print("SCORE-KERNEL-OK")
"""


def test_triton_kernel_matches_float64_in_one_launch_per_layer():
    run_under_interpreter(_TRITON_CHILD, "SCORE-KERNEL-OK")


_MEMORY_CHILD = """
import re, runpy, sys
runpy.run_path(sys.argv[1])
import numpy as np, torch
from vllm.vtoken.cpu_attention import build_cpu_read_plan, cpu_token_attention
from vllm.vtoken.triton_attention import attention_mass

torch.set_num_threads(2)
MIB = 1 << 20

def rss():  # (current, peak since the last reset) in bytes
    s = open("/proc/self/status").read()
    kb = [int(re.search(rf"{k}:\\s+(\\d+)", s).group(1)) for k in ("VmRSS", "VmHWM")]
    return kb[0] * 1024, kb[1] * 1024

def extra_peak(fn):
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    base, _ = rss()
    fn()
    return rss()[1] - base

class Scores:
    aggregate, query_window = "mean", None
    def add(self, pos, mass):
        self.total = float(mass.sum())

L, H, HQ, B, D = 8192, 2, 8, 16, 64
N = L // B
kc, vc = torch.randn(N, H, B, D), torch.randn(N, H, B, D)
q = torch.randn(L, HQ, D)
out = torch.zeros(L, HQ, D)
qsl, indptr = np.array([0, L]), np.array([0, L])
plan = build_cpu_read_plan(qsl, indptr, torch.arange(L), B, H)
scores = Scores()
new = extra_peak(lambda: cpu_token_attention(q, kc, vc, out, plan, D**-0.5, scores))
assert abs(scores.total - L * HQ) < 1, scores.total
k2 = torch.randn(2048, H, D)
old = extra_peak(lambda: attention_mass(q[:2048], k2, D**-0.5))
# The read with no scores (a resume under StreamingLLM): torch's flash path.
R = 4096
plan = build_cpu_read_plan(np.array([0, R]), np.array([0, R]), torch.arange(R), B, H)
read = extra_peak(lambda: cpu_token_attention(q[:R], kc, vc, out[:R], plan, D**-0.5))
mib = [round(x / MIB) for x in (new, old, read)]
print("PEAK new_8k={} old_2k={} read_4k={} MiB".format(*mib))
"""


def test_scoring_an_8k_prefill_on_cpu_stays_under_256_mib():
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    # Without tcmalloc: it would keep freed memory and hide the peak.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_MEMORY_CHILD), CONFTEST],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PEAK"))
    new, old, read = (int(x.split("=")[1].split()[0]) for x in line.split()[1:4])
    print(line)
    assert new < 256, line
    assert old > 256, line  # the dense probabilities at a quarter of the length
    # Unscored, 3-D SDPA took torch's math path: [8, 4k, 4k] fp32 logits.
    assert read < 256, line


def test_window_rows_are_the_prompts_last_queries_whatever_the_chunks():
    """SnapKV counts the prefill's last `window` queries: chunks of a 100-token
    prompt [0, 60), [60, 90), [90, 100) count 0, 22 and 10 rows (32 in all, as
    one chunk's last 32); a decode step counts its row; a resumed request's
    recompute (its outputs included in the tokens) is a prefill again."""
    from vllm.vtoken.scores import window_rows

    got = window_rows(
        32,
        [100, 100, 100, 100, 101, 140],
        [0, 60, 90, 0, 100, 0],
        [60, 30, 10, 100, 1, 140],
    )
    assert got.tolist() == [0, 22, 10, 32, 1, 32]
    assert window_rows(32, [10], [0], [10]).tolist() == [10]  # short prompt
