"""docs/RESULTS.md is what scripts/bench_report.py makes of docs/bench/*.json:
every table renders from its committed measurement, and the page was
regenerated after the last one (a benchmark rerun without `bench_report.py`,
or a hand edit of RESULTS.md, fails here)."""

from __future__ import annotations

import re

from tests.conftest import REPO, load_script

bench_report = load_script("bench_report")


def test_results_md_is_the_report_of_the_committed_measurements():
    committed = (REPO / "docs/RESULTS.md").read_text()
    # The machine line names the machine that measured, not this one.
    machine = re.search(r"Machine: (.*?)\. Regenerate", committed)
    assert machine, "RESULTS.md lost its machine line"
    assert bench_report.render(machine.group(1)) == committed, (
        "docs/RESULTS.md is stale: run `python scripts/bench_report.py`"
    )
