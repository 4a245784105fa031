# SPDX-License-Identifier: Apache-2.0
"""What the workers of one engine agree on each step, under TP and PP.

Every rank keeps its own Token Tables, fed by the same `SchedulerOutput`, so
the tables agree by construction. What a rank sees differs, and only the
output rank's `ModelRunnerOutput` reaches the scheduler (vLLM's executors),
so that output must carry what every rank agrees on:

                  a rank holds          agreed over TP, then PP      reported
    scores        its heads' mass       all-reduce (sum, or max)     the step's gains
                  of its layers         on the device group
    KV copies     its own copy stream   all-reduce (min) of the      acknowledged
                                        batches completed            batches
    tables        its Token Tables      all-gather of a digest:      (assert)
                                        equal on every rank
                                        (VTOKEN_CHECK_INTEGRITY=1)

TP then PP covers the engine's TP x PP ranks and no further: each DP rank is
an engine with a scheduler of its own. Every call is a collective, so every
rank makes it at the same point of the same step, on conditions that are
equal on every rank (they come from the scheduler's messages).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm.config import ParallelConfig
    from vllm.vtoken.token_table import TokenTablePool


class RankGroups:
    """The TP and PP groups of this worker with more than one rank."""

    def __init__(self, groups: list) -> None:
        self._groups = groups

    @classmethod
    def of(cls, parallel: ParallelConfig) -> RankGroups:
        if parallel.tensor_parallel_size == parallel.pipeline_parallel_size == 1:
            return cls([])  # one rank: no process group is initialised
        from vllm.distributed import get_pp_group, get_tp_group

        return cls([g for g in (get_tp_group(), get_pp_group()) if g.world_size > 1])

    @property
    def single(self) -> bool:
        return not self._groups

    def reduce_scores(self, step: torch.Tensor, aggregate: str) -> torch.Tensor:
        """Every rank's per-key mass, summed ("mean": vLLM's own all-reduce,
        shared memory on CPU, custom or NCCL on GPU) or the max."""
        for g in self._groups:
            if aggregate == "max":
                max_op = torch.distributed.ReduceOp.MAX
                torch.distributed.all_reduce(step, op=max_op, group=g.device_group)
            else:
                step = g.all_reduce(step)
        return step

    def sum(self, value: int) -> int:
        return self._host(value, torch.distributed.ReduceOp.SUM)

    def min(self, value: int) -> int:
        return self._host(value, torch.distributed.ReduceOp.MIN)

    def _host(self, value: int, op) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        for g in self._groups:
            torch.distributed.all_reduce(t, op=op, group=g.cpu_group)
        return int(t.item())

    def check_same(self, pool: TokenTablePool, with_slots: bool) -> None:
        """Asserts that every rank's Token Tables equal this rank's (slots
        too when `with_slots`: no move is in flight on any rank)."""
        mine = table_digest(pool, with_slots)
        for g in self._groups:
            theirs: list[str | None] = [None] * g.world_size
            torch.distributed.all_gather_object(theirs, mine, group=g.cpu_group)
            assert len(set(theirs)) == 1, (
                f"Token Tables differ across the ranks of {g.unique_name}: {theirs}"
            )


class Acks:
    """Move batches submitted and not yet acknowledged, in submission order
    (a rank's copies complete in that order). A batch is acknowledged once
    its copy has completed on every rank: only then may the scheduler free
    its sources."""

    def __init__(self, ranks: RankGroups, synchronous: bool = False) -> None:
        """`synchronous`: copies complete when submitted (CPU), on every rank
        in the same step, so the ranks need not compare."""
        self._ranks = ranks
        self._agree = not (ranks.single or synchronous)
        self._ids: list[int] = []
        self._done = 0  # the first _done of _ids completed on this rank

    def submitted(self, batch_id: int) -> None:
        self._ids.append(batch_id)

    def completed(self) -> None:
        self._done += 1

    @property
    def in_flight(self) -> bool:
        """Unacknowledged batches exist (equal on every rank)."""
        return bool(self._ids)

    def take(self) -> list[int]:
        """The batches completed on every rank, each once (a collective
        under TP/PP when any is in flight)."""
        done = self._done
        if self._ids and self._agree:
            done = self._ranks.min(done)
        acked, self._ids = self._ids[:done], self._ids[done:]
        self._done -= done
        return acked


def table_digest(pool: TokenTablePool, with_slots: bool) -> str:
    """A hash of every request's tokens: ids, liveness, and slots."""
    ids = sorted(pool.request_ids())
    h = hashlib.sha256("\0".join(ids).encode())
    if ids:
        rows = pool.rows(ids)
        seg, idx, live, slot = pool.tokens(rows)
        parts = [pool.num_tokens_rows(rows), seg, idx, live]
        for part in parts + ([slot] if with_slots else []):
            h.update(np.ascontiguousarray(part).tobytes())
    return h.hexdigest()[:16]
