"""vToken's per-step work does not grow with the batch (DESIGN.md §7.1).

Counted, not timed: the Python and C calls vToken's step hooks make, and
the lines of the overlay's code they run (both sides; `count_hook_calls` in
scripts/engine_driver.py), in the steps where every request decodes and is
evicted from. A loop over requests or tokens in the step path shows up as
more calls, or more lines (a loop that calls nothing), at 16 requests than
at 4.
"""

from __future__ import annotations

import itertools
import statistics

import pytest

from tests.e2e.conftest import run_engine

pytestmark = pytest.mark.e2e


def counts_per_step(policy: str, n: int) -> tuple[list, list]:
    """(calls, lines) of each steady step of `policy` at n running requests."""
    spec = {
        "engine": {
            "kv_eviction_policy": policy,
            "kv_budget_tokens": 32,
            "kv_eviction_config": {"window": 16} if policy == "snapkv" else {},
            "kv_reclaim": "vtoken",
            "max_num_seqs": n,
        },
        "random": {"n": n, "min_tokens": 64, "max_tokens": 64},
        "max_tokens": 24,
        "light": True,
        "count_hook_calls": True,
    }
    # The deep checks loop over requests by design: off here.
    run = run_engine(spec, env={"VTOKEN_CHECK_INTEGRITY": "0"})
    steady = [s for s in run["steps"] if s["running"] == n][2:]
    assert len(steady) > 10 and run["counters"]["evicted_tokens"] > 0
    pairs = list(itertools.pairwise(steady))
    return tuple(
        [b[key] - a[key] for a, b in pairs] for key in ("hook_calls", "hook_lines")
    )


# H2O: scores, selection and compaction, which every policy shares; the others
# for their own step paths: SnapKV's window scores (rows per request from the
# worker's request states), Scissorhands' persistence scores and ages,
# Random's draws. StreamingLLM's is a subset of Random's.
@pytest.mark.parametrize("policy", ["h2o", "snapkv", "scissorhands", "random"])
def test_the_hooks_make_as_many_calls_a_step_at_16_requests_as_at_4(engine_dir, policy):
    few, many = counts_per_step(policy, 4), counts_per_step(policy, 16)
    median = [tuple(statistics.median(x) for x in counts) for counts in (few, many)]
    assert min(median[0]) > 0
    assert median[1] == median[0]  # calls, lines
    if policy == "random":
        # One victim a request a step, drawn: both batches plan (a block's
        # worth dead) and open blocks in the same steps, so every step is
        # compared, not just the median one (a loop in a plan step, or in a
        # step opening blocks, shows only there).
        plans = [c for c in few[0] if c > 2 * median[0][0]]
        assert plans, "no step planned compaction"
        assert many == few
