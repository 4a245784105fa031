"""Capacity and robustness on a small, exact KV pool (num_gpu_blocks_override)."""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.e2e

BUDGET = 64
POOL = {"num_gpu_blocks_override": 64, "max_model_len": 512}


def capacity_spec(reclaim: str) -> dict:
    return {
        "engine": {
            **POOL,
            "kv_eviction_policy": "h2o",
            "kv_budget_tokens": BUDGET,
            "kv_reclaim": reclaim,
        },
        "sharegpt": {"n": 8, "min_tokens": 96, "max_tokens": 160},
        "max_tokens": 160,
    }


def test_vtoken_runs_more_requests_at_once(engine):
    naive = engine(capacity_spec("naive"))
    vtoken = engine(capacity_spec("vtoken"))
    conc_n = max(s["running"] for s in naive["steps"])
    conc_v = max(s["running"] for s in vtoken["steps"])
    assert conc_v > conc_n, (conc_v, conc_n)
    # No preemption storm: compaction is in place, it never takes a block.
    assert vtoken["preemptions"] <= naive["preemptions"]
    assert len(vtoken["steps"]) < len(naive["steps"])  # finishes sooner
    for run in (naive, vtoken):
        assert len(run["outputs"]) == 8
        assert run["free_end"] == run["free_start"]


def test_stress_arrivals_aborts_preemption(engine):
    rng = random.Random(1234)
    n = 16
    spec = {
        "engine": {
            **POOL,
            "num_gpu_blocks_override": 48,
            "kv_eviction_policy": "scissorhands",
            "kv_budget_tokens": BUDGET,
            "enable_prefix_caching": True,
        },
        "sharegpt": {"n": n, "min_tokens": 32, "max_tokens": 200},
        "max_tokens": [rng.randint(16, 200) for _ in range(n)],
        "arrivals": sorted(rng.randint(0, 120) for _ in range(n)),
        "aborts": {str(i): rng.randint(20, 200) for i in rng.sample(range(n), 4)},
    }
    run = engine(spec)
    # Integrity was checked after every step inside the engine; here: no leak,
    # every request accounted for, and the run was long enough to matter.
    assert len(run["steps"]) >= 200
    assert run["free_end"] == run["free_start"]
    assert run["pool_live_end"] == 0
    assert len(run["outputs"]) + 4 >= n
    assert run["counters"]["reclaimed_blocks"] > 0
