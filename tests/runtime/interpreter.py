"""Run a test snippet with Triton's interpreter (TRITON_INTERPRET=1) on CPU.

Each snippet runs in a fresh process, because the variable must be set before
Triton is imported. The preamble loads tests/conftest.py (so `vllm.vtoken` is
this checkout's overlay) and hands vLLM the real Triton modules: without a GPU
driver `vllm.triton_utils` holds placeholders, though the interpreter runs the
kernels fine on CPU tensors.
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
