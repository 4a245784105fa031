"""ScoreAccumulator's compiled fold and read (fold_kernels) against a dict of
per-request float32 arrays updated the way the docstring says."""

import numpy as np
import pytest

from vllm.vtoken.messages import ScoreStep
from vllm.vtoken.scores import ScoreAccumulator


@pytest.mark.parametrize("window", [None, 3])
def test_folds_and_reads_equal_a_per_request_reference(window):
    rng = np.random.default_rng(0)
    mode = "persistence" if window else "sum"
    acc = ScoreAccumulator(mode, window=window)
    ref: dict[str, np.ndarray] = {}
    names = [f"r{i}" for i in range(6)]
    for _ in range(20):
        ids = list(rng.choice(names, size=rng.integers(1, 5), replace=False))
        idx = [
            np.sort(rng.choice(300, rng.integers(1, 40), replace=False)) for _ in ids
        ]
        gain = [rng.random(i.size).astype(np.float32) for i in idx]
        acc.fold(
            ScoreStep(
                req_ids=ids,
                indptr=np.r_[0, np.cumsum([i.size for i in idx])],
                key_idx=np.concatenate(idx),
                gain=np.concatenate(gain),
            )
        )
        for rid, i, g in zip(ids, idx, gain, strict=True):
            a = ref.setdefault(rid, np.zeros(300, np.float32))
            if window is None:
                a[i] += g
            else:
                a[i] += (g - a[i]) / np.float32(window)
        # Every request (some never scored) at every index (some never seen).
        q_ids = [*names, "never"]
        seg = rng.integers(0, len(q_ids), 200)
        q_idx = rng.integers(0, 400, 200)
        got = acc.scores_rows(q_ids, q_idx, seg)
        want = [
            ref[q_ids[s]][i] if q_ids[s] in ref and i < 300 else 0.0
            for s, i in zip(seg, q_idx, strict=True)
        ]
        np.testing.assert_array_equal(got, np.asarray(want, np.float32))


def persistence_reference(mass, indptr, queries, norm) -> np.ndarray:
    """Key p of K, Q queries last: a decode's at least 1 / K of the mass
    (mass * K >= norm, ties exact); a prefill's at least what uniform
    attention gives it over the rows that see it, sum_{m > max(K - Q, p)}
    1 / m (summed from 1 / K down, as the kernel does)."""
    out = []
    for r in range(len(indptr) - 1):
        k, q = indptr[r + 1] - indptr[r], min(queries[r], indptr[r + 1] - indptr[r])
        for p in range(k):
            m = float(mass[indptr[r] + p])
            if q <= 1:
                out.append(m * k >= norm * queries[r])
            else:
                uniform = 0.0
                for x in range(k, max(k - q, p), -1):
                    uniform += 1.0 / x
                out.append(m >= norm * uniform)
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("seed", range(5))
def test_the_compiled_persistence_gain_is_the_reference(seed):
    # Ties included: integer masses make exact decode ties common.
    from vllm.vtoken import fold_kernels

    rng = np.random.default_rng(seed)
    klen = rng.integers(0, 40, 30)
    indptr = np.r_[0, np.cumsum(klen)]
    mass = rng.integers(0, 6, indptr[-1]).astype(np.float32)
    mass[rng.random(mass.size) < 0.5] *= 0.37
    queries = np.where(rng.random(klen.size) < 0.5, 1, rng.integers(2, 50, klen.size))
    norm = float(rng.integers(1, 9))
    got = fold_kernels.persistence_gain(mass, indptr, queries, norm)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(
        got, persistence_reference(mass, indptr, queries, norm)
    )
    assert 0 < got.sum() < got.size


