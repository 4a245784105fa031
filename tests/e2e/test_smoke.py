"""The patched engine, idle hooks: same greedy output as unpatched vLLM."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

SPEC = {
    "sharegpt": {"n": 4, "min_tokens": 16, "max_tokens": 96},
    "max_tokens": 48,
}


def test_native_matches_stock_vllm(engine):
    stock = engine(SPEC, pristine=True)
    patched = engine(SPEC)
    assert len(stock["outputs"]) == 4
    assert patched["outputs"] == stock["outputs"]
    assert patched["counters"] is None  # policy "none": no vToken state at all
    assert patched["free_end"] == patched["free_start"]


def test_real_model_decodes_coherently(engine, tmp_path):
    import os

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.environ["VTOKEN_MODEL_DIR"])
    prompt = tok.encode("The capital of France is")
    out = engine({"prompts": [prompt], "max_tokens": 8})
    assert "Paris" in out["texts"]["0"]
