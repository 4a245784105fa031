#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Times the reclamation planner per scheduler step (plan_blocks + pack_request).

    python scripts/bench_planner.py     # writes docs/bench/planner.json

Synthetic state: live blocks spread evenly over requests, each holding a random
number of live tokens at random offsets. A step plans every request at once
(the worst case: the engine plans a request once per 16 of its evictions) and
packs each planned request's sources into its own holes.
"""

import importlib.util
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np
from bench_report import planner_section  # scripts/ is this script's folder

REPO = pathlib.Path(__file__).resolve().parents[1]
B = 16  # block size
THRESHOLD = 1.0  # the engine default (--kv-reclaim-threshold)
BLOCKS, REQS = (1_000, 10_000, 100_000), (16, 256, 1024)  # every pair is a row
REPEATS = 9


def load_planner():
    """Imports planner.py from the overlay without importing vLLM."""
    path = REPO / "vllm_overlay/vllm/vtoken/planner.py"
    spec = importlib.util.spec_from_file_location("vtoken_planner", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def make_state(num_blocks: int, num_reqs: int, seed: int = 0) -> tuple[dict, list]:
    """plan_blocks' arrays (eligible block ids, their live counts, per-request
    offsets), and each request's live tokens as pack_request's live_idx, live_slots."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(num_blocks).astype(np.int64)
    live = rng.integers(0, B + 1, size=num_blocks)
    # A random live pattern inside each block with exactly live[b] tokens.
    live_mask = rng.random((num_blocks, B)).argsort(axis=1) < live[:, None]
    per_req = np.full(num_reqs, num_blocks // num_reqs)
    per_req[: num_blocks % num_reqs] += 1
    indptr = np.r_[0, np.cumsum(per_req)]
    reqs = []
    for lo, hi in zip(indptr[:-1], indptr[1:], strict=True):
        blk, off = np.nonzero(live_mask[lo:hi])
        idx, slots = blk * B + off, ids[lo + blk] * B + off
        reqs.append(dict(live_idx=idx, live_slots=slots, block_size=B))
    # Eligible blocks: every block but the request's tail (the last one).
    keep = np.ones(num_blocks, dtype=bool)
    keep[indptr[1:][per_req > 0] - 1] = False
    blocks = {"block_ids": ids[keep].astype(np.int32), "block_live": live[keep]}
    blocks["req_indptr"] = np.r_[0, np.cumsum(np.maximum(per_req - 1, 0))]
    return blocks, reqs


def one_step(planner, blocks: dict, reqs: list) -> tuple[float, float, int, int]:
    """Returns (plan seconds, pack seconds, planned requests, moved tokens)."""
    t0 = time.perf_counter()
    plan = planner.plan_blocks(**blocks, block_size=B, threshold=THRESHOLD)
    t1 = time.perf_counter()
    moved = 0
    for k, r in enumerate(plan.req_index):
        src = plan.src_block_ids[plan.src_indptr[k] : plan.src_indptr[k + 1]]
        dst = plan.dst_block_ids[plan.dst_indptr[k] : plan.dst_indptr[k + 1]]
        moves = planner.pack_request(**reqs[r], src_block_ids=src, dst_block_ids=dst)
        moved += moves.idx.size
    return t1 - t0, time.perf_counter() - t1, len(plan.req_index), moved


def measure(planner, num_blocks: int, num_reqs: int) -> dict:
    """The median step of REPEATS, after a warm-up, in µs."""
    state = make_state(num_blocks, num_reqs)
    one_step(planner, *state)
    runs = [one_step(planner, *state) for _ in range(REPEATS)]
    plan_us = 1e6 * statistics.median(r[0] for r in runs)
    pack_us = 1e6 * statistics.median(r[1] for r in runs)
    step_us = 1e6 * statistics.median(r[0] + r[1] for r in runs)
    row = {"blocks": num_blocks, "requests": num_reqs}
    row |= {"planned_requests": runs[0][2], "moved_tokens": runs[0][3]}
    row |= {"plan_us": round(plan_us, 1), "pack_us": round(pack_us, 1)}
    row["step_us"] = round(step_us, 1)
    row["us_per_1k_blocks"] = round(step_us / (num_blocks / 1000), 1)
    return row


if __name__ == "__main__":
    planner = load_planner()
    rows = [measure(planner, b, r) for b in BLOCKS for r in REQS]
    meta = {"block_size": B, "threshold": THRESHOLD, "repeats": REPEATS}
    meta |= {"python": platform.python_version(), "numpy": np.__version__}
    meta |= {"machine": platform.machine(), "cpus": os.cpu_count()}
    result, out = {"meta": meta, "rows": rows}, REPO / "docs/bench/planner.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(planner_section(result)) + f"wrote {out}")
