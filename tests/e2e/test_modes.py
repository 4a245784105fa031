"""The three modes on the real engine: native, naive-evict, vtoken.

Same ShareGPT prompts, same budget and seed. With a roomy KV pool the two
eviction modes schedule identically, so their greedy outputs must be identical
(compaction only moves data) while vtoken holds fewer blocks.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import assert_within_budget

pytestmark = pytest.mark.e2e

BUDGET = 96
WORKLOAD = {
    "sharegpt": {"n": 6, "min_tokens": 48, "max_tokens": 160},
    "max_tokens": 128,
}
POLICIES = ["h2o", "streamingllm", "scissorhands", "snapkv", "random"]


def spec(policy: str, reclaim: str, budget: int = BUDGET) -> dict:
    engine = {}
    if policy != "none":
        engine = {
            "kv_eviction_policy": policy,
            "kv_budget_tokens": budget,
            "kv_reclaim": reclaim,
            "kv_eviction_config": {"seed": 7} if policy == "random" else {},
        }
    return {"engine": engine, **WORKLOAD}


@pytest.mark.parametrize("policy", POLICIES)
def test_vtoken_equals_naive_and_holds_fewer_blocks(engine, policy):
    naive = engine(spec(policy, "naive"))
    vtoken = engine(spec(policy, "vtoken"))
    assert set(naive["outputs"]) == {str(i) for i in range(6)}
    assert vtoken["outputs"] == naive["outputs"]
    # Identical schedules: compare the blocks running requests hold, per step.
    assert len(vtoken["steps"]) == len(naive["steps"])
    held_n = [sum(s["held"].values()) for s in naive["steps"]]
    held_v = [sum(s["held"].values()) for s in vtoken["steps"]]
    assert all(v <= n for v, n in zip(held_v, held_n, strict=True))
    # At the last step where every request still runs, vtoken holds fewer.
    last_full = max(i for i, s in enumerate(naive["steps"]) if s["running"] == 6)
    assert held_v[last_full] < held_n[last_full], (held_v[last_full], held_n[last_full])
    assert vtoken["counters"]["moved_tokens"] > 0
    assert naive["counters"]["moved_tokens"] == 0
    assert_within_budget(vtoken, BUDGET)
    for run in (naive, vtoken):
        assert run["free_end"] == run["free_start"]


@pytest.mark.parametrize("policy", ["h2o", "streamingllm"])
def test_eviction_is_real(engine, policy):
    run = engine(spec(policy, "vtoken"))
    native = engine(spec("none", "vtoken"))
    assert_within_budget(run, BUDGET)
    assert run["counters"]["evicted_tokens"] > 0
    differ = sum(run["outputs"][k] != native["outputs"][k] for k in native["outputs"])
    assert differ > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_nothing_evicted_means_native_output_to_the_bit(engine, policy):
    """A budget past every sequence: no token dies, and every request reads
    through vLLM's own kernel (score policies are read for their scores only),
    so the greedy tokens are native's exactly, in the same batch."""
    run = engine(spec(policy, "vtoken", budget=1024))
    native = engine(spec("none", "vtoken"))
    assert run["counters"]["evicted_tokens"] == 0
    assert run["counters"]["moved_tokens"] == 0
    assert run["outputs"] == native["outputs"]


def test_h2o_aggregate_max_is_a_different_heavy_hitter_choice(engine):
    """`aggregate: max` scores a token by the head that attends it most, not
    the mean over heads: the same budget, other tokens kept."""
    runs = {}
    for aggregate in ("mean", "max"):
        s = spec("h2o", "naive")
        s["engine"]["kv_eviction_config"] = {"aggregate": aggregate}
        runs[aggregate] = engine({**s, "record_dead": True})
    mean, top = runs["mean"]["dead"], runs["max"]["dead"]
    assert mean.keys() == top.keys() == {str(i) for i in range(6)}
    # Every request is evicted to the same budget, but not of the same tokens.
    assert [len(v) for v in mean.values()] == [len(v) for v in top.values()]
    assert any(mean[k] != top[k] for k in mean)


def test_snapkv_scores_a_chunked_prompt_by_its_last_queries_only(engine):
    """A prompt prefilled in chunks (--max-num-batched-tokens 64) is scored by
    its last `window` queries, as in one chunk. Counting every chunk's last
    rows scored the prompt by each chunk's tail too: several times the mass
    (here 5 chunks), and other tokens kept. The two prefills round apart
    (vLLM's CPU kernels take other paths for a chunk than for a whole prompt:
    scores within ~2% of each other on a Xeon with AMX), so a near-tie may
    fall either way: the same mass, the same victims but for a few."""
    workload = {
        "sharegpt": {"n": 3, "min_tokens": 300, "max_tokens": 300},
        "max_tokens": 8,
        "record_dead": True,
        "record_scores": True,
    }

    def run(chunk: int) -> dict:
        engine_args = spec("snapkv", "vtoken")["engine"]
        engine_args |= {"max_num_batched_tokens": chunk, "max_num_seqs": 4}
        return engine({"engine": engine_args, **workload})

    one, chunked = run(1024), run(64)
    assert chunked["counters"]["evicted_tokens"] > 0
    assert one["scores"].keys() == chunked["scores"].keys() == {"0", "1", "2"}
    for rid, (_, scores) in one["scores"].items():
        mass = sum(chunked["scores"][rid][1])
        assert mass == pytest.approx(sum(scores), rel=0.05), rid
        dead, other = set(one["dead"][rid]), set(chunked["dead"][rid])
        assert len(dead) == len(other) > 0
        assert len(dead & other) >= 0.98 * len(dead), (rid, dead ^ other)