def test_uniform_attention_over_a_prefill_makes_every_key_important():
    """Causal uniform attention over a 100-token prompt: row i gives each of
    its i + 1 keys 1 / (i + 1). Every key got what uniform attention gives,
    so every key is important; averaged over all 100 rows, keys 37-99 (seen
    by fewer rows) read as unimportant (found by review)."""
    from vllm.vtoken import fold_kernels

    n, norm = 100, 4.0  # 4 heads x layers, each uniform
    mass = np.array([sum(1 / (i + 1) for i in range(p, n)) for p in range(n)])
    mass = (mass * norm).astype(np.float32) * np.float32(1 + 1e-6)  # float32 round
    got = fold_kernels.persistence_gain(mass, np.array([0, n]), np.array([n]), norm)
    assert got.all()
    # A key given less than that is not: half of uniform, every key.
    got = fold_kernels.persistence_gain(mass / 2, np.array([0, n]), np.array([n]), norm)
    assert not got.any()


@pytest.mark.parametrize("mode", ["sum", "persistence"])
def test_take_step_gains_are_numpys_to_the_bit(mode):
    """The worker's one compiled pass (fold_kernels.step_gains) against the
    NumPy it replaced: mass / norm in float32 (NumPy's promotion), or the
    persistence flags (the reference above); requests without keys left out
    of the step."""
    import torch

    from vllm.vtoken.scores import ScoreAccumulator

    rng = np.random.default_rng(3)
    klen = rng.integers(0, 40, 30)
    klen[[0, 7, 29]] = 0  # not read this step
    indptr, qsl = np.r_[0, np.cumsum(klen)], np.r_[0, np.cumsum(rng.integers(1, 5, 30))]
    mass = (rng.random(indptr[-1]) * 7).astype(np.float32)
    idx = np.concatenate([np.arange(n) for n in klen])
    acc = ScoreAccumulator(mode)
    acc.begin_step(mass.size)
    acc.add(torch.arange(mass.size), torch.from_numpy(mass))
    rids = [f"r{i}" for i in range(30)]
    step = acc.take_step(rids, indptr, idx, qsl, 6.0)
    if mode == "sum":
        want = (mass / 6.0).astype(np.float32)
    else:
        want = persistence_reference(mass, indptr, np.diff(qsl), 6.0)
    np.testing.assert_array_equal(step.gain, want.astype(np.float32))
    read = klen.nonzero()[0]
    assert step.req_ids == [rids[r] for r in read]
    np.testing.assert_array_equal(step.indptr, np.r_[0, np.cumsum(klen[read])])
    assert step.key_idx is idx
    with pytest.raises(ValueError, match="disagree"):
        acc.begin_step(mass.size)
        acc.take_step(rids, indptr, idx, qsl[:-1], 6.0)


def test_the_step_buffer_is_kept_and_zeroed_each_step():
    """begin_step reuses one buffer (no allocation a step, which at 1,024
    requests is page faults on the step's path) and zeroes what the step
    uses: a step's masses do not leak into the next one's gains."""
    import torch

    from vllm.vtoken.scores import ScoreAccumulator

    acc = ScoreAccumulator("sum")
    acc.begin_step(100)
    kept = acc._step.data_ptr()
    acc.add(torch.arange(100), torch.full((100,), 3.0))
    acc.take_step(["a"], np.array([0, 100]), np.arange(100), np.array([0, 1]), 1.0)
    acc.begin_step(60)  # smaller: the same memory, zeroed
    assert acc._step.data_ptr() == kept
    acc.add(torch.tensor([5]), torch.tensor([2.0]))
    step = acc.take_step(["a"], np.array([0, 60]), np.arange(60), np.array([0, 1]), 1.0)
    want = np.zeros(60, np.float32)
    want[5] = 2.0
    np.testing.assert_array_equal(step.gain, want)
    acc.begin_step(250)  # larger: a new buffer, zeroed too
    assert acc._step.numel() == 250
    step = acc.take_step(
        ["a"], np.array([0, 250]), np.arange(250), np.array([0, 1]), 1.0
    )
    assert not step.gain.any()  # no layer read scores: no gain


