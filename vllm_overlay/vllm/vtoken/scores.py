# SPDX-License-Identifier: Apache-2.0
"""Attention scores for score-based eviction policies, per request and token.

Two halves, one class: the worker's instance holds the step buffer the
attention path writes, the scheduler's the running scores the policies read.
What crosses between them is one `ScoreStep` per step (a float per key read),
so any executor ships a step's worth, never the running state.

Scores are indexed by request and **logical** token, never by KV slot: two
requests that share prefix-cache blocks read the same slots, and each must
score them with its own queries only (a per-slot score mixed them, and a new
request's reset of its hit slots wiped the owner's history). Compaction moves
no score (the logical index does not change), and a token's score starts at
zero when it first appears.

    prepare   begin_step(K)            a zeroed device buffer, one entry per key
                                       of the step's TokenRead, in read order
    forward   add(pos, mass)           per layer, the mass each key received
    end_step  take_step(...)           one device-to-host copy: each key's gain
                                       (fold_kernels.step_gains)
    on_output fold(step)               (scheduler) one fold into
                                       acc[rid][logical idx], batch-wide
                                       (rows of an arena.RowArena):

    "sum"          acc += mass / (num_layers * num_heads)         (H2O)
    "window"       the same, but a step's mass comes from each request's
                   rows inside its prefill's last `query_window` positions
                   (`window_rows`, whatever the chunks; a decode step's row):
                   a prefill scores the prompt by its observation window
                   (SnapKV)
    "persistence"  imp = 1 if mass / norm >= what uniform attention gives
                   the key over the query rows that see it (a decode row:
                   1 / num_keys; fold_kernels.persistence_gain) (the token
                   was important this step; Scissorhands), then
                   acc += (imp - acc) / window: the moving average of imp
                   over `window` steps (acc += imp without a window)

`aggregate` "mean" (the default) sums the mass over layers and query heads and
divides by their number (norm); "max" keeps, per key, the largest mass one
query head of one layer gave it (summed over the step's queries), norm 1: a
token any head relies on counts fully, which approximates the union of
per-head H2O selections (one slot holds every head's K/V, so eviction is per
token).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.vtoken.arena import BatchMemo, RowArena, indptr_of
from vllm.vtoken.messages import ScoreStep

SCORE_MODES = ("sum", "persistence", "window")


class ScoreAccumulator:
    """Running scores: float32 per request and logical token."""

    def __init__(
        self,
        mode: str,
        device: str | torch.device = "cpu",
        window: int | None = None,
        aggregate: str = "mean",
        query_window: int | None = None,
    ) -> None:
        """
        Args:
            mode: "sum" (accumulated attention mass), "persistence" (how
                often the token was important) or "window" (SnapKV's).
            device: Where the step buffer lives (the KV cache's device).
            window: "persistence": average importance over this many steps
                (>= 1); None counts the steps.
            aggregate: "mean" or "max" over layers and query heads (above).
            query_window: "window": the prefill's last query rows that count
                (>= 1); the worker counts each step's with `window_rows`.
        """
        assert mode in SCORE_MODES and aggregate in ("mean", "max"), (mode, aggregate)
        assert window is None or (mode == "persistence" and window >= 1), window
        assert (mode == "window") == (query_window is not None), query_window
        assert query_window is None or query_window >= 1, query_window
        self.mode = mode
        self.window = window
        self.aggregate = aggregate
        self.query_window = query_window
        self.device = torch.device(device)
        # Per row beside its scores: the next victim of its "score" rule,
        # found by the fold (fold_kernels.fold: `rule` is the rule's recent
        # + 1, set by the eviction; `cand` the token + 1, valid for the
        # `cand_end` and `cand_keys` it was taken at).
        self._acc = RowArena(
            {"acc": (np.float32, 0.0)}, ("rule", "cand", "cand_end", "cand_keys")
        )
        # The rows of the last batch folded, and read (arena_of).
        self._folded, self._read = BatchMemo(self._acc), BatchMemo(self._acc)
        from vllm.vtoken import fold_kernels  # numba: only with vToken on

        self._k = fold_kernels
        # The step buffer is a view of `_buf`, kept across steps: a fresh
        # zeroed tensor a step is an allocation (on CPU, past ~128 KiB, page
        # faults: a 1,024-request step's keys) on the step's path.
        self._buf = torch.zeros(0, dtype=torch.float32, device=self.device)
        self._step = self._empty = self._buf
        # Their sizes as Python ints, and on CPU the buffer as NumPy, for
        # take_step: a torch call where the hooks run (numel, cpu, numpy),
        # cold after the forward, costs some 3-8 us (64 requests, in-engine).
        self._buf_len = self._step_len = 0
        self._reduced = False  # the step buffer replaced by reduce_step's
        self._host = self._buf.numpy() if self.device.type == "cpu" else None
        # Not zeroed yet: the first layer's in-order masses are copied in
        # rather than added to zeros (a memset of every key a step, ~30 us at
        # 1,024 requests on the caches the forward left); anything else
        # reading the buffer zeroes it first (`_zeroed`).
        self._unset = False

    @classmethod
    def of_policy(cls, policy, device="cpu") -> ScoreAccumulator | None:
        """The accumulator a policy's scores need (None: it reads none)."""
        if not policy.score_mode:
            return None
        return cls(
            policy.score_mode,
            device,
            policy.score_window,
            policy.score_aggregate,
            policy.score_query_window,
        )

    def begin_step(self, num_keys: int) -> None:
        """A zeroed step buffer for the `num_keys` keys of the step's read
        (the kept buffer's first `num_keys` entries; it doubles when short),
        zeroed lazily (`_unset`)."""
        if self._buf_len < num_keys:
            size = self._buf_len = max(num_keys, 2 * self._buf_len)
            self._buf = torch.empty(size, dtype=torch.float32, device=self.device)
            if self._host is not None:
                self._host = self._buf.numpy()
        self._step, self._step_len = self._buf[:num_keys], num_keys
        self._reduced = False
        self._unset = True  # zeroed when first read, unless copied into

    def add(self, pos: torch.Tensor | None, attn_mass: torch.Tensor) -> None:
        """Adds one layer's attention mass to the step buffer.

        Args:
            pos: int [n] positions of the keys in the step's read order
                (`TokenRead.kv_slots`); None: every key, in that order.
            attn_mass: float [n] probability mass each key received this layer,
                summed over query rows, and over heads ("mean") or the most
                one head gave ("max").
        """
        mass = attn_mass.to(self.device, torch.float32)
        if pos is None:  # in order: no scatter (max: the buffer starts at 0)
            assert mass.numel() == self._step.numel(), "a mass for every key"
            if self._unset:  # 0 + mass, or max(0, mass): masses are >= 0
                self._step.copy_(mass)
                self._unset = False
            elif self.aggregate == "max":
                torch.maximum(self._step, mass, out=self._step)
            else:
                self._step.add_(mass)
            return
        idx = torch.as_tensor(pos, device=self.device).to(torch.int64)
        self._zeroed()
        if self.aggregate == "max":
            self._step.scatter_reduce_(0, idx, mass, "amax")
        else:
            self._step.index_add_(0, idx, mass)

    def reduce_step(self, reduce) -> None:
        """The step buffer becomes `reduce(step_buffer, aggregate)`: under TP
        and PP, every rank's masses (each covers its heads of its layers;
        ranks.py)."""
        self._zeroed()
        step = reduce(self._step, self.aggregate)
        # One rank: the buffer itself, still read through its view (and once
        # replaced, replaced for the step: a second reduce returns its own).
        self._reduced = self._reduced or step is not self._step
        self._step = step

    def _zeroed(self) -> None:
        # The step buffer as begin_step promised it, before it is read.
        if self._unset:
            self._step.zero_()
            self._unset = False

    def finish_step(self, req_ids, key_indptr, key_idx, query_start_loc, norm):
        """`fold(take_step(...))`, both halves in one process, of any int
        sequences (tests)."""
        i64 = [np.asarray(a, np.int64) for a in (key_indptr, key_idx, query_start_loc)]
        self.fold(self.take_step(req_ids, *i64, float(norm)))

    def take_step(
        self,
        req_ids: list[str],
        key_indptr: np.ndarray,
        key_idx: np.ndarray,
        query_start_loc: np.ndarray,
        norm: float,
    ) -> ScoreStep:
        """Worker side: the step buffer as each key's gain, for `fold` (one
        device-to-host copy and one compiled pass, fold_kernels.step_gains).

        Args:
            req_ids: [R] the step's requests, in read order.
            key_indptr: int64 [R + 1] request r's keys (empty: not read).
            key_idx: int64 [K] the logical token of each key, distinct per
                request.
            query_start_loc: int64 [R + 1] request r's query rows this step.
            norm: num_layers * num_heads (> 0), a float.
        """
        n = len(key_idx)
        assert norm > 0 and n == self._step_len, (norm, n, self._step_len)
        self._zeroed()  # no layer read scores: no mass
        if self._host is not None and not self._reduced:  # the CPU buffer's
            mass = self._host[:n]
        else:
            mass = self._step.cpu().numpy()  # the step's one device-to-host copy
        if self.aggregate == "max":
            norm = 1.0  # one head of one layer, not their sum
        gain, read, indptr = self._k.step_gains(
            mass, key_indptr, query_start_loc, norm, self.mode == "persistence"
        )
        self._step, self._step_len = self._empty, 0
        n = len(req_ids)
        return ScoreStep(
            req_ids=list(req_ids)
            if read.size == n
            else [req_ids[r] for r in read.tolist()],
            indptr=indptr,
            key_idx=key_idx,
            gain=gain,
        )

    def fold(self, step: ScoreStep, known=None) -> None:
        """Scheduler side: adds a step's gains to the running scores, of the
        requests in `known` only (default: all; a finished request's scores
        must not come back)."""
        ids, indptr, idx, gain = step.req_ids, step.indptr, step.key_idx, step.gain
        if known is not None and not all(map(known.__contains__, ids)):
            keep = np.fromiter(map(known.__contains__, ids), bool, len(ids))
            sel = np.repeat(keep, np.diff(indptr))
            ids = [r for r, k in zip(ids, keep.tolist(), strict=True) if k]
            idx, gain = idx[sel], gain[sel]
            indptr = indptr_of(np.diff(indptr)[keep])
        if not ids:
            return
        acc = self._acc
        (rows,) = self._folded.get(  # first sight: a row
            ids, lambda ids: (acc.rows_adding(ids),)
        )
        # Added, or with a window a moving average (not a count); a region
        # grows (rarely: it doubles) before the fold that needs it.
        c = acc.cols  # the next victims' columns (fold_kernels.fold)
        victims = c["rule"], c["cand"], c["cand_end"], c["cand_keys"]
        step_args, w = (rows, indptr, idx, gain), self.window or 0
        if not self._k.fold(
            *step_args, acc.start, acc.cap, acc.data["acc"], w, *victims
        ):
            acc.reserve(rows, np.maximum.reduceat(idx, indptr[:-1]) + 1)
            done = self._k.fold(
                *step_args, acc.start, acc.cap, acc.data["acc"], w, *victims
            )
            assert done, "fold: regions reserved, yet short"

    def scores(self, req_id: str, idx: np.ndarray) -> np.ndarray:
        """float32 [n]: `req_id`'s scores of logical tokens `idx` (0: unseen)."""
        row = self._acc.index.get(req_id)
        return self.scores_rows([req_id] if row is not None else [], idx)

    def scores_rows(self, req_ids: list[str], idx: np.ndarray, seg=None) -> np.ndarray:
        """float32 [n]: the scores of tokens idx[j] of requests req_ids[seg[j]]
        (seg: all 0 when None), 0 for a token or request never scored."""
        idx = np.asarray(idx, dtype=np.int64)
        if not req_ids or not self._acc.index:
            return np.zeros(idx.size, dtype=np.float32)
        rows = self._acc.rows_or_missing(req_ids)
        seg = np.zeros(idx.size, np.int64) if seg is None else np.asarray(seg, np.int64)
        a = self._acc
        return self._k.gather(rows, seg, idx, a.start, a.cap, a.data["acc"])

    def arena_of(self, req_ids: list[str]):
        """(rows, start, cap, acc, rule, cand, cand_end, cand_keys): where
        the scores of `req_ids` are (rows -1: never scored) and the per-row
        columns of the fold's next victim, for a compiled pass to read them
        in place (the one-pass eviction: TokenTablePool.evict_lowest)."""
        a = self._acc
        (rows,) = self._read.get(req_ids, lambda ids: (a.rows_or_missing(ids),))
        c = a.cols
        return (
            rows, a.start, a.cap, a.data["acc"],
            c["rule"], c["cand"], c["cand_end"], c["cand_keys"],
        )  # fmt: skip

    def release(self, req_id: str) -> None:
        """Forgets a request's scores (finished, or preempted: they restart)."""
        if req_id in self._acc.index:
            self._acc.remove(req_id)


def window_rows(
    window: int, num_tokens: np.ndarray, computed: np.ndarray, counts: np.ndarray
) -> np.ndarray:
    """int64 [R]: the step's query rows whose attention counts toward
    "window" scores (SnapKV), per request of `num_tokens` tokens that computes
    `counts` from `computed`: its last ones within the final `window`
    positions of the prefill, so that a prompt prefilled in chunks is scored
    by its last queries only, as in one chunk; a decode step's rows (up to
    `window`)::

        prompt of 100 tokens, window 32: chunks [0, 60) [60, 90) [90, 100)
        counted rows                               0        22        10
    """
    end = np.asarray(computed, np.int64) + counts
    late = end - np.asarray(num_tokens, np.int64) + window  # rows past T - window
    rows = np.minimum(counts, late)
    # Clipped to [0, window] by two ufuncs: np.clip is ~10 Python-level
    # calls, every step of a SnapKV batch.
    np.maximum(rows, 0, out=rows)
    return np.minimum(rows, window, out=rows)
