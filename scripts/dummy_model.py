#!/usr/bin/env python3
"""Write a dummy-weight model folder: a real architecture's config, no weights.

    python scripts/dummy_model.py llama-3.1-8b DEST
    python scripts/dummy_model.py mistral-7b DEST
    python scripts/dummy_model.py tiny-llama DEST     # CPU smoke test of the path

vLLM loads it with `load_format="dummy"` (random weights), so a GPU benchmark of
the KV cache needs no download and no Hub access. The attention geometry — layers,
query and KV heads, head size, RoPE — is the named model's, and that is all the
KV cache sees. One change: the vocabulary is a generated 32,768-token word-level
tokenizer written beside the config (Mistral-7B-v0.3's vocabulary size; Llama-3.1
has 128,256, so its LM head here is a quarter the size), because the real
tokenizers are downloads. Prompts for these models are random token ids.
"""

from __future__ import annotations

import argparse
import json
import pathlib

VOCAB = 32768
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2

_COMMON = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "vocab_size": VOCAB,
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

ARCHS = {
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
    # Two layers of the same shape family, small enough for a CPU test.
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


def write_tokenizer(dest: pathlib.Path) -> None:
    """A word-level tokenizer over "w3" ... "w32767" plus three specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Words are joined with spaces again, so decode(encode(text)) round-trips.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": False,
                "model_max_length": 1 << 20,
            },
            indent=1,
        )
    )


def write_model(arch: str, dest: pathlib.Path) -> None:
    if arch not in ARCHS:
        raise SystemExit(f"unknown architecture {arch!r}; choose from {sorted(ARCHS)}")
    dest.mkdir(parents=True, exist_ok=True)
    config = {**_COMMON, **ARCHS[arch]}
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(dest)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("arch", choices=sorted(ARCHS))
    p.add_argument("dest", type=pathlib.Path)
    args = p.parse_args()
    write_model(args.arch, args.dest)
    print(f"wrote {args.arch} (dummy weights) to {args.dest}")


if __name__ == "__main__":
    main()
