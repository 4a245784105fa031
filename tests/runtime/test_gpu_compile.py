"""The GPU kernels compiled for real GPUs, on CPU: Triton's own compiler
(ptxas included) turns every launch the worker's start-up warm-up makes into
a cubin for a CUDA target, launching nothing.

The interpreter (TRITON_INTERPRET=1, the other runtime tests) checks what the
kernels compute but not that they compile: it runs Python, so a `tl.dot`
under 16 rows, a branch whose types disagree, or a tile past a GPU's shared
memory pass there and fail at a GPU's first forward. Here each kernel the
token read, the scoring (every score mode and aggregate) and the KV copy
launch is compiled at the shapes of models vToken serves, as the warm-up
(`triton_attention.warm_up`) launches it: decode (2D and split-KV 3D),
prefill, one-token prompts.
"""

import pytest

from tests.runtime.interpreter import run_compiling_for

# Query heads, KV heads, head size, dtype: Llama-3.1-8B, Llama-3.1-70B at
# TP 8 (one KV head a rank), a head size of 256, SmolLM2-135M in fp16 (3
# query heads a KV head: a group padded to 4, head size 64).
GEOMETRIES = {
    90: [
        (32, 8, 128, "bfloat16"),
        (8, 1, 128, "bfloat16"),
        (8, 4, 256, "bfloat16"),
        (9, 3, 64, "float16"),
    ],
    80: [(32, 8, 128, "bfloat16")],
}
# Shared memory a block may take (bytes): A100, H100/H200.
SHARED_LIMIT = {80: 166912, 90: 232448}

_CHILD = """
from types import SimpleNamespace

from vllm.vtoken.kv_copy_triton import TritonKVSlotCopier
from vllm.vtoken.scores import ScoreAccumulator
from vllm.vtoken.triton_attention import warm_up

N, B, S = 64, 16, 16  # blocks, block size, vLLM's softmax segments (3D)
for hq, h, d, dtype in GEOMETRIES:
    kv = torch.zeros(N, 2, B, h, d, dtype=getattr(torch, dtype))
    rows = 128 // h  # TritonAttentionMetadataBuilder's seq_threshold_3D
    split = SimpleNamespace(
        seq_threshold_3D=rows,
        num_par_softmax_segments=S,
        softmax_segm_output=torch.empty(rows, hq, S, triton.next_power_of_2(d)),
        softmax_segm_max=torch.empty(rows, hq, S),
        softmax_segm_expsum=torch.empty(rows, hq, S),
    )
    for scores in (
        ScoreAccumulator("sum"),  # H2O
        ScoreAccumulator("sum", aggregate="max"),
        ScoreAccumulator("window", query_window=8),  # SnapKV
    ):
        warm_up(kv, hq, scores, split)
    copier = TritonKVSlotCopier([kv, kv.clone()], B)
    copier.copy(torch.arange(2), torch.arange(2, 4))
names = {name for name, _, _ in COMPILED}
assert names == {
    "kernel_unified_attention_2d", "kernel_unified_attention_3d",
    "reduce_segments", "score_mass_kernel", "_copy_kv_slots_kernel",
}, names
shared = max(s for _, s, _ in COMPILED)
assert shared <= SHARED_LIMIT, (shared, SHARED_LIMIT)
print("COMPILED-OK", len({v for _, _, v in COMPILED}), "variants, shared", shared)
"""


@pytest.mark.parametrize("capability", sorted(GEOMETRIES))
def test_every_kernel_the_warm_up_launches_compiles_for_the_gpu(capability):
    run_compiling_for(
        capability,
        f"GEOMETRIES = {GEOMETRIES[capability]!r}\n"
        f"SHARED_LIMIT = {SHARED_LIMIT[capability]}\n" + _CHILD,
        "COMPILED-OK",
    )
