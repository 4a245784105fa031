#!/usr/bin/env python3
"""Lint the patch stack: `patches/series` against the files, and DEP-3 headers.

    python3 scripts/check_patches.py [PATCH_DIR]

Checks that every series entry exists and is listed once, that no .patch file is
missing from the series, that each patch starts with a DEP-3 header carrying
Description (with a `Drop when:` paragraph), Forwarded and Last-Update fields,
that it only modifies existing files (new files belong in vllm_overlay/), and
that it ends with a newline. Exits 1 listing every problem found.
"""

from __future__ import annotations

import pathlib
import re
import sys

REQUIRED = ("Description:", "Forwarded:", "Last-Update:")


def series_entries(patch_dir: pathlib.Path) -> list[str]:
    entries = []
    for line in (patch_dir / "series").read_text().splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            entries.append(line)
    return entries


def check(patch_dir: pathlib.Path) -> list[str]:
    problems: list[str] = []
    if not (patch_dir / "series").is_file():
        return [f"{patch_dir}/series is missing"]
    entries = series_entries(patch_dir)
    seen: set[str] = set()
    for name in entries:
        if name in seen:
            problems.append(f"{name} is listed twice in series")
        seen.add(name)
        path = patch_dir / name
        if not path.is_file():
            problems.append(f"series lists {name}, which does not exist")
            continue
        text = path.read_text()
        header = text.split("\n---\n", 1)[0]
        for field in REQUIRED:
            if not re.search(rf"^{field}", header, re.M):
                problems.append(f"{name}: DEP-3 header has no {field} field")
        if "Drop when:" not in header:
            problems.append(f"{name}: Description has no 'Drop when:' paragraph")
        if "\n--- /dev/null" in text:
            problems.append(f"{name}: creates a file (put new files in vllm_overlay/)")
        if not text.endswith("\n"):
            problems.append(f"{name}: does not end with a newline")
        if not re.search(r"^\+\+\+ b/", text, re.M):
            problems.append(f"{name}: contains no diff")
    for path in sorted(patch_dir.rglob("*.patch")):
        rel = path.relative_to(patch_dir).as_posix()
        if rel not in seen:
            problems.append(f"{rel} is not listed in series")
    return problems


def main() -> int:
    repo = pathlib.Path(__file__).resolve().parents[1]
    patch_dir = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else repo / "patches"
    problems = check(patch_dir)
    for p in problems:
        print(f"check_patches: {p}", file=sys.stderr)
    if not problems:
        print(f"check_patches: {len(series_entries(patch_dir))} patches ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
