#!/usr/bin/env python3
"""Kernel-level check of vToken's Triton code on a GPU, with no vLLM install.

Needs torch, triton, this repo and vLLM 0.18.0's own
`vllm/v1/attention/ops/triton_unified_attention.py` (the stock kernel, from
the pristine tree). A throw-away `vllm` package shims what that file and the
overlay import (triton_utils, logger, platforms, batch_invariant); the overlay's
`vllm/vtoken` is put on its path. Checks, one line each, JSON to --out:

    copy          kv_copy_triton byte-exact (bf16, fp8, uint8); GB/s vs d2d copy
    read          one-token-page read vs stock 16-token pages (decode, prefill,
                  chunked prefill; decode on vLLM's split-KV (3D) path, and
                  with half the requests left to the stock output; decode and
                  prefill over an fp8 cache with its scales), max abs
                  difference
    score         score kernel vs float64 (mean/max, SnapKV window; the model's
                  heads and a wide GQA group; an fp8 cache's keys against
                  their dequantized values), rel error
    decode_time   stock vs vToken read vs score-only, ms (CUDA events, medians)
    score_memory  peak extra memory of scoring an 8k-token prefill (and dense)
    syncs         host syncs in a step's read: its plan uploaded through the
                  worker's stage, two layers' read + score

`--tiny` runs small sizes; without CUDA it runs on CPU under TRITON_INTERPRET=1
(fp16 for the math: the interpreter's bf16 dot is wrong) and reports timing,
bandwidth, memory and syncs as null (n/a).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
import types
import warnings
from functools import partial

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
OVERLAY = str(REPO / "vllm_overlay" / "vllm")
UA = "vllm/v1/attention/ops/triton_unified_attention.py"
_CACHE = pathlib.Path(os.environ.get("VTOKEN_CACHE", "~/.cache/vtoken")).expanduser()
CANDIDATES = [
    _CACHE / "pristine-0.18.0" / UA,
    _CACHE / "pristine-0.18.0" / "vllm" / UA,
    REPO / "shared" / UA,
    REPO / "shared" / "triton_unified_attention.py",
]
SHIM = {  # module of the fake vllm package -> its source
    "__init__.py": "__path__.append({overlay!r})",
    "triton_utils/__init__.py": "import triton, triton.language as tl\n"
    "import triton.language.extra.libdevice as tldevice\nHAS_TRITON = True",
    "logger.py": "from logging import getLogger as init_logger",
    "platforms/__init__.py": "import torch, types\ncurrent_platform = "
    "types.SimpleNamespace(fp8_dtype=lambda: torch.float8_e4m3fn)",
    "model_executor/layers/batch_invariant.py": "def vllm_is_batch_invariant():\n"
    "    return False",
}
# heads (Hq, Hkv, D), wide (a large GQA group: the score kernel's tile
# shrinks its query rows for it); copy (layers, blocks, H, D, moves); read and
# score (sequence lengths, query lengths); decode (requests, context); memory
# (tokens); syncs (sequence lengths, query lengths)
TINY = dict(
    heads=(6, 2, 32), wide=(16, 1, 32), copy=(2, 8, 2, 32, 20),
    score=([40, 25, 19, 5], [1, 6, 19, 0]),
    read=dict(decode=([40, 7, 23], [1] * 3), prefill=([9, 21],) * 2,
              chunked=([30, 20], [4, 6])),
    decode=[(1, 64), (4, 128)], memory=256, syncs=([30, 8, 50], [1, 8, 20]),
)  # fmt: skip
FULL = dict(
    heads=(32, 8, 128), wide=(48, 1, 128), copy=(8, 2048, 8, 128, 8192),
    score=([700, 1500, 333, 2048], [1, 200, 333, 1]),
    read=dict(decode=([700, 2048, 33] * 8, [1] * 24),
              prefill=([1024, 300, 2000],) * 2,
              chunked=([1500, 900, 4000], [256, 1, 512])),
    decode=[(r, n) for r in (1, 8, 64, 256) for n in (512, 2048)], memory=8192,
    syncs=([300, 40, 1000], [1, 40, 200]),
)  # fmt: skip


def install_shim(stock: pathlib.Path) -> None:
    """A fake `vllm` package first on sys.path: the stock kernel + the overlay."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="vtoken-shim-")) / "vllm"
    shim = dict(SHIM, **{"__init__.py": SHIM["__init__.py"].format(overlay=OVERLAY)})
    for rel, text in dict(shim, **{UA[5:]: stock.read_text()}).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        for parent in path.relative_to(root).parents:  # regular packages
            (root / parent / "__init__.py").touch()
    sys.path.insert(0, str(root.parent))


