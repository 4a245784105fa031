"""The GPU kernels compiled for real GPUs, on CPU: Triton's own compiler
(ptxas included) turns every launch the worker's start-up warm-up makes into
a cubin for a CUDA target, launching nothing (scripts/gpu_compile_report.py).

The interpreter (TRITON_INTERPRET=1, the other runtime tests) checks what the
kernels compute but not that they compile: it runs Python, so a `break` in a
kernel loop, a branch whose types disagree or a tile past a GPU's shared
memory pass there and fail at a GPU's first forward. Here each kernel the
token read, the scoring (every score mode and aggregate) and the KV copy
launch is compiled as the warm-up (`triton_attention.warm_up`) launches it
(decode, 2D and split-KV 3D; prefill; one-token prompts), and then steps of
every kind are checked to need nothing more.
"""

import json
import subprocess
import sys

import pytest

from tests.runtime.interpreter import run_compiling_for
from tests.runtime.test_gpu_kernel_check import PRISTINE, REPO, STOCK

KERNELS = {
    "kernel_unified_attention_2d",
    "kernel_unified_attention_3d",
    "reduce_segments",
    "score_mass_kernel",
    "_copy_kv_slots_kernel",
}


@pytest.mark.skipif(
    not STOCK.exists(),
    reason=f"no pristine vLLM tree at {PRISTINE} (scripts/prepare.py pristine)",
)
def test_every_kernel_the_warm_up_launches_compiles_for_the_gpu(tmp_path):
    """scripts/gpu_compile_report.py at the two shapes that ask the most: a
    GQA group of 8 (the score kernel's registers) and a head size of 256
    (shared memory), for A100 and H100, and the first with an fp8 cache
    (for Ada and H100: fp8 needs sm_89). It fails on a kernel that does not
    compile, or takes more shared memory than the GPU has."""
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/gpu_compile_report.py"), str(STOCK),
         "--out", str(out), "--capability", "90", "89", "80",
         "--shapes", "8/1/128", "8/4/256", "8/1/128:fp8"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())["targets"]
    assert set(report) == {"sm_90", "sm_89", "sm_80"}
    # An fp8 cache's kernels, where Triton converts e4m3 (sm_89 and later).
    assert "8/1/128:fp8" in report["sm_90"]["shapes"]
    assert "8/1/128:fp8" in report["sm_89"]["shapes"]
    assert "8/1/128:fp8" not in report["sm_80"]["shapes"]
    for target in report.values():
        for shape, kernels in target["shapes"].items():
            assert set(kernels) == KERNELS, shape
            for name, k in kernels.items():  # ptxas ran for each
                assert k["variants"] >= 1 and k["registers"] > 0, (shape, name)


