# SPDX-License-Identifier: Apache-2.0
"""The scheduler side's record of one request, beside its Token Table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class RequestState:
    """Scheduler-side vToken state of one request, beside its Token Table.

    Created when the request's first tokens get slots, dropped by `on_free`;
    `on_preempt` says which fields survive a preemption.
    """

    # Dead tokens a resumed request recomputes this step: their blocks may be
    # freed once the forward that rewrites them has run (next begin_step).
    recomputed_dead: np.ndarray | None = None
    # The move batch in flight, if any: the request is not planned again, and
    # the batch's blocks (sources and destinations) are not freed, until acked
    # (its blocks: reclaimer.InFlightMoves).
    move_batch: int | None = None
