# SPDX-License-Identifier: Apache-2.0
"""Debug switch for vToken's deep checks (`VTOKEN_CHECK_INTEGRITY=1`).

Boundaries (engine arguments, policy knobs, a policy's answer) always raise clear
errors. Calls between overlay modules only `assert` their cheap preconditions;
the costly ones (uniqueness, ranges over whole arrays) and the scheduler's
`check_integrity()` after every step run only when this is on. Read at call
time (`integrity.CHECK`), so tests can turn it on without an environment
variable.
"""

import os
import weakref

CHECK = os.environ.get("VTOKEN_CHECK_INTEGRITY", "0") == "1"

# The worker's Token Table pool by the vToken config object it was built on
# (id -> weakrefs to both). The scheduler and the worker share that object
# only in one process (vLLM's UniProcExecutor: one rank), so a scheduler finds
# its own worker here, and none across processes; kept under CHECK only.
_WORKER_POOLS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def share_worker_pool(cfg, pool) -> None:
    """The worker's pool, for `worker_pool(cfg)` in this process."""
    _WORKER_POOLS[id(cfg)] = (weakref.ref(cfg), weakref.ref(pool))


def worker_pool(cfg):
    """The pool of the worker built on `cfg` in this process, or None."""
    cfg_ref, pool_ref = _WORKER_POOLS.get(id(cfg), (lambda: None, None))
    return pool_ref() if cfg_ref() is cfg else None


def check_worker(pool, worker, req_ids) -> None:
    """After a step's acknowledgements (VTokenScheduler.on_output), where
    the two sides share a process: each of the step's requests still known
    to both has the same live tokens, in the same slots, in the scheduler's
    Token Table `pool` as in the worker's (`worker`), which the step's
    attention read. (Every step's changes reach both: the dead lists, the
    slots, the moves, acknowledged once the worker switched them.)"""
    for rid in req_ids:
        if rid not in pool or rid not in worker:
            continue
        got, want = worker.live_idx(rid), pool.live_idx(rid)
        assert got.tolist() == want.tolist(), (
            f"request {rid}: the worker's live tokens differ from the scheduler's"
        )
        got, want = worker.live_slots(rid), pool.live_slots(rid)
        assert got.tolist() == want.tolist(), (
            f"request {rid}: the worker reads live tokens from slots "
            f"{got.tolist()[:8]}..., the scheduler holds them at "
            f"{want.tolist()[:8]}..."
        )


def check_blocks(pool, block_pool, req_to_blocks, detached) -> None:
    """The scheduler's `check_integrity()` (docs/DESIGN.md §4): the Token
    Tables against vLLM's block pool. Every block's ref count is its holders
    (positional lists, plus evacuated sources a move batch holds), every live
    token sits in a block its request holds, and free + held = all blocks.

    Args:
        pool: The scheduler's TokenTablePool.
        block_pool: vLLM's BlockPool.
        req_to_blocks: vLLM's positional block lists, by request.
        detached: The evacuated sources each request's move batch holds
            (block ids, by request; BlockReclaimer.detached).
    """
    import numpy as np

    ref = np.fromiter((b.ref_cnt for b in block_pool.blocks), dtype=np.int64)
    pool.check_integrity(block_ref_cnt=ref)
    B = pool.block_size
    holders = np.zeros_like(ref)
    for rid, blocks in req_to_blocks.items():
        ids = [b.block_id for b in blocks if not b.is_null]
        ids += detached.get(rid, [])  # evacuated sources, held until acked
        np.add.at(holders, np.asarray(ids, dtype=np.int64), 1)
        if rid in pool:
            held = np.zeros(len(ref), dtype=bool)
            held[ids] = True
            assert held[pool.live_slots(rid) // B].all(), (
                f"request {rid}: a live token sits in a block it does not hold"
            )
    holders[0] = ref[0]  # the null block's ref_cnt is not maintained
    assert (holders == ref).all(), (
        "block ref counts differ from the holders: "
        f"{np.flatnonzero(holders != ref)[:8].tolist()}"
    )
    free = block_pool.get_num_free_blocks()
    assert free + int((ref[1:] > 0).sum()) == len(ref) - 1, (
        f"free ({free}) + held != total ({len(ref) - 1})"
    )


def check_tables(pool, block_ref_cnt=None) -> None:
    """`TokenTablePool.check_integrity` (token_table.py): the pool's arrays
    recounted from its tables, read through its private fields."""
    import numpy as np

    B, total, owned = pool.block_size, 0, []
    assert pool._a.regions_disjoint(), "token table regions overlap"
    slotted = np.zeros(pool._slot.size, dtype=bool)
    known = slotted.copy()
    for rid, row in pool._row.items():
        n_slotted, n_tokens = pool._n_slotted[row], pool._n_tokens[row]
        assert 0 <= n_slotted <= n_tokens <= pool._a.cap[row], (
            f"{rid}: lengths slotted={n_slotted} tokens={n_tokens}"
        )
        slotted[pool._a.span(row, n_slotted)] = True
        known[pool._a.span(row, n_tokens)] = True
        s = pool._slot[pool._a.span(row, n_slotted)]
        assert ((s >= 0) & (s < pool.num_slots)).all(), f"{rid}: slot out of range"
        n_live = int(np.count_nonzero(pool._live[pool._a.span(row, n_tokens)]))
        assert n_live == pool._n_live[row], (
            f"{rid}: live counter {pool._n_live[row]} != {n_live}"
        )
        total += n_live
        n_listed = pool._n_listed[row]
        listed = pool._listed[pool._a.span(row, pool._a.cap[row])]
        on = listed[:n_listed][pool._live[pool._a.start[row] + listed[:n_listed]]]
        want = np.flatnonzero(pool._live[pool._a.span(row, n_tokens)])
        assert (
            np.array_equal(on, want)
            and (np.diff(listed[:n_listed]) > 0).all()
            and (listed[n_listed:] == -1).all()
        ), f"{rid}: live list {listed[:n_listed][:8]} != live bits {want[:8]}"
        ls = pool._live_slots(row)
        assert np.unique(ls).size == ls.size, f"{rid}: a slot used twice"
        owned.append(ls.astype(np.int64))
    assert (pool._slot[~slotted] == -1).all(), "a slot other than -1 unslotted"
    assert not pool._live[~known].any(), "a live bit past num_tokens"
    assert total == pool._total_live, (
        f"total live counter {pool._total_live} != recount {total}"
    )
    slots = np.concatenate(owned) if owned else np.zeros(0, np.int64)
    recount = np.bincount(slots // B, minlength=pool.num_blocks)
    bad = np.flatnonzero(recount != pool.block_live)
    assert bad.size == 0, (
        f"block_live != recount from tables at blocks {bad[:8].tolist()}: "
        f"{pool.block_live[bad[:8]].tolist()} vs {recount[bad[:8]].tolist()}"
    )
    uniq, counts = np.unique(slots, return_counts=True)
    shared = uniq[counts > 1]
    if block_ref_cnt is None:
        assert shared.size == 0, f"slots owned by two requests: {shared[:8]}"
        return
    ref = np.asarray(block_ref_cnt)
    assert (ref[shared // B] > 1).all(), (
        f"slots owned twice in unshared blocks: {shared[ref[shared // B] <= 1][:8]}"
    )
    orphan = np.flatnonzero((pool.block_live > 0) & (ref[: pool.num_blocks] <= 0))
    assert orphan.size == 0, f"live tokens in free blocks {orphan[:8].tolist()}"
