"""The scale benchmark's arithmetic (scripts/bench_vtoken.py scale_run and
scale_row) on hand-made driver results: which steps count, medians over the
runs, the planner's time per plan, and the refusal of runs that disagree;
and the eviction benchmark's (cmd_eviction). The engine runs themselves are
the e2e tests' and the benchmark's."""

from __future__ import annotations

import pytest

from tests.conftest import load_script

bench = load_script("bench_vtoken")


def driver_run(step_ms, vtoken_ns, running, planner_ns=0, plan_calls=0, evicted=0):
    """A driver result: per step its wall time, the running total of vToken's
    host time, and the number of running requests."""
    steps = [
        {"step_ms": s, "vtoken_ns": v, "running": r}
        for s, v, r in zip(step_ms, vtoken_ns, running, strict=True)
    ]
    counters = {"planner_ns": planner_ns, "plan_calls": plan_calls}
    return {"steps": steps, "counters": counters | {"evicted_tokens": evicted}}


def test_a_run_counts_its_steady_steps_only():
    # Five steps run all 3 requests; the first two of them (prefill, 40 and
    # 30 ms) are left out: 7, 9, 8 ms remain, over which vToken's host time
    # grew by 4 ms, then 3.
    run = driver_run(
        [50, 40, 30, 7, 9, 8, 1],
        [0, 1e6, 2e6, 4e6, 8e6, 11e6, 11e6],
        [1, 3, 3, 3, 3, 3, 2],
    )
    got = bench.scale_run(run, 3)
    assert got["step_ms"] == 8
    assert got["host_ms"] == pytest.approx(3.5)
    # Admitting: the host time of every step before the steady ones (2 ms by
    # the second step that runs all 3), a request.
    assert got["admit_us"] == pytest.approx(2e3 / 3)
    assert bench.scale_run(run, 3, hooked=False)["host_ms"] == 0.0


def test_a_run_splits_the_steps_that_plan_from_the_others():
    # The steady steps grow vToken's host time by 4, 1, 5 and 2 ms; the
    # driver's plan count grows in the first and third (they plan).
    run = driver_run(
        [50, 40, 30, 7, 9, 8, 8, 1],
        [0, 1e6, 2e6, 4e6, 8e6, 9e6, 14e6, 16e6],
        [1, 3, 3, 3, 3, 3, 3, 3],
    )
    for step, plans in zip(run["steps"], [0, 0, 0, 0, 1, 1, 2, 2], strict=True):
        step["plan_calls"] = plans
    got = bench.scale_run(run, 3)
    assert got["host_ms"] == pytest.approx(3.0)  # the median of 4, 1, 5, 2
    assert got["host_mean_ms"] == pytest.approx(3.0)
    assert got["host_ms_plan"] == pytest.approx(4.5)  # 4 and 5
    assert got["host_ms_quiet"] == pytest.approx(1.5)  # 1 and 2
    assert got["plan_share"] == 0.5
    # A run whose driver recorded no plan counts (an older one): no split.
    for step in run["steps"]:
        del step["plan_calls"]
    assert "plan_share" not in bench.scale_run(run, 3)
    # Over runs, medians, the baseline's too, of what every run has.
    other = {**got, "host_mean_ms": 5.0, "host_ms_plan": 6.5, "plan_share": 0.25}
    mine = [{**r, "counters": {"evicted_tokens": 1, "plan_calls": 2, "planner_ns": 0}}
            for r in (got, other)]  # fmt: skip
    row = bench.scale_row(mine, 8.0, [1], mine[:1], [1])
    assert (row["host_mean_ms"], row["host_ms_plan"]) == (4.0, 5.5)
    assert (row["plan_share"], row["host_ms_quiet"]) == (0.375, 1.5)
    assert row["before_host_mean_ms"] == 3.0


