#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Times the reclamation planner per scheduler step (plan_blocks + pack_request).

Synthetic state: `blocks` live blocks of block_size 16 spread evenly over
`reqs` requests, each block holding a uniform random number of live tokens at
random offsets. One step plans every request at once (tail blocks excluded: the
worst case, where the engine plans a request once per 16 of its evictions) and
packs each planned request's sources into its own holes (with under two blocks
per request only tail blocks exist and nothing is planned). Reports the median
over repeats as a markdown table (µs per step, µs per 1,000 blocks) and writes
JSON.

    python scripts/bench_planner.py [--out docs/bench/planner.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16
THRESHOLD = 1.0  # the engine default (--kv-reclaim-threshold)


def load_planner():
    """Imports planner.py from the overlay without importing vLLM."""
    path = REPO / "vllm_overlay/vllm/vtoken/planner.py"
    spec = importlib.util.spec_from_file_location("vtoken_planner", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def make_state(num_blocks: int, num_reqs: int, seed: int = 0) -> dict:
    """Block ids, live counts and per-request live tokens (logical idx, slot)."""
    rng = np.random.default_rng(seed)
    B = BLOCK_SIZE
    ids = rng.permutation(num_blocks).astype(np.int64)
    live = rng.integers(0, B + 1, size=num_blocks)
    # A random live pattern inside each block with exactly live[b] tokens.
    live_mask = rng.random((num_blocks, B)).argsort(axis=1) < live[:, None]
    per_req = np.full(num_reqs, num_blocks // num_reqs)
    per_req[: num_blocks % num_reqs] += 1
    indptr = np.r_[0, np.cumsum(per_req)]
    reqs = []
    for r in range(num_reqs):
        lo, hi = indptr[r], indptr[r + 1]
        blk, off = np.nonzero(live_mask[lo:hi])
        reqs.append((blk * B + off, ids[lo + blk] * B + off))  # (idx, slots)
    # Eligible blocks: every block but the request's tail (the last one).
    keep = np.ones(num_blocks, dtype=bool)
    keep[indptr[1:][per_req > 0] - 1] = False
    elig_indptr = np.r_[0, np.cumsum(np.maximum(per_req - 1, 0))]
    return {
        "block_ids": ids[keep].astype(np.int32),
        "block_live": live[keep],
        "indptr": elig_indptr,
        "reqs": reqs,
        "num_blocks": num_blocks,
    }


def one_step(planner, state: dict) -> tuple[float, float, int, int]:
    """Returns (plan seconds, pack seconds, planned requests, moved tokens)."""
    t0 = time.perf_counter()
    plan = planner.plan_blocks(
        req_indptr=state["indptr"],
        block_ids=state["block_ids"],
        block_live=state["block_live"],
        block_size=BLOCK_SIZE,
        threshold=THRESHOLD,
    )
    t1 = time.perf_counter()
    moved = 0
    for k, r in enumerate(plan.req_index):
        idx, slots = state["reqs"][r]
        m = planner.pack_request(
            live_idx=idx,
            live_slots=slots,
            src_block_ids=plan.src_block_ids[
                plan.src_indptr[k] : plan.src_indptr[k + 1]
            ],
            dst_block_ids=plan.dst_block_ids[
                plan.dst_indptr[k] : plan.dst_indptr[k + 1]
            ],
            block_size=BLOCK_SIZE,
        )
        moved += m.idx.size
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, len(plan.req_index), moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs/bench/planner.json"))
    parser.add_argument(
        "--blocks", type=int, nargs="+", default=[1_000, 10_000, 100_000]
    )
    parser.add_argument("--reqs", type=int, nargs="+", default=[16, 256, 1024])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    planner = load_planner()
    rows = []
    for num_blocks in args.blocks:
        for num_reqs in args.reqs:
            state = make_state(num_blocks, num_reqs)
            one_step(planner, state)  # warm-up
            runs = [one_step(planner, state) for _ in range(args.repeats)]
            plan_us = statistics.median(r[0] for r in runs) * 1e6
            pack_us = statistics.median(r[1] for r in runs) * 1e6
            step_us = statistics.median(r[0] + r[1] for r in runs) * 1e6
            rows.append(
                {
                    "blocks": num_blocks,
                    "requests": num_reqs,
                    "planned_requests": runs[0][2],
                    "moved_tokens": runs[0][3],
                    "plan_us": round(plan_us, 1),
                    "pack_us": round(pack_us, 1),
                    "step_us": round(step_us, 1),
                    "us_per_1k_blocks": round(step_us / (num_blocks / 1000), 1),
                }
            )

    print(
        "| blocks | requests | planned | moved tokens | plan µs | pack µs "
        "| step µs | µs / 1k blocks |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['blocks']:,} | {r['requests']:,} | {r['planned_requests']:,} "
            f"| {r['moved_tokens']:,} | {r['plan_us']:,.0f} | {r['pack_us']:,.0f} "
            f"| {r['step_us']:,.0f} | {r['us_per_1k_blocks']:,.0f} |"
        )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "block_size": BLOCK_SIZE,
        "threshold": THRESHOLD,
        "repeats": args.repeats,
        "statistic": "median",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
