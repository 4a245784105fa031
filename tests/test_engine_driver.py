"""scripts/engine_driver.py's own arithmetic and checks: the memory
benchmark's block census (block_state) on a real Token Table pool, and the
check that a run loaded the vLLM it was asked for. The engine runs
themselves are the e2e tests' and the benchmarks'."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import load_script
from vllm.vtoken.token_table import TokenTablePool

engine_driver = load_script("engine_driver")
bench = load_script("bench_vtoken")

B = 4


def scheduler(pool, lists: dict[str, list[int]]):
    """What block_state reads of vLLM's scheduler: the running requests and
    their positional block lists."""
    blocks = {
        rid: [SimpleNamespace(block_id=b, is_null=False) for b in ids]
        for rid, ids in lists.items()
    }
    mgr = SimpleNamespace(req_to_blocks=blocks)
    running = [
        SimpleNamespace(request_id=rid, num_computed_tokens=len(ids) * B)
        for rid, ids in lists.items()
    ]
    return SimpleNamespace(
        block_size=B,
        running=running,
        vtoken=SimpleNamespace(pool=pool),
        kv_cache_manager=SimpleNamespace(
            coordinator=SimpleNamespace(single_type_managers=[mgr])
        ),
    )


def test_a_shared_block_counts_each_holders_own_live_tokens():
    # a and b share block 0 (a prefix-cache hit), then hold blocks 1 and 2.
    # a evicts two of block 0's tokens: for a, block 0 is half empty; for b
    # it is full. The pool's block_live counts both (4 + 2 = 6 of 4 slots),
    # which read as two full blocks: the memory table's non-live share
    # came out low wherever ShareGPT prompts share a block (found by review).
    pool = TokenTablePool(num_blocks=4, block_size=B)
    lists = {"a": [0, 1], "b": [0, 2]}
    for rid, ids in lists.items():
        pool.add_request(rid)
        slots = np.concatenate([np.arange(b * B, b * B + B) for b in ids])
        pool.append_rows(pool.rows([rid]), np.array([slots.size]), slots)
    pool.evict_rows(pool.rows(["a"]), np.array([0, 2]), np.array([0, 1]))

    state = engine_driver.block_state(scheduler(pool, lists), histogram=True)

    assert state["held"] == {"a": 2, "b": 2}
    assert state["live"] == {"a": 6, "b": 8}
    # a: block 0 with 2 live, block 1 with 4; b: both with 4.
    assert state["hist"] == [0, 0, 1, 0, 3]


def test_a_run_of_another_tree_must_load_its_vllm_from_there(tmp_path: Path):
    # --baseline put a folder first on PYTHONPATH; a folder without vLLM
    # let the venv's load, and the "before" runs timed this overlay
    # (found by review).
    tree = tmp_path / "site"
    engine_driver.check_tree(str(tree / "vllm"), str(tree))
    engine_driver.check_tree("/venv/site-packages/vllm", None)  # nothing asked
    with pytest.raises(RuntimeError, match="loaded vLLM from /venv/"):
        engine_driver.check_tree("/venv/site-packages/vllm", str(tree))
    with pytest.raises(RuntimeError, match="not from"):  # a sibling's prefix
        engine_driver.check_tree(str(tmp_path / "site2" / "vllm"), str(tree))
    with pytest.raises(SystemExit, match="no vllm/vtoken/ there"):
        bench.versions(SimpleNamespace(baseline=tree))
    (tree / "vllm" / "vtoken").mkdir(parents=True)
    assert bench.versions(SimpleNamespace(baseline=tree))["before"] == {
        "PYTHONPATH": str(tree)
    }


def test_the_call_counter_counts_the_calls_a_function_makes():
    # It counted the function's own call and the profiler's switching off
    # too: 2 a hook, 12 a step in "calls in the hooks" (found by review).
    def empty():
        pass

    def three():
        len([])  # C
        abs(-1)  # C
        empty()  # Python

    for fn, calls, c_calls in ((empty, 0, 0), (three, 1, 2)):
        into = {"call": 0, "c_call": 0, "line": 0}
        engine_driver.call_counter(into)(fn)
        assert (into["call"], into["c_call"]) == (calls, c_calls), fn.__name__


def test_the_call_counter_can_count_only_the_calls_the_overlay_makes():
    # What vLLM's own functions do inside (a loop over blocks in
    # evict_blocks) is not the overlay's: the overlay makes each call once.
    import numpy as np

    from vllm.vtoken.arena import indptr_of

    def outside():
        len([])  # C, not the overlay's
        indptr_of(np.arange(3))  # len, zeros, asarray, cumsum: the overlay's

    for overlay_only, calls, c_calls in ((True, 0, 4), (False, 1, 6)):
        into = {"call": 0, "c_call": 0, "line": 0}
        engine_driver.call_counter(into, overlay_only)(outside)
        assert (into["call"], into["c_call"]) == (calls, c_calls), overlay_only


def test_only_a_folder_holding_vllm_is_a_tree_to_load_it_from(tmp_path, monkeypatch):
    # A folder of plug-in packages first on PYTHONPATH (tests/plugin_site)
    # is no vLLM tree: the check refused every plug-in run (found by CI).
    calls = []
    monkeypatch.setattr(engine_driver, "check_tree", lambda *a: calls.append(a[1]))

    def fake_run(cmd, env, **kw):  # the driver's output, as a run writes it
        out = Path(cmd[-1])
        out.write_text('{"vllm_path": "/venv/vllm"}')
        return SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(engine_driver.subprocess, "run", fake_run)
    plugins, site = tmp_path / "plugins", tmp_path / "site"
    plugins.mkdir()
    (site / "vllm").mkdir(parents=True)
    engine_driver.run_driver({}, env={"PYTHONPATH": str(plugins)})
    engine_driver.run_driver({}, env={"PYTHONPATH": str(site)})
    engine_driver.run_driver({})
    assert calls == [None, str(site), None]


def test_the_eviction_kernels_take_turns_and_every_call_is_timed(monkeypatch):
    # bench_vtoken.py eviction: another overlay's kernel (here this one's file,
    # loaded a second time under its own name) runs the odd steps.
    import sys

    import vllm.vtoken.token_table as tt
    from vllm.vtoken import eviction_kernels
    from vllm.vtoken.eviction import EvictionRuntime
    from vllm.vtoken.policies import create_policy

    monkeypatch.setattr(tt, "_eviction_kernels", tt._eviction_kernels)
    monkeypatch.setattr(
        tt.TokenTablePool, "evict_lowest", tt.TokenTablePool.evict_lowest
    )
    monkeypatch.setattr(engine_driver, "EVICTION_CALLS", [])
    # Its module leaves sys.modules at the end (recorded as absent now).
    monkeypatch.delitem(sys.modules, "baseline_eviction_kernels", raising=False)
    turn = engine_driver.alternate_eviction(eviction_kernels.__file__)
    other = sys.modules["baseline_eviction_kernels"]
    assert other is not eviction_kernels
    policy = create_policy("streamingllm", 4, {"num_sinks": 1})
    rt = EvictionRuntime(TokenTablePool(64, B), policy, 4, seed=0)
    rids, top = ["a", "b", "c"], 0
    for rid in rids:
        rt.sync_new_tokens(rid, np.arange(top, top + 16))
        top += 16
    for step in range(4):
        turn(step)
        assert tt._eviction_kernels() is (eviction_kernels, other)[step % 2]
        attended = np.array([rt.pool.num_slotted(r) for r in rids])
        _, counts, _ = rt.enforce_budgets(rids, attended)
        assert counts.tolist() == [12 if step == 0 else 1] * 3
        for rid in rids:
            rt.sync_new_tokens(rid, np.array([top]))
            top += 1
    calls = engine_driver.EVICTION_CALLS
    assert [c[:2] for c in calls] == [["this", 3], ["baseline", 3]] * 2
    assert all(c[2] > 0 for c in calls)


def test_any_kernel_takes_turns_with_another_overlays_and_every_call_is_timed(
    monkeypatch,
):
    # bench_vtoken.py kernel: the module's attribute is swapped, so the
    # pool's calls through it (pool._k.read_walk) alternate and are timed,
    # each with its rows; both versions walk the same table alike.
    import sys

    from vllm.vtoken import table_kernels

    monkeypatch.setattr(table_kernels, "read_walk", table_kernels.read_walk)
    monkeypatch.setattr(engine_driver, "KERNEL_CALLS", [])
    monkeypatch.delitem(sys.modules, "baseline_table_kernels", raising=False)
    turn = engine_driver.alternate_kernel(table_kernels.__file__, "read_walk")
    other = sys.modules["baseline_table_kernels"]
    assert other is not table_kernels
    pool = TokenTablePool(64, B)
    for i, rid in enumerate(["a", "b", "c"]):
        pool.add_request(rid, keep_dead=True)
        pool.append(rid, np.arange(10) + 16 * i)
    pool.evict("b", np.array([2, 5], np.int64))
    rows = pool.rows(["a", "b", "c"])
    got = []
    for step in range(4):
        turn(step)
        got.append(pool.read_walk(rows, np.full(3, 9, np.int64)))
    for counts, idx, slots, queries in got:
        assert counts.tolist() == [10, 8, 10] and queries == 3
        np.testing.assert_array_equal(idx, got[0][1])
        np.testing.assert_array_equal(slots, got[0][2])
    calls = engine_driver.KERNEL_CALLS
    assert [c[:2] for c in calls] == [["this", 3], ["baseline", 3]] * 2
    assert all(c[2] > 0 for c in calls)


_TIME_KERNELS_CHILD = """
import runpy, sys
runpy.run_path(sys.argv[1])  # tests/conftest.py: this checkout's overlay
sys.path.insert(0, sys.argv[2])
import numpy as np
import engine_driver as ed