def test_a_row_is_the_median_of_its_runs():
    def one(step, host, planner_ns):
        r = {"step_ms": step, "host_ms": host}
        return r | {
            "counters": {"planner_ns": planner_ns, "plan_calls": 4, "evicted_tokens": 9}
        }

    mine = [one(10, 1.0, 4e6), one(14, 3.0, 8e6), one(12, 2.0, 0)]
    before = [one(0, 5.0, 0), one(0, 7.0, 0)]
    row = bench.scale_row(mine, 8.0, [100, 90, 95], before, [120, 130])
    assert (row["step_ms"], row["host_ms"], row["hook_calls"]) == (12, 2.0, 95)
    assert row["host_ms_runs"] == [1.0, 3.0, 2.0]
    assert row["step_ratio"] == pytest.approx(1.5)
    assert row["planner_ms"] == pytest.approx(1.0)  # 12 ms over 12 plans
    assert (row["plan_calls"], row["evicted_tokens"]) == (4, 9)
    assert row["before_host_ms"] == 6.0 and row["before_hook_calls"] == 125
    assert "before_host_ms" not in bench.scale_row(mine, 8.0, [1])
    # Runs are deterministic: ones that evict or plan differently are refused.
    for key in ("evicted_tokens", "plan_calls"):
        odd = [dict(r) for r in mine]
        odd[1]["counters"] = odd[1]["counters"] | {key: 10}
        with pytest.raises(AssertionError, match=rf"^\('{key}'"):
            bench.scale_row(odd, 8.0, [1])


def report_of_one_row():
    """bench_report, and a scale result of one H2O row at 64 requests."""
    report = load_script("bench_report")
    row = {"step_ms": 12.0, "step_ratio": 1.5, "host_ms": 2.0, "hook_calls": 95}
    row |= {"planner_ms": 1.0}
    d = {"command": "bench scale", "date": "today", "prompt_len": 64}
    d |= {"gen_len": 64, "budget": 32, "repeats": 2}
    d["rows"] = {"64/none": {"step_ms": 8.0}, "64/h2o": row}
    return report, d, row


def test_the_report_shows_the_probe_only_for_runs_that_timed_it():
    report, d, row = report_of_one_row()
    old = "\n".join(report.scale_section(d, "img"))
    assert "probe" not in old.lower()
    row |= {"probe_cold_us": 57.4, "probe_warm_us": 4.24}
    new = "\n".join(report.scale_section(d, "img"))
    assert "probe µs, cold / warm" in new
    assert "| 64 | h2o | 12.0 | 8.0 | 1.50 | 2.00 | 95 | 1.00 | 57 / 4.2 |" in new


def test_the_report_splits_quiet_and_planning_steps_when_measured():
    report, d, row = report_of_one_row()
    assert "steps that plan" not in "\n".join(report.scale_section(d, "img"))
    row |= {"plan_share": 0.52, "host_ms_quiet": 1.4, "host_ms_plan": 2.9}
    row |= {"host_mean_ms": 2.2, "before_host_mean_ms": 2.5}
    row |= {"before_host_ms_quiet": 1.5, "before_host_ms_plan": 3.1}
    new = "\n".join(report.scale_section(d, "img"))
    assert "| 64 | h2o | 52% | 1.40 / 1.50 | 2.90 / 3.10 | 2.20 / 2.50 |" in new
    assert "admitting" not in new  # not measured: no column
    row |= {"admit_us": 57.6, "before_admit_us": 77.4}
    new = "\n".join(report.scale_section(d, "img"))
    assert "| 2.20 / 2.50 | 58 / 77 |" in new and "a request, admitting |" in new


def test_a_cost_never_measured_reads_as_a_dash_not_zero():
    # H2O and SnapKV never planned at these sizes: their "planner ms per
    # plan" and "steps that plan" cells read 0.00, a plan that costs
    # nothing (found by review).
    report, d, row = report_of_one_row()
    row |= {"planner_ms": 0.0, "plan_calls": 0, "plan_share": 0.0}
    row |= {"host_ms_quiet": 1.4, "host_ms_plan": 0.0, "host_mean_ms": 1.4}
    row |= {"before_plan_share": 0.0, "before_host_ms_plan": 0.0}
    row |= {"before_host_ms_quiet": 1.5, "before_host_mean_ms": 1.5}
    new = "\n".join(report.scale_section(d, "img"))
    assert "| 64 | h2o | 12.0 | 8.0 | 1.50 | 2.00 | 95 | – |" in new
    assert "| 64 | h2o | 0% | 1.40 / 1.50 | – / – | 1.40 / 1.50 |" in new


