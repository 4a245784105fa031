# SPDX-License-Identifier: Apache-2.0
"""Budget enforcement: the only caller of eviction-policy methods.

Scheduler side. `EvictionRuntime` keeps the Token Tables in step with the tokens
vLLM computes (`sync_new_tokens`), asks the policy for victims when a request
holds more live tokens than its budget (`enforce_budget`), checks the policy's
answer against the contract and applies it to the pool. Each request gets its own
random generator, seeded from (seed, a stable hash of a key: its id, or what the
caller passes, e.g. its prompt), so results do not depend on batch order or on
Python's hash randomization.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from vllm.vtoken.policies.base import EvictionPolicy, RequestView
from vllm.vtoken.token_table import TokenTablePool


def request_rng(seed: int, key: bytes) -> np.random.Generator:
    """The per-request generator: same (seed, key), same draws."""
    digest = np.frombuffer(hashlib.sha256(key).digest()[:16], dtype=np.uint32)
    return np.random.default_rng([int(seed), *digest.tolist()])


class EvictionRuntime:
    """Keeps each request's live tokens within the budget through a policy."""

    def __init__(
        self,
        pool: TokenTablePool,
        policy: EvictionPolicy,
        budget: int,
        seed: int = 0,
        score_source: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        """Binds a pool and a policy.

        Args:
            pool: The Token Tables.
            policy: Decides victims; called only from here.
            budget: Live tokens kept per request (> 0).
            seed: Seed of the per-request generators.
            score_source: int64 slots [n] -> float32 scores [n]; required (by
                the time a request exceeds its budget) when the policy has a
                `score_mode`.

        Raises:
            ValueError: If budget is not positive.
        """
        if budget <= 0:
            raise ValueError(f"budget must be > 0, got {budget}")
        self.pool = pool
        self.policy = policy
        self.budget = int(budget)
        self.seed = int(seed)
        self.score_source = score_source
        self._rngs: dict[str, np.random.Generator] = {}
        # Building a view costs O(tokens); skip it for the default no-op hook.
        self._policy_syncs = (
            type(policy).sync_new_tokens is not EvictionPolicy.sync_new_tokens
        )

    def sync_new_tokens(
        self, req_id: str, slots: np.ndarray, rng_key: bytes | None = None
    ) -> None:
        """Slots the next tokens of a request and tells the policy about new ones.

        Registers the request on its first call. Tokens re-slotted after a
        preemption are not new: the policy hears only of tokens past the known
        length. The view passed carries no scores, and marks evictable only the
        tokens known before this call (minus the last one).

        Args:
            req_id: The request.
            slots: Integer [n] slots of logical tokens [num_slotted, num_slotted + n).
            rng_key: Seeds the request's generator on its first call instead of
                its id (engine request ids carry a random suffix; a key derived
                from the prompt makes runs reproducible).
        """
        if req_id not in self.pool:
            self.pool.add_request(req_id)
            key = req_id.encode() if rng_key is None else rng_key
            self._rngs[req_id] = request_rng(self.seed, key)
        before = self.pool.num_tokens(req_id)
        self.pool.append(req_id, slots)
        num_new = self.pool.num_tokens(req_id) - before
        if num_new > 0 and self._policy_syncs:
            view = self._view(req_id, before, with_scores=False)
            self.policy.sync_new_tokens(view, num_new)

    def enforce_budget(self, req_id: str, num_attended: int) -> np.ndarray:
        """Evicts down to the budget if the request holds more live tokens.

        Args:
            req_id: A synced request.
            num_attended: Tokens [0, num_attended) have been attended; tokens
                from num_attended - 1 on are protected.

        Returns:
            int64 sorted logical indices that died now (empty if none).

        Raises:
            KeyError: Unknown request.
            RuntimeError: The policy broke its contract, or it needs scores and
                no score source is set.
        """
        excess = self.pool.num_live(req_id) - self.budget
        if excess <= 0:
            return np.zeros(0, dtype=np.int64)
        view = self._view(req_id, num_attended, with_scores=True)
        chosen = np.asarray(self.policy.evict_token(view, excess), dtype=np.int64)
        self._check_answer(view, chosen, excess)
        return self.pool.evict(req_id, chosen)

    def release(self, req_id: str) -> None:
        """Forgets a finished or aborted request (pool, generator, policy state).

        Raises:
            KeyError: Unknown request.
        """
        self.pool.release(req_id)
        self._rngs.pop(req_id, None)
        self.policy.release(req_id)

    def _view(self, req_id: str, num_attended: int, with_scores: bool) -> RequestView:
        live_idx = self.pool.live_idx(req_id)
        scores = None
        if with_scores and self.policy.score_mode is not None:
            if self.score_source is None:
                raise RuntimeError(
                    f"policy {self.policy.name} needs {self.policy.score_mode!r} "
                    "scores but the runtime has no score source"
                )
            slots = self.pool.live_slots(req_id)
            scores = np.asarray(self.score_source(slots), dtype=np.float32)
        return RequestView(
            req_id=req_id,
            live_idx=live_idx,
            evictable=live_idx < num_attended - 1,
            scores=scores,
            rng=self._rngs[req_id],
        )

    def _check_answer(self, view: RequestView, chosen: np.ndarray, want: int) -> None:
        expected = min(want, int(np.count_nonzero(view.evictable)))
        ok = (
            chosen.ndim == 1
            and chosen.size == expected
            and np.unique(chosen).size == chosen.size
            and np.isin(chosen, view.live_idx[view.evictable]).all()
        )
        if not ok:
            raise RuntimeError(
                f"policy {self.policy.name} broke its contract on {view.req_id!r}: "
                f"wanted {expected} distinct evictable tokens, got {chosen[:16]}"
            )
