"""ranks.py: what the ranks of one engine agree on, on two real gloo ranks."""

from __future__ import annotations

import json
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm.vtoken.ranks import Acks, RankGroups
from vllm.vtoken.token_table import TokenTablePool


def pool_with(evicted: list[int], slots_from: int = 0) -> TokenTablePool:
    pool = TokenTablePool(num_blocks=8, block_size=4)
    pool.add_request("A")
    pool.append("A", np.arange(slots_from, slots_from + 6))
    pool.evict("A", np.asarray(evicted, dtype=np.int64))
    return pool


def agree(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    world = dist.group.WORLD
    group = SimpleNamespace(
        world_size=2, device_group=world, cpu_group=world, unique_name="tp:0"
    )
    group.all_reduce = lambda t: (dist.all_reduce(t, group=world), t)[1]
    ranks, got = RankGroups([group]), {}
    step = torch.tensor([1.0 + rank, 2.0 * rank, 0.5])
    got["sum"] = ranks.reduce_scores(step, "mean").tolist()
    step = torch.tensor([1.0 + rank, 2.0 * rank, 0.5])
    got["max"] = ranks.reduce_scores(step, "max").tolist()
    got["host"] = [ranks.sum(3 + rank), ranks.min(3 + rank)]

    # Rank 1's copy of batch 11 is still in flight: only batch 10 is acked.
    acks = Acks(ranks)
    acks.submitted(10)
    acks.submitted(11)
    acks.completed()
    if rank == 0:
        acks.completed()
    got["acks"] = [acks.take()]
    if rank == 1:
        acks.completed()
    got["acks"] += [acks.take(), acks.take()]

    # Slots may differ while a move is in flight, liveness never.
    ranks.check_same(pool_with([1, 2], slots_from=4 * rank), with_slots=False)
    try:
        ranks.check_same(pool_with([1, 2], slots_from=4 * rank), with_slots=True)
        got["slots_differ"] = "passed"
    except AssertionError as err:
        got["slots_differ"] = str(err)
    try:
        ranks.check_same(pool_with([1, 2 + rank]), with_slots=True)
        got["dead_differ"] = "passed"
    except AssertionError as err:
        got["dead_differ"] = str(err)
    pathlib.Path(out, f"{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def agreed(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("ranks")
    init = f"file://{tmp / 'rendezvous'}"
    mp.start_processes(agree, args=(init, str(tmp)), nprocs=2, start_method="spawn")
    return [json.loads((tmp / f"{r}.json").read_text()) for r in range(2)]


def test_scores_are_summed_or_maxed_over_the_ranks(agreed):
    for got in agreed:
        assert got["sum"] == [3.0, 2.0, 1.0]
        assert got["max"] == [2.0, 2.0, 0.5]
        assert got["host"] == [7, 3]


def test_a_batch_is_acked_once_every_rank_copied_it(agreed):
    for got in agreed:
        assert got["acks"] == [[10], [11], []]


def test_tables_that_differ_across_ranks_fail_the_check(agreed):
    for got in agreed:
        assert "Token Tables differ across the ranks of tp:0" in got["slots_differ"]
        assert "Token Tables differ" in got["dead_differ"]


def test_one_rank_agrees_with_itself_without_a_process_group():
    ranks = RankGroups([])
    step = torch.tensor([0.25, 0.5])
    assert ranks.reduce_scores(step, "mean").tolist() == [0.25, 0.5]
    assert ranks.single
    assert ranks.sum(5) == 5 and ranks.min(5) == 5
    acks = Acks(ranks)
    acks.submitted(3)
    assert acks.in_flight and acks.take() == []
    acks.completed()
    assert acks.take() == [3] and not acks.in_flight


def test_synchronous_copies_are_acked_without_asking_the_other_ranks():
    """CPU: every rank's copy completes when submitted, in the same step."""

    class NoCollectives(RankGroups):
        def min(self, value: int) -> int:
            raise AssertionError("a collective for synchronous copies")

    ranks = NoCollectives([SimpleNamespace()])
    acks = Acks(ranks, synchronous=True)
    acks.submitted(12)
    acks.completed()
    assert not ranks.single and acks.take() == [12]
    with pytest.raises(AssertionError, match="a collective"):
        asynchronous = Acks(ranks)
        asynchronous.submitted(13)
        asynchronous.take()