def test_each_hooks_time_is_its_median_growth_over_the_steady_steps():
    # Two hooks' running totals over the run above's steps: per steady step
    # A grows by 3, 1 ms (median 2), B by 1, 1 (median 1); host = A + B.
    run = driver_run(
        [50, 40, 30, 7, 9, 8, 1],
        [0, 1e6, 2e6, 4e6, 8e6, 10e6, 10e6],
        [1, 3, 3, 3, 3, 3, 2],
    )
    a, b = [0, 1, 2, 3, 6, 7, 7], [0, 0, 0, 0, 1, 2, 2]
    for step, x, y in zip(run["steps"], a, b, strict=True):
        step["hook_ns"] = {"A.begin_step": x * 1e6, "B.end_step": y * 1e6}
    got = bench.scale_run(run, 3)
    assert got["hooks_ms"] == {"A.begin_step": 2.0, "B.end_step": 1.0}
    assert bench.scale_run(run, 3, hooked=False)["hooks_ms"] == {}
    runs = [got, {**got, "hooks_ms": {"A.begin_step": 4.0, "B.end_step": 3.0}}]
    assert bench._hooks_median(runs) == {"A.begin_step": 3.0, "B.end_step": 2.0}


def test_the_report_breaks_the_host_time_down_by_hook_when_timed():
    report, d, row = report_of_one_row()
    assert "Where the host time goes" not in "\n".join(report.scale_section(d, "i"))
    hooks = dict.fromkeys(report.HOOK_NAMES, 0.25) | {"VTokenWorker.end_step": 0.5}
    row |= {"hooks_ms": hooks, "before_hooks_ms": dict.fromkeys(hooks, 1.0)}
    new = "\n".join(report.scale_section(d, "i"))
    assert "(now / the baseline overlay's)" in new
    cells = ["0.25 / 1.00"] * 4 + ["0.50 / 1.00", "0.25 / 1.00"]
    assert "| 64 | h2o | " + " | ".join(cells) + " |" in new


def test_runs_take_turns_forward_then_backward():
    # Native ran first in every turn, and on a VM slowing over a turn it
    # looked the fastest of a memory run's 11 (found in its numbers).
    turns = list(bench.in_turns(3, ["none", "h2o"], ["now", "before"]))
    forward = [("none", "now"), ("none", "before"), ("h2o", "now"), ("h2o", "before")]
    assert turns == [
        *((0, *x) for x in forward),
        *((1, *x) for x in forward[::-1]),
        *((2, *x) for x in forward),
    ]


def test_the_eviction_benchmark_takes_only_the_calls_that_evict_every_request(
    tmp_path, monkeypatch
):
    # bench_vtoken.py eviction on a hand-made driver result: calls on fewer
    # rows (the first decodes, the last requests) are left out; per kernel
    # the median and mean of the rest, and now / baseline of the medians.
    base = tmp_path / "site"
    (base / "vllm/vtoken").mkdir(parents=True)
    (base / "vllm/vtoken/eviction_kernels.py").write_text("")
    (base / ".vtoken").mkdir()
    (base / ".vtoken/manifest").write_text("hash abc123\nversion 0.18.0\n")
    calls = [["this", 2, 9_000], ["baseline", 4, 1_000], ["this", 4, 3_000]]
    calls += [["baseline", 4, 5_000], ["this", 4, 1_000], ["baseline", 4, 9_000]]
    specs = []

    def run_driver(spec, **kwargs):
        specs.append(spec)
        return {"eviction_calls": calls}

    monkeypatch.setattr(bench, "run_driver", run_driver)
    args = bench.parse_args(
        ["eviction", "--requests", "4", "--prompt-len", "8", "--gen-len", "8"]
        + ["--budget", "4", "--policies", "streamingllm", "--baseline", str(base)]
    )
    out = bench.cmd_eviction(args)
    row = out["rows"]["streamingllm"]
    assert row["this"] == {"calls": 2, "median_us": 2.0, "mean_us": 2.0}
    assert row["baseline"] == {"calls": 3, "median_us": 5.0, "mean_us": 5.0}
    assert row["ratio"] == pytest.approx(0.4)
    assert out["baseline"].endswith("(series abc123)")
    assert specs[0]["alternate_eviction"] == str(
        base / "vllm/vtoken/eviction_kernels.py"
    )
    assert specs[0]["engine"]["num_gpu_blocks_override"] == 4 + 2 * 4  # room for all
    calls[:] = [["this", 2, 1], ["baseline", 2, 1]]  # none evicted every request
    with pytest.raises(RuntimeError, match="no call on every request"):
        bench.cmd_eviction(args)
    with pytest.raises(SystemExit, match="--baseline"):
        bench.cmd_eviction(bench.parse_args(["eviction"]))


