"""The integration map's layout check (its C1): the CPU_ATTN cache layout that
every vToken read and move relies on.

vLLM's own writer (`cpu_attn_reshape_and_cache`, ISA vec/vec16) stores V
naturally `[B, D]` per (block, head) page and K transposed `[D, B]`. Written
tokens are read back through that index math and through `gather_live_kv`.
"""

import pytest
import torch

from vllm.vtoken.cpu_attention import gather_live_kv

ops = pytest.importorskip(
    "vllm._custom_ops",
    reason="vLLM CPU _C ops did not load (see LD_PRELOAD in ENVIRONMENT.md)",
)

CASES = [
    ("vec", 32, torch.float32),
    ("vec", 32, torch.bfloat16),
    ("vec16", 16, torch.float32),
    ("vec16", 16, torch.bfloat16),
]


@pytest.mark.parametrize("isa,block,dtype", CASES)
def test_vllm_writer_stores_k_transposed_v_natural(isa, block, dtype):
    num_blocks, heads, head_dim, num_tokens = 5, 2, 32, 23
    gen = torch.Generator().manual_seed(block)
    kv = torch.zeros(2, num_blocks, heads, block, head_dim, dtype=dtype)
    key_cache, value_cache = kv.unbind(0)
    key = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block, generator=gen)[:num_tokens]

    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    blk, off = slots // block, slots % block
    # K element (offset o, dim d) of page (n, h) sits at flat position d * B + o.
    pages = key_cache.reshape(num_blocks, heads, block * head_dim)
    flat = torch.arange(head_dim)[None, :] * block + off[:, None]  # [T, D]
    for h in range(heads):
        got = pages[blk[:, None], h, flat]  # [T, D]
        assert torch.equal(got, key[:, h])
    assert torch.equal(value_cache[blk, :, off], value)
    # The natural [B, D] reading of K is NOT the layout (the test can fail).
    assert not torch.equal(key_cache[blk, :, off], key)

    got_k, got_v = gather_live_kv(key_cache, value_cache, slots)
    assert torch.equal(got_k, key)
    assert torch.equal(got_v, value)

    # Only the written slots changed.
    untouched = torch.ones(num_blocks * block, dtype=torch.bool)
    untouched[slots] = False
    rest = untouched.nonzero().squeeze(1)
    rest_k, rest_v = gather_live_kv(key_cache, value_cache, rest)
    assert not rest_k.any() and not rest_v.any()


def test_gather_live_kv_follows_slot_order():
    # Slots in an arbitrary order come back in that order.
    block, num_blocks, heads, head_dim = 16, 3, 1, 32
    kv = torch.zeros(2, num_blocks, heads, block, head_dim)
    key_cache, value_cache = kv.unbind(0)
    slots = torch.tensor([47, 0, 16, 15])
    key = torch.arange(4.0)[:, None, None].expand(4, heads, head_dim).contiguous()
    ops.cpu_attn_reshape_and_cache(
        key, key + 10, key_cache, value_cache, slots, "vec16"
    )
    got_k, got_v = gather_live_kv(key_cache, value_cache, torch.tensor([16, 47, 15]))
    assert got_k[:, 0, 0].tolist() == [2.0, 0.0, 3.0]
    assert got_v[:, 0, 0].tolist() == [12.0, 10.0, 13.0]
