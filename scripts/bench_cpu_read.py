#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""One decode layer's attention on CPU: vLLM's CPU_ATTN kernel against vToken's
token read, at the memory benchmark's shape (issue 10's CPU decode target).

    python scripts/bench_cpu_read.py    # SmolLM2-135M's heads, bf16; writes
                                        # docs/bench/cpu_read.json

The engine's step time mixes the read with the rest of the forward and this
machine's noise (two native runs of the memory benchmark differ by up to 20%);
one layer's read, repeated hundreds of times on the same tensors, does not.
Native reads each request's whole context through its block table; vToken's
read gathers the live slots of the step's plan (`build_cpu_read_plan`), with
H2O's masses or without. Before timing, both reads of one full context (every
token live, the same slots) must agree to the dtype's rounding (2e-2), so that the two
numbers time the same attention.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import shlex
import statistics
import sys
import time

import numpy as np
import torch

B = 16  # block size
OUT = pathlib.Path(__file__).resolve().parents[1] / "docs/bench/cpu_read.json"


def _native(q, kc, vc, out, context: int, scale: float):
    from vllm import _custom_ops as ops

    R, Hq, D = q.shape
    qsl = torch.arange(R + 1, dtype=torch.int32)
    seq_lens = torch.full((R,), context, dtype=torch.int32)
    per_req = kc.shape[0] // R
    table = torch.arange(kc.shape[0], dtype=torch.int32).view(R, per_req)
    table = table[:, : -(-context // B)].contiguous()
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=R, num_heads=Hq, num_kv_heads=kc.shape[1], head_dim=D,
        seq_lens=seq_lens, dtype=q.dtype, query_start_loc=qsl, causal=True,
        sliding_window_size=-1, isa="vec16", enable_kv_split=True,
    )  # fmt: skip
    o = out.view(R, Hq, D)

    def read():
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=kc, value_cache=vc, output=o, query_start_loc=qsl,
            seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
            sliding_window=(-1, -1), block_table=table, softcap=0.0,
            scheduler_metadata=meta, s_aux=None,
        )  # fmt: skip

    return read


def _token_read(q, kc, vc, out, slots: np.ndarray, scale: float, scored: bool):
    from vllm.vtoken.cpu_attention import build_cpu_read_plan, cpu_token_attention
    from vllm.vtoken.policies import create_policy
    from vllm.vtoken.scores import ScoreAccumulator

    R = q.shape[0]
    width = slots.size // R
    plan = build_cpu_read_plan(
        np.arange(R + 1), np.arange(R + 1) * width, slots, B, kc.shape[1]
    )
    scores = None
    if scored:  # H2O's: every key's mass summed over heads and queries
        scores = ScoreAccumulator.of_policy(create_policy("h2o", slots.size))
        scores.begin_step(slots.size)  # the worker's, once a step: not timed

    def read():
        cpu_token_attention(q, kc, vc, out, plan, scale, scores)

    return read


def _median_us(read, iters: int) -> float:
    for _ in range(max(iters // 10, 1)):  # warm
        read()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        read()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def run(args) -> dict:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    R, Hq, H, D = args.requests, args.heads, args.kv_heads, args.head_dim
    dtype = getattr(torch, args.dtype)
    per_req = -(-max(*args.context, args.live) // B) * 2  # blocks per request
    kc = torch.randn(R * per_req, H, B, D, dtype=dtype)
    vc = torch.randn(R * per_req, H, B, D, dtype=dtype)
    q = torch.randn(R, Hq, D, dtype=dtype)
    scale = D**-0.5
    base = np.arange(R)[:, None] * per_req * B

    # The same attention: one full context, every token live, both reads.
    full = args.context[0]
    want, got = torch.empty(R, Hq * D, dtype=dtype), torch.empty(R, Hq * D, dtype=dtype)
    _native(q, kc, vc, want, full, scale)()
    dense = (base + np.arange(full)).ravel()
    _token_read(q, kc, vc, got, dense, scale, scored=False)()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)

    # vToken holds `live` tokens: packed into the request's blocks after
    # compaction, or scattered (holes not yet compacted).
    packed = (base + np.arange(args.live)).ravel()
    spread = np.concatenate(
        [
            b + np.sort(rng.choice(per_req * B, args.live, replace=False))
            for b in base[:, 0]
        ]
    )
    out = torch.empty(R, Hq * D, dtype=dtype)
    reads = {
        f"native, context {c}": _native(q, kc, vc, out, c, scale) for c in args.context
    }
    for layout, slots in (("packed", packed), ("scattered", spread)):
        for scored in (True, False):
            what = "scores" if scored else "no scores"
            name = f"vtoken, {args.live} live {layout}, {what}"
            reads[name] = _token_read(q, kc, vc, out, slots, scale, scored)
    runs: dict[str, list[float]] = {name: [] for name in reads}
    for _ in range(args.repeats):  # taking turns: a drift hits every read alike
        for name, read in reads.items():
            runs[name].append(_median_us(read, args.iters))
    med = {name: statistics.median(v) for name, v in runs.items()}
    ref = med[f"native, context {args.context[-1]}"]
    for name, us in med.items():
        each = [round(x) for x in runs[name]]
        print(f"{name:44s} {us:8.1f} µs  {us / ref:5.2f}x  runs {each}")
    return {
        "shape": {
            "requests": R, "heads": Hq, "kv_heads": H, "head_dim": D,
            "dtype": args.dtype, "context": args.context, "live": args.live,
        },
        "iters": args.iters,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "median_us": med,
        "runs_us": runs,
        "vs": f"native, context {args.context[-1]}",
    }  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--context", type=int, nargs="+", default=[256, 384],
                   help="native's context per request (the memory benchmark "
                        "decodes from 128 to 384 tokens)")  # fmt: skip
    p.add_argument("--live", type=int, default=129, help="vToken's keys: budget + 1")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=600)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=str(OUT), help="write the result here")
    args = p.parse_args(argv)
    result = run(args)
    given = sys.argv[1:] if argv is None else argv
    result["command"] = shlex.join(["python", "scripts/bench_cpu_read.py", *given])
    result["date"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
