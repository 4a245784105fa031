"""Engines for end-to-end tests: one subprocess per configuration, cached.

Each configuration runs scripts/engine_driver.py once per session (engine start-up
costs ~26 s on two cores); tests share the JSON it writes. Every vToken engine
runs with VTOKEN_CHECK_INTEGRITY=1, so DESIGN.md §4's invariants are checked
after every step of every end-to-end run, and a violation fails the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import installed_overlay_matches

DRIVER = pathlib.Path(__file__).resolve().parents[2] / "scripts/engine_driver.py"
_cache: dict[str, dict] = {}


def run_engine(spec: dict, *, pristine: bool = False, tmp_dir: pathlib.Path) -> dict:
    """Run the driver for `spec` (stock vLLM when `pristine`) and load its JSON."""
    key = hashlib.sha256(
        json.dumps([spec, pristine], sort_keys=True).encode()
    ).hexdigest()[:16]
    if key in _cache:
        return _cache[key]
    spec_file = tmp_dir / f"{key}.spec.json"
    out_file = tmp_dir / f"{key}.out.json"
    spec_file.write_text(json.dumps(spec))
    env = dict(os.environ, VTOKEN_CHECK_INTEGRITY="1", PYTHONDONTWRITEBYTECODE="1")
    if pristine:
        env["PYTHONPATH"] = os.environ["VTOKEN_PRISTINE"]
    proc = subprocess.run(
        [sys.executable, str(DRIVER), str(spec_file), str(out_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"engine run failed ({'stock' if pristine else 'patched'}):\n"
            + proc.stderr[-6000:]
        )
    result = json.loads(out_file.read_text())
    _cache[key] = result
    return result


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory) -> pathlib.Path:
    for var in ("VTOKEN_MODEL_DIR", "VTOKEN_SHAREGPT", "VTOKEN_PRISTINE"):
        if not os.environ.get(var):
            pytest.fail(f"{var} is not set: run the tests through scripts/test.sh")
    if not installed_overlay_matches():
        pytest.fail(
            "the environment's vLLM carries an older overlay: run scripts/test.sh "
            "(it re-applies the series when patches/ or vllm_overlay/ change)"
        )
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def engine(engine_dir):
    def _run(spec: dict, pristine: bool = False) -> dict:
        return run_engine(spec, pristine=pristine, tmp_dir=engine_dir)

    return _run
