"""A careless and hostile client against the patched server, for every policy.

Each policy gets a mix of what the OpenAI API lets a client send: prompt
embeddings, n > 1, beam search, logprobs and prompt_logprobs, stop strings, a
streaming client that disconnects, priorities, per-request settings,
structured output, a prompt over the limit. No answer may be a 5xx, the
server stays healthy, the KV pool drains to empty, and a fixed greedy prompt
answers the same before and after. (LoRA: test_lora.py.)

A server per score mode, on a small KV pool (evictions and preemptions) with
VTOKEN_CHECK_INTEGRITY=1 (an invariant broken at any step kills the engine):
H2O's serves StreamingLLM's and Random's mixes too, every request naming its
policy (`vllm_xargs`; beam search, which takes none, runs with H2O), as a
server serves any policy of its score mode; Scissorhands (scores of its own)
gets one of its own. (Engines started with StreamingLLM or Random as their
own policy run in test_modes.)
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import http.client
import io
import json
import os
import pathlib
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests.e2e.conftest import engine_driver
from tests.e2e.test_server import PROMPT, metric

pytestmark = pytest.mark.e2e
REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
SERVER_LOGS: dict[str, pathlib.Path] = {}  # url -> its log, for failure messages
LONG = " ".join(["the lighthouse keeper counted the waves"] * 20)  # 121 tokens


# Each policy's server, in the order the tests run (the params below): one at
# a time on two cores.
SERVER_OF = {"h2o": "h2o", "streamingllm": "h2o", "random": "h2o"}
SERVER_OF["scissorhands"] = "scissorhands"


@pytest.fixture(scope="module")
def servers(tmp_path_factory, engine_dir):
    """`start(name)`: the URL of the server started with policy `name`,
    started on first use; the one before it is stopped then (the tests run
    grouped by server), and a start that failed is not tried again."""
    with contextlib.ExitStack() as stack:
        now: dict[str, str] = {}
        failed: dict[str, str] = {}

        def start(name: str) -> str:
            if name in failed:
                pytest.fail(f"the {name} server did not start: {failed[name]}")
            if name not in now:
                stack.close()
                now.clear()
                try:
                    now[name] = stack.enter_context(serve(name, tmp_path_factory))
                except Exception as err:
                    failed[name] = str(err)[-3000:]
                    raise
            return now[name]

        yield start


@contextlib.contextmanager
def serve(policy: str, tmp_path_factory):
    cmd = [str(REPO / "scripts/run.sh"), "--max-model-len", "384", "--enforce-eager"]
    cmd += ["--num-gpu-blocks-override", "24", "--enable-prompt-embeds"]
    cmd += ["--kv-eviction-policy", policy, "--kv-budget-tokens", "48"]
    log = tmp_path_factory.mktemp("hostile") / "serve.log"
    os.environ["VTOKEN_CHECK_INTEGRITY"] = "1"  # the server inherits it
    try:
        with engine_driver.serve(cmd, log, timeout=240) as url:
            os.environ.pop("VTOKEN_CHECK_INTEGRITY")
            SERVER_LOGS[url] = log
            yield url
    finally:
        os.environ.pop("VTOKEN_CHECK_INTEGRITY", None)


@pytest.fixture(params=["h2o", "streamingllm", "random", "scissorhands"])
def policy(request) -> str:
    return request.param


def with_policy(body: dict, policy: str | None) -> dict:
    """`body` asking for `policy` (vllm_xargs), beside its other keys there;
    as it is without a policy, or for beam search, which takes no eviction
    settings of its own (HTTP 400: it runs with the server's)."""
    if policy is None or body.get("use_beam_search"):
        return body
    return {
        **body,
        "vllm_xargs": {"kv_eviction_policy": policy, **body.get("vllm_xargs", {})},
    }


def send(url: str, body: dict, policy: str | None = None) -> tuple[int, dict]:
    """POST a completion; `policy`: the request's own (with_policy)."""
    req = urllib.request.Request(
        url + "/v1/completions",
        json.dumps({"model": MODEL, **with_policy(body, policy)}).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def stream_and_hang_up(url: str, body: dict, policy: str) -> tuple[int, dict]:
    """Reads a few chunks of a streamed completion, then drops the connection."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    payload = json.dumps({"model": MODEL, "stream": True, **with_policy(body, policy)})
    conn.request(
        "POST", "/v1/completions", payload, {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    for _ in range(3):
        resp.readline()
    conn.close()
    return resp.status, {}


def embeds_b64(n: int) -> str:
    import torch

    buf = io.BytesIO()
    torch.save(torch.randn(n, 576, generator=torch.Generator().manual_seed(n)), buf)
    return base64.b64encode(buf.getvalue()).decode()


def greedy(url: str, policy: str) -> str:
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    status, out = send(url, body, policy)
    assert status == 200, out
    return out["choices"][0]["text"]


EMBEDS = (send, {"prompt_embeds": embeds_b64(80), "max_tokens": 64})
BEAM = (send, {"prompt": PROMPT, "max_tokens": 32, "n": 3, "use_beam_search": True})
# Structured output goes alone, after the mix: vLLM 0.18.0's CPU worker itself
# dies on a batch mixing it with other requests (apply_grammar_bitmask pins
# memory, which needs a GPU driver).
CHOICES = ["the lighthouse keeper counted", "the waves were counted"]
CHOICE = {"prompt": LONG, "structured_outputs": {"choice": CHOICES}}
# Then two samples that opt out of eviction, alone on the server: each grows
# to 18 blocks (121 + 159 tokens with KV), which fit the pool's 23 usable
# (24 less vLLM's null block), the two 29 even where the second hits the
# first's 7 full prompt blocks, so one is preempted whatever the timing (the
# mix's own preemptions depend on how close together its requests arrive:
# none on a loaded machine, CI saw).
PAIR = {"prompt": LONG, "max_tokens": 160, "n": 2, "temperature": 1, "seed": 7}
PAIR |= {"ignore_eos": True, "vllm_xargs": {"kv_budget_tokens": "none"}}
MIX = [
    (send, {"prompt": LONG, "max_tokens": 96, "temperature": 0, "ignore_eos": True}),
    (send, {"prompt": LONG, "max_tokens": 64, "n": 4, "temperature": 1, "seed": 3}),
    BEAM,
    (send, {"prompt": LONG, "max_tokens": 48, "logprobs": 3, "prompt_logprobs": 2}),
    (send, {"prompt": LONG, "max_tokens": 80, "stop": [".", "\n"]}),
    (stream_and_hang_up, {"prompt": LONG, "max_tokens": 200, "ignore_eos": True}),
    (send, {"prompt": LONG, "max_tokens": 64, "priority": 5}),
    (send, {"prompt": LONG, "max_tokens": 64, "vllm_xargs": {"kv_budget_tokens": 16}}),
    (send, {"prompt": LONG, "max_tokens": 64, "vllm_xargs": {"kv_budget_tokens": "x"}}),
    (send, {"prompt": LONG * 5, "max_tokens": 8}),  # over max_model_len
    EMBEDS,
    (send, {"prompt": "", "max_tokens": 8}),
    (send, {"prompt": LONG, "max_tokens": 0}),
]


def test_a_hostile_mix_leaves_the_server_healthy_and_the_pool_empty(servers, policy):
    url = servers(SERVER_OF[policy])
    counted = ("vllm:kv_evicted_tokens_total", "vllm:num_preemptions_total")
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    start = {name: metric(text, name) for name in counted}  # a server's earlier mixes
    before = greedy(url, policy)
    # All at once, on a pool of 24 blocks (StreamingLLM's requests, which drop
    # the shared prompt's middle blocks, fit six at a time).
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(MIX)) as pool:
        jobs = [pool.submit(fn, url, body, policy) for fn, body in MIX]
        answers = [job.result(timeout=600) for job in jobs]
    statuses = [status for status, _ in answers]
    pairs = zip(MIX, answers, strict=True)
    bad = [(body, out) for (_, body), (status, out) in pairs if status >= 500]
    assert not bad, (bad, engine_driver.server_errors(SERVER_LOGS[url]))
    assert set(statuses) <= {200, 400}, list(zip(MIX, answers, strict=True))
    assert statuses[MIX.index(EMBEDS)] == 200  # it used to kill the engine core
    assert statuses[MIX.index(BEAM)] == 200, answers[MIX.index(BEAM)]
    status, out = send(url, CHOICE, policy)  # evicted while it decodes
    assert status == 200 and out["choices"][0]["text"] in CHOICES, out
    status, out = send(url, PAIR, policy)
    assert status == 200 and out["usage"]["completion_tokens"] == 2 * 160, out
    assert urllib.request.urlopen(url + "/health", timeout=10).status == 200
    # The last step of this request reports the pool after everything finished
    # (an aborted stream takes no step of its own).
    assert greedy(url, policy) == before
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    assert metric(text, "vllm:num_requests_running") == 0
    assert metric(text, "vllm:kv_cache_usage_perc") == 0
    for name in counted:  # this mix's: evictions, and PAIR's preemption at least
        assert metric(text, name) > start[name], name
