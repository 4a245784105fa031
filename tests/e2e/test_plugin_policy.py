"""A policy from another package, on the real engine.

tests/plugin_site holds `vtoken_oldest`, installed the way pip lays a package
out (its dist-info declares `oldest` in the `vtoken.policies` entry point
group). With that folder on the engine's PYTHONPATH, `--kv-eviction-policy
oldest` is a choice, and the policy runs like a built-in: within budget, the
same tokens in both reclaim modes, the pool empty at the end. Nothing in vLLM or
the overlay names it.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import PLUGIN_SITE
from tests.e2e.conftest import assert_within_budget, engine_driver, run_engine

pytestmark = pytest.mark.e2e
ENV = {"PYTHONPATH": str(PLUGIN_SITE)}
BUDGET = 64


def spec(reclaim: str) -> dict:
    return {
        "engine": {
            "kv_eviction_policy": "oldest",
            "kv_budget_tokens": BUDGET,
            "kv_reclaim": reclaim,
        },
        "sharegpt": {"n": 4, "min_tokens": 96, "max_tokens": 128},
        "max_tokens": 64,
    }


def test_a_plugin_policy_runs_like_a_built_in(engine_dir):
    naive = run_engine(spec("naive"), env=ENV)
    vtoken = run_engine(spec("vtoken"), env=ENV)
    assert vtoken["counters"]["evicted_tokens"] > 0
    assert vtoken["outputs"] == naive["outputs"]
    assert_within_budget(vtoken, BUDGET)
    # Oldest first kills whole blocks in order: naive-evict frees them too.
    assert vtoken["counters"]["reclaimed_blocks"] > 0
    assert vtoken["counters"]["evicted_tokens"] == naive["counters"]["evicted_tokens"]
    for run in (naive, vtoken):
        assert run["free_end"] == run["free_start"]


def test_vllm_serve_lists_a_plugin_policy(engine_dir):
    import os

    out = subprocess.run(
        [*engine_driver.VLLM, "serve", "--help=VTokenConfig"],
        env=dict(os.environ, **ENV),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "oldest" in out.stdout.split("--kv-eviction-policy", 1)[1][:400]
