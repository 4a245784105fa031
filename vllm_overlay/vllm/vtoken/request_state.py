# SPDX-License-Identifier: Apache-2.0
"""The scheduler side's record of one request, beside its Token Table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

NO_BLOCKS = np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class RequestState:
    """Scheduler-side vToken state of one request, beside its Token Table.

    Created when the request's first tokens get slots, dropped by `on_free`;
    `on_preempt` says which fields survive a preemption.
    """

    # Dead tokens a resumed request recomputes this step: their blocks may be
    # freed once the forward that rewrites them has run (next begin_step).
    recomputed_dead: np.ndarray | None = None
    # Positional blocks freed (null-replaced), for the gauges.
    nulls: int = 0
    # The move batch in flight, if any: the request is not planned again, and
    # the batch's blocks (sources and destinations) are not freed, until acked.
    move_batch: int | None = None
    move_src: list[KVCacheBlock] = field(default_factory=list)
    move_src_at: list[int] = field(default_factory=list)  # their list entries
    move_dst: np.ndarray = field(default_factory=lambda: NO_BLOCKS)
    # Evacuated sources a fresh block displaced from the positional list: the
    # batch alone holds them (reclaimer.py), so vLLM's free does not see them;
    # move_fresh[i] took move_detached[i]'s place.
    move_detached: list[KVCacheBlock] = field(default_factory=list)
    move_fresh: list[KVCacheBlock] = field(default_factory=list)
