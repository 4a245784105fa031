"""scripts/bench_gpu.sh --smoke: the GPU benchmark's own path, run on CPU.

The same script, dummy-model writer (a two-layer Llama with a generated
tokenizer), random prompts, stock twin and the four experiments a GPU run makes,
at sizes a CPU finishes in a few minutes. What only a GPU can tell (the figures)
is not asserted here; that the path runs end to end and measures sane things is.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

pytestmark = pytest.mark.e2e

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("bench-gpu")
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/bench_gpu.sh"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out / "tiny-llama"


def load(folder: pathlib.Path, name: str) -> dict:
    return json.loads((folder / f"{name}.json").read_text())


def test_dummy_model_runs_every_experiment(smoke):
    for name in ("memory", "capacity", "sla", "overhead", "meta"):
        assert (smoke / f"{name}.json").exists(), name
    for png in ("memory", "capacity", "sla"):
        assert (smoke / f"{png}.png").stat().st_size > 1000
    config = json.loads((smoke.parent / "models/tiny-llama/config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == 32768


def test_memory_and_capacity_measure_reclamation(smoke):
    mem = load(smoke, "memory")
    r = mem["results"]
    assert set(r) == {"none/-", "h2o/naive", "h2o/vtoken"}
    assert "random" in mem["workload"]
    naive, vtoken = r["h2o/naive"], r["h2o/vtoken"]
    assert naive["evicted_tokens"] == vtoken["evicted_tokens"] > 0
    assert vtoken["moved_tokens"] > 0 and naive["moved_tokens"] == 0
    assert vtoken["retained_blocks"] < naive["retained_blocks"]
    assert vtoken["utilization"] > naive["utilization"]
    cap = load(smoke, "capacity")["results"]
    pool = load(smoke, "capacity")["pools"][0]
    native, vt = cap[f"{pool}/native"], cap[f"{pool}/vtoken"]
    assert native["max_concurrency"] == cap[f"{pool}/native_theory"]["max_concurrency"]
    assert vt["max_concurrency"] > native["max_concurrency"]
    assert vt["max_concurrency"] <= cap[f"{pool}/theory"]["max_concurrency"]


def test_sla_and_overhead_complete(smoke):
    sla = load(smoke, "sla")
    assert sla["prompts"] == "random"
    assert sla["temperature"] == 0  # greedy: no sampler compile a server
    # --modes: the servers asked for (native, which the SLA is of, and vtoken)
    assert sla["modes"] == ["native", "vtoken"]
    assert sorted(sla["results"]) == ["native/4.0", "vtoken/4.0"]
    assert set(sla["best_throughput"]) == {"native", "vtoken"}
    for key, res in sla["results"].items():
        assert res["completed"] == sla["num_prompts"], key
    over = load(smoke, "overhead")
    assert len(over["runs"]["stock"]) == len(over["runs"]["patched"]) == 1
    assert 0.2 < over["throughput_ratio_median"] < 5


def test_stock_twin_is_unpatched_and_the_install_is_not(smoke):
    want = subprocess.run(
        ["bash", str(REPO / "apply.sh"), "--print-hash"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    twin = pathlib.Path(os.environ["VTOKEN_CACHE"]) / f"stock-twin-{want}"
    assert (twin / "vllm/_version.py").exists()
    assert not (twin / "vllm/vtoken").exists() and not (twin / ".vtoken").exists()
    scheduler = (twin / "vllm/v1/core/sched/scheduler.py").read_text()
    assert "vtoken" not in scheduler
    import vllm

    site = pathlib.Path(vllm.__file__).parents[1]
    assert (site / ".vtoken/manifest").read_text().startswith(f"hash {want}")
