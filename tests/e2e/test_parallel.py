"""vToken past one worker: tensor and pipeline parallelism (and both) on
vLLM's multiprocessing executor (gloo on CPU), with a dummy-weight two-layer
Llama whose 4 query / 2 KV heads and 2 layers divide by 2.

One engine per configuration serves every policy of the "sum" score mode as
one wave each (per-request `kv_eviction_policy`); SnapKV and Scissorhands,
which need scores of their own, get an engine each at TP=2. Every engine runs
with VTOKEN_CHECK_INTEGRITY=1, so each rank checks its Token Tables against
the other ranks' after every step (ranks.py).

Oracles: vtoken == naive token for token at TP=2 and PP=2; every policy
evicts the same tokens at TP=2, PP=2 and TP=2 x PP=2 as on one rank; H2O's
scores, reduced over the ranks, equal one rank's to 1e-4.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import re
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from tests.e2e.conftest import engine_driver, run_engine

pytestmark = pytest.mark.e2e
REPO = pathlib.Path(__file__).resolve().parents[2]
BUDGET = 48
SUM_POLICIES = ["h2o", "streamingllm", "random"]  # one engine (h2o's scores)
CONFIGS = ["tp2", "pp2", "tp2pp2"]
NAIVE_TOO = ["tp2", "pp2"]  # TP x PP is checked against TP=1 only


@pytest.fixture(scope="module")
def tiny_llama(engine_dir) -> str:
    out = pathlib.Path(os.environ["VTOKEN_CACHE"], "models", "tiny-llama")
    cmd = [sys.executable, str(REPO / "scripts/prepare.py"), "tiny-llama"]
    subprocess.run([*cmd, "--out", str(out)], check=True, capture_output=True)
    return str(out)


def wave(policy: str) -> dict:
    return {
        "random": {"n": 4, "min_tokens": 0, "max_tokens": 96},
        "max_tokens": 40,
        "extra_args": [{"kv_eviction_policy": policy}] * 4,
        "record_dead": True,
        "record_scores": True,
    }


def run(model: str, policy: str, reclaim: str, tp=1, pp=1, waves=None, **extra) -> list:
    engine = {
        "model": model,
        "load_format": "dummy",
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "distributed_executor_backend": "mp" if tp * pp > 1 else None,
        "max_model_len": 256,
        "num_gpu_blocks_override": 96,  # roomy: naive and vtoken schedule alike
        "kv_eviction_policy": policy,
        "kv_budget_tokens": BUDGET,
        "kv_reclaim": reclaim,
        "kv_eviction_config": {"seed": 7},
        **extra,
    }
    out = run_engine({"engine": engine, "waves": [wave(p) for p in waves or [policy]]})
    assert out["pool_live_end"] == 0
    for w in out["waves"]:  # the engine's, at its end
        w["counters"] = out["counters"]
    return out["waves"]


@pytest.fixture(scope="module")
def sum_runs(tiny_llama) -> dict[str, list]:
    """Each configuration's waves, one per policy in SUM_POLICIES."""
    configs = {"tp1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}
    configs["tp2pp2"] = {"tp": 2, "pp": 2}
    runs = {}
    for name, size in configs.items():
        # Naive runs where vtoken == naive is checked: TP and PP each.
        for reclaim in ("vtoken", "naive") if name in NAIVE_TOO else ("vtoken",):
            waves = run(tiny_llama, "h2o", reclaim, waves=SUM_POLICIES, **size)
            runs[f"{name}-{reclaim}"] = waves
    return runs


def check_vtoken_equals_naive(vtoken: dict, naive: dict) -> None:
    assert set(vtoken["outputs"]) == {"0", "1", "2", "3"}
    assert vtoken["outputs"] == naive["outputs"]
    assert vtoken["dead"] == naive["dead"]
    assert any(vtoken["dead"].values())  # eviction happened
    for w in (vtoken, naive):
        assert w["free_end"] == w["free_start"]


@pytest.mark.parametrize("config", NAIVE_TOO)
@pytest.mark.parametrize("k", range(len(SUM_POLICIES)), ids=SUM_POLICIES)
def test_vtoken_equals_naive(sum_runs, config, k):
    vtoken, naive = sum_runs[f"{config}-vtoken"][k], sum_runs[f"{config}-naive"][k]
    check_vtoken_equals_naive(vtoken, naive)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("k", range(len(SUM_POLICIES)), ids=SUM_POLICIES)
def test_the_same_tokens_die_as_on_one_rank(sum_runs, config, k):
    one, many = sum_runs["tp1-vtoken"][k], sum_runs[f"{config}-vtoken"][k]
    assert many["dead"] == one["dead"]


@pytest.mark.parametrize("config", CONFIGS)
def test_the_bytes_copied_are_every_rank_s(sum_runs, config):
    """The same moves on every rank, each with its heads or layers: the
    metric counts them all, as on one rank (it counted the output rank's:
    half at TP=2, found by review)."""
    one, many = sum_runs["tp1-vtoken"][0]["counters"], sum_runs[f"{config}-vtoken"][0]
    many = many["counters"]
    assert many["moved_tokens"] == one["moved_tokens"] > 0
    assert many["copy_bytes"] == one["copy_bytes"] > 0


def check_same_scores(one: dict, many: dict) -> None:
    assert one["scores"].keys() == many["scores"].keys() and one["scores"]
    for rid, (idx, score) in one["scores"].items():
        idx2, score2 = many["scores"][rid]
        assert idx2 == idx
        np.testing.assert_allclose(score2, score, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("config", CONFIGS)
def test_h2o_scores_are_reduced_over_every_rank(sum_runs, config):
    """Each rank sees its heads (TP) or its layers (PP): unreduced, a score
    would be about half of TP=1's."""
    check_same_scores(sum_runs["tp1-vtoken"][0], sum_runs[f"{config}-vtoken"][0])


@pytest.fixture(scope="module")
def one_rank(tiny_llama):
    """policy -> its run on one rank, made once (SnapKV's serves two tests)."""
    runs: dict[str, dict] = {}

    def get(policy: str) -> dict:
        if policy not in runs:
            runs[policy] = run(tiny_llama, policy, "vtoken")[0]
        return runs[policy]

    return get


@pytest.mark.parametrize("policy", ["scissorhands", "snapkv"])
def test_score_policies_of_their_own_at_tp2(tiny_llama, one_rank, policy):
    """Persistence and window scores: the same tokens die, with the same
    scores, as on one rank (vtoken == naive at TP=2 does not depend on the
    policy: the sum-score waves check it)."""
    one = one_rank(policy)
    vtoken = run(tiny_llama, policy, "vtoken", tp=2)[0]
    assert any(vtoken["dead"].values()) and vtoken["free_end"] == vtoken["free_start"]
    assert vtoken["dead"] == one["dead"]
    check_same_scores(one, vtoken)


def test_snapkv_chunked_prefill_at_pp2_scores_as_one_chunk_on_one_rank(
    tiny_llama, one_rank
):
    """Chunks of 32 at PP=2: each stage counts the same rows of each chunk (the
    prompt's last window), though a non-last stage's input batch knows only
    the chunk's end, so the same tokens die as with the whole prompt in one
    step on one rank."""
    one = one_rank("snapkv")
    chunked = run(
        tiny_llama, "snapkv", "vtoken", pp=2, max_num_batched_tokens=32, max_num_seqs=4
    )[0]
    assert any(chunked["dead"].values())
    assert chunked["dead"] == one["dead"]


def per_engine(text: str, name: str) -> dict[str, float]:
    """A metric's value by its `engine` label (one per DP rank)."""
    pattern = rf'^{re.escape(name)}\{{[^}}]*engine="(\d+)"[^}}]*\}} (\S+)$'
    return {e: float(v) for e, v in re.findall(pattern, text, re.M)}


def test_data_parallel_ranks_each_evict_and_drain(tiny_llama, tmp_path):
    """--data-parallel-size 2: an engine (scheduler and worker) per rank, so
    nothing is shared; both ranks serve, evict, and end with empty pools."""
    cmd = [str(REPO / "scripts/run.sh"), tiny_llama, "--load-format", "dummy"]
    cmd += ["--data-parallel-size", "2", "--enforce-eager", "--max-model-len", "256"]
    cmd += ["--num-gpu-blocks-override", "64", "--kv-eviction-policy", "h2o"]
    cmd += ["--kv-budget-tokens", str(BUDGET), "--served-model-name", "tiny"]
    prompts = [[100 + 7 * i + j for j in range(80)] for i in range(8)]
    os.environ["VTOKEN_CHECK_INTEGRITY"] = "1"  # the server inherits it
    try:
        with engine_driver.serve(cmd, tmp_path / "serve.log", timeout=300) as url:
            os.environ.pop("VTOKEN_CHECK_INTEGRITY")
            with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
                answers = list(pool.map(lambda p: complete(url, p), prompts))
            text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    finally:
        os.environ.pop("VTOKEN_CHECK_INTEGRITY", None)
    assert all(len(a["choices"][0]["text"]) > 0 for a in answers)
    assert all(a["usage"]["completion_tokens"] == 40 for a in answers)
    evicted = per_engine(text, "vllm:kv_evicted_tokens_total")
    assert evicted.keys() == {"0", "1"} and min(evicted.values()) > 0, evicted
    assert set(per_engine(text, "vllm:kv_cache_usage_perc").values()) == {0.0}


def complete(url: str, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40}
    body |= {"temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())
