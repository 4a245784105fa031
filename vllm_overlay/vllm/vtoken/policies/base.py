# SPDX-License-Identifier: Apache-2.0
"""The eviction-policy interface (docs/DESIGN.md §3.2, C3) and its registry.

Scheduler side. A policy sees one request at a time through a `RequestView` built
by `EvictionRuntime` and answers one question: which live tokens to evict. It
never touches the Token Table, the scheduler, the block manager or the worker;
the runtime applies its answer (flips liveness bits) and reclamation follows.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from vllm.vtoken.scores import SCORE_MODES

POLICIES: dict[str, type[EvictionPolicy]] = {}
AGGREGATES = ("mean", "max")  # the `aggregate` knob of score policies
MAX_KNOB = 2**31 - 1  # an int knob's bound (config.UNBOUNDED_BUDGET's)


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
        rng: Per-request generator seeded from (the engine's seed, a hash of
            the prompt): seeding.request_rng.
        seed: The request's batch seed (seeding.request_seed), or None: one
            is drawn from rng.
    """

    req_id: str
    live_idx: np.ndarray
    evictable: np.ndarray
    scores: np.ndarray | None
    rng: np.random.Generator
    seed: int | None = None


@dataclass(frozen=True)
class BatchView:
    """The requests a policy evicts from in one step, as flat arrays; built
    by the runtime, read-only (the runtime reads them after `evict_batch`).

    Request r's live tokens are entries [indptr[r], indptr[r + 1]) of the token
    arrays, ascending; `seg` is each token's request. `seeds` are per-request
    random seeds (fixed per request: seeding.request_seed), `rngs` the
    generators themselves (what a `RequestView` carries).
    """

    req_ids: list[str]
    indptr: np.ndarray  # int64 [R + 1]
    seg: np.ndarray  # int64 [N]
    live_idx: np.ndarray  # int64 [N]
    evictable: np.ndarray  # bool [N]
    scores: np.ndarray | None  # float32 [N]
    seeds: np.ndarray  # uint64 [R]
    rngs: list[np.random.Generator]

    def request(self, r: int) -> RequestView:
        lo, hi = self.indptr[r], self.indptr[r + 1]
        scores = None if self.scores is None else self.scores[lo:hi]
        return RequestView(
            self.req_ids[r],
            self.live_idx[lo:hi],
            self.evictable[lo:hi],
            scores,
            self.rngs[r],
            int(self.seeds[r]),
        )


@dataclass(frozen=True)
class LowestRule:
    """A built-in's `evict_batch` stated as data, for the runtime's one-pass
    eviction (eviction_kernels.evict_lowest; tests hold the two equal):
    per request, the evictable tokens with the lowest `key` go first (ties:
    oldest first), the protected ones last, oldest first. Protected: the
    first `sinks` logical tokens and the `recent` newest live ones.

    key: "score" (the running scores), "index" (the logical index: oldest
    first), "hash" (`selection.hash_uniform` of the request's seed, the
    token and its newest token: Random's draw; one victim, not the lowest
    draw but the candidate at a drawn position: RandomPolicy.evict_batch)
    or "persistence" (minus the steps in the last `window` a token was
    unimportant, from the running scores and `ages`, the requests'
    `ArrivalSteps.arena_of`: Scissorhands').
    """

    key: str
    recent: int = 0
    sinks: int = 0
    window: int = 0
    ages: tuple | None = None


def one_request(req: RequestView, seed: int = 0) -> BatchView:
    n = req.live_idx.size
    return BatchView(
        [req.req_id],
        np.array([0, n]),
        np.zeros(n, np.int64),
        req.live_idx,
        req.evictable,
        req.scores,
        np.array([int(seed)], np.uint64),
        [req.rng],
    )


