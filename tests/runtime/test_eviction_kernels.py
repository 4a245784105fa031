"""The one-pass eviction of the built-ins' rules (eviction_kernels.py, through
EvictionRuntime) evicts exactly what their `evict_batch` does, on tables with
dead history, unscored tokens, ties and NaN scores."""

import numpy as np
import pytest

from vllm.vtoken import integrity
from vllm.vtoken.eviction import EvictionRuntime
from vllm.vtoken.messages import ScoreStep
from vllm.vtoken.policies import create_policy
from vllm.vtoken.policies.base import LowestRule, is_builtin
from vllm.vtoken.scores import ScoreAccumulator
from vllm.vtoken.token_table import TokenTablePool

B = 4
RULES = {
    "h2o": {"recent_ratio": 0.25},
    "streamingllm": {"num_sinks": 1},
    "random": {},
    "snapkv": {"window": 3},
    "scissorhands": {"recent_ratio": 0.25, "history_window": 3},
}


def rules(name: str, budget: int) -> dict:
    """RULES[name], SnapKV's window below `budget` (which it must be)."""
    if name == "snapkv":
        return {"window": min(RULES[name]["window"], budget - 1)}
    return RULES[name]


def generic(policy):
    """The same policy, not a built-in: the runtime calls its evict_batch."""
    cls = type(policy)
    return type("Generic" + cls.__name__, (cls,), {"__module__": __name__})(
        policy.budget, **policy.knobs
    )


def runtime(policy, num_blocks):
    """A runtime for `policy` over a fresh pool, with scores if it reads any."""
    acc = ScoreAccumulator("sum") if policy.score_mode else None
    rt = EvictionRuntime(
        TokenTablePool(num_blocks, B),
        policy,
        policy.budget,
        seed=5,
        score_source=acc.scores if acc else None,
        score_batch=acc.scores_rows if acc else None,
        score_arena=acc.arena_of if acc else None,
    )
    return rt, rt.pool, acc