_NO_COMPILE_AFTER_WARM_UP_CHILD = """
from types import SimpleNamespace

from vllm.vtoken.copy_executor import slot_pairs
from vllm.vtoken.kv_copy_triton import TritonKVSlotCopier
from vllm.vtoken.score_kernel import triton_attention_mass
from vllm.vtoken.scores import ScoreAccumulator
from vllm.vtoken.staging import HostToDevice
from vllm.vtoken.triton_attention import KVQuant, _Read, triton_forward, warm_up
from vllm.vtoken.triton_plan import build_triton_read_plan

hq, h, d = 32, 8, 128  # Llama-3.1-8B
N, B, S = 4096, 16, 16
bf16 = torch.zeros(N, 2, B, h, d, dtype=torch.bfloat16)
# An fp8 cache as vLLM allocates it (bytes), and a layer's scales.
fp8 = bf16.new_zeros(bf16.shape, dtype=torch.uint8), torch.float8_e4m3fn
scales = torch.tensor([0.5]), torch.tensor([0.25])
rows = 128 // h
split = SimpleNamespace(
    seq_threshold_3D=rows,
    num_par_softmax_segments=S,
    softmax_segm_output=torch.empty(rows, hq, S, d),
    softmax_segm_max=torch.empty(rows, hq, S),
    softmax_segm_expsum=torch.empty(rows, hq, S),
)
rng = np.random.default_rng(0)
stage = HostToDevice(torch.device("cpu"))
steps = [[1] * r for r in (1, 2, 3, 7, 8, 15, 16, 17, 33, 100, 256)]  # decodes
steps += [[n] for n in (1, 2, 3, 15, 16, 17, 100, 513)]  # prefills
steps += [[1] * (r - 1) + [77] for r in (2, 9, 40)]  # decodes beside a chunk


def step(scores, qlens, extra_keys, write):  # reads kv and quant
    qlens = np.asarray(qlens)
    klens = qlens + extra_keys
    qsl, indptr = np.r_[0, np.cumsum(qlens)], np.r_[0, np.cumsum(klens)]
    window = None
    if scores is not None and scores.query_window is not None:
        window = np.minimum(qlens, scores.query_window)
    plan = build_triton_read_plan(
        qsl, indptr, rng.permutation(N * B)[: indptr[-1]], B, write,
        scored=scores is not None, score_query_window=window,
        score_group=hq // h, stage=stage,
    )
    # As vLLM passes it: a view of the fused QKV projection; for an fp8
    # cache, the query CUDA quantized to fp8 (contiguous). Output: bf16.
    t = int(qsl[-1])
    q = torch.zeros(t, hq + 2 * h, d, dtype=torch.bfloat16)[:, :hq]
    if quant is not None:
        q = torch.zeros(t, hq, d, dtype=quant.dtype)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    triton_forward(_Read(plan, None), q, kv, out, d**-0.5, split, quant)
    if scores is not None and plan.score.num_tiles:
        cache, k_scale = kv, None
        if quant is not None:  # as triton_forward hands it on
            cache, k_scale = kv.view(quant.dtype), quant.k_scale
        triton_attention_mass(
            q, cache, plan.score, d**-0.5, scores.aggregate, k_scale=k_scale
        )


for kv, kv_dtype in ((bf16, None), fp8):
    quant = None if kv_dtype is None else KVQuant(kv_dtype, *scales)
    for scores in (
        None,
        ScoreAccumulator("sum"),
        ScoreAccumulator("sum", aggregate="max"),
        ScoreAccumulator("window", query_window=8),
    ):
        COMPILED.clear()
        fp8_query = kv_dtype is not None  # CUDA's query_quant
        warm_up(kv, hq, scores, split, kv_dtype, torch.bfloat16, fp8_query)
        warm = {c[2] for c in COMPILED}
        for qlens in steps:
            r = len(qlens)
            for extra in (0, rng.integers(0, 200, r)):  # a first chunk, a later one
                for write in (None, np.arange(r) % 2 == 1):  # all rows, some
                    step(scores, qlens, extra, write)
        new = {(c[0], c[2]) for c in COMPILED if c[2] not in warm}
        assert not new, (kv_dtype, scores and scores.mode, sorted(n for n, _ in new))
copier = TritonKVSlotCopier([bf16], B)
COMPILED.clear()
pairs = slot_pairs(np.array([0]), np.array([1]))  # KVCopyExecutor.warm_up
copier.copy(pairs[0, :1], pairs[1, :1])
for m in (2, 15, 16, 17, 300):
    pairs = slot_pairs(np.arange(m), np.arange(m, 2 * m))  # as _submit_cuda
    copier.copy(pairs[0, :m], pairs[1, :m])
assert len({c[2] for c in COMPILED}) == 1, COMPILED
print("NO-COMPILE-OK", len(COMPILED), "launches")
"""


def test_no_step_compiles_a_kernel_variant_the_warm_up_did_not():
    """The warm-up exists so that no step stalls on a compile (seconds):
    Triton compiles a variant per specialization of a launch's integer and
    pointer arguments (1, divisible by 16, or neither; 16-byte aligned or
    not). After it, steps of every kind (decodes of 1 to 256 requests,
    prefills of 1 to 513 tokens, first chunks and later ones, decodes beside
    a chunk, every row read or some), in each score mode (sum, its max
    aggregate, SnapKV's window; Scissorhands' persistence launches as sum
    does), at Llama-3.1-8B's shape with the query a view of fused QKV, with
    a bf16 cache and an fp8 one, and KV copies of 1 to 300 moves, reach only
    the variants it compiled: Triton's own cache keys, compared."""
    run_compiling_for(90, _NO_COMPILE_AFTER_WARM_UP_CHILD, "NO-COMPILE-OK")
