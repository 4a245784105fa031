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

CHECK = os.environ.get("VTOKEN_CHECK_INTEGRITY", "0") == "1"


def check_blocks(pool, block_pool, req_to_blocks, reqs) -> None:
    """The scheduler's `check_integrity()` (docs/DESIGN.md §4): the Token
    Tables against vLLM's block pool. Every block's ref count is its holders
    (positional lists, plus evacuated sources a move batch holds), every live
    token sits in a block its request holds, and free + held = all blocks.

    Args:
        pool: The scheduler's TokenTablePool.
        block_pool: vLLM's BlockPool.
        req_to_blocks: vLLM's positional block lists, by request.
        reqs: The scheduler's RequestState records, by request.
    """
    import numpy as np

    ref = np.fromiter((b.ref_cnt for b in block_pool.blocks), dtype=np.int64)
    pool.check_integrity(block_ref_cnt=ref)
    B = pool.block_size
    holders = np.zeros_like(ref)
    for rid, blocks in req_to_blocks.items():
        ids = [b.block_id for b in blocks if not b.is_null]
        rec = reqs.get(rid)
        if rec is not None:  # evacuated sources, held until acked
            ids += [b.block_id for b in rec.move_detached]
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
