"""Engines for end-to-end tests: one subprocess per configuration, cached.

Each configuration runs scripts/engine_driver.py once per session; tests share
the JSON it writes. Every vToken engine runs with VTOKEN_CHECK_INTEGRITY=1, so
DESIGN.md §4's invariants are checked after every step of every end-to-end run,
and a violation fails the run. A run of the installed vLLM is forked from one
process that imported torch and vLLM once (engine_driver.ForkServer: ~5 s of an
engine's ~9 s start-up on two cores); stock vLLM, another PYTHONPATH and
multi-rank engines get a fresh interpreter (run_driver).
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import json
import os
import pathlib

import pytest

from tests.conftest import installed_overlay_matches

DRIVER = pathlib.Path(__file__).resolve().parents[2] / "scripts/engine_driver.py"
_spec = importlib.util.spec_from_file_location("engine_driver", DRIVER)
engine_driver = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine_driver)  # imports no vLLM: its engines run in processes
_cache: dict[str, dict] = {}
_forks = engine_driver.ForkServer()
atexit.register(_forks.close)


def run_engine(spec: dict, *, pristine: bool = False, env=None) -> dict:
    """Run the driver for `spec` (stock vLLM when `pristine`; `env` added to
    its environment) and load its JSON."""
    key = hashlib.sha256(
        json.dumps([spec, pristine, env], sort_keys=True).encode()
    ).hexdigest()[:16]
    if key not in _cache:
        full = {"VTOKEN_CHECK_INTEGRITY": "1", **(env or {})}
        try:
            if pristine or not engine_driver.forkable(spec, full):
                run = engine_driver.run_driver(
                    spec, pristine=pristine, env=full, timeout=900
                )
            else:
                run = _forks.run(spec, env=full, timeout=900)
        except RuntimeError as err:
            pytest.fail(str(err))
        if not pristine:  # the switch reached the engine, however it ran
            want = full["VTOKEN_CHECK_INTEGRITY"] == "1"
            assert run.get("integrity") is want, (spec, env)
        _cache[key] = run
    return _cache[key]


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
        return run_engine(spec, pristine=pristine)

    return _run


def assert_within_budget(run: dict, budget: int) -> None:
    """After its prefill step, no request of `run` holds more than budget + 1
    live tokens (the new token is written before the policy evicts)."""
    seen: set[str] = set()
    for s in run["steps"]:
        for rid, live in s["live"].items():
            if rid in seen:
                assert live <= budget + 1, (rid, s["step"], live)
            seen.add(rid)
