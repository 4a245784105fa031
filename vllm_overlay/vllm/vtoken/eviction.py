# SPDX-License-Identifier: Apache-2.0
"""Budget enforcement: the only caller of eviction-policy methods.

Scheduler side. `EvictionRuntime` keeps the Token Tables in step with the tokens
vLLM computes (`sync_rows`), asks the policies for victims when requests hold
more live tokens than their budget (`enforce_budgets`, the batch at once),
checks the answers against the contract and applies them to the pool. Each
request has its own generator (seeding.py): results do not depend on batch order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import attrgetter, is_
from typing import TYPE_CHECKING

import numpy as np

from vllm.vtoken import integrity
from vllm.vtoken.arena import each_distinct, indptr_of, ranges
from vllm.vtoken.policies import create_policy
from vllm.vtoken.policies.base import (
    BatchView,
    EvictionPolicy,
    RequestView,
    check_answers,
    is_builtin,
    keeps_dead_listed,
)
from vllm.vtoken.seeding import request_rng, request_seed
from vllm.vtoken.token_table import TokenTablePool

if TYPE_CHECKING:
    from vllm.vtoken.request_args import RequestEviction


class _Evicting:
    """How one request is evicted: its policy (None: never), budget, seed
    (the batch path's, seeding.request_seed) and generator, built the first
    time it is asked for (a RequestView is built: a plug-in's per-request
    path; BatchView.rngs is read): the built-ins draw from the seed alone."""

    __slots__ = ("policy", "budget", "seed", "_rng_seed", "_key", "_rng")

    def __init__(
        self, policy: EvictionPolicy | None, budget: int, rng_seed: int, key: bytes
    ) -> None:
        self.policy, self.budget = policy, budget
        self._rng_seed, self._key = rng_seed, key
        self.seed = request_seed(rng_seed, key) if policy is not None else 0
        self._rng: np.random.Generator | None = None

    @property
    def rng(self) -> np.random.Generator:
        if self._rng is None:
            self._rng = request_rng(self._rng_seed, self._key)
        return self._rng


class EvictionRuntime:
    """Keeps each request's live tokens within its budget through its policy.

    The engine's policy and budget are the defaults; a request may bring its
    own (request_args.py) or opt out. Policy objects are shared by the requests
    with the same (name, budget); per-request policy state is keyed by id.
    """

    def __init__(
        self,
        pool: TokenTablePool,
        policy: EvictionPolicy,
        budget: int | None,
        seed: int = 0,
        score_source: Callable[[str, np.ndarray], np.ndarray] | None = None,
        score_batch: Callable[..., np.ndarray] | None = None,
        score_arena: Callable[[list[str]], tuple] | None = None,
    ) -> None:
        """Binds a pool and the engine's default policy.

        Args:
            pool: The Token Tables.
            policy: The engine's policy; decides victims, called only from here.
            budget: The engine's budget (live tokens kept per request), or None:
                only requests that bring a budget are evicted.
            seed: Seed of the per-request generators.
            score_source: (request id, int64 logical indices [n]) -> float32
                scores [n]; required (by the time a request exceeds its
                budget) when a policy has a `score_mode`.
            score_batch: Optional (request ids [R], logical indices [n],
                their requests' positions seg [n]) -> float32 scores [n]: the
                same for many requests in one call (the step path).
            score_arena: Optional (request ids [R]) -> where their scores
                are (`ScoreAccumulator.arena_of`): the one-pass eviction of
                a built-in's "score" rule reads them in place.
        """
        assert budget is None or budget > 0, budget
        # The compiled selection and one-pass eviction (numba): loaded now,
        # not in a step.
        import vllm.vtoken.eviction_kernels  # noqa: F401
        import vllm.vtoken.policies.selection_kernels  # noqa: F401

        self.pool = pool
        self.policy = policy
        self.budget = budget
        self.seed = int(seed)
        self.score_source = score_source
        self.score_batch = score_batch
        self.score_arena = score_arena
        self._policies: dict[tuple[str, int], EvictionPolicy] = {}
        if budget is not None:
            self._policies[(policy.name, budget)] = policy
        self._reqs: dict[str, _Evicting] = {}
        # For the batch path, by Token Table row: each request's budget (never
        # reached without a policy), its policy's position in `_by_index`, and
        # its batch seed.
        names = ("budget", "pix", "seed")
        self._by_row = {name: np.zeros(0, np.int64) for name in names}
        self._by_index: list[EvictionPolicy | None] = [None]
        self._syncing = False  # whether a policy in use has sync_batch
        self._sync_groups = pool.memo()  # sync_rows' last batch, grouped

    def sync_new_tokens(
        self,
        req_id: str,
        slots: np.ndarray,
        rng_key: bytes | None = None,
        evict: RequestEviction | None = None,
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
            evict: The request's own policy and budget (first call); default:
                the engine's.
        """
        if req_id not in self.pool:
            self.register(req_id, rng_key, evict)
        slots = np.asarray(slots)
        self.sync_rows([req_id], np.array([slots.size]), slots)

    def register(
        self, req_id: str, rng_key: bytes | None, evict: RequestEviction | None
    ) -> None:
        """A request's table, generator, policy and budget (see
        `sync_new_tokens` for the arguments)."""
        self.register_many([req_id], [rng_key], [evict])

    def register_many(
        self,
        req_ids: list[str],
        rng_keys: Sequence[bytes | None],
        evicts: Sequence[RequestEviction | None],
    ) -> None:
        """`register` of distinct requests at once (a step's admissions): a
        call a request for its seed (`_Evicting`), the rest once for all: a
        policy a setting (the step's requests share a few)."""
        if not req_ids:
            return
        keys = rng_keys  # the prompt's (the scheduler's), else the id
        if None in keys:
            keys = [
                k if k is not None else r.encode()
                for r, k in zip(req_ids, keys, strict=True)
            ]
        policies, budgets = zip(*each_distinct(evicts, self._policy_of), strict=True)
        recs = list(map(_Evicting, policies, budgets, repeat(self.seed), keys))
        self._reqs.update(zip(req_ids, recs, strict=True))
        # By the policy's class, as the worker's table (VTokenWorker._add).
        keep = each_distinct(policies, _keeps_dead_listed)
        self.pool.add_requests(req_ids, np.array(keep, bool))
        rows, cols = self.pool.rows(req_ids), self._by_row
        size = cols["budget"].size
        if rows.max() >= size:  # the pool's rows grew
            grow = max(16, size, int(rows.max()) + 1 - size)
            for name, col in cols.items():
                cols[name] = np.r_[col, np.zeros(grow, np.int64)]
        budget = np.array(budgets, np.int64)
        budget[np.fromiter(map(is_, policies, repeat(None)), bool, len(recs))] = _NEVER
        cols["budget"][rows] = budget
        cols["pix"][rows] = each_distinct(policies, self._index_of)
        cols["seed"][rows] = np.fromiter(map(_SEED, recs), np.int64, len(recs))

    def _index_of(self, policy: EvictionPolicy | None) -> int:
        """`policy`'s position in `_by_index`, added if new: by identity (a
        plug-in may define __eq__)."""
        for i, p in enumerate(self._by_index):
            if p is policy:
                return i
        self._by_index.append(policy)
        self._syncing |= policy is not None and _syncs(policy)
        return len(self._by_index) - 1

    def sync_rows(
        self, req_ids: list[str], counts: np.ndarray, slots, rows=None
    ) -> None:
        """`sync_new_tokens` for registered requests at once: req_ids[k]
        gets the next counts[k] of `slots`. `rows`: their Token Table rows,
        when the caller has them."""
        rows = self.pool.rows(req_ids) if rows is None else rows
        if not self._syncing:  # no policy in use hears of new tokens
            self.pool.append_rows(rows, counts, slots)
            return
        before = self.pool.num_tokens_rows(rows).copy()
        self.pool.append_rows(rows, counts, slots)
        num_new = self.pool.num_tokens_rows(rows) - before
        # count_nonzero (~2 us where the hooks run, profiled), not any() and
        # all(): a ufunc reduction each behind a Python wrapper, ~15 and ~8.
        num_with = np.count_nonzero(num_new)
        if not num_with:
            return
        # The batch's syncing policies, each with its requests: grouped once
        # for a batch that the next steps repeat (BatchMemo), not every step.
        (groups,) = self._sync_groups.get(
            req_ids, lambda ids: (self._sync_groups_of(ids, rows),)
        )
        for policy, sel, ids in groups:
            new, b = (num_new, before) if sel is None else (num_new[sel], before[sel])
            every = (
                num_with == new.size
                if sel is None
                else np.count_nonzero(new) == new.size
            )
            if not every:  # new tokens only (a chunk may bring none)
                keep = new > 0
                ids = list(compress(ids, keep.tolist()))
                new, b = new[keep], b[keep]
                if not ids:
                    continue
            policy.sync_batch(
                ids, new, lambda k, ids=ids, b=b: self._view(ids[k], b[k], None)
            )

    def _sync_groups_of(self, req_ids: list[str], rows: np.ndarray) -> list:
        """sync_rows' groups: (policy, positions in the batch or None for
        all, their ids) per policy in the batch that hears of new tokens."""
        pix, groups = self._by_row["pix"][rows], []
        for p in np.unique(pix).tolist():
            policy = self._by_index[p]
            if policy is None or not _syncs(policy):
                continue
            sel = (pix == p).nonzero()[0]
            if sel.size == len(req_ids):
                groups.append((policy, None, list(req_ids)))
            else:
                groups.append((policy, sel, [req_ids[i] for i in sel.tolist()]))
        return groups

    def enforce_budget(self, req_id: str, num_attended: int) -> np.ndarray:
        """Evicts down to the request's budget if it holds more live tokens.

        Args:
            req_id: A synced request.
            num_attended: Tokens [0, num_attended) have been attended; tokens
                from num_attended - 1 on are protected.

        Returns:
            int64 sorted logical indices that died now (empty if none).

        Raises:
            RuntimeError: The policy broke its contract, or it needs scores and
                no score source is set.
        """
        return self.enforce_budgets([req_id], np.array([num_attended]))[2]

    def enforce_budgets(
        self, req_ids: list[str], num_attended: np.ndarray, rows=None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`enforce_budget` for a batch: a fixed number of NumPy calls per
        policy in use, whatever the number of requests. `rows`: their Token
        Table rows, when the caller has them.

        Returns:
            (which, counts, idx): requests req_ids[which[k]] lost counts[k]
            tokens, the k-th run of `idx` (ascending within the run).
        """
        rows = self.pool.rows(req_ids) if rows is None else rows
        excess = self.pool.num_live_rows(rows) - self._by_row["budget"][rows]
        over = (excess > 0).nonzero()[0]
        if not over.size:
            return over, over, over
        attended = np.asarray(num_attended)[over]
        return over, *self._evict_over(req_ids, rows, over, attended, excess[over])

    def evict_running(
        self, req_ids: list[str], rows: np.ndarray, prompt: np.ndarray, limit
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The scheduler's step: `enforce_budgets` of the running requests at
        Token Table `rows` (int64, -1: no table yet) that have attended their
        `prompt` tokens, slotted every token they know (not a resume between
        its chunks) and, where `limit` is not empty, hold fewer than
        limit[i] slotted (their last step's output is in); choosing them and
        their excess is one compiled pass (TokenTablePool.over_budget).

        Returns:
            (ok, which, counts, idx): `ok` marks the requests so chosen;
            req_ids[which[k]] lost counts[k] tokens, as in `enforce_budgets`.
        """
        budget = self._by_row["budget"]
        assert not integrity.CHECK or rows.max(initial=-1) < budget.size
        ok, over, attended, excess = self.pool.over_budget(rows, prompt, limit, budget)
        if not over.size:
            return ok, over, over, over
        return ok, over, *self._evict_over(req_ids, rows, over, attended, excess)

    def _evict_over(self, req_ids, rows, over, attended, excess):
        """(counts, idx): evicts excess[k] tokens of req_ids[over[k]] (at
        rows[over[k]], `attended` slotted), each group of one policy at once;
        runs in `over`'s order."""
        if over.size == len(req_ids):  # every request (the steady state)
            ids = req_ids
        else:
            ids = [req_ids[i] for i in over.tolist()]
        if len(self._by_index) == 2:  # one policy in use: one group, in order
            return self._evict_group(
                self._by_index[1], ids, rows[over], attended, excess
            )
        out = []
        pix = self._by_row["pix"][rows[over]]
        for p in np.unique(pix):
            sel = np.flatnonzero(pix == p)
            policy = self._by_index[p]
            group = ids if sel.size == len(ids) else [ids[i] for i in sel]
            counts, idx = self._evict_group(
                policy, group, rows[over[sel]], attended[sel], excess[sel]
            )
            out.append((sel, counts, idx))
        which, counts, idx = (np.concatenate(x) for x in zip(*out, strict=True))
        order = np.argsort(which, kind="stable")
        starts = (np.cumsum(counts) - counts)[order]
        return counts[order], idx[ranges(starts, counts[order])]

    def _evict_group(self, policy, ids, rows, attended, excess):
        """Evicts `excess` tokens of each of `ids` (one policy's requests):
        (counts, idx), idx ascending per request. A built-in's rule in one
        compiled pass; else its `evict_batch` over a `BatchView`."""
        rule = policy.lowest_rule(ids) if is_builtin(policy) else None
        scored = rule is not None and rule.key in ("score", "persistence")
        if rule is not None and (not scored or self.score_arena):
            seeds = self._by_row["seed"][rows]
            arena = self.score_arena(ids) if scored else None
            if integrity.CHECK:  # the rule chooses what evict_batch does
                want = self._choose(policy, ids, rows, attended, excess)[1:]
            counts, idx = self.pool.evict_lowest(
                rows, excess, attended, rule, seeds, arena
            )
            if integrity.CHECK:
                assert counts.tolist() == want[0].tolist(), (policy.name, "counts")
                assert idx.tolist() == want[1].tolist(), (policy.name, "victims")
            return counts, idx
        indptr, counts, chosen = self._choose(policy, ids, rows, attended, excess)
        self.pool.evict_rows(rows, indptr, chosen)
        return counts, chosen

    def _choose(self, policy, ids, rows, attended, excess):
        """(indptr, counts, idx) of `evict_batch`'s answer, checked, idx
        ascending per request; evicts nothing."""
        seg, idx, _ = self.pool.live_tokens(rows)
        indptr = indptr_of(np.bincount(seg, minlength=len(ids)))
        scores = None
        if policy.score_mode is not None:
            scores = self._batch_scores(policy, ids, idx, seg)
        evictable = idx < (attended - 1)[seg]
        seeds = self._by_row["seed"][rows].astype(np.uint64)
        rngs = _Generators(self._reqs, ids)
        # A copy of the ids: a step's list may be kept for the next (BatchMemo).
        batch = BatchView(list(ids), indptr, seg, idx, evictable, scores, seeds, rngs)
        counts, chosen = policy.evict_batch(batch, excess)
        counts, chosen = np.asarray(counts, np.int64), np.asarray(chosen, np.int64)
        cseg = np.arange(counts.size).repeat(counts)
        # A plug-in's answer is checked always, the built-ins' (tested against
        # the per-request reference) under VTOKEN_CHECK_INTEGRITY=1.
        if integrity.CHECK or not is_builtin(policy):
            check_answers(policy, ids, seg, idx, evictable, excess, counts, chosen)
        order = np.lexsort((chosen, cseg))
        return indptr_of(counts), counts, chosen[order]

    def _batch_scores(self, policy, ids, idx, seg) -> np.ndarray:
        if self.score_source is None:
            raise RuntimeError(
                f"policy {policy.name} needs {policy.score_mode!r} "
                "scores but the runtime has no score source"
            )
        if self.score_batch is not None:
            return np.asarray(self.score_batch(ids, idx, seg), dtype=np.float32)
        lo = np.searchsorted(seg, np.arange(len(ids) + 1))
        parts = [
            self.score_source(r, idx[lo[k] : lo[k + 1]]) for k, r in enumerate(ids)
        ]
        return np.concatenate([np.zeros(0, np.float32), *parts]).astype(np.float32)

    def reset_scores(self, req_id: str) -> None:
        """A preempted request's scores start over (its slots are reset)."""
        r = self._reqs.get(req_id)
        if r is not None and r.policy is not None:
            r.policy.reset_scores(req_id)

    def release(self, req_id: str) -> None:
        """Forgets a finished or aborted request (pool, generator, policy state)."""
        self.pool.release(req_id)
        r = self._reqs.pop(req_id)
        if r.policy is not None:
            r.policy.release(req_id)

    def _policy_of(
        self, evict: RequestEviction | None
    ) -> tuple[EvictionPolicy | None, int]:
        """(policy, budget) a request's settings give it ((None, 0): none)."""
        if evict is None:
            name, budget = self.policy.name, self.budget
        elif evict.evicts:
            name, budget = evict.policy, evict.budget
        else:
            name, budget = None, None
        if name is None or budget is None:
            return None, 0
        policy = self._policies.get((name, budget))
        if policy is None:
            # The engine's knobs configure the engine's policy; another policy a
            # request picks runs with its defaults.
            knobs = self.policy.knobs if name == self.policy.name else None
            policy = create_policy(name, budget, knobs)
            self._policies[(name, budget)] = policy
        return policy, budget

    def _view(
        self, req_id: str, num_attended: int, scores: np.ndarray | None
    ) -> RequestView:
        live_idx = self.pool.live_idx(req_id)
        return RequestView(
            req_id=req_id,
            live_idx=live_idx,
            evictable=live_idx < num_attended - 1,
            scores=scores,
            rng=self._reqs[req_id].rng,
            seed=self._reqs[req_id].seed,
        )


class _Generators(Sequence):
    """`BatchView.rngs`, looked up only when a policy reads one."""

    def __init__(self, reqs: dict[str, _Evicting], ids: list[str]) -> None:
        self._reqs, self._ids = reqs, ids

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, r):
        if isinstance(r, slice):
            return [self._reqs[i].rng for i in self._ids[r]]
        return self._reqs[self._ids[r]].rng


_NEVER = np.iinfo(np.int64).max  # a budget no request reaches (no policy)
_SEED = attrgetter("seed")


def _keeps_dead_listed(policy: EvictionPolicy | None) -> bool:
    return keeps_dead_listed(type(policy) if policy is not None else None)


def _syncs(policy: EvictionPolicy) -> bool:
    cls = type(policy)
    return (cls.sync_new_tokens, cls.sync_batch) != (
        EvictionPolicy.sync_new_tokens,
        EvictionPolicy.sync_batch,
    )