def test_the_kernel_benchmark_times_the_named_kernel_of_the_baselines_module(
    tmp_path, monkeypatch
):
    # bench_vtoken.py kernel on a hand-made driver result: the baseline's copy
    # of the named module is what the driver swaps in; the calls on every
    # request count, as eviction's.
    base = tmp_path / "site"
    (base / "vllm/vtoken").mkdir(parents=True)
    (base / "vllm/vtoken/table_kernels.py").write_text("")
    calls = [["this", 4, 2_000], ["baseline", 4, 4_000], ["this", 3, 9_000]]
    specs = []

    def run_driver(spec, **kwargs):
        specs.append(spec)
        return {"kernel_calls": calls}

    monkeypatch.setattr(bench, "run_driver", run_driver)
    argv = ["kernel", "--requests", "4", "--policies", "h2o", "random"]
    argv += ["--baseline", str(base), "--kernel", "table_kernels:append_read"]
    out = bench.cmd_kernel(bench.parse_args(argv))
    assert out["kernel"] == "table_kernels:append_read"
    assert out["baseline"].endswith("(series ?)")  # no manifest
    for policy in ("h2o", "random"):
        row = out["rows"][policy]
        assert row["this"] == {"calls": 1, "median_us": 2.0, "mean_us": 2.0}
        assert row["ratio"] == pytest.approx(0.5)
    assert specs[0]["alternate_kernel"] == {
        "path": str(base / "vllm/vtoken/table_kernels.py"),
        "name": "append_read",
    }
    assert specs[1]["engine"]["kv_eviction_policy"] == "random"
    with pytest.raises(SystemExit, match="no .*read_kernels.py"):
        bench.cmd_kernel(bench.parse_args([*argv[:-1], "read_kernels:cpu_plan_index"]))
    with pytest.raises(SystemExit, match="--kernel module:function"):
        bench.cmd_kernel(bench.parse_args(argv[:-2]))
    calls[:] = []  # the overlay never called it through its module
    with pytest.raises(RuntimeError, match="no call on every request"):
        bench.cmd_kernel(bench.parse_args(argv))


def test_a_kernels_run_takes_each_kernel_s_median_growth_and_the_quiet_steps():
    # The steady steps' pairs: kernel A grows by 100, 300, 200 µs, B by 50,
    # 0, 50; host by 400, 900, 500 µs; the second step plans (quiet: 1, 3).
    run = driver_run(
        [50, 40, 30, 7, 9, 8, 6, 1],
        [0, 1e5, 2e5, 3e5, 7e5, 16e5, 21e5, 21e5],
        [1, 3, 3, 3, 3, 3, 3, 2],
    )
    a = [0, 0, 0, 0, 1e5, 4e5, 6e5, 6e5]
    b = [0, 0, 0, 0, 5e4, 5e4, 1e5, 1e5]
    plans = [0, 0, 0, 0, 0, 1, 1, 1]
    for step, x, y, p in zip(run["steps"], a, b, plans, strict=True):
        step["kernel_ns"] = {"m.A": x, "m.B": y, "m.C": 0}
        step["plan_calls"] = p
    got = bench.kernels_run(run, 3)
    assert got["kernel_us"] == {"m.A": 200.0, "m.B": 50.0}  # C never ran
    assert got["kernels_us"] == 250.0  # 150, 300, 250 a step
    assert got["host_us"] == 500.0
    assert got["quiet_host_us"] == 450.0 and got["quiet_kernels_us"] == 200.0


def test_the_kernels_report_names_the_costliest_kernels_and_the_glue():
    report = load_script("bench_report")
    row = {
        "host_us": 300.0, "kernels_us": 120.0,
        "quiet_host_us": 280.0, "quiet_kernels_us": 110.0,
        "kernel_us": {f"m.k{i}": float(i) for i in range(10)},
    }  # fmt: skip
    d = {
        "command": "c", "date": "d", "prompt_len": 64, "gen_len": 64,
        "budget": 32, "repeats": 2, "rows": {"1024/h2o": row},
    }  # fmt: skip
    text = "\n".join(report.kernels_section(d, "i"))
    top = ", ".join(f"`k{i}` {i}" for i in range(9, 3, -1))
    assert f"| 1,024 | h2o | 300 | 120 | 180 | 280 / 110 | {top} |" in text
