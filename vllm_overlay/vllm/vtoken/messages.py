# SPDX-License-Identifier: Apache-2.0
"""What vToken sends between the scheduler and the worker each step.

Scheduler -> worker: `VTokenStep`, on `SchedulerOutput.vtoken` (newly dead tokens
and at most one batch of KV moves). Worker -> scheduler: `VTokenWorkerOutput`, on
`ModelRunnerOutput.vtoken_output` (move batches whose copy completed, and the
step's attention-score gains that H2O, Scissorhands and SnapKV fold into their
scores: one float per key read, `ScoreStep`).

Both are fresh objects every step, made of flat arrays and lists, and nothing
in them is mutated after the hand-off, so a multi-process executor pickles a
step's worth, never a running state. Numpy arrays travel out of band.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np


def owned(a: np.ndarray) -> np.ndarray:
    """An int64 copy of a received index array that the receiver owns.

    vLLM's message queue sends arrays of 1 MiB or more out of band, and they
    arrive as views of its buffers: of the shared-memory ring, reused once
    the message is read (a move batch is held until its copy lands), or of
    a read-only zmq frame (a message over the ring's chunk, a remote
    reader), which numba's kernels refuse."""
    return np.array(a, np.int64)


@dataclass(frozen=True, kw_only=True)
class MoveBatch:
    """KV moves planned in one step; the worker acknowledges them as a whole.

    Request r's moves are entries [indptr[r], indptr[r + 1]) of the flat arrays.
    """

    batch_id: int
    req_ids: list[str]
    indptr: np.ndarray  # int64 [num_reqs + 1]
    idx: np.ndarray  # int64 [num_moves]: logical token index
    src_slots: np.ndarray  # int64 [num_moves]
    dst_slots: np.ndarray  # int64 [num_moves]

    def received(self) -> MoveBatch:
        """This batch with arrays of its own (`owned`): the worker keeps it
        until its copy lands and hands its arrays to compiled loops."""
        return replace(
            self,
            indptr=owned(self.indptr),
            idx=owned(self.idx),
            src_slots=owned(self.src_slots),
            dst_slots=owned(self.dst_slots),
        )

    def __repr__(self) -> str:  # SchedulerOutput is logged on engine errors
        return (
            f"MoveBatch(id={self.batch_id}, reqs={len(self.req_ids)}, "
            f"moves={len(self.idx)})"
        )


@dataclass(frozen=True, kw_only=True)
class VTokenStep:
    """Scheduler -> worker control plane for one step."""

    # Newly dead tokens, CSR: dead_req_ids[r] lost dead_idx[indptr[r]:...].
    dead_req_ids: list[str] = field(default_factory=list)
    dead_indptr: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    dead_idx: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    moves: MoveBatch | None = None

    @property
    def dead(self) -> dict[str, np.ndarray]:
        """The dead lists by request (for tests and logs; not the step path)."""
        ptr = self.dead_indptr
        return {
            r: self.dead_idx[ptr[i] : ptr[i + 1]]
            for i, r in enumerate(self.dead_req_ids)
        }

    def __repr__(self) -> str:
        n = len(self.dead_idx)
        return f"VTokenStep(dead={n}, moves={self.moves!r})"


@dataclass(frozen=True, kw_only=True)
class ScoreStep:
    """One step's score gains (scores.py): request req_ids[r]'s keys are
    entries [indptr[r], indptr[r + 1]) of `key_idx` (logical tokens,
    distinct; the worker's are ascending, which the fold's choice of the
    next victim needs) and `gain` (what the step adds to each token's
    score)."""

    req_ids: list[str]
    indptr: np.ndarray  # int64 [R + 1]
    key_idx: np.ndarray  # int64 [K]
    gain: np.ndarray  # float32 [K]

    def received(self) -> ScoreStep:
        """These gains as arrays the compiled fold takes: read-only views of
        the transport's buffers (a zmq frame: a message over the ring's
        chunk, or a remote reader; `owned`) copied, writable ones as they
        are (the fold reads them at once and keeps none)."""
        # Not all() over a generator: five Python calls a step, cold.
        indptr, key_idx, gain = self.indptr, self.key_idx, self.gain
        if indptr.flags.writeable and key_idx.flags.writeable and gain.flags.writeable:
            return self
        return replace(
            self,
            indptr=owned(self.indptr),
            key_idx=owned(self.key_idx),
            gain=np.array(self.gain, np.float32),
        )

    def __repr__(self) -> str:
        return f"ScoreStep(reqs={len(self.req_ids)}, keys={len(self.key_idx)})"


@dataclass(frozen=True, kw_only=True)
class VTokenWorkerOutput:
    """Worker -> scheduler: completed move batches, attention scores."""

    acked_batches: list[int] = field(default_factory=list)
    copy_bytes: int = 0  # running total of KV bytes the worker's moves wrote
    host_ns: int = 0  # running total of the worker's time in its vToken hooks
    scores: ScoreStep | None = None  # this step's score gains, if scored
