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


@pytest.fixture(autouse=True)
def deep_checks(monkeypatch):
    """The overlay's deep checks, as in tests/runtime (VTOKEN_CHECK_INTEGRITY)."""
    from vllm.vtoken import integrity

    monkeypatch.setattr(integrity, "CHECK", True)


def setup(
    reclaim: str,
    caching: bool = False,
    embeds: bool = False,
    blocks=16,
    policy="streamingllm",
    knobs=None,
    budget=6,
    threshold=1.0,
):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.request import Request
    from vllm.vtoken.config import VTokenConfig
    from vllm.vtoken.scheduler import VTokenScheduler

    spec = FullAttentionSpec(
        block_size=B, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv = KVCacheManager(
        KVCacheConfig(
            num_blocks=blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        ),
        max_model_len=64,
        hash_block_size=B,
        enable_caching=caching,
    )
    cfg = VTokenConfig(
        kv_eviction_policy=policy,
        kv_budget_tokens=budget,
        kv_eviction_config=knobs
        if knobs is not None
        else {"num_sinks": 1}
        if policy == "streamingllm"
        else {},
        kv_reclaim=reclaim,
        kv_reclaim_threshold=threshold,
    )
    hasher = None
    if caching:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        hasher = get_request_block_hasher(B, sha256)
    req = Request(
        "A",
        None if embeds else list(range(100, 112)),
        SamplingParams(max_tokens=8),
        None,
        block_hasher=hasher,
        prompt_embeds=torch.ones(12, 8, dtype=torch.bfloat16) if embeds else None,
    )
    requests = {"A": req}
    return kv, VTokenScheduler(cfg, kv, B, requests), req


def step(kv, vt, req, num_new: int, running: list, ack: bool = True):
    """One scheduler step as the patched Scheduler runs it, with a worker that
    acks its copies at once (`ack`) or keeps them in flight."""
    from vllm.vtoken.messages import VTokenWorkerOutput

    vt.begin_step(running)
    assert kv.allocate_slots(req, num_new) is not None
    out = vt.end_step(SimpleNamespace(num_scheduled_tokens={"A": num_new}))
    req.num_computed_tokens += num_new
    acked = [out.moves.batch_id] if ack and out is not None and out.moves else []
    vt.on_output(VTokenWorkerOutput(acked_batches=acked))
    req.append_output_token_ids(7)
    vt.check_integrity()
    return out


def test_more_than_one_kv_cache_group_is_refused_at_start_up():
    """Layers of two KV specs make two block lists a request; the refusals
    of config.py (hybrid, sliding window, MLA) leave such a text model
    through, and the scheduler read the first group's only (found by
    review)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: F401 (first)
    from vllm.vtoken.config import VTokenConfig
    from vllm.vtoken.scheduler import VTokenScheduler

    kv = SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=[1, 2]))
    cfg = VTokenConfig(kv_eviction_policy="h2o", kv_budget_tokens=8)
    with pytest.raises(ValueError, match="does not support 2 KV cache groups"):
        VTokenScheduler(cfg, kv, B, {})


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

    b0, b1, b2 = kv.get_block_ids("A")[0]

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
        assert not vt._plan_due  # no planner without compaction
        assert s.retained_blocks == 4
        assert s.token_utilization == pytest.approx(7 / 16)
        assert s.intra_block_waste == pytest.approx(6 / 16)
        assert (s.reclaimed_blocks, s.moved_tokens) == (0, 0)
        assert kv.block_pool.get_num_free_blocks() == free0 - 4
    else:
        # Six dead slots >= one block's worth, so A is planned, in place. Its
        # full blocks b0, b1, b2 (the tail b3 is being written) hold 3 + 3 + 0
        # holes: enough to empty floor(6 / 4) = 1 block. Sparsest first (b0 and
        # b1 tie at 1 live; input order wins): token 0 moves into the first
        # hole of the densest block with one, b1 offset 0, and b0 is freed.
        m = out.moves
        assert m.idx.tolist() == [0]
        assert m.src_slots.tolist() == [b0 * B] and m.dst_slots.tolist() == [b1 * B]
        assert vt.pool.slots("A")[0] == b1 * B
        assert kv.get_block_ids("A")[0][0] == 0  # b0 null-replaced
        # Held: b1, b2, b3 = 12 slots; written: 13 positional slots minus b0's
        # 4 = 9; live 7 (0 and 7 in b1, 8-11 in b2, 12 in b3): 2 dead slots.
        assert s.retained_blocks == 3
        assert s.token_utilization == pytest.approx(7 / 12)
        assert s.intra_block_waste == pytest.approx(2 / 12)
        assert (s.reclaimed_blocks, s.moved_tokens) == (1, 1)
        assert kv.block_pool.get_num_free_blocks() == free0 - 3
    # Counters are deltas: a second read in the same interval reports none.
    again = vt.make_stats([req])
    assert (again.evicted_tokens, again.reclaimed_blocks, again.moved_tokens) == (
        0,
        0,
        0,
    )

    # Finish: every block returns to the pool.
    vt.on_free(req)
    kv.free(req)
    assert kv.block_pool.get_num_free_blocks() == free0
    assert "A" not in vt.pool and not vt._reqs


def test_preemption_keeps_dead_set_and_frees_everything():
    kv, vt, req = setup("vtoken")
    free0 = kv.block_pool.get_num_free_blocks()
    step(kv, vt, req, 12, running=[])
    step(kv, vt, req, 1, running=[req])
    dead = vt.pool.dead_idx("A").tolist()
    # Preempt: vLLM frees the blocks; the Token Table keeps the dead set.
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


def test_evictions_of_a_request_preempted_in_the_same_step_reach_the_worker():
    """begin_step evicts, then schedule() preempts the same request: the worker
    must still hear of the evictions, or its Token Table keeps those tokens live
    and reads them after the resume, from blocks the scheduler freed."""
    kv, vt, req = setup("naive")
    step(kv, vt, req, 12, running=[])
    vt.begin_step([req])  # 12 live > budget 6: tokens 1..6 die
    vt.on_preempt(req)
    kv.free(req)
    req.num_computed_tokens = 0
    out = vt.end_step(SimpleNamespace(num_scheduled_tokens={}))
    assert out is not None and out.dead["A"].tolist() == [1, 2, 3, 4, 5, 6]
    vt.check_integrity()


def test_a_request_evicted_by_a_reset_and_aborted_before_the_step_is_not_sent():
    """reset_prefix_cache(reset_running_requests=True) evicts every running
    request to budget between steps (before_preempting_all), and the engine
    takes aborts before its next step: an aborted request's dead list stays
    out of that step's message (its worker releases it first, and would find
    no row)."""
    kv, vt, req = setup("vtoken")
    step(kv, vt, req, 12, running=[])
    vt.before_preempting_all([req])  # 12 live > budget 6: tokens 1..6 die
    vt.on_preempt(req)
    kv.free(req)
    vt.on_free(req)  # aborted while waiting
    vt.begin_step([])  # the next step's schedule()
    out = vt.end_step(SimpleNamespace(num_scheduled_tokens={}))
    assert out is not None and out.dead_req_ids == [] and not out.dead_idx.size
    vt.check_integrity()


@pytest.mark.parametrize("policy", ["streamingllm", "h2o"])
def test_a_reset_while_a_move_batch_is_in_flight_undoes_it_and_resumes_within_budget(
    policy,
):
    """On a GPU a batch's copy may still be on the side stream when
    reset_prefix_cache(reset_running_requests=True) comes between steps: the
    reset's eviction runs with the batch in flight, the preemption drops it
    (its blocks go back with the list), and its acknowledgement, arriving
    with the resume's step, changes nothing. The resume recomputes the live
    tokens only (the CPU worker acknowledges in the same step, so only this
    path shows it)."""
    from vllm.vtoken.messages import ScoreStep, VTokenWorkerOutput

    kv, vt, req = setup("vtoken", policy=policy)
    free0 = kv.block_pool.get_num_free_blocks()
    vt.begin_step([])
    assert kv.allocate_slots(req, 12) is not None
    vt.end_step(SimpleNamespace(num_scheduled_tokens={"A": 12}))
    req.num_computed_tokens = 12
    # H2O: heavy hitters 1, 4 and 8 (and the recent 10..12) hold one token
    # in each of b0 and b1: holes to compact.
    gain = np.isin(np.arange(12), [1, 4, 8]).astype(np.float32)
    one = np.array([0, 12])
    scores = ScoreStep(req_ids=["A"], indptr=one, key_idx=np.arange(12), gain=gain)
    vt.on_output(VTokenWorkerOutput(scores=scores))
    req.append_output_token_ids(7)
    out = step(kv, vt, req, 1, running=[req], ack=False)
    assert out.moves is not None
    assert vt.pool.num_live("A") == 7  # budget 6 + the step's token
    vt.before_preempting_all([req])
    assert vt.pool.num_live("A") == 6  # evicted to budget, the batch in flight
    vt.check_integrity()
    vt.on_preempt(req)
    kv.free(req)
    req.num_computed_tokens = 0
    vt.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == free0
    dead = vt.pool.dead_idx("A").tolist()
    vt.begin_step([])  # the resume: every token recomputed, the dead stay dead
    assert kv.allocate_slots(req, req.num_tokens) is not None
    vt.end_step(SimpleNamespace(num_scheduled_tokens={"A": req.num_tokens}))
    req.num_computed_tokens = req.num_tokens
    vt.on_output(VTokenWorkerOutput(acked_batches=[out.moves.batch_id]))  # late
    vt.check_integrity()
    assert vt.pool.dead_idx("A").tolist() == dead
    assert vt.pool.num_live("A") == 7  # the 6 and the one never computed
    kv.free(req)
    vt.on_free(req)
    assert kv.block_pool.get_num_free_blocks() == free0


def test_a_prompt_embeds_request_is_served():
    """--enable-prompt-embeds: no prompt token ids (the generator was keyed on
    them, and the engine core died on the request)."""
    kv, vt, req = setup("vtoken", embeds=True)
    step(kv, vt, req, 12, running=[])
    out = step(kv, vt, req, 1, running=[req])
    assert out.dead["A"].tolist() == [1, 2, 3, 4, 5, 6]


def test_kv_written_after_the_first_eviction_is_not_cached():
    """Once tokens are dead, the request's new KV was computed without them: a
    later request hitting it in the prefix cache would read attention that no
    model computed for it (and an opted-out one would no longer match native)."""
    kv, vt, req = setup("naive", caching=True)
    step(kv, vt, req, 12, running=[])
    step(kv, vt, req, 1, running=[req])  # first eviction: tokens 1..6 die
    for _ in range(3):  # tokens 13..15: block 3 (tokens 12..15) fills
        step(kv, vt, req, 1, running=[req])
    blocks = [kv.block_pool.blocks[i] for i in kv.get_block_ids("A")[0]]
    assert len(blocks) == 4
    assert blocks[2].block_hash is not None  # written before the eviction
    assert blocks[3].block_hash is None


def test_caching_stops_at_an_eviction_before_the_first_full_block():
    """A budget below the block size evicts before vLLM has cached a full
    block of the request, so before it keeps a count for it: stopping the
    caching did nothing then, and vLLM went on caching blocks written after
    the eviction, which a new request with that prefix hit (found by
    review). Nothing past the first eviction is cached now."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    kv, vt, a = setup("naive", caching=True, budget=2)
    req = Request(
        "A", [100, 101, 102], SamplingParams(max_tokens=16), None,
        block_hasher=a._block_hasher,
    )  # fmt: skip
    vt._requests["A"] = req
    step(kv, vt, req, 3, running=[])  # the prompt: no full block
    for _ in range(6):  # the first step evicts token 1, of block 0
        step(kv, vt, req, 1, running=[req])
    assert vt.pool.has_dead("A")
    listed = kv.coordinator.single_type_managers[0].req_to_blocks["A"]
    assert len(listed) == 3
    assert not any(b.block_hash is not None for b in listed)
    assert cache_hits(kv, list(req.all_token_ids)) == 0
    vt.check_integrity()


