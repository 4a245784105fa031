"""Run a test snippet with Triton's interpreter (TRITON_INTERPRET=1) on CPU, or
with Triton's compiler for a GPU and no launch (`run_compiling_for`).

Each snippet runs in a fresh process, because the variable must be set before
Triton is imported (and the compile-only driver is process-wide). The
preamble loads tests/conftest.py (so `vllm.vtoken` is this checkout's
overlay) and hands vLLM the real Triton modules: without a GPU driver
`vllm.triton_utils` holds placeholders, though the interpreter runs the
kernels fine on CPU tensors, and the compiler needs no GPU.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

CONFTEST = str(pathlib.Path(__file__).resolve().parents[1] / "conftest.py")

PREAMBLE = """\
import runpy, sys
runpy.run_path(sys.argv[1])
import numpy as np, torch
import triton, triton.language as tl
import triton.language.extra.libdevice as tldevice
import vllm.triton_utils as tu
tu.HAS_TRITON, tu.triton, tu.tl, tu.tldevice = True, triton, tl, tldevice
"""


def run_under_interpreter(code: str, marker: str, timeout: int = 180) -> None:
    """Runs `code` after the preamble; asserts it exits 0 and prints `marker`."""
    proc = subprocess.run(
        [sys.executable, "-c", PREAMBLE + textwrap.dedent(code), CONFTEST],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and marker in proc.stdout, proc.stderr[-3000:]


SCRIPTS = str(pathlib.Path(__file__).resolve().parents[2] / "scripts")


def run_compiling_for(
    capability: int, code: str, marker: str, timeout: int = 600
) -> None:
    """Runs `code` after the preamble with every Triton launch compiled for
    CUDA compute capability `capability` (80: A100, 90: H100/H200) and not
    run (scripts/gpu_compile_report.py's `compile_only`: its list is
    COMPILED, an entry a launch); asserts it exits 0 and prints `marker`."""
    preamble = PREAMBLE + (
        f"sys.path.insert(0, {SCRIPTS!r})\n"
        "from gpu_compile_report import compile_only\n"
        f"COMPILED = compile_only({int(capability)})\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", preamble + textwrap.dedent(code), CONFTEST],
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and marker in proc.stdout, proc.stderr[-3000:]
