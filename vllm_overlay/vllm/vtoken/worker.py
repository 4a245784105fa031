# SPDX-License-Identifier: Apache-2.0
"""vToken's worker side: the slot map attention reads, and the KV moves.

`VTokenWorker` is what the patched model runner calls, once per step:

  begin_step         (in _update_states) forget finished requests, re-slot
                     resumed ones, apply the scheduler's dead lists, submit the
                     step's move batch to the copy executor, `apply_moves`;
  prepare_attention  (after _prepare_inputs) append the step's tokens at their
                     positional slots and publish the step's `TokenRead`: per
                     batch row, the live slots in logical order (query tokens
                     last), with the device's read plan built once for all layers;
  end_step           (building ModelRunnerOutput) fold this step's attention
                     scores, clear the read state, `apply_moves`, acknowledge.

and, outside the steps, `before_sleep` (vLLM's sleep: in-flight copies land)
and `after_wake_up` (what vToken keeps in the KV cache's memory pool).

`apply_moves` switches the tokens of every batch whose copy has completed to
their new slots (docs/DESIGN.md §3.3, C2: never before the copy landed).

The worker keeps its own Token Tables, fed by the same messages as the
scheduler's, so with several workers nothing but those messages is shared.
"""

from __future__ import annotations

from functools import partial
from itertools import chain
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.vtoken import integrity
from vllm.vtoken.arena import (
    attrs,
    block_shift,
    block_spans,
    each_distinct,
    lookup,
    ranges,
    span_slots,
    spans_of,
    values,
)
from vllm.vtoken.config import _ATTENTION_OP, UNBOUNDED_BUDGET
from vllm.vtoken.context import TokenRead, set_token_read
from vllm.vtoken.copy_executor import KVCopyExecutor
from vllm.vtoken.cpu_attention import cpu_read_plan
from vllm.vtoken.messages import MoveBatch, ScoreStep, VTokenWorkerOutput, owned
from vllm.vtoken.policies import create_policy
from vllm.vtoken.ranks import Acks, RankGroups
from vllm.vtoken.request_args import request_evictions
from vllm.vtoken.scores import ScoreAccumulator, window_rows
from vllm.vtoken.staging import HostToDevice
from vllm.vtoken.stats import VTokenCounters, timed
from vllm.vtoken.token_table import TokenTablePool

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm.v1.worker.utils import AttentionGroup

logger = init_logger(__name__)

# CachedRequestState.num_tokens (prompt + outputs) is a Python property: read
# its two terms through attrgetter maps instead, so that no Python code runs
# per request (DESIGN.md §7.1).
_NUM_PROMPT = attrgetter("num_prompt_tokens")
_OUTPUTS = attrgetter("output_token_ids")
_REQ_IDS = attrgetter("req_ids")
_SAMPLING = attrgetter("sampling_params")
_BLOCK_IDS = attrgetter("block_ids")
_FIRST_GROUP = itemgetter(0)
_KEEPS_DEAD_LISTED = attrgetter("keeps_dead_listed")


def refuse_unsupported_attention(vllm_config: VllmConfig) -> None:
    """Start-up check of the model's attention layers: the token read
    implements plain causal attention only, and would silently drop these."""
    layers = vllm_config.compilation_config.static_forward_context
    for name, layer in layers.items():
        impl = getattr(layer, "impl", None)
        found = [
            what
            for what, used in (
                ("ALiBi slopes", getattr(impl, "alibi_slopes", None) is not None),
                ("logit soft-capping", bool(getattr(impl, "logits_soft_cap", 0))),
                ("attention sinks", getattr(impl, "sinks", None) is not None),
            )
            if used
        ]
        if found:
            raise ValueError(
                f"--kv-eviction-policy {vllm_config.vtoken_config.kv_eviction_policy}"
                f" does not support {' and '.join(found)} (layer {name}): the "
                "token-level attention read does not implement them."
            )


