#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Times the reclamation planner per scheduler step (plan_blocks + pack_requests).

    python scripts/bench_planner.py     # writes docs/bench/planner.json
    python scripts/bench_planner.py --baseline /tmp/old   # and an older checkout's,
                                        # taking turns, its plans checked equal

Synthetic state: live blocks spread evenly over requests, each holding a random
number of live tokens at random offsets. A step plans every request at once
(the worst case: the engine plans a request once per 16 of its evictions) and
packs every planned request's sources into its own holes, one call each.
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
from bench_report import planner_section  # scripts/ is this script's folder

REPO = pathlib.Path(__file__).resolve().parents[1]
B = 16  # block size
THRESHOLD = 1.0  # the engine default (--kv-reclaim-threshold)
BLOCKS, REQS = (1_000, 10_000, 100_000), (16, 256, 1024)  # every pair is a row
REPEATS = 21


def git_commit(repo: pathlib.Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return out.stdout.strip() or str(repo)


def load(name: str):
    """vllm/vtoken/<name>.py from this checkout's overlay (imported ahead of
    the installed copy, as the unit tests do; numba kernels included)."""
    import importlib

    import vllm.vtoken

    here = str(REPO / "vllm_overlay/vllm/vtoken")
    if here not in vllm.vtoken.__path__:
        vllm.vtoken.__path__.insert(0, here)
    return importlib.import_module(f"vllm.vtoken.{name}")


def load_from(repo: pathlib.Path, name: str):
    """vllm/vtoken/<name>.py of another checkout, under its own module name,
    with that checkout's compiled loops (planner_kernels.py) when it has them:
    its planner and packer as they ran there (it imports this checkout's
    other helpers: integrity, arena)."""
    import importlib.util

    def from_file(path: pathlib.Path, module_name: str, rewrite=None):
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses resolve annotations by it
        source = path.read_text()
        if rewrite:
            for old, new in rewrite.items():
                assert old in source, f"{path} no longer says {old!r}"
                source = source.replace(old, new)
        exec(compile(source, str(path), "exec"), module.__dict__)
        return module

    folder = repo / "vllm_overlay/vllm/vtoken"
    rewrite = {}
    if (folder / "planner_kernels.py").exists():
        if "baseline_planner_kernels" not in sys.modules:
            from_file(folder / "planner_kernels.py", "baseline_planner_kernels")
        rewrite = {
            "packing": {
                "from vllm.vtoken import planner_kernels as k": "import "
                "baseline_planner_kernels as k"
            },
            "planner": {
                "from vllm.vtoken.planner_kernels import": "from "
                "baseline_planner_kernels import"
            },
        }[name]
    return from_file(folder / f"{name}.py", f"baseline_{name}", rewrite)


def make_state(num_blocks: int, num_reqs: int, seed: int = 0) -> tuple[dict, dict]:
    """plan_blocks' arrays (eligible block ids, their live counts, per-request
    offsets), and every request's live tokens, flat, as pack_requests takes them."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(num_blocks).astype(np.int64)
    live = rng.integers(0, B + 1, size=num_blocks)
    # A random live pattern inside each block with exactly live[b] tokens.
    live_mask = rng.random((num_blocks, B)).argsort(axis=1) < live[:, None]
    per_req = np.full(num_reqs, num_blocks // num_reqs)
    per_req[: num_blocks % num_reqs] += 1
    indptr = np.r_[0, np.cumsum(per_req)]
    # Request r holds blocks [indptr[r], indptr[r + 1]) in logical order.
    blk, off = np.nonzero(live_mask)
    first = indptr[np.searchsorted(indptr, blk, side="right") - 1]
    tokens = {"live_indptr": np.searchsorted(blk, indptr), "num_blocks": num_blocks}
    tokens |= {"live_idx": (blk - first) * B + off, "live_slots": ids[blk] * B + off}
    # Eligible blocks: every block but the request's tail (the last one).
    keep = np.ones(num_blocks, dtype=bool)
    keep[indptr[1:][per_req > 0] - 1] = False
    blocks = {"block_ids": ids[keep].astype(np.int32), "block_live": live[keep]}
    blocks["req_indptr"] = np.r_[0, np.cumsum(np.maximum(per_req - 1, 0))]
    return blocks, tokens


def one_step(modules, blocks: dict, tokens: dict):
    """Returns (plan seconds, pack seconds, the plan, the moves)."""
    planner, packing = modules
    t0 = time.perf_counter()
    plan = planner.plan_blocks(**blocks, block_size=B, threshold=THRESHOLD)
    t1 = time.perf_counter()
    moves = packing.pack_requests(plan, **tokens, block_size=B)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, plan, moves


def same(a, b) -> bool:
    """Two plans (or two Moves) with equal arrays."""
    return all(
        np.array_equal(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__
    )


def measure(modules, num_blocks: int, num_reqs: int, base=None) -> dict:
    """The median step of REPEATS, after a warm-up, in µs; with `base` (an
    older checkout's modules) its median too, runs taking turns, and its
    plans and moves asserted equal to these."""
    state = make_state(num_blocks, num_reqs)
    first = one_step(modules, *state)
    if base is not None:
        old = one_step(base, *state)
        assert same(first[2], old[2]) and same(first[3], old[3]), "plans differ"
    runs, base_runs = [], []
    for _ in range(REPEATS):
        runs.append(one_step(modules, *state))
        if base is not None:
            base_runs.append(one_step(base, *state))
    row = {"blocks": num_blocks, "requests": num_reqs}
    row |= {"planned_requests": len(first[2].req_index)}
    row |= {"moved_tokens": first[3].idx.size}
    for key, f in (("plan", 0), ("pack", 1)):
        row[f"{key}_us"] = round(1e6 * statistics.median(r[f] for r in runs), 1)
    row["step_us"] = round(1e6 * statistics.median(r[0] + r[1] for r in runs), 1)
    row["us_per_1k_blocks"] = round(row["step_us"] / (num_blocks / 1000), 1)
    if base_runs:
        step = statistics.median(r[0] + r[1] for r in base_runs)
        row["baseline_step_us"] = round(1e6 * step, 1)
    return row


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=pathlib.Path, help="an older checkout")
    args = p.parse_args()
    modules = load("planner"), load("packing")
    base = None
    if args.baseline:
        base = load_from(args.baseline, "planner"), load_from(args.baseline, "packing")
    rows = [measure(modules, b, r, base) for b in BLOCKS for r in REQS]
    meta = {"block_size": B, "threshold": THRESHOLD, "repeats": REPEATS}
    if args.baseline:
        meta["baseline"] = git_commit(args.baseline)
    meta |= {"python": platform.python_version(), "numpy": np.__version__}
    meta |= {"machine": platform.machine(), "cpus": os.cpu_count()}
    out = REPO / "docs/bench/planner.json"
    old = json.loads(out.read_text()) if out.exists() else {}
    before = old.get("before") or {  # the step times of per-request packing
        f"{r['blocks']}x{r['requests']}": r["step_us"] for r in old.get("rows", [])
    }
    result = {"meta": meta, "rows": rows, "before": before}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(planner_section(result)) + f"wrote {out}")