def cache_hits(kv, prompt: list[int]) -> int:
    """Prompt tokens a new request with `prompt` finds in the prefix cache."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    hasher = get_request_block_hasher(B, sha256)
    probe = Request(
        "P", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher
    )
    return kv.get_computed_blocks(probe)[1]


def test_cached_blocks_are_evacuated_and_stay_hittable():
    """Compaction writes no block the prefix cache can serve: the live tokens of
    cached blocks go to a fresh block, and the emptied blocks are freed with
    their hashes, so the next request with the same prompt still hits them."""
    kv, vt, req = setup("vtoken", caching=True)
    free0 = kv.block_pool.get_num_free_blocks()
    step(kv, vt, req, 12, running=[])
    b0, b1, b2 = (kv.block_pool.blocks[i] for i in kv.get_block_ids("A")[0])
    assert cache_hits(kv, list(range(100, 113))) == 12
    # As in test_hand_computed_step, tokens 1..6 die: b0 and b1 keep one live
    # token each (0 and 7), b2 is full. Evacuating both into one fresh block
    # frees one block net; nothing is written into b0, b1 or b2.
    out = step(kv, vt, req, 1, running=[req])
    fresh = kv.block_pool.blocks[int(out.moves.dst_slots[0]) // B]
    assert out.moves.idx.tolist() == [0, 7]
    assert out.moves.dst_slots.tolist() == [fresh.block_id * B, fresh.block_id * B + 1]
    assert kv.get_block_ids("A")[0][:3] == [fresh.block_id, 0, b2.block_id]
    assert all(b.block_hash is not None for b in (b0, b1, b2))
    assert b0.ref_cnt == b1.ref_cnt == 0  # freed, still cached
    assert cache_hits(kv, list(range(100, 113))) == 12
    assert kv.block_pool.get_num_free_blocks() == free0 - 3  # fresh, b2, tail
    s = vt.make_stats([req])
    assert (s.reclaimed_blocks, s.moved_tokens) == (1, 2)
    assert vt.counters.evacuated_blocks == 2 and vt.counters.tight_plans == 0
    # Freed tail first, as vLLM frees a list: the head b0 is reused last.
    assert reused_last(kv, 2) == [b1.block_id, b0.block_id]


def reused_last(kv, n: int) -> list[int]:
    """The last `n` blocks of vLLM's free queue (handed out last)."""
    queue = kv.block_pool.free_block_queue.get_all_free_blocks()
    return [b.block_id for b in queue[-n:]]


@pytest.mark.parametrize("reclaim", ["naive", "vtoken"])
def test_blocks_emptied_together_are_freed_tail_first(reclaim):
    """Blocks emptied in one step go back to vLLM's free queue as vLLM frees
    a request's list, tail first: the queue hands out the first freed first,
    and a cached chain is hit from its head only, so with the head reused
    last the pool can run down to one free block and the prefix still hits
    (head first, the first block taken broke the chain)."""
    kv, vt, req = setup(reclaim, caching=True, knobs={"num_sinks": 0}, budget=2)
    step(kv, vt, req, 12, running=[])
    b0, b1, b2 = kv.get_block_ids("A")[0]
    out = step(kv, vt, req, 1, running=[req])  # 0..9 die: b0 and b1 emptied
    assert out.dead["A"].tolist() == list(range(10))
    assert kv.get_block_ids("A")[0][:3] == [0, 0, b2]
    assert reused_last(kv, 2) == [b1, b0]
    kv.block_pool.get_new_blocks(kv.block_pool.get_num_free_blocks() - 1)
    assert cache_hits(kv, list(range(100, 113))) == B  # b0 left, still cached


