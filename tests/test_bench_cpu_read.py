"""scripts/bench_cpu_read.py at tiny sizes: the two reads it times agree on a
full context (it checks that itself before timing), and it times every read
it names. The timings themselves are the benchmark's (docs/RESULTS.md)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_script

pytest.importorskip("vllm._custom_ops")  # vLLM's CPU kernels, to time against

bench = load_script("bench_cpu_read")

TINY = ["--requests", "2", "--context", "32", "48", "--live", "20", "--iters", "3"]


def test_it_times_native_and_each_token_read(tmp_path):
    out = tmp_path / "read.json"
    bench.main([*TINY, "--repeats", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["command"].startswith("python scripts/bench_cpu_read.py --requests 2")
    names = set(result["median_us"])
    assert {"native, context 32", "native, context 48"} <= names
    assert len(names) == 6 and result["vs"] == "native, context 48"
    for name, runs in result["runs_us"].items():
        assert len(runs) == 2 and all(t > 0 for t in runs), name
    # docs/RESULTS.md's section: a row per read, against native's longest.
    import bench_report  # scripts/ is on sys.path: bench_cpu_read's folder

    table = [x for x in bench_report.cpu_read_section(result) if x.startswith("| ")]
    assert len(table) == 1 + 6 and "| native, context 48 |" in table[2]
    assert table[2].split(" | ")[2] == "1.00"


def test_it_refuses_to_time_reads_that_disagree(monkeypatch):
    # A token read that attends to the wrong keys (the last one left out)
    # is caught before anything is timed.
    from vllm.vtoken import cpu_attention

    build = cpu_attention.build_cpu_read_plan

    def drop_last_key(q_loc, kv_loc, slots, *args, **kw):
        slots = slots.copy()
        slots[kv_loc[1] - 1] = slots[kv_loc[1] - 2]
        return build(q_loc, kv_loc, slots, *args, **kw)

    monkeypatch.setattr(cpu_attention, "build_cpu_read_plan", drop_last_key)
    with pytest.raises(AssertionError):
        bench.main([*TINY, "--repeats", "1", "--json", "/nonexistent/never.json"])
