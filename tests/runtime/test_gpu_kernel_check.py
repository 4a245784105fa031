"""scripts/gpu_kernel_check.py at --tiny sizes on CPU (TRITON_INTERPRET=1).

The GPU check runs where no vLLM is installed; running it here, against the
pristine tree's stock kernel and through its own `vllm` shim, keeps it from
rotting between GPU runs.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
VERSION = (REPO / "VLLM_VERSION").read_text().split()[0]
CACHE = pathlib.Path(os.environ.get("VTOKEN_CACHE", "~/.cache/vtoken")).expanduser()
PRISTINE = pathlib.Path(
    os.environ.get("VTOKEN_PRISTINE", CACHE / f"pristine-{VERSION}")
)
STOCK = PRISTINE / "vllm/v1/attention/ops/triton_unified_attention.py"


@pytest.mark.skipif(
    not STOCK.exists(),
    reason=f"no pristine vLLM tree at {PRISTINE} (scripts/prepare.py pristine)",
)
def test_gpu_kernel_check_runs_tiny_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/gpu_kernel_check.py"), str(STOCK),
         "--tiny", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=90, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["device"] == "cpu", report
    assert "site-packages" not in report["vllm"], report["vllm"]  # the shim
    for name in ("copy", "read", "score", "decode_time", "score_memory", "syncs"):
        assert name in report, name
    assert all(report["copy"][t]["exact"] for t in ("bfloat16", "uint8"))
    assert set(report["read"]) >= {
        "decode", "prefill", "chunked", "decode_split_kv", "decode_mixed",
        "decode_fp8", "prefill_fp8", "decode_fp8q", "prefill_fp8q",
        "decode_mixed_fp8q", "decode_split_kv_fp8q",
    }  # fmt: skip
    assert {
        "g3_float32_mean_wNone", "g16_float32_mean_wNone", "g3_float32_fp8_max_w8",
        "g3_float16_fp8q_mean_wNone",
    } <= set(report["score"])  # fmt: skip


def load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_kernel_check", REPO / "scripts/gpu_kernel_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines only: nothing runs, no shim
    return module


@pytest.mark.parametrize("size", ["TINY", "FULL"])
def test_the_split_kv_reads_are_of_batches_vllm_splits(size):
    """vLLM reads a decode batch on its split-KV (3D) path only up to
    MIN_LAUNCH_GRID_SIZE_2D // Hkv sequences (128 // 8 = 16 at full size);
    the full check's split runs read all 24 of its decode batch, so vLLM took
    the 2D path and the check failed on a GPU (`ran` false), which --tiny (3
    sequences, threshold 64) could not show."""
    import types

    script = load_script()
    cfg = getattr(script, size)
    c = types.SimpleNamespace(read=cfg["read"], heads=cfg["heads"])
    threshold = script.MIN_GRID_2D // cfg["heads"][1]
    runs = {run[0]: run for run in script.read_runs(c)}
    for name in ("decode_split_kv", "decode_split_kv_fp8q"):
        _, seq, ql, how, _ = runs[name]
        assert how == "split" and 0 < len(seq) == len(ql) <= threshold, (name, len(seq))
        assert all(q == 1 for q in ql)  # decode
    if size == "FULL":  # the cut matters there: the decode batch is wider
        assert len(cfg["read"]["decode"][0]) > threshold
    backend = PRISTINE / "vllm/v1/attention/backends/triton_attn.py"
    if backend.exists():  # the constant is vLLM's
        want = f"MIN_LAUNCH_GRID_SIZE_2D = {script.MIN_GRID_2D} "
        assert want in backend.read_text()
