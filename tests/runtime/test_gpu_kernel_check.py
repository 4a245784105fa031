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
