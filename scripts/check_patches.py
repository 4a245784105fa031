#!/usr/bin/env python3
"""Lint the patch stack: `patches/series` against the files, and DEP-3 headers.

    python3 scripts/check_patches.py [PATCH_DIR]

Every series entry exists once, every .patch file is in the series, and each
patch has a DEP-3 header (Description with a `Drop when:` paragraph, Forwarded,
Last-Update), modifies only existing files (new ones belong in vllm_overlay/)
and ends with a newline. Exits 1 listing every problem found.
"""

import pathlib
import re
import sys


def series_entries(patch_dir: pathlib.Path) -> list[str]:
    lines = (patch_dir / "series").read_text().splitlines()
    return [e for line in lines if (e := re.sub(r"(^|\s)#.*$", "", line).strip())]


def patch_problems(name: str, text: str) -> list[str]:
    header = text.split("\n---\n", 1)[0]
    checks = {
        f"DEP-3 header has no {field} field": not re.search(rf"^{field}", header, re.M)
        for field in ("Description:", "Forwarded:", "Last-Update:")
    }
    checks |= {
        "Description has no 'Drop when:' paragraph": "Drop when:" not in header,
        "creates a file (put new files in vllm_overlay/)": "\n--- /dev/null" in text,
        "does not end with a newline": not text.endswith("\n"),
        "contains no diff": not re.search(r"^\+\+\+ b/", text, re.M),
    }
    return [f"{name}: {why}" for why, failed in checks.items() if failed]


def check(patch_dir: pathlib.Path) -> list[str]:
    if not (patch_dir / "series").is_file():
        return [f"{patch_dir}/series is missing"]
    problems, seen = [], set()
    for name in series_entries(patch_dir):
        if name in seen:
            problems.append(f"{name} is listed twice in series")
        seen.add(name)
        if not (patch_dir / name).is_file():
            problems.append(f"series lists {name}, which does not exist")
        else:
            problems += patch_problems(name, (patch_dir / name).read_text())
    for path in sorted(patch_dir.rglob("*.patch")):
        if (rel := path.relative_to(patch_dir).as_posix()) not in seen:
            problems.append(f"{rel} is not listed in series")
    return problems


if __name__ == "__main__":
    repo = pathlib.Path(__file__).resolve().parents[1]
    patch_dir = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else repo / "patches"
    if problems := check(patch_dir):
        sys.exit("\n".join(f"check_patches: {p}" for p in problems))  # exits 1
    print(f"check_patches: {len(series_entries(patch_dir))} patches ok")
