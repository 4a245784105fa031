"""docs/RESULTS.md is what scripts/bench_report.py makes of docs/bench/*.json:
every table renders from its committed measurement, and the page was
regenerated after the last one (a benchmark rerun without `bench_report.py`,
or a hand edit of RESULTS.md, fails here)."""

from __future__ import annotations

from tests.conftest import REPO, load_script

bench_report = load_script("bench_report")


def test_results_md_is_the_report_of_the_committed_measurements():
    committed = (REPO / "docs/RESULTS.md").read_text()
    # The machine line names the machine that measured, not this one.
    machine = bench_report.committed_machine(committed)
    assert machine, "RESULTS.md lost its machine line"
    assert bench_report.render(machine) == committed, (
        "docs/RESULTS.md is stale: run `python scripts/bench_report.py`"
    )


def test_regenerating_keeps_the_machine_of_the_tables_that_name_none(
    tmp_path, monkeypatch
):
    # A rerun of one table on another machine names its own ("Ran on"); the
    # page's line is where the others ran. Regenerating wrote this machine's
    # there instead (found by review, after a scale rerun on another VM).
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs/RESULTS.md"
    page.write_text("Machine, where a table names none: Box (AMX), 2 cores. Regen")
    monkeypatch.setattr(bench_report, "REPO", tmp_path)
    bench_report.main()
    assert bench_report.committed_machine(page.read_text()) == "Box (AMX), 2 cores"
    assert bench_report.committed_machine("no such line") is None
    page.unlink()  # a first page: this machine
    bench_report.main()
    assert bench_report.committed_machine(page.read_text()) == bench_report.machine()


def test_a_table_names_the_machine_that_ran_it(tmp_path):
    # The page's one machine line was the machine rendering it, whatever
    # machine ran each table (found by review): a table now names its own.
    import json

    sla = json.loads((REPO / "docs/bench/sla.json").read_text())
    (tmp_path / "sla.json").write_text(json.dumps(sla | {"machine": "Box (AMX)"}))
    lines = bench_report.sections(tmp_path, "img")
    at = lines.index("## Throughput under a latency SLA")
    assert lines[at + 2].startswith("`python scripts/bench_vtoken.py sla")
    assert lines[at + 3] == "Ran on: Box (AMX)."


def test_an_sla_run_of_some_modes_renders_those(tmp_path):
    # bench_gpu.sh --smoke runs native and vtoken only (--modes).
    import json

    sla = json.loads((REPO / "docs/bench/sla.json").read_text())
    keep = [k for k in sla["results"] if k.split("/")[0] != "naive"]
    sla |= {
        "modes": ["native", "vtoken"],
        "results": {k: sla["results"][k] for k in keep},
    }
    (tmp_path / "sla.json").write_text(json.dumps(sla))
    lines = bench_report.sections(tmp_path, "img")
    rows = [
        x.split(" | ")[0] for x in lines if x.startswith("| n") or x.startswith("| v")
    ]
    assert rows == ["| native", "| vtoken"]