def test_a_block_emptied_while_its_copy_is_in_flight_waits_for_the_ack():
    """A batch stays in flight across steps (the GPU's copy stream, PP's batch
    queue). As in test_hand_computed_step, step 2 moves token 0 from b0 into
    b1's holes; before the ack, step 3 evicts 7, b1's own last token. b1 is
    then empty but busy: token 0 lands in it. Every block emptied in that step
    being busy used to crash the step (nothing left to free)."""
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, req = setup("vtoken")
    free0 = kv.block_pool.get_num_free_blocks()
    step(kv, vt, req, 12, running=[])
    b0, b1, _ = kv.get_block_ids("A")[0]
    out = step(kv, vt, req, 1, running=[req], ack=False)
    assert out.moves.idx.tolist() == [0] and out.moves.dst_slots.tolist() == [b1 * B]
    out = step(kv, vt, req, 1, running=[req], ack=False)
    assert out.dead["A"].tolist() == [7] and vt.pool.block_live[b1] == 0
    assert kv.get_block_ids("A")[0][:2] == [b0, b1]  # both held: in flight
    vt.on_output(VTokenWorkerOutput(acked_batches=[0]))  # the copy completes
    vt.check_integrity()
    assert kv.get_block_ids("A")[0][:2] == [0, b1]  # b0 freed, b1 holds token 0
    assert vt.pool.block_live[b1] == 1
    assert kv.block_pool.get_num_free_blocks() == free0 - 3  # b1, b2, tail (12, 13)


def test_no_step_writes_a_block_whose_copy_is_in_flight():
    """On GPU a batch's copy runs on a side stream beside the next forwards,
    which write their tokens' K and V positionally: no slot of those may lie
    in a block the copy reads or writes (found by review: nothing checked
    it). Here b0 -> b1 is checked against its own step's forward (the worker
    submits it before that forward), then stays in flight for four steps as
    the tail block fills and a new one starts; the check (integrity) sees
    each step's slots. A busy tail, the race it guards against, is refused
    by name."""
    kv, vt, req = setup("vtoken", blocks=32)
    step(kv, vt, req, 12, running=[])
    b0, b1, tail = kv.get_block_ids("A")[0]
    seen, check = [], vt.reclaimer.check_step
    vt.reclaimer.check_step = lambda *a: [
        seen.append(vt.reclaimer.busy_blocks().tolist()),
        check(*a),
    ]
    batch = step(kv, vt, req, 1, running=[req], ack=False).moves.batch_id
    assert seen[0] == sorted([b0, b1])  # end_step's, after the plan
    assert vt.reclaimer.busy_blocks().tolist() == sorted([b0, b1])
    for _ in range(4):  # slots 13..16: the tail fills, a fifth block starts
        step(kv, vt, req, 1, running=[req], ack=False)
    assert len(kv.get_block_ids("A")[0]) == 5
    assert vt.reclaimer.busy_blocks().tolist() == sorted([b0, b1])
    vt.reclaimer._busy[kv.get_block_ids("A")[0][-1]] = batch  # the race, forced
    with pytest.raises(AssertionError, match="written this step in blocks a copy"):
        step(kv, vt, req, 1, running=[req], ack=False)


def test_no_destination_of_a_copy_in_flight_is_a_live_slot():
    """The copy's other half: until the ack, the slots it writes are no
    request's live ones (the forwards beside it read those), nor in a block
    a prefix-cache hit reads. Either, forced, is refused by name."""
    kv, vt, req = setup("vtoken", blocks=32)
    step(kv, vt, req, 12, running=[])
    out = step(kv, vt, req, 1, running=[req], ack=False)
    for _ in range(3):
        step(kv, vt, req, 1, running=[req], ack=False)  # checked each step
    # A new request's one slot this step, a prefix-cache hit (0 written),
    # in the destination block: the hit would read what the copy writes.
    one, zero = np.ones(1, np.int64), np.zeros(1, np.int64)
    with pytest.raises(AssertionError, match="prefix-cache hits"):
        vt.reclaimer.check_step(vt._reqs, out.moves.dst_slots[:1], one, zero)
    live = vt.pool.live_slots("A")
    out.moves.dst_slots[0] = live[-1]  # the race, forced
    with pytest.raises(AssertionError, match="live and written by a copy"):
        vt.check_integrity()


def test_a_request_due_while_its_batch_is_in_flight_is_planned_after_the_ack():
    """Planning waits for the request's in-flight batch (its slots switch at
    the ack): each step it would have been planned counts as deferred, and
    its evictions keep counting towards the next plan, which comes once the
    ack has landed and the request has a block's worth of holes (a plan
    with fewer would move nothing: it used to be made anyway, and marked the
    request planned, so the plan with work waited for a block's worth of
    evictions more)."""
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, req = setup("vtoken", blocks=32)
    step(kv, vt, req, 12, running=[])
    first = step(kv, vt, req, 1, running=[req], ack=False).moves
    assert first is not None and first.batch_id == 0
    since = lambda: int(vt.pool.dead_since_mark_rows(vt.pool.rows(["A"]))[0])  # noqa: E731
    for _ in range(8):  # a block's worth of evictions (and more) since
        assert step(kv, vt, req, 1, running=[req], ack=False).moves is None
    assert vt.counters.deferred_plans == 5 and since() == 8  # due from the 4th
    vt.on_output(VTokenWorkerOutput(acked_batches=[0]))
    vt.check_integrity()
    # The ack freed b0 and this step's eviction empties another block: 15
    # dead less 3 freed blocks leave 3 holes at most, short of a block.
    assert step(kv, vt, req, 1, running=[req], ack=False).moves is None
    assert vt.counters.deferred_plans == 5 and since() == 9  # not planned
    assert vt.pool.num_nulls_rows(vt.pool.rows(["A"])).tolist() == [3]
    # One more death makes 4 holes: planned at once.
    second = step(kv, vt, req, 1, running=[req], ack=False).moves
    assert second is not None and second.batch_id == 1
    assert vt.counters.deferred_plans == 5 and since() == 0