@pytest.mark.parametrize("aggregate", ["mean", "max"])
def test_a_steps_first_in_order_masses_are_copied_into_the_kept_buffer(aggregate):
    """The buffer is not zeroed at begin_step: the first layer's masses in
    read order are copied in (as adding them to zeros, or their max with
    zeros, would give), the next layers' added; a scatter, a reduce or a
    step no layer read zero it first. Last step's masses never leak."""
    import torch

    from vllm.vtoken.scores import ScoreAccumulator

    def gains(layers, n=50):
        acc = ScoreAccumulator("sum", aggregate=aggregate)
        acc.begin_step(n)
        acc.add(None, torch.full((n,), 7.0))  # a step that leaves its masses
        acc.take_step(["a"], np.array([0, n]), np.arange(n), np.array([0, 1]), 1.0)
        acc.begin_step(n)
        for pos, mass in layers:
            acc.add(pos, mass)
        idx = np.arange(n)
        return acc.take_step(["a"], np.array([0, n]), idx, np.array([0, 1]), 1.0).gain

    m1, m2 = torch.rand(50), torch.rand(50)
    combine = torch.maximum if aggregate == "max" else torch.add
    np.testing.assert_array_equal(gains([(None, m1)]), m1.numpy())
    np.testing.assert_array_equal(gains([(None, m1), (None, m2)]), combine(m1, m2))
    pos = torch.arange(50).flip(0)  # a scatter first: from zeros
    np.testing.assert_array_equal(gains([(pos, m1)]), m1.flip(0).numpy())
    np.testing.assert_array_equal(gains([]), np.zeros(50, np.float32))
    # A rank whose layers read nothing reduces zeros, not the last step's
    # masses, with the others' (TP/PP: the reduce sums every rank's buffer).
    other = torch.rand(50)
    acc = ScoreAccumulator("sum", aggregate=aggregate)
    acc.begin_step(50)
    acc.add(None, torch.full((50,), 7.0))
    acc.take_step(["a"], np.array([0, 50]), np.arange(50), np.array([0, 1]), 1.0)
    acc.begin_step(50)
    acc.reduce_step(lambda buf, agg: combine(buf, other))
    step = acc.take_step(["a"], np.array([0, 50]), np.arange(50), np.array([0, 1]), 1.0)
    np.testing.assert_array_equal(step.gain, other.numpy())


def test_one_ranks_step_buffer_is_read_in_place(monkeypatch):
    """On CPU, take_step reads the step buffer through the NumPy view kept
    with it (no Tensor.cpu() a step), also after one rank's reduce, which
    returns the buffer itself; a reduce that returns another tensor (TP,
    PP) is read from that tensor."""
    import torch

    from vllm.vtoken.scores import ScoreAccumulator

    cpu, calls = torch.Tensor.cpu, []

    def counted_cpu(self, *args, **kwargs):
        calls.append(self.numel())
        return cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counted_cpu)
    acc, n = ScoreAccumulator("sum"), 40
    one = (["a"], np.array([0, n]), np.arange(n), np.array([0, 1]), 1.0)
    mass, other = torch.rand(n), torch.rand(n)
    acc.begin_step(n)
    acc.add(None, mass)
    acc.reduce_step(lambda buf, agg: buf)  # one rank: no group to reduce over
    np.testing.assert_array_equal(acc.take_step(*one).gain, mass.numpy())
    assert calls == []
    acc.begin_step(n)
    acc.add(None, mass)
    acc.reduce_step(lambda buf, agg: buf + other)  # another rank's masses
    np.testing.assert_array_equal(acc.take_step(*one).gain, (mass + other).numpy())
    assert calls == [n]
    acc.begin_step(n)  # the next step's buffer: in place again
    acc.add(None, other)
    np.testing.assert_array_equal(acc.take_step(*one).gain, other.numpy())
    assert calls == [n]
    # Replaced, then reduced again by an identity (the replacement itself):
    # still the replacement that is read, not the step buffer under it.
    acc.begin_step(n)
    acc.add(None, mass)
    acc.reduce_step(lambda buf, agg: buf + other)
    acc.reduce_step(lambda buf, agg: buf)
    np.testing.assert_array_equal(acc.take_step(*one).gain, (mass + other).numpy())
