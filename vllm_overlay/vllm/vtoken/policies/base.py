# SPDX-License-Identifier: Apache-2.0
"""The eviction-policy interface (docs/DESIGN.md §3.2, C3) and its registry.

Scheduler side. A policy sees one request at a time through a `RequestView` built
by `EvictionRuntime` and answers one question: which live tokens to evict. It
never touches the Token Table, the scheduler, the block manager or the worker;
the runtime applies its answer (flips liveness bits) and reclamation follows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

POLICIES: dict[str, type[EvictionPolicy]] = {}
AGGREGATES = ("mean", "max")  # the `aggregate` knob of score policies


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator: makes `cls` available to `create_policy` under `cls.name`."""
    if cls.name in POLICIES:
        raise ValueError(f"policy {cls.name!r} registered twice")
    POLICIES[cls.name] = cls
    return cls


@dataclass(frozen=True)
class RequestView:
    """What a policy sees of one request; built by the runtime, read-only.

    Attributes:
        req_id: The request.
        live_idx: int64 [n] logical indices of live, slotted tokens, ascending.
        evictable: bool [n]; False for protected tokens: the most recent
            attended token and every token not yet attended.
        scores: float32 [n] aligned with `live_idx` (see `ScoreAccumulator`), or
            None when the policy needs none. Views passed to `sync_new_tokens`
            carry None: scores are read only when tokens must be chosen.
        rng: Per-request generator seeded from (seed, stable hash of req_id).
    """

    req_id: str
    live_idx: np.ndarray
    evictable: np.ndarray
    scores: np.ndarray | None
    rng: np.random.Generator


class EvictionPolicy(ABC):
    """A token eviction policy.

    Subclasses set `name`, `score_mode` (None, "sum" or "persistence": which
    score the runtime must provide), `defaults` (knob name -> default value) and
    implement `evict_token`. Knob values are in `self.knobs`; `_validate` checks
    them and derives attributes.
    """

    name: ClassVar[str]
    score_mode: ClassVar[str | None] = None
    defaults: ClassVar[dict[str, Any]] = {}
    # Steps a "persistence" score averages over (None: it counts forever).
    score_window: int | None = None
    # How a step's attention is reduced over layers and query heads: "mean",
    # or "max" (a token one head attends strongly counts fully). The knob
    # `aggregate` of every policy with a score_mode.
    score_aggregate: str | None = None
    # "window" scores: the query rows of a step whose attention counts.
    score_query_window: int | None = None

    def __init__(self, budget: int, **knobs: Any) -> None:
        """Builds the policy.

        Args:
            budget: Live tokens kept per request (> 0).
            **knobs: Policy knobs; see the subclass docstring.

        Raises:
            ValueError: On a bad budget, an unknown knob or a bad knob value.
        """
        if isinstance(budget, bool) or not isinstance(budget, int | np.integer):
            raise ValueError(f"{self.name}: budget must be an int, got {budget!r}")
        if budget <= 0:
            raise ValueError(f"{self.name}: budget must be > 0, got {budget}")
        defaults = dict(self.defaults)
        if self.score_mode is not None:
            defaults.setdefault("aggregate", "mean")
        unknown = sorted(set(knobs) - set(defaults))
        if unknown:
            raise ValueError(
                f"{self.name}: unknown knob(s) {unknown}; "
                f"valid knobs: {sorted(defaults) or 'none'}"
            )
        self.budget = int(budget)
        self.knobs = {**defaults, **knobs}
        if self.score_mode is not None:
            self.score_aggregate = self.knobs["aggregate"]
            if self.score_aggregate not in AGGREGATES:
                raise ValueError(
                    f"{self.name}: aggregate must be one of {list(AGGREGATES)}, "
                    f"got {self.score_aggregate!r}"
                )
        self._validate()

    def _validate(self) -> None:  # noqa: B027
        """Checks knob values (override); raises ValueError."""

    def sync_new_tokens(self, req: RequestView, num_new: int) -> None:  # noqa: B027
        """Told that the request's last `num_new` logical tokens are new.

        Default: no-op. Must not mutate the view.
        """

    @abstractmethod
    def evict_token(self, req: RequestView, num_evict: int) -> np.ndarray:
        """Chooses tokens to evict; does not mutate anything.

        Args:
            req: The request.
            num_evict: How many tokens must die (> 0).

        Returns:
            int64 logical indices: exactly `num_evict` distinct evictable
            entries of `req.live_idx`, or all evictable ones if fewer exist.
        """

    def reset_scores(self, req_id: str) -> None:  # noqa: B027
        """The request's scores start over from zero (it was preempted: its
        tokens get new slots when it resumes). Default: no-op."""

    def release(self, req_id: str) -> None:  # noqa: B027
        """Forgets per-request state (default: none kept)."""

    # ------------------------------------------------------------ helpers
    def _ratio(self, knob: str) -> float:
        value = self.knobs[knob]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{self.name}: {knob} must be a number, got {value!r}")
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{self.name}: {knob} must be in [0, 1], got {value}")
        return float(value)

    def _int(self, knob: str, low: int) -> int:
        value = self.knobs[knob]
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(f"{self.name}: {knob} must be an int, got {value!r}")
        if value < low:
            raise ValueError(f"{self.name}: {knob} must be >= {low}, got {value}")
        return int(value)


def recent_mask(req: RequestView, window: int) -> np.ndarray:
    """bool [n]: True for the `window` most recent live tokens."""
    mask = np.zeros(req.live_idx.size, dtype=bool)
    if window > 0:
        mask[-window:] = True
    return mask


def select_lowest(
    req: RequestView, num_evict: int, key: np.ndarray, protected: np.ndarray
) -> np.ndarray:
    """Evictable, unprotected tokens with the lowest `key` (ties: oldest first).

    Only when those are too few does it take protected-but-evictable tokens,
    oldest first, so a policy always returns min(num_evict, #evictable) tokens.

    Args:
        req: The request.
        num_evict: Tokens wanted.
        key: [n] aligned with `req.live_idx`; lower is evicted first.
        protected: bool [n], the policy's own protection (sinks, recent window).

    Returns:
        int64 logical indices.
    """
    pos = np.arange(req.live_idx.size)
    first = np.flatnonzero(req.evictable & ~protected)
    first = first[np.lexsort((pos[first], key[first]))]
    if first.size < num_evict:
        extra = np.flatnonzero(req.evictable & protected)
        first = np.concatenate([first, extra])
    return req.live_idx[first[:num_evict]].astype(np.int64)