def fp8_read_of(
    vllm_config: VllmConfig, gpu_has_fp8: bool
) -> tuple[torch.dtype | None, bool]:
    """(kv_dtype, fp8_query) of the model's TRITON_ATTN layers: the type
    their fp8 KV cache's bytes are read as (None: the model's dtype), from
    the layers themselves, as a checkpoint's kv_cache_scheme may set it
    past the start-up check of --kv-cache-dtype (hence refused here too on
    a GPU without fp8, `gpu_has_fp8` False); and whether vLLM hands them the
    query quantized to fp8 (Attention.query_quant, CUDA), as the read's
    kernels then see it."""
    layers = vllm_config.compilation_config.static_forward_context.values()
    for layer in layers:
        impl = getattr(layer, "impl", None)
        if not str(getattr(impl, "kv_cache_dtype", "")).startswith("fp8"):
            continue
        if not gpu_has_fp8:
            raise ValueError(
                "vToken's token read takes an fp8 KV cache on GPUs with fp8 "
                "only (CUDA: compute capability 8.9 and later)"
            )
        quant = getattr(layer, "query_quant", None) is not None
        return impl.fp8_dtype, quant and impl.supports_quant_query_input
    return None, False


def assert_attention_splits_graphs(vllm_config: VllmConfig) -> None:
    """GPU: CUDA graphs must run attention eagerly (a splitting op), or a
    graph would replay vLLM's read of every block, freed ones included. The
    config refuses the combinations that break this; this checks the result."""
    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if mode is None or mode.name == "NONE":
        return
    assert _ATTENTION_OP in (compilation.splitting_ops or ()), (
        f"vToken needs {_ATTENTION_OP} among the graph-splitting ops "
        f"(cudagraph_mode {mode.name}, splitting_ops {compilation.splitting_ops})"
    )