def find_stock(given: str | None) -> pathlib.Path:
    """The stock kernel file: `given`, or the first of CANDIDATES found;
    exits naming where it looked."""
    found = [pathlib.Path(given)] if given else [x for x in CANDIDATES if x.exists()]
    if not found or not found[0].exists():
        sys.exit(f"no stock {UA}; looked in {given or CANDIDATES}")
    return found[0]


def timed(fn, c, reps: int = 20) -> float | None:
    """Median ms of `fn` by CUDA events (None on CPU: not measured)."""
    if not c.gpu:
        return None
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return round(statistics.median(times), 4)


def make_batch(c, seq, qlen, dtype=None, B=16, heads=None):
    """Requests laid out positionally on random 16-token blocks (stock layout)."""
    hq, hkv, d = heads or c.heads
    seq, qlen = np.asarray(seq), np.asarray(qlen)
    nb, R = -(-seq // B), len(seq)
    bt = torch.zeros(R, int(nb.max()), dtype=torch.int32)
    bt[torch.from_numpy(np.arange(nb.max()) < nb[:, None])] = torch.randperm(
        int(nb.sum()) + 1, dtype=torch.int32
    )[: nb.sum()]
    req = torch.from_numpy(np.repeat(np.arange(R), seq))
    t = torch.from_numpy(np.arange(seq.sum()) - np.repeat(np.cumsum(seq) - seq, seq))
    slots = bt[req, t // B].long() * B + t % B
    kw = dict(device=c.dev, dtype=dtype or c.dt)
    qsl, indptr = np.r_[0, np.cumsum(qlen)], np.r_[0, np.cumsum(seq)]
    i32 = partial(torch.tensor, dtype=torch.int32, device=c.dev)
    return dict(
        q=torch.randn(int(qsl[-1]), hq, d, **kw), bt=bt.to(c.dev),
        cache=torch.randn(int(nb.sum()) + 1, 2, B, hkv, d, **kw),
        slots=slots.to(c.dev), qsl=qsl, indptr=indptr, seq=seq, qlen=qlen,
        qsl_t=i32(qsl), seq_t=i32(seq), scale=d**-0.5,
    )  # fmt: skip


def fp8_batch(b, fp8_query=False):
    """Batch `b` with its cache in fp8 (e4m3, per-tensor K and V scales) as
    vLLM allocates it (bytes), its `quant` as patch 0080 passes it, and the
    keys as the kernels multiply them (`deq`, for the float64 references);
    `fp8_query`: the query quantized to fp8 too, as CUDA hands it (vLLM's
    query_quant), against which vLLM's kernel reads the keys unscaled."""
    from vllm.vtoken.triton_attention import KVQuant

    f8, cache = torch.float8_e4m3fn, b["cache"]
    scales = [torch.tensor([s], device=cache.device) for s in (0.05, 0.03)]
    raw = torch.empty(cache.shape, dtype=torch.uint8, device=cache.device)
    deq = torch.empty_like(cache)
    for kv, s in enumerate(scales):
        x = (cache[:, kv].float() / s).to(f8)
        raw[:, kv] = x.view(torch.uint8)
        deq[:, kv] = (x.float() * (1.0 if fp8_query else s)).to(cache.dtype)
    out = dict(b, cache=raw, deq=deq, quant=KVQuant(f8, *scales))
    if fp8_query:
        out["q"] = b["q"].to(f8)
    return out


def stock_read(b, out, split=None):
    """vLLM's kernel over batch `b`'s 16-token pages; with `split`
    (split_kv), its split-KV (3D) path where it takes it."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    cache, quant, descale = b["cache"], b.get("quant"), {}
    if quant is not None:  # as TRITON_ATTN's forward passes an fp8 cache
        cache, shape = cache.view(quant.dtype), (len(b["seq"]), cache.shape[3])
        descale = dict(
            k_descale=quant.k_scale.expand(shape), v_descale=quant.v_scale.expand(shape)
        )
    unified_attention(
        q=b["q"], k=cache[:, 0], v=cache[:, 1], out=out,
        cu_seqlens_q=b["qsl_t"], max_seqlen_q=int(b["qlen"].max()),
        seqused_k=b["seq_t"], max_seqlen_k=int(b["seq"].max()),
        softmax_scale=b["scale"], causal=True,
        window_size=(-1, -1), block_table=b["bt"], softcap=0,
        q_descale=None, **(descale or dict(k_descale=None, v_descale=None)),
        **{k: getattr(split, k) for k in vars(split or types.SimpleNamespace())},
    )  # fmt: skip


# vLLM's MIN_LAUNCH_GRID_SIZE_2D (v1/attention/backends/triton_attn.py): a
# decode batch of more than this // Hkv sequences takes the 2D kernel.
MIN_GRID_2D = 128


def split_kv(b):
    """vLLM's split-KV (3D) buffers for batch `b`, as TritonAttentionMetadata
    carries them (MIN_GRID_2D // Hkv sequences, 16 softmax segments), the max
    NaN: only the 3D kernel writes it."""
    _, hq, d = b["q"].shape
    n, segments, dev = MIN_GRID_2D // b["cache"].shape[3], 16, b["q"].device
    f32 = partial(torch.empty, dtype=torch.float32, device=dev)
    return types.SimpleNamespace(
        seq_threshold_3D=n, num_par_softmax_segments=segments,
        softmax_segm_output=f32(n, hq, segments, 1 << (d - 1).bit_length()),
        softmax_segm_max=f32(n, hq, segments).fill_(float("nan")),
        softmax_segm_expsum=f32(n, hq, segments),
    )  # fmt: skip


def stale_table(b):
    """The token table's buffer as the worker holds it after earlier steps
    (reserved in vLLM's profile run, patch 0052): room for batch `b`, every
    entry a row id of its cache, none the padding zeros of a fresh table.
    The kernel must mask what lies past each live length."""
    from vllm.vtoken.triton_plan import reserve_token_table

    n, _, block = b["cache"].shape[:3]
    buf = reserve_token_table(len(b["seq"]), int(b["seq"].max()), b["q"].device)
    return buf.random_(0, n * 2 * block)


def vtoken_read(b, out, scores=None, write=None, split=None):
    """One layer of the overlay's read of batch `b`, its token table laid in
    a `stale_table`; returns the runner."""
    from vllm.vtoken.context import TokenRead
    from vllm.vtoken.triton_attention import triton_forward
    from vllm.vtoken.triton_plan import build_triton_read_plan

    window = None if scores is None else scores.query_window
    plan = build_triton_read_plan(
        b["qsl"], b["indptr"], b["slots"], 16, write,
        scored=scores is not None, score_query_window=window,
        score_group=b["q"].shape[1] // b["cache"].shape[3],
        table_buffer=stale_table(b),
    )  # fmt: skip
    if scores is not None:
        scores.begin_step(b["slots"].numel())
    stock = write is not None and not np.all(write)
    read = TokenRead(
        query_start_loc=b["qsl"], kv_indptr=b["indptr"], kv_slots=b["slots"],
        plan=plan, scores=scores, with_stock=stock,
    )  # fmt: skip
    return partial(
        triton_forward, read, b["q"], b["cache"], out, b["scale"], split, b.get("quant")
    )


def dense_mass64(b, aggregate, window):
    """float64 reference masses, request by request, in kv_slots order."""
    cache = b.get("deq", b["cache"])  # an fp8 cache's values, dequantized
    out, keys = [], cache[b["slots"] // 16, 0, b["slots"] % 16].double()
    for r in range(len(b["seq"])):
        q = b["q"][b["qsl"][r] : b["qsl"][r + 1]].double().transpose(0, 1)
        k = keys[b["indptr"][r] : b["indptr"][r + 1]].transpose(0, 1)
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        s = q @ k.transpose(1, 2) * b["scale"]
        lq, lk = s.shape[1:]
        causal = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril(lk - lq)
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)[:, -(window or lq) :]
        out.append(p.sum(1).amax(0) if aggregate == "max" else p.sum(1).sum(0))
    return torch.cat(out)


def check_copy(c):
    from vllm.vtoken.kv_copy_triton import TritonKVSlotCopier

    L, N, H, D, M = c.copy
    res = {}
    for name in ("bfloat16", "float8_e4m3fn", "uint8"):
        size = getattr(torch, name).itemsize  # raw bytes, viewed as the dtype
        shape = (N, 2, 16, H, D * size)
        raw = [torch.randint(0, 256, shape, dtype=torch.uint8, device=c.dev)]
        raw += [torch.randint_like(raw[0], 256) for _ in range(L - 1)]
        perm = torch.randperm(N * 16, device=c.dev)
        src, dst = perm[:M], perm[M : 2 * M]
        want = [w.clone() for w in raw]
        for w in want:
            w[dst // 16, :, dst % 16] = w[src // 16, :, src % 16]
        copier = TritonKVSlotCopier([r.view(getattr(torch, name)) for r in raw], 16)
        copier.copy(src, dst)
        exact = all(map(torch.equal, raw, want))
        moved = 2 * M * L * 2 * H * D * size  # read + write, K and V rows
        ms = timed(partial(copier.copy, src, dst), c)
        res[name] = dict(exact=exact, gbps=ms and round(moved / ms / 1e6, 1))
    big = torch.empty(2, moved // 2, dtype=torch.uint8, device=c.dev)
    ms = timed(partial(big[1].copy_, big[0]), c)
    res["d2d_gbps"] = ms and round(moved / ms / 1e6, 1)
    res["ok"] = all(v["exact"] for v in res.values() if isinstance(v, dict))
    return res


def read_runs(c) -> list[tuple]:
    """check_read's runs: (name, seq, qlen, how: None, "split" or rows
    written, fp8: None, "fp8" (the cache fp8 with its scales, queries of the
    model's dtype: ROCm) or "fp8q" (the query quantized to fp8 too, as CUDA
    hands it)). The split-KV runs take as many of the decode batch's
    sequences as vLLM reads on its 3D path (MIN_GRID_2D // Hkv; the full
    batch of 24 at 8 KV heads took the 2D one, and the check failed)."""
    runs = [(name, seq, ql, None, None) for name, (seq, ql) in c.read.items()]
    seq, ql = c.read["decode"]
    half = np.arange(len(seq)) % 2 == 0
    few = MIN_GRID_2D // c.heads[1]
    runs += [("decode_split_kv", seq[:few], ql[:few], "split", None)]
    runs += [("decode_mixed", seq, ql, half, None)]
    for fp8 in ("fp8", "fp8q"):
        runs += [(f"{n}_{fp8}", *c.read[n], None, fp8) for n in ("decode", "prefill")]
    runs += [("decode_mixed_fp8q", seq, ql, half, "fp8q")]
    runs += [("decode_split_kv_fp8q", seq[:few], ql[:few], "split", "fp8q")]
    return runs


def check_read(c):
    res = {}
    for name, seq, ql, how, fp8 in read_runs(c):
        b = make_batch(c, seq, ql)
        if fp8 is not None:
            b = fp8_batch(b, fp8_query=fp8 == "fp8q")
        # The output in the model's dtype (an fp8 query's too).
        want = torch.zeros(b["q"].shape, dtype=c.dt, device=c.dev)
        got = torch.zeros_like(want)
        # An fp8 query's 3D path rounds its probabilities to fp8 by segment:
        # stock's own 3D read is its reference (bf16's is the 2D read).
        stock_read(b, want, split_kv(b) if isinstance(how, str) and fp8 else None)
        if isinstance(how, str):  # decode on vLLM's 3D path (patch 0080 passes it)
            md = split_kv(b)
            vtoken_read(b, got, split=md)()
            ran = not md.softmax_segm_max[: len(seq)].isnan().all().item()
        elif how is not None:  # the others keep the stock output the backend wrote
            got.copy_(want)
            got[torch.from_numpy(np.repeat(how, b["qlen"])).to(c.dev)] = 0
            vtoken_read(b, got, write=how)()
            ran = True
        else:
            vtoken_read(b, got)()
            ran = True
        err = (got.float() - want.float()).abs().max().item()
        ok = ran and err <= 2e-2 and want.abs().max().item() > 0  # bf16 tolerance
        res[name] = dict(max_abs_err=err, ok=ok)
        if not ran:
            res[name]["error"] = "vLLM's kernel did not take its split-KV path"
    res["ok"] = all(v["ok"] for v in res.values())
    return res


def check_score(c):
    from vllm.vtoken.score_kernel import build_score_plan, triton_attention_mass

    res = {}
    runs = list(itertools.product((c.heads, c.wide), (torch.float32, c.dt), [0]))
    # An fp8 cache: queries of the model's dtype (its keys dequantized), and
    # an fp8 query (CUDA's; the keys as they are), as vLLM's kernel reads them.
    runs += [(c.heads, torch.float32, 1), (c.heads, c.dt, 1), (c.heads, c.dt, 2)]
    for heads, dt, fp8 in runs:
        b = make_batch(c, *c.score, dtype=dt, heads=heads)
        cache, k_scale = b["cache"], None
        if fp8:
            b = fp8_batch(b, fp8_query=fp8 == 2)
            cache, k_scale = b["cache"].view(b["quant"].dtype), b["quant"].k_scale
        group = heads[0] // heads[1]
        for aggregate in ("mean", "max"):
            for window in (None, 8):
                plan = build_score_plan(
                    b["qsl"], b["indptr"], b["slots"], window, group=group
                )
                got = triton_attention_mass(
                    b["q"], cache, plan, b["scale"], aggregate, k_scale=k_scale
                ).double()
                want = dense_mass64(b, aggregate, window)
                err = ((got - want).abs() / (1 + want.abs())).max().item()
                # fp8 x fp8 dots accumulate imprecisely on sm_90 by default
                # (stock's too): a looser bound there.
                ok = err <= (1e-5 if dt == torch.float32 else 2e-3 if fp8 < 2 else 1e-2)
                kind = ["", "_fp8", "_fp8q"][fp8]
                key = f"g{group}_{str(dt)[6:]}{kind}_{aggregate}_w{window}"
                res[key] = dict(rel_err=err, ok=ok)
    res["ok"] = all(v["ok"] for v in res.values())
    return res


def check_decode_time(c):
    from vllm.vtoken.scores import ScoreAccumulator

    res = {}
    for reqs, ctx in c.decode:
        b = make_batch(c, [ctx] * reqs, [1] * reqs)
        out = torch.zeros_like(b["q"])
        acc = ScoreAccumulator("sum", c.dev)
        res[f"{reqs}x{ctx}"] = dict(
            stock_ms=timed(partial(stock_read, b, out), c),
            vtoken_ms=timed(vtoken_read(b, out), c),
            score_only_ms=timed(vtoken_read(b, out, acc, np.zeros(reqs, bool)), c),
        )
    return res


def check_score_memory(c):
    from vllm.vtoken.score_kernel import build_score_plan, triton_attention_mass
    from vllm.vtoken.triton_attention import attention_mass

    b = make_batch(c, [c.memory], [c.memory])
    group = c.heads[0] // c.heads[1]
    plan = build_score_plan(b["qsl"], b["indptr"], b["slots"], None, group=group)
    keys = b["cache"][b["slots"] // 16, 0, b["slots"] % 16]
    runs = {
        "tiled": partial(triton_attention_mass, b["q"], b["cache"], plan, b["scale"]),
        "dense": partial(attention_mass, b["q"], keys, b["scale"]),  # the old path
    }
    res = {"tokens": c.memory}
    for name, fn in runs.items():
        if c.gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base, t, peak = (
            c.gpu and torch.cuda.memory_allocated(),
            time.perf_counter(),
            None,
        )
        try:
            fn()
            if c.gpu:  # the call's own synchronize: the time is the kernel's too
                torch.cuda.synchronize()
                peak = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        except torch.OutOfMemoryError:
            peak = "OOM"
        res[f"{name}_ms"] = round((time.perf_counter() - t) * 1e3, 1)
        res[f"{name}_peak_mib"] = peak
    res["ok"] = not c.gpu or res["tiled_peak_mib"] < 256
    return res


def check_syncs(c):
    """Host syncs in a step's read as the worker makes it: the plan built from
    NumPy slots and uploaded through its persistent stage (one non-blocking
    copy), then two layers' read and scores. Run on CPU too (--tiny), so the
    path does not rot; counted on a GPU only."""
    from vllm.vtoken.context import TokenRead
    from vllm.vtoken.scores import ScoreAccumulator
    from vllm.vtoken.staging import HostToDevice
    from vllm.vtoken.triton_attention import triton_forward
    from vllm.vtoken.triton_plan import build_triton_read_plan

    b = make_batch(c, *c.syncs)
    acc, stage = ScoreAccumulator("sum", c.dev), HostToDevice(c.dev)
    out, slots = torch.zeros_like(b["q"]), b["slots"].cpu().numpy()
    write = np.array([True, False, True])  # rows mixed: one read for scores only
    group, table = b["q"].shape[1] // b["cache"].shape[3], stale_table(b)

    def step():
        plan = build_triton_read_plan(
            b["qsl"], b["indptr"], slots, 16, write, scored=True,
            score_group=group, stage=stage, table_buffer=table,
        )  # fmt: skip
        acc.begin_step(slots.size)
        read = TokenRead(
            query_start_loc=b["qsl"], kv_indptr=b["indptr"], kv_slots=plan.kv_slots,
            plan=plan, scores=acc, with_stock=True,
        )  # fmt: skip
        for _layer in range(2):
            triton_forward(read, b["q"], b["cache"], out, b["scale"])

    step()  # compiled before counting
    if not c.gpu:
        return {"syncs": None, "ok": bool(out.abs().sum() > 0)}
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in seen)
    return {"syncs": syncs, "ok": syncs == 0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stock", nargs="?", help=f"path of {UA} (vLLM 0.18.0)")
    p.add_argument("--out", default="gpu_kernel_check.json", help="JSON report")
    p.add_argument("--tiny", action="store_true", help="small sizes (CPU ok)")
    a = p.parse_args()
    stock = find_stock(a.stock)
    gpu = torch.cuda.is_available()
    if not gpu and not a.tiny:
        sys.exit("no CUDA device: only --tiny runs on CPU (TRITON_INTERPRET=1)")
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads
    install_shim(stock)
    import vllm  # the shim: nothing of an installed vLLM is read

    c = types.SimpleNamespace(
        gpu=gpu, dev="cuda" if gpu else "cpu",
        dt=torch.bfloat16 if gpu else torch.float16, **(TINY if a.tiny else FULL),
    )  # fmt: skip
    torch.manual_seed(0)
    report = dict(
        device=torch.cuda.get_device_name() if gpu else "cpu",
        tiny=a.tiny, stock_kernel=str(stock), vllm=vllm.__file__,
    )  # fmt: skip
    start = time.perf_counter()
    for check in (
        check_copy, check_read, check_score, check_decode_time,
        check_score_memory, check_syncs,
    ):  # fmt: skip
        t, name = time.perf_counter(), check.__name__[6:]
        try:  # one failing check (a kernel that does not compile) spares the rest
            res = check(c)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            res = {"error": f"{type(e).__name__}: {e}"[:2000], "ok": False}
        report[name] = res
        print(f"[{name}] {json.dumps(res)} ({time.perf_counter() - t:.1f} s)")
        if c.gpu:
            torch.cuda.empty_cache()
    report["ok"] = all(v.get("ok", True) for v in report.values() if type(v) is dict)
    report["seconds"] = round(time.perf_counter() - start, 1)
    pathlib.Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'OK' if report['ok'] else 'FAILED'} in {report['seconds']} s -> {a.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
