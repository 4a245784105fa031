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


# Triton's JIT, compiling for a CUDA target and launching nothing: what the
# snippet launches is compiled to a cubin as on that GPU (ptxas included)
# from the CPU tensors' dtypes and alignments; COMPILED lists each launch's
# (kernel name, shared memory bytes, variant hash).
COMPILE_ONLY = """\
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

class CompileOnly:
    def __init__(self, target):
        self.target = target
    def get_current_device(self):
        return 0
    def get_current_stream(self, device=None):
        return 0
    def get_current_target(self):
        return self.target

COMPILED = []
_run = JITFunction.run
def _compile(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    COMPILED.append((self.fn.__name__, kernel.metadata.shared, kernel.hash))
    return kernel
JITFunction.run = _compile
driver.set_active(CompileOnly(GPUTarget("cuda", CAPABILITY, 32)))
"""


def run_compiling_for(
    capability: int, code: str, marker: str, timeout: int = 600
) -> None:
    """Runs `code` after the preamble with every Triton launch compiled for
    CUDA compute capability `capability` (80: A100, 90: H100/H200) and not
    run; asserts it exits 0 and prints `marker`."""
    preamble = PREAMBLE + COMPILE_ONLY.replace("CAPABILITY", str(int(capability)))
    proc = subprocess.run(
        [sys.executable, "-c", preamble + textwrap.dedent(code), CONFTEST],
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and marker in proc.stdout, proc.stderr[-3000:]