class VTokenWorker:
    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_caches: list[torch.Tensor],
        attn_groups: Sequence[Sequence[AttentionGroup]] = (),
        token_table: torch.Tensor | None = None,
    ) -> None:
        """`attn_groups`: the model runner's, whose TRITON_ATTN metadata
        builders hold the split-KV buffers the start-up warm-up reads.
        `token_table`: the buffer `reserve_token_table` gave the model
        runner in its profile run (GPU; default: one allocated here)."""
        refuse_unsupported_attention(vllm_config)
        self.cfg = cfg = vllm_config.vtoken_config
        self.block_size = B = vllm_config.cache_config.block_size
        self._shift = block_shift(B)
        device = kv_caches[0].device
        num_blocks = kv_caches[0].shape[1 if device.type == "cpu" else 0]
        self.pool = TokenTablePool(num_blocks, B)
        policy = create_policy(
            cfg.kv_eviction_policy, UNBOUNDED_BUDGET, cfg.policy_knobs()
        )
        self.scores = ScoreAccumulator.of_policy(policy, device)  # the step's
        layout = "cpu" if device.type == "cpu" else "triton"
        # CPU cache [2, N, H, B, D]: the read plan addresses V rows per KV head.
        self._num_kv_heads = kv_caches[0].shape[2] if layout == "cpu" else 0
        self.executor = KVCopyExecutor(kv_caches, layout, B)
        if layout == "cpu":  # numba: compile (or load) now, not in a step
            import vllm.vtoken.read_kernels  # noqa: F401
        if layout == "triton":  # compile now, not in the first requests' steps
            from vllm.vtoken.triton_attention import split_kv_buffers, warm_up

            assert_attention_splits_graphs(vllm_config)
            self.executor.warm_up()
            heads = vllm_config.model_config.get_num_attention_heads(
                vllm_config.parallel_config
            )
            # Query heads per KV head: the score kernel's tiles are sized by it.
            self._group = heads // kv_caches[0].shape[3]
            from vllm.platforms import current_platform

            kv_dtype, fp8_query = fp8_read_of(
                vllm_config, current_platform.supports_fp8()
            )
            warm_up(
                kv_caches[0],
                heads,
                self.scores,
                split_kv_buffers(attn_groups),
                kv_dtype=kv_dtype,
                model_dtype=vllm_config.model_config.dtype,
                fp8_query=fp8_query,
            )
            if token_table is None:  # no profile run: nothing to size around
                token_table = self.reserve_token_table(vllm_config, device)
                logger.warning(
                    "vToken: no profile run reserved the token table; %d MiB "
                    "allocated now, outside vLLM's memory profile",
                    token_table.numel() * 4 >> 20,
                )
        self._token_table = token_table
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        self._ranks = RankGroups.of(parallel)
        # One PP rank: the input batch holds each row's prompt + outputs
        # (num_tokens_no_spec; on a rank before the last, the chunk's end).
        self._totals_in_batch = parallel.pipeline_parallel_size == 1
        # Scores are summed over layers and query heads (every rank's, under
        # TP and PP: ranks.py); normalise to a mean.
        local = len(kv_caches) * model.get_num_attention_heads(parallel)
        self._score_norm = float(self._ranks.sum(local))
        # Every rank moves the same slots, each with its own heads (TP) and
        # layers (PP): the bytes reported are all ranks' (kv_copy_bytes).
        self._slot_bytes_all = self._ranks.sum(self.executor.slot_bytes)
        self._pending: dict[int, MoveBatch] = {}
        self._acks = Acks(self._ranks, synchronous=layout == "cpu")
        self._open = False  # a step began and has not ended
        self._read: TokenRead | None = None
        # The step's read, for folding scores: its request ids and the logical
        # token of each key (TokenRead.kv_slots order).
        self._read_keys: tuple[list[str], np.ndarray] | None = None
        self._device = device
        self._stage = HostToDevice(device)  # the read plan's one upload a step
        # Requests whose policy reads attention scores: the token read always
        # covers them, for their scores (vLLM's kernels return no
        # probabilities); their output is its only once they have a dead token.
        self._scored: dict[str, bool] = {}
        # The last batch's rows (and whether each is scored), and the last
        # dead lists' (arena.BatchMemo).
        self._batch, self._dead = self.pool.memo(), self.pool.memo()
        self.counters = VTokenCounters()  # worker_ns only
        if integrity.CHECK:  # for its scheduler, in the same process
            integrity.share_worker_pool(cfg, self.pool)

    @staticmethod
    def reserve_token_table(
        vllm_config: VllmConfig, device: torch.device
    ) -> torch.Tensor | None:
        """GPU: the buffer each step's token table is laid in, sized for the
        largest step (triton_plan.reserve_token_table). The model runner
        allocates it in its profile run and keeps it, so that vLLM's memory
        profile counts it and sizes the KV cache around it. None on CPU
        (the CPU read has no table) or with vToken off."""
        if not vllm_config.vtoken_config.enabled or torch.device(device).type == "cpu":
            return None
        from vllm.vtoken.triton_plan import reserve_token_table

        return reserve_token_table(
            vllm_config.scheduler_config.max_num_seqs,
            vllm_config.model_config.max_model_len,
            device,
        )

    @timed("worker_ns")
    def begin_step(self, so: SchedulerOutput) -> None:
        self._open = True
        pool = self.pool
        # The batches still copying (GPU side stream): their requests, in C.
        pending_reqs = set(chain.from_iterable(map(_REQ_IDS, self._pending.values())))
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        if pending_reqs and (
            not pending_reqs <= so.num_scheduled_tokens.keys()
            or not pending_reqs.isdisjoint(resumed)
        ):
            # Not scheduled: finished, preempted (also outside a step, which
            # no preempted_req_ids reports: the scheduler's
            # reset_prefix_cache(reset_running_requests=True)); or preempted
            # so and resumed at once. Their blocks may be handed out again
            # this step: copies first (a resumed row's switch is then
            # skipped below: its row is reset first, pool.apply_moves).
            self.executor.wait_all()
        done = [rid for rid in so.finished_req_ids if rid in pool]
        if done:  # released for the batch at once
            pool.release_many(done)
            for rid in done:
                del self._scored[rid]
        step = so.vtoken
        # The step's dead first, then the resumed rows' reset, in the
        # scheduler's order: a request preempted between steps (vLLM's
        # reset_prefix_cache(reset_running_requests=True)) and resumed at once
        # was evicted, while slotted, just before (before_preempting_all).
        # The message's arrays as our own (messages.owned): from another
        # process they may be views of the transport's buffers.
        if step is not None and step.dead_req_ids:
            (rows,) = self._dead.get(step.dead_req_ids, lambda b: (pool.rows(b),))
            pool.evict_rows(rows, owned(step.dead_indptr), owned(step.dead_idx))
        for rid in resumed:
            if rid in pool:
                pool.reset_slots(rid)
        if step is not None:
            if step.moves is not None:
                m = step.moves.received()
                self._pending[m.batch_id] = m
                self._acks.submitted(m.batch_id)
                self.executor.submit(m.batch_id, m.src_slots, m.dst_slots)
        self.apply_moves()

    def before_sleep(self) -> None:
        """vLLM's sleep (level 1 or 2) discards the KV cache. Every request
        was aborted or preempted before (its pause), but a move batch's copy
        may still be writing the cache on the side stream: it lands first.
        The scheduler dropped such batches with their requests, and takes
        their acknowledgements, whenever they come, as of dropped batches."""
        self.executor.synchronize()

    def after_wake_up(self) -> None:
        """vLLM woke the KV cache's memory pool: what vToken allocated in it
        (with the cache, at start-up) is rewritten."""
        self.executor.after_wake_up()

    def apply_moves(self) -> None:
        """The paper's `apply_moves`, worker side: batches whose copy completed
        switch their tokens to the new slots, and are acknowledged next."""
        for batch_id in self.executor.poll():
            b = self._pending.pop(batch_id)
            self.pool.apply_moves(b.req_ids, b.indptr, b.idx, b.dst_slots)
            self._acks.completed()

    @timed("worker_ns")
    def prepare_attention(
        self,
        input_batch: InputBatch,
        requests: dict[str, CachedRequestState],
        num_scheduled: np.ndarray,
    ) -> None:
        """Slot the step's tokens and publish the live slots for attention.

        Only requests with a dead token take their output from the token read;
        requests whose policy reads scores are read for their attention masses
        too. The two mix in a step: vLLM's kernel writes every row, then the
        token read overwrites the rows of requests with a dead token (so the
        others get vLLM's output to the bit until their first eviction).
        """
        B, pool = self.block_size, self.pool
        num_reqs = input_batch.num_reqs
        rids = input_batch.req_ids[:num_reqs]
        slot_mapping = input_batch.block_table[0].slot_mapping.np
        computed = input_batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        counts = num_scheduled[:num_reqs].astype(np.int64)
        qsl = pool.offsets(counts)
        rows, scored = self._batch.get(rids, lambda b: self._rows_of(b, requests))
        new = slot_mapping[: qsl[-1]]
        # Append, then the keys of the rows read: live tokens before the
        # step, then every query token. A query token may be dead when a
        # preempted request recomputes its KV; it is attended this once and
        # stays dead afterwards. Rows not read get no keys: vLLM's kernel
        # reads their positional KV. One compiled call (DESIGN §10).
        writes, kv_indptr, idx, kv_np, stock = pool.append_read(
            rows, computed, counts, new, scored,
            partial(self._with_hits, rids, requests, counts, new),
        )  # fmt: skip
        if kv_np.size == 0:
            return  # nobody reads through the token table this step
        score_rows = None
        if self.scores is not None:
            self.scores.begin_step(kv_np.size)
            self._read_keys = (list(rids), idx)
            if self.scores.query_window is not None:
                # Prompt and outputs so far. With one PP rank, vLLM's array
                # (its objects' reads were ~60 µs a step at 1,024 requests);
                # with more, the same on every rank from the objects (a
                # non-last rank's num_tokens_no_spec is the chunk's end).
                if self._totals_in_batch:
                    total = input_batch.num_tokens_no_spec[:num_reqs].astype(np.int64)
                else:
                    reqs = values(requests, rids)
                    total = attrs(reqs, _NUM_PROMPT)
                    outputs = map(len, map(_OUTPUTS, reqs))
                    total += np.fromiter(outputs, np.int64, len(reqs))
                assert not integrity.CHECK or total.tolist() == [
                    requests[r].num_tokens for r in rids
                ], "a row's tokens are not its prompt + outputs"
                score_rows = window_rows(
                    self.scores.query_window, total, computed, counts
                )
        if self._device.type == "cpu":
            kv_slots = torch.from_numpy(kv_np)
            plan = cpu_read_plan(
                qsl, kv_indptr, kv_np, self._shift, self._num_kv_heads, writes,
                score_rows,
            )  # fmt: skip
        else:
            from vllm.vtoken.triton_plan import build_triton_read_plan

            scores = self.scores
            plan = build_triton_read_plan(
                qsl,
                kv_indptr,
                kv_np,
                B,
                writes,
                scored=scores is not None,
                score_query_window=score_rows,
                score_group=self._group,
                stage=self._stage,
                table_buffer=self._token_table,
            )
            kv_slots = plan.kv_slots
        self._read = TokenRead(
            query_start_loc=qsl,
            kv_indptr=kv_indptr,
            kv_slots=kv_slots,
            plan=plan,
            scores=self.scores,
            with_stock=stock,
            score_rows=score_rows,
        )
        set_token_read(self._read)

    def _rows_of(self, rids: list[str], requests) -> tuple:
        """The batch's rows (a new request gets one) and whether each reads
        scores: read again only when the batch changes (`BatchMemo`)."""
        rows = self.pool.rows_adding(rids, lambda new: self._add(new, requests))
        return rows, lookup(self._scored, rids, bool)

    def _add(self, rids: list[str], requests: dict[str, CachedRequestState]) -> None:
        # First sight of the step's new requests, at once: a Token Table each
        # (kept as the scheduler keeps theirs: EvictionRuntime.register_many),
        # and whether its policy reads scores; read once a setting.
        evicts = request_evictions(
            list(map(_SAMPLING, values(requests, rids))), self.cfg
        )
        keep = each_distinct(evicts, _KEEPS_DEAD_LISTED)
        self.pool.add_requests(rids, np.array(keep, bool))
        scores = self.scores is not None
        scored = each_distinct(evicts, lambda e: scores and e.score_mode is not None)
        self._scored.update(zip(rids, scored, strict=True))

    def _with_hits(self, rids, requests, counts, new, start, hits) -> np.ndarray:
        """The step's slots with each request's prefix-cache hits (tokens
        [start, num_computed), from its block table) before its new tokens.
        Runs on a request's first step only (or its resume): the step's
        such requests at once (a system prompt shared: each new one hits)."""
        B, total = self.block_size, hits + counts
        out = np.empty(int(total.sum()), dtype=np.int64)
        first = np.cumsum(total) - total
        out[ranges(first + hits, counts)] = new
        hit = np.flatnonzero(hits)
        if hit.size:
            lo, n = start[hit], hits[hit]
            b0, b1 = block_spans(lo, n, B)
            states = values(requests, list(map(rids.__getitem__, hit.tolist())))
            lists = map(_FIRST_GROUP, map(_BLOCK_IDS, states))  # group 0's ids
            ids = np.fromiter(spans_of(lists, b0.tolist(), b1.tolist()), np.int64)
            assert ids.size == int((b1 - b0).sum()), "a block table is too short"
            out[ranges(first[hit], n)] = span_slots(ids, lo, n, B)
        return out

    def end_stage(self) -> None:
        """PP, a rank before the last: its step ends when it has sent its
        activations on (vLLM's sample_tokens), with the same agreement as
        the last rank's `end_step`; only the last rank's output is kept."""
        if self._open:
            self.end_step()

    def end_step(self) -> VTokenWorkerOutput:
        acked, copy_bytes, scores = self._end_step()
        # The running total with this hook's own time, added as the timed
        # call returns (read inside it, each step's lagged a step's).
        return VTokenWorkerOutput(
            acked_batches=acked,
            copy_bytes=copy_bytes,
            host_ns=self.counters.worker_ns,
            scores=scores,
        )

    @timed("worker_ns")
    def _end_step(self) -> tuple[list[int], int, ScoreStep | None]:
        self._open = False
        if integrity.CHECK and not self._ranks.single:  # before a reduce over them
            self._ranks.check_same(self.pool, with_slots=not self._acks.in_flight)
        read, self._read = self._read, None
        set_token_read(None)
        step_scores = None
        if read is not None and self.scores is not None:
            (rids, key_idx), self._read_keys = self._read_keys, None
            self.scores.reduce_step(self._ranks.reduce_scores)
            step_scores = self.scores.take_step(
                rids, read.kv_indptr, key_idx, read.query_start_loc, self._score_norm
            )
        self.apply_moves()
        acked = self._acks.take()
        copied = self.executor.bytes_copied // self.executor.slot_bytes
        return acked, copied * self._slot_bytes_all, step_scores
