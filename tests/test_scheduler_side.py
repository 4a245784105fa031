"""VTokenScheduler against vLLM's real KVCacheManager, step by step, by hand.

No engine: a tiny KV cache (block size 4, 16 blocks, block 0 is vLLM's null
block) and one request, driven through the same calls the patched scheduler
makes. Every figure below is worked out by hand in the comments.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

B = 4


def setup(reclaim: str):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.request import Request
    from vllm.vtoken.config import VTokenConfig
    from vllm.vtoken.manager import VTokenScheduler

    spec = FullAttentionSpec(
        block_size=B, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv = KVCacheManager(
        KVCacheConfig(
            num_blocks=16,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        ),
        max_model_len=64,
        hash_block_size=B,
        enable_caching=False,
    )
    cfg = VTokenConfig(
        kv_eviction_policy="streamingllm",
        kv_budget_tokens=6,
        kv_eviction_config={"num_sinks": 1},
        kv_reclaim=reclaim,
        kv_reclaim_threshold=1.0,
        kv_reclaim_margin=0,
    )
    req = Request("A", list(range(100, 112)), SamplingParams(max_tokens=8), None)
    requests = {"A": req}
    return kv, VTokenScheduler(cfg, kv, B, requests), req


def step(kv, vt, req, num_new: int, running: list):
    """One scheduler step as the patched Scheduler runs it, with an acking worker."""
    from vllm.vtoken.messages import VTokenWorkerOutput

    vt.begin_step(running)
    assert kv.allocate_slots(req, num_new) is not None
    out = vt.end_step(SimpleNamespace(num_scheduled_tokens={"A": num_new}))
    req.num_computed_tokens += num_new
    acked = [out.moves.batch_id] if out is not None and out.moves else []
    vt.on_output(VTokenWorkerOutput(acked_batches=acked))
    req.append_output_token_ids(7)
    vt.check_integrity()
    return out


@pytest.mark.parametrize("reclaim", ["naive", "vtoken"])
def test_hand_computed_step(reclaim):
    kv, vt, req = setup(reclaim)
    free0 = kv.block_pool.get_num_free_blocks()
    assert free0 == 15  # 16 blocks minus the null block

    # Step 1: prefill 12 tokens into 3 positional blocks. Nothing evicted yet.
    step(kv, vt, req, 12, running=[])
    s = vt.make_stats([req])
    assert (s.retained_blocks, s.live_tokens, s.evicted_tokens) == (3, 12, 0)
    assert s.token_utilization == 1.0 and s.intra_block_waste == 0.0

    # Step 2: 12 live > budget 6, so StreamingLLM (1 sink) evicts the 6 oldest
    # non-sink tokens 1..6; token 11 (last attended) is protected. Live: 0, 7,
    # 8-11 and the new token 12. Blocks 0 and 1 keep one live token each.
    out = step(kv, vt, req, 1, running=[req])
    assert out.dead["A"].tolist() == [1, 2, 3, 4, 5, 6]
    s = vt.make_stats([req])
    assert s.evicted_tokens == 6 and s.live_tokens == 7
    if reclaim == "naive":
        # 4 positional blocks = 16 slots; written 13, live 7, dead 6.
        assert out.moves is None
        assert s.retained_blocks == 4
        assert s.token_utilization == pytest.approx(7 / 16)
        assert s.intra_block_waste == pytest.approx(6 / 16)
        assert (s.reclaimed_blocks, s.moved_tokens) == (0, 0)
        assert kv.block_pool.get_num_free_blocks() == free0 - 4
    else:
        # Six dead slots >= one block's worth, so A is planned. Candidates under
        # 1.0: blocks 0 and 1 (1 live each; block 2 is full of live tokens).
        # Packing both frees 2 blocks for 1 destination: tokens 0 and 7 move to
        # offsets 0 and 1 of a fresh block, then blocks 0 and 1 are freed.
        m = out.moves
        assert m.idx.tolist() == [0, 7]
        dst_block = int(m.dst_slots[0]) // B
        assert m.dst_slots.tolist() == [dst_block * B, dst_block * B + 1]
        assert vt.pool.slots("A")[[0, 7]].tolist() == m.dst_slots.tolist()
        # Held: blocks 2, 3 and the destination = 12 slots; written: tokens 8-12
        # in blocks 2-3 plus 2 in the destination = 7 = live, so no dead slot.
        assert s.retained_blocks == 3
        assert s.token_utilization == pytest.approx(7 / 12)
        assert s.intra_block_waste == 0.0
        assert (s.reclaimed_blocks, s.moved_tokens) == (2, 2)
        assert kv.block_pool.get_num_free_blocks() == free0 - 3
    # Counters are deltas: a second read in the same interval reports none.
    again = vt.make_stats([req])
    assert (again.evicted_tokens, again.reclaimed_blocks, again.moved_tokens) == (
        0,
        0,
        0,
    )

    # Finish: every block returns to the pool, including the destination.
    vt.on_free(req)
    kv.free(req)
    assert kv.block_pool.get_num_free_blocks() == free0
    assert "A" not in vt.pool and not vt.extra_blocks


def test_preemption_keeps_dead_set_and_frees_everything():
    kv, vt, req = setup("vtoken")
    free0 = kv.block_pool.get_num_free_blocks()
    step(kv, vt, req, 12, running=[])
    step(kv, vt, req, 1, running=[req])
    dead = vt.pool.dead_idx("A").tolist()
    # Preempt: the extra block goes back now, vLLM frees the positional ones.
    vt.on_preempt(req)
    kv.free(req)
    req.num_computed_tokens = 0
    assert kv.block_pool.get_num_free_blocks() == free0
    assert vt.pool.num_slotted("A") == 0 and vt.pool.dead_idx("A").tolist() == dead
    # Resume: all 14 tokens are recomputed; the dead ones get slots but stay dead.
    step(kv, vt, req, req.num_tokens, running=[])
    assert vt.pool.num_slotted("A") == 14
    assert vt.pool.dead_idx("A").tolist() == dead
    assert np.count_nonzero(vt.pool.block_live) == 4  # every block has a live token