@pytest.mark.parametrize("caching", [True, False])
def test_a_destination_whose_moved_tokens_died_in_flight_is_freed_at_the_ack(
    caching,
):
    """Random evictions while a batch stays in flight for six steps: in some
    runs every token moved into a destination dies before the copy is acked
    (in a fresh block, when evacuating cached blocks). At the ack such a block
    is freed, as it would have been had it not been busy; it used to stay
    held, empty, until the request ended."""
    from vllm.vtoken.messages import VTokenWorkerOutput

    emptied = 0
    for seed in range(40):
        kv, vt, req = setup("vtoken", caching, policy="random", knobs={"seed": seed})
        step(kv, vt, req, 12, running=[])
        out = step(kv, vt, req, 1, running=[req], ack=False)  # the plan
        if out is None or out.moves is None:
            continue
        dst = np.unique(out.moves.dst_slots // B)
        for _ in range(6):
            step(kv, vt, req, 1, running=[req], ack=False)
        emptied += bool((vt.pool.block_live[dst] == 0).any())
        vt.on_output(VTokenWorkerOutput(acked_batches=[out.moves.batch_id]))
        vt.check_integrity()
        held = np.asarray(kv.get_block_ids("A")[0][:-1])  # all but the tail
        held = held[held != 0]
        assert (vt.pool.block_live[held] > 0).all(), (seed, held.tolist())
        assert kv.block_pool.get_num_free_blocks() == 15 - held.size - 1, seed
    assert emptied > 0  # the case arose


@pytest.mark.parametrize("how", ["preempt", "finish"])
def test_an_evacuation_dropped_in_flight_is_undone(how):
    """Dropped before its copies are acked: the evacuation is undone. b0 (the
    chain's head, evacuated into the fresh block F) goes back in its place, so
    vLLM frees it with the list, in its order: last, reused last, and still a
    prefix-cache hit. F, whose copy never counted, is freed first."""
    kv, vt, req = setup("vtoken", caching=True)
    free0 = kv.block_pool.get_num_free_blocks()
    step(kv, vt, req, 12, running=[])
    b0, b1, b2 = kv.get_block_ids("A")[0]
    out = step(kv, vt, req, 1, running=[req], ack=False)
    fresh = int(out.moves.dst_slots[0]) // B
    assert kv.get_block_ids("A")[0][:3] == [fresh, b1, b2]  # b0 detached
    vt.check_integrity()  # the detached source counts as held
    vt.on_preempt(req) if how == "preempt" else vt.on_free(req)
    assert kv.get_block_ids("A")[0][:3] == [b0, b1, b2]
    vt.check_integrity()
    kv.free(req)
    assert kv.block_pool.get_num_free_blocks() == free0
    queue = [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]
    assert queue[-3:] == [b2, b1, b0]  # vLLM's order: the list's tail first
    assert queue.index(fresh) < queue.index(b2)
    assert cache_hits(kv, list(range(100, 113))) == 12


def test_a_tight_pool_writes_cached_blocks():
    """No fresh block to spare: memory comes first, cached blocks take moves,
    and a destination's content changes, so its hash must go; the emptied
    source keeps its KV intact, so it stays a valid cache entry."""
    # 5 usable blocks: after the next step's tail, one is free, and it is
    # kept for the next step's tokens.
    kv, vt, req = setup("vtoken", caching=True, blocks=6)
    step(kv, vt, req, 12, running=[])
    b0, b1, b2 = (kv.block_pool.blocks[i] for i in kv.get_block_ids("A")[0])
    out = step(kv, vt, req, 1, running=[req])  # as in test_hand_computed_step
    assert vt.counters.tight_plans == 1
    assert out.moves.dst_slots.tolist() == [b1.block_id * B]
    assert b1.block_hash is None  # destination: out of the cache
    assert b0.block_hash is not None and b0.ref_cnt == 0  # freed, still cached
    assert b2.block_hash is not None  # untouched
    # The hash chain ends at b1: the probe finds b0 only.
    assert cache_hits(kv, list(range(100, 113))) == 4


def hold_blocks(kv, n: int):
    """A request vToken does not see (another one's) holding n blocks."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    hasher = get_request_block_hasher(B, sha256)
    prompt = list(range(500, 500 + n * B))
    other = Request(
        "Z", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher
    )
    assert kv.allocate_slots(other, n * B) is not None
    return other


def test_a_tight_pool_still_evacuates_when_no_fresh_block_is_needed():
    """The pool's spare blocks bound only plans that take fresh ones. After
    the evacuation of step 2 and three more deaths, token 0 sits alone in the
    fresh block F (three holes), 10 and 11 in cached b2; once 10 dies, the
    evacuation of b2 into F's holes takes nothing from the pool, so it runs
    with the pool empty too, and b2 stays in the cache."""
    kv, vt, req = setup("vtoken", caching=True, blocks=8)
    step(kv, vt, req, 12, running=[])
    b2 = kv.block_pool.blocks[kv.get_block_ids("A")[0][2]]
    for _ in range(4):  # step 2 evacuates b0, b1 into F; then 7, 8, 9 die
        step(kv, vt, req, 1, running=[req])
    fresh_id = kv.get_block_ids("A")[0][0]
    assert vt.pool.block_live[[fresh_id, b2.block_id]].tolist() == [1, 2]
    # Another request holds the pool but for this step's new tail block.
    other = hold_blocks(kv, kv.block_pool.get_num_free_blocks() - 1)
    out = step(kv, vt, req, 1, running=[req])  # 10 dies: a block's worth
    assert out.moves.idx.tolist() == [11]
    assert out.moves.dst_slots.tolist() == [fresh_id * B + 1]
    assert vt.counters.tight_plans == 0 and vt.counters.evacuated_blocks == 3
    assert b2.block_hash is not None and b2.ref_cnt == 0  # freed, still cached
    assert kv.block_pool.get_num_free_blocks() == 1  # b2
    kv.free(other)


def test_a_tight_pool_takes_the_plan_in_place_when_it_frees_more():
    """Budget 8 and threshold 0.5: tokens 1..4 die, b0 keeps token 0 (a
    candidate), b1 tokens 5..7 (not one). Around the cache, b0 would need a
    fresh block and free none net: no plan. With no block to spare memory
    comes first: in place, token 0 goes into b1's hole and b0 is freed."""
    kv, vt, req = setup("vtoken", caching=True, blocks=8, budget=8, threshold=0.5)
    step(kv, vt, req, 12, running=[])
    b0, b1, _ = kv.get_block_ids("A")[0]
    other = hold_blocks(kv, kv.block_pool.get_num_free_blocks() - 1)
    out = step(kv, vt, req, 1, running=[req])
    assert out.dead["A"].tolist() == [1, 2, 3, 4]
    assert out.moves.idx.tolist() == [0] and out.moves.dst_slots.tolist() == [b1 * B]
    assert vt.counters.tight_plans == 1
    assert kv.get_block_ids("A")[0][:2] == [0, b1]  # b0 freed
    kv.free(other)


def test_blocks_emptied_mid_list_are_freed_in_place_also_after_a_resume():
    """Naive-evict finds an emptied block in the request's list through the
    reclaimer's mirror of the lists (BlockIndex), which follows vLLM's
    appends and the new list of a resumed request (the deep checks compare
    it with the list at every use)."""
    kv, vt, req = setup("naive")
    step(kv, vt, req, 12, running=[])
    b0 = kv.get_block_ids("A")[0][0]
    for _ in range(6):  # StreamingLLM keeps token 0 and the newest: 7..11 die
        step(kv, vt, req, 1, running=[req])
    ids = kv.get_block_ids("A")[0]  # tokens 4-7 (b1) and 8-11 (b2) all dead
    assert len(ids) == 5 and ids[:3] == [b0, 0, 0] and 0 not in ids[3:]
    assert kv.block_pool.get_num_free_blocks() == 15 - 3
    vt.on_preempt(req)
    kv.free(req)
    req.num_computed_tokens = 0
    step(kv, vt, req, req.num_tokens, running=[])  # 19 tokens, 5 new blocks
    assert not vt._plan_due  # the recomputed dead make no plan without compaction
    for _ in range(7):  # recomputed dead 4-11 freed at once, 12-15 and 16-19 later
        step(kv, vt, req, 1, running=[req])
    ids = kv.get_block_ids("A")[0]
    assert [i for i, b in enumerate(ids) if b == 0] == [1, 2, 3, 4]
    vt.on_free(req)
    kv.free(req)
    assert kv.block_pool.get_num_free_blocks() == 15


def test_a_plan_whose_sources_hold_no_live_token_frees_them_without_moves():
    """A source block whose tokens all died after planning needs no move: it
    is freed at once, and a plan of only such sources is no batch (this
    crashed the batch binder on an empty move list, found by test_hostile)."""
    from vllm.vtoken.planner import BlockPlan

    kv, vt, req = setup("vtoken")
    step(kv, vt, req, 12, [])  # prompt: 3 blocks, none dead
    blocks = vt.reclaimer.positional("A")
    src = blocks[1].block_id
    vt.pool.evict("A", np.arange(4, 8))  # block 1's tokens die, unfreed
    free = kv.block_pool.get_num_free_blocks()
    plan = BlockPlan(
        req_index=np.array([0]),
        src_indptr=np.array([0, 1]),
        src_block_ids=np.array([src], np.int32),
        dst_indptr=np.array([0, 1]),
        dst_block_ids=np.array([blocks[0].block_id], np.int32),
        num_fresh=np.array([0]),
    )
    entry_of = {blocks[0].block_id: 0, src: 1}
    hashed = [b for b in entry_of if kv.block_pool.blocks[b].block_hash is not None]
    cached_ids = np.array(hashed, np.int64)  # what the plan reads
    assert (
        vt.reclaimer._bind(
            plan, [vt._reqs["A"]], ["A"], vt.pool.rows(["A"]), entry_of, cached_ids
        )
        is None
    )
    assert vt.reclaimer.positional("A")[1].is_null
    assert kv.block_pool.get_num_free_blocks() == free + 1
    vt.check_integrity()


@pytest.mark.parametrize("check", [True, False])
def test_no_eviction_while_the_requests_last_step_is_in_flight(check, monkeypatch):
    """Under PP vLLM schedules the next batch before the last one's output
    arrives: a request whose step is in flight (every known token computed)
    waits for that step's scores before its policy runs. It evicted with
    stale (here: no) scores, and PP=2 evicted other tokens than one rank.
    Without the deep checks, the tokens are read only with a batch in flight."""
    from vllm.vtoken import integrity
    from vllm.vtoken.messages import VTokenWorkerOutput

    monkeypatch.setattr(integrity, "CHECK", check)
    kv, vt, req = setup("vtoken")
    vt.begin_step([])
    assert kv.allocate_slots(req, 12) is not None
    vt.end_step(SimpleNamespace(num_scheduled_tokens={"A": 12}))
    req.num_computed_tokens += 12
    vt.begin_step([req])  # the prefill's output has not arrived
    assert vt.make_stats([req]).evicted_tokens == 0
    vt.on_output(VTokenWorkerOutput())
    req.append_output_token_ids(7)
    vt.begin_step([req])  # now it has: 12 live > budget 6
    assert vt.make_stats([req]).evicted_tokens == 6
    vt.check_integrity()


def test_gains_of_a_batch_in_flight_when_its_request_was_preempted_are_dropped():
    """PP's batch queue: a request is preempted (its scores restart) while a
    batch that read it is in flight; that batch's gains predate the restart.
    They were folded back in; a later batch's are folded as usual."""
    from vllm.vtoken.messages import ScoreStep, VTokenWorkerOutput

    kv, vt, req = setup("vtoken", policy="h2o")
    idx = np.arange(12)

    def gains(value: float) -> VTokenWorkerOutput:
        step = ScoreStep(
            req_ids=["A"],
            indptr=np.array([0, 12]),
            key_idx=idx,
            gain=np.full(12, value, np.float32),
        )
        return VTokenWorkerOutput(scores=step)

    vt.begin_step([])
    assert kv.allocate_slots(req, 12) is not None
    vt.end_step(SimpleNamespace(num_scheduled_tokens={"A": 12}))  # batch 1
    vt.on_preempt(req)  # while batch 1 is in flight
    kv.free(req)
    vt.end_step(SimpleNamespace(num_scheduled_tokens={}))  # batch 2
    vt.on_output(gains(0.5))  # batch 1's: stale
    assert not vt.scores.scores("A", idx).any()
    vt.on_output(gains(0.25))  # batch 2's
    np.testing.assert_allclose(vt.scores.scores("A", idx), 0.25)


@pytest.mark.parametrize("chunks", [(5, 5, 4), (13, 1), (14,)])
def test_a_chunked_recompute_scores_persistence_as_one_step(chunks):
    """Scissorhands after a preemption: the resume recomputes in chunks (a
    chunk ending at the last computed token among them; one step for
    reference), each read for its scores. Its ages count the resume as one
    step (the last chunk's, which brings the one new token), so its scores
    must see one fold too: the chunks before it are skipped. Folding them read
    the first chunk's tokens as important once per chunk in one step of age."""
    from vllm.vtoken.messages import ScoreStep, VTokenWorkerOutput

    knobs = {"history_window": 4}
    kv, vt, req = setup("vtoken", policy="scissorhands", budget=64, knobs=knobs)
    step(kv, vt, req, 12, running=[])
    step(kv, vt, req, 1, running=[req])
    vt.on_preempt(req)
    kv.free(req)
    req.num_computed_tokens = 0
    total = req.num_tokens  # 14: 13 computed before, 1 sampled
    assert sum(chunks) == total
    for chunk in chunks:
        vt.begin_step([])
        assert kv.allocate_slots(req, chunk) is not None
        vt.end_step(SimpleNamespace(num_scheduled_tokens={"A": chunk}))
        req.num_computed_tokens += chunk
        n = req.num_computed_tokens  # keys read: every token up to the chunk's end
        gains = ScoreStep(
            req_ids=["A"],
            indptr=np.array([0, n]),
            key_idx=np.arange(n),
            gain=np.ones(n, np.float32),
        )
        vt.on_output(VTokenWorkerOutput(scores=gains))
        vt.check_integrity()
    np.testing.assert_allclose(vt.scores.scores("A", np.arange(total)), 1 / 4)


@pytest.mark.parametrize(
    "policy, knobs",
    [
        ("scissorhands", {"history_window": 4}),
        ("snapkv", {"window": 2, "kernel_size": 1}),
        ("h2o", {}),
        ("streamingllm", {"num_sinks": 1}),
    ],
)
def test_a_resume_recomputed_in_chunks_is_evicted_once_it_is_whole(policy, knobs):
    """Over budget and preempted, a request resumes in two chunks, the first
    past its prompt. Between them it is running but not whole again: nothing
    is evicted (its scores cover the first chunk; Scissorhands' ages are all
    0 then, and its key divided by zero, ending the engine core). Once the
    recompute is in, the next step evicts it back to its budget."""
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, req = setup("vtoken", policy=policy, budget=8, knobs=knobs, blocks=32)
    step(kv, vt, req, 12, running=[])
    for _ in range(5):
        step(kv, vt, req, 1, running=[req])
    assert vt.pool.num_live("A") == 9  # the budget, and the newest token
    vt.on_preempt(req)
    kv.free(req)
    req.num_computed_tokens = 0
    total = req.num_tokens  # 18: 17 computed before, 1 sampled
    for chunk, running in ((12, []), (total - 12, [req])):
        vt.begin_step(running)
        assert not vt._step_dead  # not between the chunks
        assert kv.allocate_slots(req, chunk) is not None
        vt.end_step(SimpleNamespace(num_scheduled_tokens={"A": chunk}))
        req.num_computed_tokens += chunk
        vt.on_output(VTokenWorkerOutput())
        vt.check_integrity()
    req.append_output_token_ids(7)
    step(kv, vt, req, 1, running=[req])  # whole: evicted as before
    assert vt.counters.evicted_tokens == 9 + 1
    assert vt.pool.num_live("A") == 9


def test_scores_of_a_request_that_finished_with_its_step_in_flight_stay_gone():
    """A request aborted after its step was scheduled, before that step's
    output: the output's gains for it are not folded (they would make it a
    score row again, and leak into a request later given the same row)."""
    from vllm.vtoken.messages import ScoreStep, VTokenWorkerOutput

    kv, vt, req = setup("vtoken", policy="h2o")
    vt.begin_step([])
    assert kv.allocate_slots(req, 12) is not None
    vt.end_step(SimpleNamespace(num_scheduled_tokens={"A": 12}))
    vt.on_free(req)  # aborted while the step is in flight
    kv.free(req)
    gains = ScoreStep(
        req_ids=["A"],
        indptr=np.array([0, 12]),
        key_idx=np.arange(12),
        gain=np.ones(12, np.float32),
    )
    vt.on_output(VTokenWorkerOutput(scores=gains))
    assert "A" not in vt.scores._acc.index
    assert not vt.scores.scores("A", np.arange(12)).any()


@pytest.mark.parametrize("check", [True, False])
def test_a_prefix_cache_hit_is_slotted_where_vllm_wrote_it(check, monkeypatch):
    """A new request whose prompt hits the prefix cache: its hit tokens are
    computed but not slotted yet, so its first step slots them from vLLM's
    computed-token count (not from its slotted ones, which are none)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request
    from vllm.vtoken import integrity

    monkeypatch.setattr(integrity, "CHECK", check)
    kv, vt, req = setup("vtoken", caching=True, budget=32)
    step(kv, vt, req, 12, running=[])  # A's 12 prompt tokens: 3 blocks cached
    hasher = get_request_block_hasher(B, sha256)
    other = Request(
        "B", list(range(100, 114)), SamplingParams(max_tokens=4), None,
        block_hasher=hasher,
    )  # fmt: skip
    vt._requests["B"] = other
    blocks, hits = kv.get_computed_blocks(other)
    assert hits == 12
    vt.begin_step([req])
    assert kv.allocate_slots(other, 2, hits, blocks) is not None
    other.num_computed_tokens = hits
    vt.end_step(SimpleNamespace(num_scheduled_tokens={"B": 2}))
    ids = kv.get_block_ids("B")[0]
    want = [ids[i // B] * B + i % B for i in range(14)]
    assert vt.pool.slots("B").tolist() == want
    assert ids[:3] == kv.get_block_ids("A")[0][:3]  # the shared prefix
    vt.check_integrity()


@pytest.mark.parametrize("reclaim", ["naive", "vtoken"])
@pytest.mark.parametrize("b_budget", [6, 8])
def test_a_shared_block_no_holder_has_a_live_token_in_is_freed(reclaim, b_budget):
    """B hits A's three prompt blocks (as n > 1 siblings, or a common system
    prompt, do). Once neither has a live token in b1, b1 leaves both lists
    and the pool gets it back, once, still cached: it stayed held by both,
    as a block another request holds was never freed (found by review).
    With B's budget 6 both lose b1's last tokens in one step; with 8, A
    loses its own two steps before B, whose eviction finds A's list."""
    kv, vt, a, b, both = sharing(reclaim, a_budget=6, b_budget=b_budget)
    # A's prompt blocks, B's first three (A loses tokens 1..6 as B hits them).
    b0, b1, b2 = (kv.block_pool.blocks[i] for i in kv.get_block_ids("B")[0][:3])
    assert b1.ref_cnt == 2
    free = kv.block_pool.get_num_free_blocks()
    steps = 0
    while b1.ref_cnt and steps < 6:
        both([a, b])
        steps += 1
    assert steps == (1 if b_budget == 6 else 3)
    assert b1.block_id not in kv.get_block_ids("A")[0] + kv.get_block_ids("B")[0]
    assert b1.ref_cnt == 0 and b1.block_hash is not None  # freed, still cached
    queue = kv.block_pool.free_block_queue.get_all_free_blocks()
    assert [x.block_id for x in queue].count(b1.block_id) == 1
    assert cache_hits(kv, list(range(100, 113))) == 12
    if reclaim == "naive":  # vtoken's compaction frees and takes blocks too
        assert kv.block_pool.get_num_free_blocks() >= free + 1 - 2 * steps


