"""policies/selection.py: the batch choices agree with one request at a time,
in the compiled kernel's scans (a few victims) and its sort (more)."""

import numpy as np
import pytest

from vllm.vtoken.policies import base, selection


def random_batch(rng, num_reqs=40, nan=0.0):
    lens = rng.integers(1, 30, num_reqs)
    indptr = np.r_[0, np.cumsum(lens)]
    seg = np.repeat(np.arange(num_reqs), lens)
    idx = np.concatenate([np.sort(rng.choice(60, n, replace=False)) for n in lens])
    evictable = rng.random(seg.size) < 0.9
    # Few distinct keys: ties everywhere, broken oldest first.
    scores = rng.integers(0, 4, seg.size).astype(np.float32)
    scores[rng.random(seg.size) < nan] = np.nan
    return base.BatchView(
        [f"r{i}" for i in range(num_reqs)],
        indptr,
        seg,
        idx,
        evictable,
        scores,
        np.zeros(num_reqs, np.uint64),
        [None] * num_reqs,
    )


def by_request(batch, want, protected):
    out = []
    for r in range(len(batch.req_ids)):
        view = batch.request(r)
        lo, hi = batch.indptr[r], batch.indptr[r + 1]
        out.append(
            base.select_lowest(view, int(want[r]), view.scores, protected[lo:hi])
        )
    return out


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("most", [1, 3, 12])  # 12: past the scans, the sort
@pytest.mark.parametrize("nan", [0.0, 0.2])
def test_lowest_batch_equals_select_lowest_per_request(seed, most, nan):
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, nan=nan)
    want = rng.integers(1, most + 1, len(batch.req_ids))
    protected = selection.recent_batch(batch, int(rng.integers(0, 4)))
    expected = by_request(batch, want, protected)
    counts, idx = selection.lowest_batch(batch, want, batch.scores, protected)
    runs = np.split(idx, np.cumsum(counts)[:-1])
    assert [sorted(r.tolist()) for r in runs] == [sorted(e.tolist()) for e in expected]


def small_batch(lens, scores):
    n = len(lens)
    seg = np.repeat(np.arange(n), lens)
    idx = np.concatenate([np.arange(k) for k in lens] + [np.zeros(0, int)])
    return base.BatchView(
        [f"r{i}" for i in range(n)],
        np.r_[0, np.cumsum(lens)],
        seg,
        idx,
        np.ones(seg.size, bool),
        np.asarray(scores, np.float32),
        np.arange(n, dtype=np.uint64),
        [None] * n,
    )


def test_a_nan_score_still_gives_each_request_its_victims():
    """(Review) The rounds' minimum is NaN for a request with a NaN score: the
    fast path would pick nothing there while reporting a pick."""
    batch = small_batch([4, 4], [np.nan, 1, 2, 3, 4, 5, 0, 7])
    counts, idx = selection.lowest_batch(
        batch, np.array([1, 1]), batch.scores, np.zeros(8, bool)
    )
    assert counts.tolist() == [1, 1] and idx.size == 2 and idx[1] == 2


def test_an_empty_request_wanting_nothing_is_no_error():
    batch = small_batch([3, 0], [3, 1, 2])
    counts, idx = selection.lowest_batch(
        batch, np.array([1, 0]), batch.scores, np.zeros(3, bool)
    )
    assert counts.tolist() == [1, 0] and idx.tolist() == [1]


def test_random_evicts_from_an_empty_batch_without_error():
    from vllm.vtoken.policies import create_policy

    counts, idx = create_policy("random", 4).evict_batch(
        small_batch([0, 0], []), np.array([1, 1])
    )
    assert counts.tolist() == [0, 0] and idx.size == 0


def test_arrival_steps_count_each_request_s_own_steps():
    """ArrivalSteps: a request counts a step only when it brings tokens, a
    token's age is the steps since it arrived plus one, and a region grows
    past its first 16 entries (RowArena.reserve) with every step kept."""
    born = selection.ArrivalSteps()
    born.add(["a", "b"], np.array([20, 3]))  # both: step 1
    born.add(["a", "b"], np.array([1, 0]))  # a: step 2 (b brings none)
    born.add(["b", "a"], np.array([30, 1]))  # b: step 2 (grows), a: step 3
    idx = {"a": [0, 19, 20, 21], "b": [0, 2, 3, 32]}
    view = base.BatchView(
        ["a", "b"],
        np.array([0, 4, 8]),
        np.repeat([0, 1], 4),
        np.array(idx["a"] + idx["b"]),
        np.ones(8, bool),
        None,
        np.zeros(2, np.uint64),
        [None, None],
    )
    assert born.age(view).tolist() == [3, 3, 2, 1, 2, 2, 1, 1]