class EvictionPolicy(ABC):
    """A token eviction policy.

    Subclasses set `name`, `score_mode` (None, "sum", "persistence" or
    "window": which score the runtime must provide), `defaults` (knob name ->
    default value), optionally `scatters_victims`, and implement
    `evict_token`. Knob values are in
    `self.knobs`; `_validate` checks them and derives attributes, the score
    attributes below included, which are then checked against the mode.
    """

    name: ClassVar[str]
    score_mode: ClassVar[str | None] = None
    defaults: ClassVar[dict[str, Any]] = {}
    # Victims spread at random over a request's live tokens (Random's): its
    # Token Tables take each victim out of the live list at once, so that a
    # walk copies the list. Otherwise the dead stay listed until they are as
    # many as the live, and a walk tests each entry's bit: a branch that
    # predicts well where the dead gather (the oldest, the lowest-scored),
    # and spares the kill a pass over each list (table_kernels.kill_rows).
    # A class attribute: both sides read it from the class.
    scatters_victims: ClassVar[bool] = False
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
        self._check_score_attributes()

    def _check_score_attributes(self) -> None:
        """What the worker's ScoreAccumulator needs, checked at start-up (a
        plug-in's mistakes would otherwise surface in the worker's first step)."""
        mode = self.score_mode
        if mode is not None and mode not in SCORE_MODES:
            raise ValueError(
                f"{self.name}: score_mode must be None or one of "
                f"{list(SCORE_MODES)}, got {mode!r}"
            )
        if mode == "window" and self.score_query_window is None:
            raise ValueError(
                f"{self.name}: score_mode 'window' needs score_query_window"
            )
        for attr, mode_of_attr in (
            ("score_window", "persistence"),
            ("score_query_window", "window"),
        ):
            value = getattr(self, attr)
            if value is None:
                continue
            if mode != mode_of_attr:
                raise ValueError(
                    f"{self.name}: {attr} is for score_mode {mode_of_attr!r}, "
                    f"not {mode!r}"
                )
            integral = isinstance(value, int | np.integer)
            if isinstance(value, bool) or not integral or value < 1:
                raise ValueError(
                    f"{self.name}: {attr} must be an integer >= 1, got {value!r}"
                )

    def _validate(self) -> None:  # noqa: B027
        """Checks knob values (override); raises ValueError."""

    def sync_new_tokens(self, req: RequestView, num_new: int) -> None:  # noqa: B027
        """Told that the request's last `num_new` logical tokens are new.

        Default: no-op. Must not mutate the view.
        """

    def sync_batch(
        self,
        req_ids: list[str],
        num_new: np.ndarray,
        view: Callable[[int], RequestView] | None = None,
    ) -> None:
        """`sync_new_tokens` for a batch (the step path): request req_ids[k]
        got num_new[k] new tokens; `view(k)` builds its view. Both are the
        runtime's, read-only (a repeated batch passes the same list on the
        next steps). Default: one `sync_new_tokens` call per request with
        new tokens."""
        for k, n in enumerate(num_new):
            if n > 0:
                self.sync_new_tokens(view(k), int(n))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mine = EvictionPolicy.evict_token, EvictionPolicy.evict_batch
        if (cls.evict_token, cls.evict_batch) == mine and not getattr(
            cls, "__abstractmethods__", None
        ):
            raise TypeError(
                f"{cls.__name__} implements neither evict_token nor evict_batch"
            )

    def evict_token(self, req: RequestView, num_evict: int) -> np.ndarray:
        """Chooses tokens to evict; does not mutate anything.

        A policy implements this or `evict_batch` (or both); each defaults to
        the other.

        Args:
            req: The request.
            num_evict: How many tokens must die (> 0).

        Returns:
            int64 logical indices: exactly `num_evict` distinct evictable
            entries of `req.live_idx`, or all evictable ones if fewer exist.
        """
        seed = req.rng.integers(1 << 63) if req.seed is None else req.seed
        chosen = self.evict_batch(one_request(req, seed), np.array([num_evict]))[1]
        return np.sort(chosen)

    def evict_batch(
        self, batch: BatchView, num_evict: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """`evict_token` for every request of `batch` at once (the step path).

        Returns:
            (counts int64 [R], idx int64 [sum counts]): request r's choice is
            the r-th run of `idx`, with `evict_token`'s contract each.
        """
        picks = [
            np.asarray(self.evict_token(batch.request(r), int(n)), np.int64)
            for r, n in enumerate(num_evict)
        ]
        counts = np.fromiter((p.size for p in picks), np.int64, len(picks))
        return counts, np.concatenate([np.zeros(0, np.int64), *picks])

    def lowest_rule(self, req_ids: list[str]) -> LowestRule | None:
        """`evict_batch` for these requests as a `LowestRule`, or None (the
        default): then the runtime calls `evict_batch`. Read from built-ins
        only (a plug-in's subclass of one keeps its own `evict_batch`)."""
        return None

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

    def _int_below_budget(self, knob: str, low: int, why: str) -> int:
        """`_int`, and below the budget (`why`: what it keeps)."""
        value = self._int(knob, low)
        if value >= self.budget:
            raise ValueError(
                f"{self.name}: {knob} ({value}) must be < budget ({self.budget}): {why}"
            )
        return value

    def _int(self, knob: str, low: int) -> int:
        """An int knob in [low, MAX_KNOB] (past it, the per-step arrays it
        sizes or indexes overflow: no context is that long)."""
        value = self.knobs[knob]
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(f"{self.name}: {knob} must be an int, got {value!r}")
        if not low <= value <= MAX_KNOB:
            raise ValueError(
                f"{self.name}: {knob} must be in [{low}, {MAX_KNOB}], got {value}"
            )
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


def keeps_dead_listed(policy: type[EvictionPolicy] | None) -> bool:
    """Whether the Token Tables of a request evicting by `policy` (None:
    not evicting) leave its victims listed a while (`scatters_victims`;
    TokenTablePool.add_request). The one rule both sides' tables follow."""
    return policy is None or not policy.scatters_victims


def is_builtin(policy: EvictionPolicy) -> bool:
    """One of vToken's own policies (not a plug-in's)."""
    return type(policy).__module__.startswith("vllm.vtoken.policies.")


def check_answers(policy, ids, seg, idx, evictable, excess, counts, chosen) -> None:
    """The contract, all requests at once: the right count each, distinct,
    evictable tokens of the request's own; else a RuntimeError."""
    want = np.minimum(excess, np.bincount(seg[evictable], minlength=len(ids)))
    ok = counts.size == len(ids) and (counts == want).all()
    ok = ok and chosen.size == counts.sum()
    # A negative index would key another request's token (cseg * width).
    if ok and chosen.size and chosen.min() >= 0:
        cseg = np.repeat(np.arange(len(ids)), counts)
        width = int(max(idx.max(), chosen.max())) + 1
        key, ckey = seg * width + idx, cseg * width + chosen
        at = np.minimum(np.searchsorted(key, ckey), key.size - 1)
        ok = (key[at] == ckey).all() and evictable[at].all()
        ok = ok and np.unique(ckey).size == ckey.size
    elif chosen.size:
        ok = False
    if not ok:
        raise RuntimeError(
            f"policy {policy.name} broke its contract on {ids[:4]}...: wanted "
            f"{want[:8].tolist()} distinct evictable tokens, got {counts[:8]}"
        )