def build(policy, rng, num_reqs, scored):
    """A runtime whose requests have grown, been evicted and scored at random."""
    rt, pool, acc = runtime(policy, num_reqs * 40)
    rids = [f"r{i}" for i in range(num_reqs)]
    lens = rng.integers(1, 30, num_reqs)
    blocks = rng.permutation(pool.num_blocks)
    for i, rid in enumerate(rids):
        own = blocks[i * 8 : i * 8 + -(-lens[i] // B)]  # blocks of its own
        slots = (own[:, None] * B + np.arange(B)).ravel()[: lens[i]]
        rt.sync_new_tokens(rid, slots)
        dead = np.flatnonzero(rng.random(lens[i]) < 0.3)
        if dead.size:
            pool.evict(rid, dead)
    if acc is not None:
        for i, rid in enumerate(rids):
            if rid in scored:
                keys = pool.live_idx(rid)[: rng.integers(0, lens[i] + 1)]
                gain = rng.integers(0, 3, keys.size).astype(np.float32)
                gain[rng.random(keys.size) < 0.1] = np.nan
                if keys.size:
                    indptr = np.array([0, keys.size])
                    acc.fold(
                        ScoreStep(req_ids=[rid], indptr=indptr, key_idx=keys, gain=gain)
                    )
    return rt, rids


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("budget", [2, 4, 12])
def test_the_rule_evicts_what_evict_batch_does(name, seed, budget, monkeypatch):
    monkeypatch.setattr(integrity, "CHECK", False)  # not the runtime's own check
    policy = create_policy(name, budget, rules(name, budget))
    out, pools = [], []
    for pol in (policy, generic(policy)):
        if name == "snapkv":  # past their first eviction: the decode rule
            pol._pooled.update(f"r{i}" for i in range(30))
        rng = np.random.default_rng(seed)
        rt, rids = build(pol, rng, 30, scored={f"r{i}" for i in range(0, 30, 2)})
        assert isinstance(pol.lowest_rule(rids), LowestRule)
        attended = rng.integers(0, 32, len(rids))
        which, counts, idx = rt.enforce_budgets(rids, attended)
        out.append((which.tolist(), counts.tolist(), idx.tolist()))
        pools.append(rt.pool)
    assert is_builtin(policy) and not is_builtin(generic(policy))
    assert out[0] == out[1]
    assert sum(out[0][1]) > 0
    a, b = pools
    for rid in a.request_ids():
        assert a.dead_idx(rid).tolist() == b.dead_idx(rid).tolist()
        assert a.live_idx(rid).tolist() == b.live_idx(rid).tolist()
    np.testing.assert_array_equal(a.block_live, b.block_live)
    assert a.total_live() == b.total_live()
    a.check_integrity()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("sinks", [0, 1, 3])
@pytest.mark.parametrize("keep_dead", [True, False])
def test_the_index_rule_evicts_what_evict_batch_does_on_either_kind_of_list(
    seed, sinks, keep_dead, monkeypatch
):
    """StreamingLLM's rule ("index": the oldest candidates first) on lists
    with no dead and on lists keeping dead entries at either end and in
    between (kill_rows' two kinds of row), rows preempted and re-slotted
    part way (an unslotted tail), attended short of the slotted, and budgets
    under the sinks + window (protected tokens go too): it evicts what
    evict_batch does, and leaves the same live tokens."""
    monkeypatch.setattr(integrity, "CHECK", False)
    cls = type(create_policy("streamingllm", 8, {}))
    monkeypatch.setattr(cls, "scatters_victims", not keep_dead)
    out, pools = [], []
    for budget in (2, 5, 9):
        policy = create_policy(
            "streamingllm", max(budget, sinks + 1), {"num_sinks": sinks}
        )
        for pol in (policy, generic(policy)):
            rng = np.random.default_rng(seed)
            rt, pool, _ = runtime(pol, 4096)
            rids, top = [f"r{i}" for i in range(24)], 0
            for rid in rids:
                n = int(rng.integers(1, 40))
                rt.sync_new_tokens(rid, np.arange(top, top + n))
                top += n
                live = pool.live_idx(rid)
                dead = live[rng.random(live.size) < rng.choice([0.0, 0.2, 0.6])]
                if rng.random() < 0.3:  # the newest die too
                    dead = np.union1d(dead, live[-int(rng.integers(1, 4)) :])
                if dead.size and dead.size < live.size:
                    pool.evict(rid, dead)
                if rng.random() < 0.3:  # preempted, re-slotted part way
                    pool.reset_slots(rid)
                    k = int(rng.integers(0, n + 1))
                    rt.sync_new_tokens(rid, np.arange(top, top + k))
                    top += k
            attended = np.array([pool.num_slotted(r) for r in rids])
            attended -= rng.integers(0, 3, len(rids)) * (rng.random(len(rids)) < 0.3)
            which, counts, idx = rt.enforce_budgets(rids, np.maximum(attended, 0))
            out.append((which.tolist(), counts.tolist(), idx.tolist()))
            pools.append(pool)
        assert out[-2] == out[-1], budget
        assert sum(out[-1][1]) > 0
        a, b = pools[-2:]
        for rid in a.request_ids():
            assert a.live_idx(rid).tolist() == b.live_idx(rid).tolist()
        a.check_integrity()


@pytest.mark.parametrize("budget", [15, 19])  # 5 victims (the lowest draws), 1
def test_a_list_without_dead_is_read_in_place_up_to_its_slotted_end(
    budget, monkeypatch
):
    """A row whose list holds no dead (Random's: its victims leave the list at
    once) is read where it lies, so its tail not slotted again after a
    preemption must be cut off as listed_live's copy does: counted, the
    draws' nonce (the newest token) would be one not slotted (5 victims:
    other draws, other victims; one: another position)."""
    monkeypatch.setattr(integrity, "CHECK", False)
    out = []
    policy = create_policy("random", budget, {})
    for pol in (policy, generic(policy)):
        rt, pool, _ = runtime(pol, 64)
        rt.sync_new_tokens("r", np.arange(20))
        pool.reset_slots("r")  # preempted: 20 live, listed, none slotted
        rt.sync_new_tokens("r", np.arange(20, 33))  # re-slotted 13 of them
        which, counts, idx = rt.enforce_budgets(["r"], np.array([13]))
        out.append((counts.tolist(), idx.tolist()))
    assert out[0] == out[1]
    assert out[0][0] == [20 - budget]


def test_the_index_rule_reads_a_list_keeping_dead_off_its_two_ends():
    """StreamingLLM's steady state (eviction_kernels._oldest_candidates):
    the k oldest candidates past the live sinks, the counts off the tail
    (the unslotted and the protected newest), or none where the
    candidates are fewer than k (the caller walks the list)."""
    from vllm.vtoken.eviction_kernels import _oldest_candidates

    # Logical tokens 0..11 listed; 1 (a sink), 2, 3, 5 dead; slotted below
    # 11 (end), attended 10 (last 9): 9 and 10 protected, 11 unslotted.
    listed = np.arange(12, dtype=np.int32)
    live = np.ones(12, bool)
    live[[1, 2, 3, 5]] = False
    out = np.full(8, -1, np.int64)

    def take(k, sinks=2, recent=2, m=3):
        n_live = int(live.sum())
        got = _oldest_candidates(
            listed, live, 0, 12, n_live, 11, 9, sinks, recent, k, out, m
        )
        return out[m:got].tolist()

    # live slotted 0 4 6 7 8 9 10: candidates past the sink 0 and before the
    # window (9, 10) are 4 6 7 8
    assert take(1) == [4] and take(3) == [4, 6, 7] and take(4) == [4, 6, 7, 8]
    assert take(5) == []  # fewer than 5: declined
    assert take(2, recent=4) == [4, 6] and take(3, recent=4) == []
    assert take(3, sinks=5) == [6, 7, 8] and take(4, sinks=5) == []
    # 10 dead too: the tail's bits count (9 protected, 11 unslotted), and
    # with no window the protected bound alone ends the candidates.
    live[10] = False
    assert take(4, recent=0) == [4, 6, 7, 8] and take(5, recent=0) == []
    live[10] = True
    out[:] = -1  # written at out[m:m + k] only
    assert take(2, m=5) == [4, 6] and out.tolist() == [-1] * 5 + [4, 6, -1]


def test_a_request_over_by_many_takes_the_sorted_path():
    # More than a few victims: the stable sort, not the scans, ties by age.
    policy = create_policy("h2o", 2, {"recent_ratio": 0.0})
    every = {"r0", "r1", "r2", "r3"}
    rt, rids = build(policy, np.random.default_rng(0), 4, scored=every)
    ref, _ = build(generic(policy), np.random.default_rng(0), 4, scored=every)
    att = np.full(4, 40)
    assert [x.tolist() for x in rt.enforce_budgets(rids, att)] == [
        x.tolist() for x in ref.enforce_budgets(rids, att)
    ]


def test_snapkv_evicts_by_evict_batch_until_its_requests_are_pooled():
    policy = create_policy("snapkv", 4, {"window": 2})
    assert policy.lowest_rule(["a"]) is None  # its first eviction pools
    policy._pooled.add("a")
    assert policy.lowest_rule(["a"]) == LowestRule("score", recent=2)
    assert policy.lowest_rule(["a", "b"]) is None


def test_a_plug_in_subclass_of_a_built_in_keeps_its_own_evict_batch():
    calls = []
    base = create_policy("h2o", 2)

    class Mine(type(base)):
        def evict_batch(self, batch, num_evict):
            calls.append(len(batch.req_ids))
            return super().evict_batch(batch, num_evict)

    rt, rids = build(Mine(2), np.random.default_rng(1), 6, scored=set())
    rt.enforce_budgets(rids, np.full(6, 40))
    assert len(calls) == 1  # its evict_batch chose, not the rule


def test_under_deep_checks_the_runtime_compares_the_two(monkeypatch):
    """VTOKEN_CHECK_INTEGRITY=1 runs evict_batch beside the rule and asserts
    they agree: a rule that disagrees is caught."""
    monkeypatch.setattr(integrity, "CHECK", True)
    policy = create_policy("streamingllm", 3, {"num_sinks": 1})
    rt, rids = build(policy, np.random.default_rng(2), 8, scored=set())
    monkeypatch.setattr(
        type(policy), "lowest_rule", lambda self, ids: LowestRule("index", sinks=0)
    )
    with pytest.raises(AssertionError, match="victims"):
        rt.enforce_budgets(rids, np.full(8, 40))


def tables(pool):
    """The whole arena, in two parts: live lists and bits; the counters and
    block counts. Both paths kill through kill_rows with the row's
    `keep_dead`, so even the dead each list holds agree."""
    a = pool._a
    return (
        [a.data["listed"].tolist(), a.data["live"].tolist()],
        [c.tolist() for c in a.cols.values()] + [pool.block_live.tolist()],
    )


def run_steps(policy, seed, num_reqs=10, steps=30):
    """Steps of growth, preemption, scores and eviction; after each, what
    was evicted and the whole arena (`tables`)."""
    rng = np.random.default_rng(seed)
    rt, pool, acc = runtime(policy, 2048)
    top, rids, out = 0, [f"r{i}" for i in range(num_reqs)], []
    for t in range(steps):
        for rid in rids:
            if t and rng.random() < 0.05:  # preempted: slots and scores go
                pool.reset_slots(rid)
                if acc is not None:
                    acc.release(rid)
            known = pool.num_tokens(rid) if rid in pool else 0
            slotted = pool.num_slotted(rid) if rid in pool else 0
            n = int(rng.integers(0, known - slotted + 1 if slotted < known else 4))
            n = n if t else int(rng.integers(1, 20))
            if n:
                rt.sync_new_tokens(rid, np.arange(top, top + n))
                top += n
        if acc is not None:
            for rid in rids:
                keys = pool.live_idx(rid)
                if keys.size and rng.random() < 0.6:
                    gain = rng.integers(0, 3, keys.size).astype(np.float32)
                    gain[rng.random(keys.size) < 0.05] = np.nan
                    ind = np.array([0, keys.size])
                    acc.fold(
                        ScoreStep(req_ids=[rid], indptr=ind, key_idx=keys, gain=gain)
                    )
        attended = np.array([pool.num_slotted(r) for r in rids])
        attended += rng.integers(-2, 2, len(rids))
        out.append([x.tolist() for x in rt.enforce_budgets(rids, attended)])
        out.extend(tables(pool))  # two entries: a step is three
        pool.check_integrity()
    return out


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("seed", range(3))
def test_step_after_step_the_rule_leaves_the_tables_as_evict_batch_does(
    name, seed, monkeypatch
):
    monkeypatch.setattr(integrity, "CHECK", False)
    policy = create_policy(name, 3, rules(name, 3))
    ref = generic(policy)
    if name == "snapkv":
        for pol in (policy, ref):
            pol._pooled.update(f"r{i}" for i in range(10))
    got, want = run_steps(policy, seed), run_steps(ref, seed)
    assert sum(len(s[2]) for s in got[::3]) > 0  # it evicted
    assert got == want


def decode_steps(policy, seed, steps=40, num_reqs=20):
    """Steps of decodes as the engine runs them: a token each, the live keys
    of most requests scored in one multi-request step (the worker reads
    them all; gains with ties, NaN, infinities and -0.0), one victim a
    request at its budget. Some steps perturb a request after its fold:
    preempted and resumed (its scores restart), a token slotted or evicted
    with no fold after it, attended short of the slotted. Returns, after
    each step, what was evicted and the tables; and how many one-victim
    evictions found the fold's choice valid (taken without a walk)."""
    rng = np.random.default_rng(seed)
    rt, pool, acc = runtime(policy, 4096)
    rids, top, out, ready = [f"r{i}" for i in range(num_reqs)], 0, [], 0
    for rid in rids:
        n = int(rng.integers(1, 12))
        rt.sync_new_tokens(rid, np.arange(top, top + n))
        top += n
    values = np.array([0, 1, 2, -0.0, np.nan, np.inf, -np.inf], np.float32)
    for _ in range(steps):
        read = [r for r in rids if pool.num_live(r) and rng.random() < 0.9]
        keys = [pool.live_idx(r) for r in read]
        gain = values[rng.choice(7, sum(map(len, keys)), p=[0.28] * 3 + [0.04] * 4)]
        ind = np.cumsum([0] + [k.size for k in keys])
        key_idx = np.concatenate(keys + [np.zeros(0, np.int64)])
        acc.fold(ScoreStep(req_ids=read, indptr=ind, key_idx=key_idx, gain=gain))
        attended = np.array([pool.num_slotted(r) for r in rids])
        for i, rid in enumerate(rids):  # after the fold, before the eviction
            what = rng.random()
            if what < 0.04:  # preempted, then its tokens slotted again
                n = pool.num_slotted(rid)
                pool.reset_slots(rid)
                acc.release(rid)
                rt.sync_new_tokens(rid, np.arange(top, top + n))
                top += n
            elif what < 0.08:  # a token slotted, not yet read
                rt.sync_new_tokens(rid, np.array([top]))
                top += 1
            elif what < 0.12 and pool.num_live(rid) > 1:  # one evicted by hand
                pool.evict(rid, pool.live_idx(rid)[:1])
            elif what < 0.16:
                attended[i] -= 1
        ready += fold_choices_valid(policy, rt, pool, acc, rids, attended)
        out.append([x.tolist() for x in rt.enforce_budgets(rids, attended)])
        out.extend(tables(pool))  # two entries: a step is three
        pool.check_integrity()
        for rid in rids:  # the step's new token
            rt.sync_new_tokens(rid, np.array([top]))
            top += 1
    return out, ready


def fold_choices_valid(policy, rt, pool, acc, rids, attended):
    """How many of `rids` the eviction will take the fold's choice for
    (eviction_kernels.evict_lowest's conditions, read from outside)."""
    rule = policy.lowest_rule(rids)
    if rule is None or rule.key != "score" or rule.sinks:
        return 0
    cols, c, n = acc._acc.cols, pool._a.cols, 0
    for rid, att in zip(rids, attended.tolist(), strict=True):
        row, srow = pool.rows([rid])[0], acc._acc.index.get(rid)
        live, end = c["n_live"][row], c["n_slotted"][row]
        n += bool(
            srow is not None
            and live - rt.budget == 1
            and cols["rule"][srow] == rule.recent + 1
            and cols["cand"][srow] > 0
            and cols["cand_keys"][srow] == live
            and cols["cand_end"][srow] == end == c["n_tokens"][row] == att
        )
    return n


@pytest.mark.parametrize(
    "name,budget,knobs",
    [
        ("h2o", 6, RULES["h2o"]),
        ("h2o", 6, {"recent_ratio": 0.0}),
        ("snapkv", 6, RULES["snapkv"]),
        ("snapkv", 2, rules("snapkv", 2)),
    ],
)
@pytest.mark.parametrize("seed", range(4))
def test_decode_steps_evict_what_evict_batch_does_with_the_fold_s_choice(
    name, budget, knobs, seed, monkeypatch
):
    """A "score" rule's one victim comes from the fold (fold_kernels.fold)
    when the row is as the fold saw it, from the walk otherwise: either way
    what evict_batch picks, and the tables it leaves (SnapKV's window of 1
    over a budget of 2: one candidate a step; H2O without a recent window:
    only the newest token is kept)."""
    monkeypatch.setattr(integrity, "CHECK", False)
    policy = create_policy(name, budget, knobs)
    ref = generic(policy)
    if name == "snapkv":
        for pol in (policy, ref):
            pol._pooled.update(f"r{i}" for i in range(20))
    (got, ready), (want, _) = decode_steps(policy, seed), decode_steps(ref, seed)
    ones = sum(c == 1 for s in got[::3] for c in s[1])
    assert ones > 400  # mostly one victim a request: the fold's case
    assert ready > ones // 2 or budget < 3  # taken without a walk
    assert got == want


CHANGES = [
    None, "slotted and evicted", "evicted", "unslotted", "unordered", "rule",
    "attended",
]  # fmt: skip


@pytest.mark.parametrize("change", CHANGES)
def test_the_fold_s_choice_is_taken_without_a_walk_while_the_row_is_unchanged(
    change, monkeypatch
):
    """The eviction takes the fold's choice as it stands (moved by hand here
    to a token the walk would not pick, it is still evicted: nothing walked)
    unless the row changed since the fold: as many live tokens but one
    slotted and one evicted; one evicted (from two over the budget to one);
    a live token not slotted (preempted, a dead query read, as many keys as
    live tokens); keys folded out of order; or the rule is another, or the
    newest token is not attended. Then the walk picks what evict_batch
    does."""
    monkeypatch.setattr(integrity, "CHECK", False)

    def run(policy, tamper):
        rt, pool, acc = runtime(policy, 64)

        def fold(keys, gain):
            ind = np.array([0, len(keys)])
            keys, gain = np.array(keys), np.array(gain, np.float32)
            acc.fold(ScoreStep(req_ids=["r0"], indptr=ind, key_idx=keys, gain=gain))

        rt.sync_new_tokens("r0", np.arange(7))
        fold(range(7), [9, 0, 0, 9, 9, 9, 9])
        first = rt.enforce_budgets(["r0"], np.array([7]))[2]  # two: the walk
        if change == "evicted":  # two over the budget at the fold
            rt.sync_new_tokens("r0", np.array([7, 8]))
            fold([0, 3, 4, 5, 6, 7, 8], [0, 0, -5, 0, 0, 9, 0])
            attended = np.array([9])
        elif change == "unslotted":  # token 7 live, not slotted; 1 dead, read
            rt.sync_new_tokens("r0", np.array([7]))
            pool.reset_slots("r0")
            rt.sync_new_tokens("r0", np.arange(7))
            fold([0, 1, 3, 4, 5, 6], [0, 0, 0, -5, 0, 0])
            attended = np.array([7])
        elif change == "unordered":  # keys not in the worker's order
            rt.sync_new_tokens("r0", np.array([7]))
            fold([3, 0, 4, 5, 6, 7], [0, 0, -5, 0, 0, 0])
            attended = np.array([8])
        else:
            rt.sync_new_tokens("r0", np.array([7]))
            fold([0, 3, 4, 5, 6, 7], [0, 0, -5, 0, 0, 0])  # 4 is the lowest
            attended = np.array([8])
        if tamper:
            cols = acc._acc.cols
            assert cols["rule"][0] == policy.lowest_rule(["r0"]).recent + 1 == 2
            assert cols["cand"][0] == 4 + 1 or change in ("unslotted", "unordered")
            cols["cand"][0] = 0 + 1  # moved to token 0
        if change == "slotted and evicted":
            rt.sync_new_tokens("r0", np.array([8]))
            pool.evict("r0", np.array([6]))
            attended += 1
        elif change == "evicted":
            pool.evict("r0", np.array([3]))
        elif change == "rule" and tamper:
            acc._acc.cols["rule"][0] += 1
        elif change == "attended":
            attended -= 1
        return first.tolist(), rt.enforce_budgets(["r0"], attended)[2].tolist()

    policy = create_policy("h2o", 5, {"recent_ratio": 0.2})
    got, want = run(policy, True), run(generic(policy), False)
    assert got[0] == want[0] == [1, 2]
    if change is None:
        assert (got[1], want[1]) == ([0], [4])
    else:
        assert got[1] == want[1] != [0]
