#!/usr/bin/env python3
"""What vToken's Triton kernels ask of a GPU, from the compiler alone (no GPU).

Every launch the worker's start-up warm-up makes (`triton_attention.warm_up`:
the token read, 2D and split-KV 3D with its reduce; scoring in each mode and
aggregate; and the KV copy) is compiled to a cubin for each CUDA compute
capability asked, at the head shapes given, by Triton's own compiler (ptxas
included) behind a driver that reports that target and launches nothing.
Per capability, shape and kernel: the variants compiled, and their largest
shared memory, registers a thread and spilled bytes (ptxas -v), into
docs/bench/gpu_compile.json (docs/RESULTS.md's table: bench_report.py). A kernel
that does not compile for a target fails the run (exit 1), naming it.

Needs torch, Triton and vLLM 0.18.0's triton_unified_attention.py, as
gpu_kernel_check.py (whose shim it uses): no GPU, no vLLM install.

    python scripts/gpu_compile_report.py --out report.json
    python scripts/gpu_compile_report.py --capability 90 --shapes 32/8/128
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

# Query heads / KV heads / head size[:dtype]: Llama-3.1-8B, Llama-3.1-70B at
# TP 8 (one KV head a rank), a head size of 256, SmolLM2-135M in fp16 (3
# query heads a KV head: a group padded to 4), Llama-3.1-8B with an fp8 KV
# cache (--kv-cache-dtype fp8: the cache's bytes read as e4m3, bf16 queries).
SHAPES = ("32/8/128", "8/1/128", "8/4/256", "9/3/64:float16", "32/8/128:fp8")
# Triton converts e4m3 (fp8e4nv) on sm_89 and later only: an fp8 shape is
# compiled there (vLLM's own kernel reads the cache the same way).
FP8_FROM = 89
OUT = pathlib.Path(__file__).resolve().parents[1] / "docs/bench/gpu_compile.json"
# Shared memory a block may take, bytes (the compile does not check it; a
# launch would fail): A100, L40S/Ada, H100/H200.
SHARED_LIMIT = {80: 166912, 89: 101376, 90: 232448}
# ptxas -v, one kernel a compile: "Used 112 registers", "0 bytes spill stores".
_REGS, _SPILL = re.compile(r"Used (\d+) registers"), re.compile(r"(\d+) bytes spill st")


def compile_only(capability: int) -> list:
    """Makes every Triton launch in this process compile for CUDA compute
    capability `capability` and not run. Returns the list each launch
    appends (kernel name, shared memory bytes, variant hash, registers,
    spill bytes); registers and spills are None when Triton's cache served
    the variant (ptxas did not run: TRITON_DUMP_PTXAS_LOG=1 and a fresh
    TRITON_CACHE_DIR give them). The worker's upload of the read plan packs
    its arrays on CPU too, as on a GPU: a variant's key includes its
    pointers' alignment, and on CPU the live slots would otherwise be
    NumPy's own array (at times only 8-byte aligned), where a GPU reads
    them from the start of the upload's buffer."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from vllm.vtoken import staging

    init = staging.HostToDevice.__init__
    staging.HostToDevice.__init__ = lambda self, device, pack=True: init(
        self, device, pack
    )

    class CompileOnly:  # the part of Triton's driver that JIT launches use
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

    compiled, seen = [], {}
    run = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        log = io.StringIO()
        with contextlib.redirect_stdout(log):  # ptxas -v, printed on a compile
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        regs, spill = (_REGS.search(log.getvalue()), _SPILL.search(log.getvalue()))
        if regs and spill:
            seen[kernel.hash] = (int(regs[1]), int(spill[1]))
        regs, spill = seen.get(kernel.hash, (None, None))
        name = self.fn.__name__
        compiled.append((name, kernel.metadata.shared, kernel.hash, regs, spill))
        return kernel

    JITFunction.run = compile_instead
    driver.set_active(CompileOnly())
    return compiled