ed.time_kernels()
from vllm.vtoken.token_table import TokenTablePool

pool = TokenTablePool(8, 4)
pool.add_requests(["a"], np.zeros(1, bool))
pool.append("a", np.arange(6))
pool.evict("a", np.array([1]))
rows = pool.rows(["a"])
one = np.ones(1, np.int64)
pool.append_read(rows, 6 * one, one, np.array([6]), np.ones(1, bool))
import json
ns = ed.KERNEL_NS
print(json.dumps([sorted(k for k, v in ns.items() if v), sorted(ns)]))
"""


def test_time_kernels_times_the_calls_from_python_only(tmp_path):
    """The driver's time_kernels: each compiled kernel the hooks call from
    Python gets its running total; a kernel another calls inside compiled
    code (append_read's walk_row) is not counted again."""
    tests = Path(__file__).resolve().parent
    proc = subprocess.run(
        [sys.executable, "-c", _TIME_KERNELS_CHILD, str(tests / "conftest.py"),
         str(tests.parent / "scripts")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran, timed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "table_kernels.walk_row" in timed  # a kernel timed ...
    assert ran == [  # ... but only those Python called ran up a total
        "table_kernels.append_read",
        "table_kernels.append_rows",
        "table_kernels.evict_rows",
    ], ran


def test_another_overlays_kernels_compile_from_a_copy_not_beside_it(
    tmp_path, monkeypatch
):
    # Loading a site's kernel file itself under another name left numba's
    # cache beside it pickled with that name: the site's own engine then
    # failed to import the module ("No module named 'baseline_fold_kernels'").
    import shutil
    import sys

    from vllm.vtoken import fold_kernels

    site = tmp_path / "site" / "vllm" / "vtoken"
    site.mkdir(parents=True)
    path = shutil.copyfile(fold_kernels.__file__, site / "fold_kernels.py")
    monkeypatch.delitem(sys.modules, "baseline_fold_kernels", raising=False)
    this, other = engine_driver.load_beside(str(path))
    assert this is fold_kernels and other is not fold_kernels
    assert Path(other.__file__).parent != site
    assert not (site / "__pycache__").exists(), "a cache beside the site's file"
    assert other.fold is not fold_kernels.fold and other.fold.signatures


def test_only_one_rank_engines_of_this_environment_are_forked():
    forkable = engine_driver.forkable
    assert forkable({"engine": {"tensor_parallel_size": 1}}, None)
    assert forkable({}, {"VTOKEN_CHECK_INTEGRITY": "0"})
    assert not forkable({"engine": {"tensor_parallel_size": 2}}, None)
    assert not forkable({"engine": {"pipeline_parallel_size": 2}}, None)
    assert not forkable({}, {"PYTHONPATH": "/elsewhere"})
    with pytest.raises(ValueError, match="not a run to fork"):
        engine_driver.ForkServer().run({}, env={"PYTHONPATH": "/elsewhere"})


def test_a_forked_run_that_fails_or_overruns_is_reported_and_the_next_runs(
    monkeypatch,
):
    """The server outlives a failed run (its traceback comes back); a run
    that overruns is killed with its process group, by a server started
    again (the old one's next answer would be that run's), which serves the
    next run. Imports the installed vLLM: scripts/test.sh's environment."""
    model = os.environ.get("VTOKEN_MODEL_DIR")
    if not model:
        pytest.skip("VTOKEN_MODEL_DIR unset: run through scripts/test.sh")
    forks = engine_driver.ForkServer()
    bad = {"engine": {"no_such_argument": 1}, "prompts": [[1, 2]], "max_tokens": 1}
    try:
        servers = set()
        for _ in range(2):
            with pytest.raises(RuntimeError, match="(?s)exit 1.*no_such_argument"):
                forks.run(bad, env={"VTOKEN_CHECK_INTEGRITY": "1"}, timeout=120)
            servers.add(forks._proc.pid)
        (server,) = servers
        slow = {"engine": {}, "prompts": [[1, 2]], "max_tokens": 1}
        with pytest.raises(RuntimeError, match="timed out after 0.5 s"):
            forks.run(slow, timeout=0.5)  # still starting its engine
        with pytest.raises(RuntimeError, match="no_such_argument"):
            forks.run(bad, timeout=120)
        assert forks._proc.pid != server
        again = forks._proc.pid
        monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")  # each test's
        with pytest.raises(RuntimeError, match="no_such_argument"):
            forks.run(bad, timeout=120)
        assert forks._proc.pid == again
        monkeypatch.setenv("VTOKEN_SOME_SETTING", "1")  # as a fresh run sees it
        with pytest.raises(RuntimeError, match="no_such_argument"):
            forks.run(bad, timeout=120)
        assert forks._proc.pid != again
    finally:
        forks.close()