def sharing(reclaim, a_budget=14, b_budget=6):
    """A (the engine's budget) and B (its own), B's prompt hitting A's three
    prompt blocks b0..b2 (A's prompt run, B's first step taken); and a step
    of both (`both(running)`, copies acknowledged at once unless `ack`)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, a = setup(reclaim, caching=True, blocks=32, budget=a_budget)
    b = Request(
        "B", list(range(100, 113)),
        SamplingParams(max_tokens=64, extra_args={"kv_budget_tokens": b_budget}),
        None, block_hasher=a._block_hasher,
    )  # fmt: skip
    vt._requests["B"] = b
    step(kv, vt, a, 12, running=[])

    def both(running, hits=(), ack=True):
        vt.begin_step(running)
        assert kv.allocate_slots(a, 1) is not None
        assert kv.allocate_slots(b, 1, *hits) is not None
        if hits:
            b.num_computed_tokens = hits[0]
        out = vt.end_step(SimpleNamespace(num_scheduled_tokens={"A": 1, "B": 1}))
        for r in (a, b):
            r.num_computed_tokens += 1
            r.append_output_token_ids(7)
        acked = [out.moves.batch_id] if ack and out is not None and out.moves else []
        vt.on_output(VTokenWorkerOutput(acked_batches=acked))
        vt.check_integrity()
        return out

    blocks, hits = kv.get_computed_blocks(b)
    assert hits == 12
    both([a], hits=(hits, blocks))
    return kv, vt, a, b, both


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("reclaim", ["naive", "vtoken"])
def test_a_holder_emptying_a_block_of_its_own_in_that_step_is_counted_once(
    reclaim, check, monkeypatch
):
    """A kills b1's last live token in the step B empties a block of its own:
    b1's holders search found B's list, and B was added to the step's batch a
    second time, so its null count (added per row) missed one: an assertion
    with the checks on, a miscount (the planner's due list) without (found by
    review). Now a holder already in the batch keeps its place."""
    from vllm.vtoken import integrity

    monkeypatch.setattr(integrity, "CHECK", check)
    kv, vt, a, b, both = sharing(reclaim)
    b1 = kv.block_pool.blocks[kv.get_block_ids("A")[0][1]]
    for _ in range(9):  # at the 9th, A's token 7 (b1's last) dies while
        both([a, b])  # B's own tokens 12..15 do
    assert b1.ref_cnt == 0
    vt.reclaimer.check_nulls(["A", "B"])
    vt.check_integrity()


def test_a_source_a_hit_took_in_flight_is_freed_once_its_tokens_are_dead():
    """A's compaction moves b1's live tokens out while B hits b1 (the copy in
    flight), and B evicts its own tokens there before the acknowledgement:
    b1 had live tokens (A's) until the switch, so no death freed it, and
    after it B held b1 with no live token until it finished (found by
    review). Now the acknowledgement frees it from B's list too."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, a = setup("vtoken", caching=True, blocks=64)
    g = Request(
        "G", list(range(100, 113)),
        SamplingParams(max_tokens=64, extra_args={"kv_budget_tokens": 4}),
        None, block_hasher=a._block_hasher,
    )  # fmt: skip
    vt._requests["G"] = g

    def run(running, sched, hits=None, ack=()):
        vt.begin_step(running)
        for r, n in sched:
            if r is g and hits is not None:
                assert kv.allocate_slots(g, n, *hits) is not None
                g.num_computed_tokens = hits[0]
            else:
                assert kv.allocate_slots(r, n) is not None
        scheduled = {r.request_id: n for r, n in sched}
        out = vt.end_step(SimpleNamespace(num_scheduled_tokens=scheduled))
        for r, n in sched:
            r.num_computed_tokens += n
            r.append_output_token_ids(7)
        vt.on_output(VTokenWorkerOutput(acked_batches=list(ack)))
        vt.check_integrity()
        return out

    run([], [(a, 12)])
    b1 = kv.block_pool.blocks[kv.get_block_ids("A")[0][1]]
    out = run([a], [(a, 1)])  # A's 1..6 die: b0, b1 evacuated, in flight
    assert out.moves is not None and vt.reclaimer._busy[b1.block_id] >= 0
    blocks, hits = kv.get_computed_blocks(g)
    assert hits == 12
    run([a], [(a, 1), (g, 1)], hits=(hits, blocks))
    assert b1.ref_cnt == 2
    run([a, g], [(a, 1), (g, 1)], ack=[out.moves.batch_id])  # G's b1 dies
    assert vt.pool.block_live[b1.block_id] == 0
    assert b1.block_id not in kv.get_block_ids("G")[0]
    assert b1.ref_cnt == 0 and b1.block_hash is not None  # back, still cached
    vt.reclaimer.check_nulls(["A", "G"])


@pytest.mark.parametrize("leaves", ["finished", "preempted"])
@pytest.mark.parametrize("reclaim", ["naive", "vtoken"])
def test_a_shared_block_its_last_live_holder_leaves_is_freed(reclaim, leaves):
    """B's tokens in b1 (a prefix-cache hit on A's prompt) die first; when A,
    which still has live tokens there, finishes or is preempted, B keeps b1
    with no live token, and no death comes to free it: it stayed held until
    B finished. Now A's leaving frees it from B's list, back to the pool
    once, still cached."""
    kv, vt, a, b, both = sharing(reclaim, a_budget=24)
    b1 = kv.block_pool.blocks[kv.get_block_ids("A")[0][1]]
    for _ in range(2):
        both([a, b])
    assert not set(vt.pool.live_idx("B").tolist()) & {4, 5, 6, 7}  # b1's: dead
    assert {4, 5, 6, 7} <= set(vt.pool.live_idx("A").tolist()) and b1.ref_cnt == 2
    reclaimed = vt.counters.reclaimed_blocks
    if leaves == "finished":
        vt.on_free(a)
    else:
        vt.on_preempt(a)
    kv.free(a)
    assert b1.block_id not in kv.get_block_ids("B")[0]
    assert vt.counters.reclaimed_blocks == reclaimed + 1  # b1, with A's list
    assert b1.ref_cnt == 0 and b1.block_hash is not None
    queue = kv.block_pool.free_block_queue.get_all_free_blocks()
    assert [x.block_id for x in queue].count(b1.block_id) == 1
    vt.reclaimer.check_nulls(["B"])
    vt.check_integrity()


@pytest.mark.parametrize("leaves", ["finished", "preempted"])
def test_an_evacuation_undone_before_its_acknowledgement_is_not_counted(leaves):
    """evacuated_blocks counts cached blocks emptied; an evacuation dropped
    with its request before the acknowledgement puts its sources back, and
    stayed counted (found by review)."""
    kv, vt, req = setup("vtoken", caching=True)
    step(kv, vt, req, 12, running=[])
    out = step(kv, vt, req, 1, running=[req], ack=False)
    assert out.moves is not None and vt.counters.evacuated_blocks == 2
    vt.on_free(req) if leaves == "finished" else vt.on_preempt(req)
    kv.free(req)
    assert (vt.counters.moved_tokens, vt.counters.evacuated_blocks) == (0, 0)


def test_reclaimed_blocks_counts_the_blocks_back_in_the_pool():
    """A block freed while another request holds it (an evacuated source
    the prefix cache handed out meanwhile) is not back in the pool: it
    counted as reclaimed all the same (found by review)."""
    kv, vt, req = setup("naive", caching=True)
    step(kv, vt, req, 12, running=[])
    b0, b1 = (kv.block_pool.blocks[i] for i in kv.get_block_ids("A")[0][:2])
    kv.block_pool.touch([b0])  # a second holder
    before = vt.counters.reclaimed_blocks
    vt.reclaimer._free([b1, b0])
    assert (b0.ref_cnt, b1.ref_cnt) == (1, 0)
    assert vt.counters.reclaimed_blocks == before + 1


def test_stats_counters_never_go_back_and_catch_up_after_a_dip():
    """reclaimed_blocks is a net count: an acknowledged evacuation takes its
    fresh blocks off, and a displaced source a prefix-cache hit took in
    flight does not come back then. Its stats delta went negative, which
    prometheus_client's Counter.inc refuses, ending the front end's output
    handler (found by review). The dip reads as 0 and later growth pays it
    back before it counts."""
    kv, vt, req = setup("naive")
    step(kv, vt, req, 12, running=[])
    vt.counters.reclaimed_blocks += 5
    vt.counters.evicted_tokens += 3
    assert vt.make_stats([req]).reclaimed_blocks == 5
    vt.counters.reclaimed_blocks -= 2  # the dip
    s = vt.make_stats([req])
    assert (s.reclaimed_blocks, s.evicted_tokens) == (0, 0)
    vt.counters.reclaimed_blocks += 3  # 1 past the reported 5
    vt.counters.evicted_tokens += 4
    s = vt.make_stats([req])
    assert (s.reclaimed_blocks, s.evicted_tokens) == (1, 4)


def test_a_block_emptied_of_tokens_moved_into_it_is_freed_where_it_is():
    """The emptied-block search names the entry a dead token was written at;
    after compaction moved token 0 into b1 (entry 1), that entry holds the
    null block, so the freeing finds b1 through the index instead."""
    import numpy as np

    kv, vt, req = setup("vtoken")
    step(kv, vt, req, 12, running=[])
    b0, b1, b2 = kv.get_block_ids("A")[0]
    step(kv, vt, req, 1, running=[req])  # as test_hand_computed_step: 0 -> b1
    assert vt.pool.slots("A")[0] == b1 * B and kv.get_block_ids("A")[0][0] == 0
    free = kv.block_pool.get_num_free_blocks()
    dead = vt.pool.evict("A", np.array([0, 7]))  # b1's two live tokens
    vt.reclaimer.free_empty_blocks(["A"], np.zeros(2, np.int64), dead)
    assert kv.get_block_ids("A")[0][:3] == [0, 0, b2]
    assert kv.block_pool.get_num_free_blocks() == free + 1
    assert vt.pool.num_nulls_rows(vt.pool.rows(["A"])).tolist() == [2]
    vt.check_integrity()


def test_a_request_resumed_with_dead_tokens_is_planned_once_slotted_on_both_sides():
    """A resumed request recomputing a block's worth of dead tokens is due at
    once (its cached prompt blocks hold them), but its worker resets its row
    at the step's start, before the batch's copy lands, and would skip the
    switch: its tokens would stay in the sources the ack frees. So it is
    planned the step after, and both sides keep the same live slots, none
    in a freed block."""
    from tests.runtime.test_messages import cpu_worker
    from vllm.vtoken import integrity
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, req = setup("vtoken", caching=True)
    # On the scheduler's config, as in one process: on_output compares the
    # two sides' tables (integrity.check_worker).
    worker, _ = cpu_worker(num_blocks=16, block_size=B, vtoken_config=vt.cfg)
    assert integrity.worker_pool(vt.cfg) is worker.pool

    def engine_step(count, running, resumed=(), hits=None):
        """One step as the engine runs it: the scheduler's hooks, the CPU
        worker's on the message (the block table vLLM sends), the output."""
        vt.begin_step(running)
        computed = req.num_computed_tokens
        assert kv.allocate_slots(req, count, *hits or ()) is not None
        out = vt.end_step(SimpleNamespace(num_scheduled_tokens={"A": count}))
        ids = list(kv.get_block_ids("A")[0])
        worker.begin_step(
            SimpleNamespace(
                finished_req_ids=set(),
                preempted_req_ids=set(),
                scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)),
                vtoken=out,
            )
        )
        pos = np.arange(computed, computed + count)
        slots = (np.asarray(ids)[pos // B] * B + pos % B).astype(np.int64)
        batch = SimpleNamespace(
            num_reqs=1,
            req_ids=["A"],
            block_table=[SimpleNamespace(slot_mapping=SimpleNamespace(np=slots))],
            num_computed_tokens_cpu=np.array([computed], np.int32),
            num_tokens_no_spec=np.array([req.num_tokens], np.int32),
        )
        reqs = {
            "A": SimpleNamespace(
                sampling_params=SimpleNamespace(extra_args=None), block_ids=[ids]
            )
        }
        worker.prepare_attention(batch, reqs, np.array([count], np.int32))
        acked = worker.end_step().acked_batches
        req.num_computed_tokens += count
        vt.on_output(VTokenWorkerOutput(acked_batches=acked))
        req.append_output_token_ids(7)
        got = worker.pool.live_slots("A").tolist()
        assert got == vt.pool.live_slots("A").tolist()
        assert all(kv.block_pool.blocks[s // B].ref_cnt > 0 for s in got)
        return out

    engine_step(12, running=[])  # the prefill: b0 b1 b2 cached
    out = engine_step(1, running=[req])  # 1..6 die, b0 and b1 evacuated
    assert out.moves is not None
    preempt(kv, vt, req)  # vLLM frees every block; the resume hits the prompt
    blocks, hits = kv.get_computed_blocks(req)
    assert hits > 0
    req.num_computed_tokens = hits
    new = req.num_tokens - hits
    out = engine_step(new, running=[], resumed={"A"}, hits=(hits, blocks))
    assert out is None or out.moves is None  # due, not planned yet
    out = engine_step(1, running=[req])  # the next step plans it
    assert out.moves is not None and out.moves.req_ids == ["A"]


def resume(kv, vt, req, count=None):
    """vLLM's resume of a preempted request: its prefix-cache hits, then
    allocate_slots (which caches the full blocks) and the patched waiting
    loop's `on_allocated`. Returns the hit tokens."""
    blocks, hits = kv.get_computed_blocks(req)
    count = req.num_tokens - hits if count is None else count
    assert kv.allocate_slots(req, count, hits, blocks) is not None
    vt.on_allocated(req, hits)
    req.num_computed_tokens = hits
    return hits


def preempt(kv, vt, req):
    vt.on_preempt(req)
    kv.free(req)
    req.num_computed_tokens = 0


def test_the_gauges_of_a_resume_recomputing_in_chunks_count_its_slotted_tokens():
    """Liveness outlives a preemption; the first chunk of the resume slots 4
    of its 21 tokens, in 1 block. The gauges counted every live token
    against that block: utilization 1.75, waste -0.75 (found by review)."""
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, req = setup("naive", budget=6, blocks=32)
    step(kv, vt, req, 12, running=[])
    for _ in range(8):
        step(kv, vt, req, 1, running=[req])
    preempt(kv, vt, req)
    vt.begin_step([])
    resume(kv, vt, req, count=4)  # tokens 0-3: StreamingLLM kept 0 (a sink)
    vt.end_step(SimpleNamespace(num_scheduled_tokens={"A": 4}))
    req.num_computed_tokens += 4
    vt.on_output(VTokenWorkerOutput())
    s = vt.make_stats([req])
    assert (s.retained_blocks, s.live_tokens) == (1, 1)
    assert s.token_utilization == pytest.approx(1 / 4)
    assert s.intra_block_waste == pytest.approx(3 / 4)


def test_a_resume_caches_none_of_what_it_recomputes_past_a_dead_token():
    """A resume's recompute attends live tokens only, so the blocks
    allocate_slots caches from the first dead token's block on hold KV no
    model computed for their prefix: they leave the cache before another
    request can hit them. Its hits on its own cached prompt (native KV)
    stay cached; nothing later is cached."""
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, req = setup("naive", caching=True, budget=8, blocks=32)
    step(kv, vt, req, 12, running=[])  # the prompt: blocks 0..2 cached
    for _ in range(8):  # decodes with evictions
        step(kv, vt, req, 1, running=[req])
    first = int(vt.pool.dead_idx("A")[0])
    preempt(kv, vt, req)
    vt.begin_step([])
    hits = resume(kv, vt, req)
    assert hits > 0  # its own prompt
    new = req.num_tokens - hits
    vt.end_step(SimpleNamespace(num_scheduled_tokens={"A": new}))
    req.num_computed_tokens += new
    vt.on_output(VTokenWorkerOutput())
    vt.check_integrity()
    listed = kv.coordinator.single_type_managers[0].req_to_blocks["A"]
    cached = [e for e, b in enumerate(listed) if b.block_hash is not None]
    assert cached == list(range(hits // B))  # its hits, none recomputed
    assert hits // B > first // B  # (some hit holds a dead token: kept)
    assert cache_hits(kv, list(req.all_token_ids)) == hits


def test_a_resume_without_prefix_caching_leaves_vllm_s_counts_alone():
    """Prefix caching off: vLLM keeps no cached-block count for a request,
    and the resume's hook makes none (a count marks a running request)."""
    kv, vt, req = setup("naive", caching=False)
    step(kv, vt, req, 12, running=[])
    step(kv, vt, req, 1, running=[req])  # tokens 1..6 die
    assert "A" not in kv.coordinator.single_type_managers[0].num_cached_block
    preempt(kv, vt, req)
    vt.begin_step([])
    assert resume(kv, vt, req) == 0
    assert "A" not in kv.coordinator.single_type_managers[0].num_cached_block


def test_a_chunked_resume_caches_nothing_past_its_first_dead_token():
    """Without hits, in chunks: the first chunk's allocation stops the
    caching, so no later chunk (allocated as a running request) is cached:
    a new request with the same prompt finds nothing past the dead token."""
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, req = setup("naive", caching=True)
    step(kv, vt, req, 12, running=[])
    step(kv, vt, req, 1, running=[req])  # tokens 1..6 die
    assert vt.pool.dead_idx("A").tolist() == [1, 2, 3, 4, 5, 6]
    preempt(kv, vt, req)
    kv.reset_prefix_cache()  # no hit: every block recomputed
    vt.begin_step([])
    assert resume(kv, vt, req, count=4) == 0
    running = []
    for chunk in (4, 4):
        if running:
            vt.begin_step(running)
            assert kv.allocate_slots(req, chunk) is not None
        vt.end_step(SimpleNamespace(num_scheduled_tokens={"A": chunk}))
        req.num_computed_tokens += chunk
        vt.on_output(VTokenWorkerOutput())
        vt.check_integrity()
        running = [req]
    listed = kv.coordinator.single_type_managers[0].req_to_blocks["A"]
    assert [b.block_hash for b in listed] == [None, None]
    assert cache_hits(kv, list(range(100, 113))) == 0


def test_a_budget_past_the_engine_s_max_model_len_is_taken_not_fatal():
    """A request the front end took with a budget past the engine core's
    max_model_len (vLLM's auto-fit shrinks the engine's alone) registers
    when first scheduled, where a refusal would end the engine: it keeps
    every token (its budget is past any length it can reach)."""
    kv, vt, req = setup("vtoken", caching=True)
    req.sampling_params.extra_args = {"kv_budget_tokens": kv.max_model_len + 16}
    step(kv, vt, req, 12, running=[])
    for _ in range(4):
        step(kv, vt, req, 1, running=[req])
    assert not vt.pool.has_dead("A") and vt.pool.num_live("A") == 16


def test_scores_received_read_only_are_folded():
    """From another process, a step's gains of 1 MiB or more arrive as
    read-only views of the transport's frames (vLLM's message queue over
    zmq), which the compiled fold refuses: the scheduler folds copies."""
    import pickle

    from vllm.vtoken.messages import ScoreStep, VTokenWorkerOutput

    kv, vt, req = setup("vtoken", policy="h2o")
    step(kv, vt, req, 4, running=[])
    vt.begin_step([req])
    assert kv.allocate_slots(req, 1) is not None
    vt.end_step(SimpleNamespace(num_scheduled_tokens={"A": 1}))
    req.num_computed_tokens += 1
    keys = np.arange(5, dtype=np.int64)
    gains = ScoreStep(
        req_ids=["A"],
        indptr=np.array([0, 5]),
        key_idx=keys,
        gain=np.ones(5, np.float32),
    )
    frames = []
    data = pickle.dumps(
        VTokenWorkerOutput(scores=gains), protocol=5, buffer_callback=frames.append
    )
    out = pickle.loads(data, buffers=[memoryview(bytes(f.raw())) for f in frames])
    assert not out.scores.key_idx.flags.writeable
    vt.on_output(out)
    np.testing.assert_array_equal(vt.scores.scores("A", keys), np.ones(5))