def launch_warm_up(shape: str) -> None:
    """Runs the worker's warm-up at `shape` ("Hq/Hkv/D[:dtype]"; dtype fp8:
    an e4m3 cache) for each score mode (H2O's sum, its max aggregate,
    SnapKV's window), and one KV copy, on CPU tensors (the launches only
    compile)."""
    import torch
    import triton

    from vllm.vtoken.kv_copy_triton import TritonKVSlotCopier
    from vllm.vtoken.triton_attention import warm_up

    heads, _, dtype = shape.partition(":")
    hq, h, d = map(int, heads.split("/"))
    num_blocks, block, segments = 64, 16, 16
    fp8 = dtype == "fp8"  # as vLLM allocates it: bytes, read as e4m3
    kv = torch.zeros(
        num_blocks, 2, block, h, d,
        dtype=torch.uint8 if fp8 else getattr(torch, dtype or "bfloat16"),
    )  # fmt: skip
    kv_dtype = torch.float8_e4m3fn if fp8 else None
    model_dtype = torch.bfloat16 if fp8 else None
    rows = 128 // h  # TritonAttentionMetadataBuilder's seq_threshold_3D
    split = SimpleNamespace(  # its split-KV buffers
        seq_threshold_3D=rows,
        num_par_softmax_segments=segments,
        softmax_segm_output=torch.empty(rows, hq, segments, triton.next_power_of_2(d)),
        softmax_segm_max=torch.empty(rows, hq, segments),
        softmax_segm_expsum=torch.empty(rows, hq, segments),
    )
    for aggregate, window in (("mean", None), ("max", None), ("mean", 8)):
        scores = SimpleNamespace(aggregate=aggregate, query_window=window)
        # CUDA quantizes an fp8 cache's query (vLLM's query_quant).
        warm_up(kv, hq, scores, split, kv_dtype, model_dtype, fp8_query=fp8)
    TritonKVSlotCopier([kv], block).copy(torch.arange(2), torch.arange(2, 4))


def summarize(launches: list) -> dict:
    """Per kernel: variants, and the largest shared memory, registers and
    spill of any of them."""
    out: dict[str, dict] = {}
    for name, shared, variant, regs, spill in launches:
        k = out.setdefault(
            name, {"variants": set(), "shared": 0, "regs": 0, "spill": 0}
        )
        k["variants"].add(variant)
        k["shared"] = max(k["shared"], shared)
        k["regs"] = max(k["regs"], regs or 0)
        k["spill"] = max(k["spill"], spill or 0)
    return {
        name: {
            "variants": len(k["variants"]),
            "shared_bytes": k["shared"],
            "registers": k["regs"] or None,
            "spill_bytes": k["spill"],
        }
        for name, k in sorted(out.items())
    }


def main() -> int:
    from gpu_kernel_check import UA, find_stock, install_shim

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stock", nargs="?", help=f"path of {UA} (vLLM 0.18.0)")
    p.add_argument("--capability", type=int, nargs="+", default=[90, 80])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--out", default=str(OUT), help="JSON report")
    a = p.parse_args()
    stock = find_stock(a.stock)
    if len(a.capability) > 1:  # a process per target: a JIT keeps its first
        import triton

        report = {
            "command": "python scripts/gpu_compile_report.py"
            + ("" if a.capability == [90, 80] else f" --capability {a.capability}")
            + ("" if a.shapes == list(SHAPES) else f" --shapes {' '.join(a.shapes)}"),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "triton": triton.__version__,
            "targets": {},
        }
        for cap in a.capability:
            with tempfile.NamedTemporaryFile(suffix=".json") as part:
                cmd = [sys.executable, __file__, str(stock), "--capability",
                       str(cap), "--shapes", *a.shapes, "--out", part.name]  # fmt: skip
                if subprocess.run(cmd).returncode:
                    return 1
                report["targets"].update(
                    json.loads(pathlib.Path(part.name).read_text())
                )
        pathlib.Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"OK -> {a.out} (docs/RESULTS.md: python scripts/bench_report.py)")
        return 0
    (cap,) = a.capability
    # Every variant compiled afresh, so that ptxas reports each one's use.
    cache = tempfile.mkdtemp(prefix="vtoken-triton-")
    atexit.register(shutil.rmtree, cache, True)
    os.environ["TRITON_CACHE_DIR"] = cache
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    install_shim(stock)
    launches = compile_only(cap)
    start, shapes = time.perf_counter(), {}
    print(f"sm_{cap}:")
    for shape in a.shapes:
        if shape.endswith(":fp8") and cap < FP8_FROM:
            print(f"  {shape:>16} (fp8: sm_{FP8_FROM} and later)")
            continue
        del launches[:]
        launch_warm_up(shape)
        shapes[shape] = kernels = summarize(launches)
        for name, k in kernels.items():
            print(f"  {shape:>16} {name:28} {k}")
            if k["shared_bytes"] > SHARED_LIMIT.get(cap, 1 << 30):
                sys.exit(f"{name} at {shape}: more shared memory than sm_{cap} has")
    seconds = round(time.perf_counter() - start, 1)
    report = {f"sm_{cap}": {"shapes": shapes, "seconds": seconds}}
    pathlib.Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    sys.exit(main())
