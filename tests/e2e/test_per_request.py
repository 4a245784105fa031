"""Per-request eviction on the real engine: `SamplingParams(extra_args=...)`.

One batch on an H2O engine without an engine-wide budget: requests with their
own budgets (64 and 256), one with a score-free policy of its own, and one that
opts out. Each stays within its own budget, vtoken equals naive-evict request by
request, and the opted-out request, which reads through vLLM's own attention
kernel, is byte-identical to the same batch on an engine with no policy.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

ARGS = [
    {"kv_budget_tokens": 64},
    {"kv_budget_tokens": 256},
    {"kv_eviction_policy": "streamingllm", "kv_budget_tokens": 96},
    {"kv_budget_tokens": "none"},
]
BUDGETS = [64, 256, 96, None]
WORKLOAD = {
    "sharegpt": {"n": len(ARGS), "min_tokens": 200, "max_tokens": 200},
    "max_tokens": 96,
    "extra_args": ARGS,
}


def spec(policy: str, reclaim: str = "vtoken") -> dict:
    return {"engine": {"kv_eviction_policy": policy, "kv_reclaim": reclaim}, **WORKLOAD}


@pytest.fixture(scope="module")
def runs(engine):
    return {
        "vtoken": engine(spec("h2o")),
        "naive": engine(spec("h2o", "naive")),
        "native": engine({**WORKLOAD, "engine": {}, "extra_args": None}),
    }


def test_each_request_stays_within_its_own_budget(runs):
    run = runs["vtoken"]
    peak = {str(i): 0 for i in range(len(ARGS))}
    for s in run["steps"][1:]:  # after the prefill step
        for rid, live in s["live"].items():  # engine ids: w0-<index>-<suffix>
            i = rid.split("-")[1]
            peak[i] = max(peak[i], live)
    for i, budget in enumerate(BUDGETS):
        if budget is None:  # opted out: every token stays
            assert peak[str(i)] >= 200 + 96 - 2, peak
        else:
            assert budget <= peak[str(i)] <= budget + 1, (i, peak)
    assert run["counters"]["evicted_tokens"] > 0
    assert run["free_end"] == run["free_start"]


def test_vtoken_equals_naive_request_by_request(runs):
    assert runs["vtoken"]["outputs"] == runs["naive"]["outputs"]
    assert runs["vtoken"]["counters"]["moved_tokens"] > 0


def test_the_opted_out_request_is_byte_identical_to_native(runs):
    out, native = runs["vtoken"]["outputs"], runs["native"]["outputs"]
    assert out["3"] == native["3"]
    # The evicting requests' outputs do change (their attention lost tokens).
    assert any(out[str(i)] != native[str(i)] for i in range(3))
