"""LoRA under eviction, on the patched server.

An adapter changes the projections, not the KV layout, so vToken needs nothing
of its own: this checks it. The adapter's B matrices are zero, so it computes
exactly what the base model does, and a greedy request through it must answer
what the base model answers, under the same eviction. (Not in test_hostile's
mix: vLLM 0.18.0 itself fails LoRA with prompt_logprobs, vllm#16668 / #29955.)
"""

from __future__ import annotations

import json
import os
import pathlib
import urllib.request

import pytest

from tests.e2e.conftest import engine_driver
from tests.e2e.test_hostile import LONG, send
from tests.e2e.test_server import metric

pytestmark = pytest.mark.e2e
REPO = pathlib.Path(__file__).resolve().parents[2]


def zero_lora(folder: pathlib.Path) -> pathlib.Path:
    """A rank-8 LoRA adapter on q_proj and v_proj whose B matrices are zero: the
    model it gives computes exactly what the base model does."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads(
        pathlib.Path(os.environ["VTOKEN_MODEL_DIR"], "config.json").read_text()
    )
    hidden, head = cfg["hidden_size"], cfg["head_dim"]
    out = {"q_proj": cfg["num_attention_heads"] * head}
    out["v_proj"] = cfg["num_key_value_heads"] * head
    rank, tensors = 8, {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, size in out.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden).bfloat16()
            tensors[f"{key}.lora_B.weight"] = torch.zeros(size, rank).bfloat16()
    folder.mkdir()
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "bias": "none"}
    config |= {"target_modules": list(out), "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def server_url(tmp_path_factory, engine_dir):
    tmp = tmp_path_factory.mktemp("lora")
    cmd = [str(REPO / "scripts/run.sh"), "--max-model-len", "384", "--enforce-eager"]
    cmd += ["--kv-eviction-policy", "h2o", "--kv-budget-tokens", "48"]
    cmd += ["--enable-lora", "--lora-modules", f"zero={zero_lora(tmp / 'zero')}"]
    with engine_driver.serve(cmd, tmp / "serve.log", timeout=240) as url:
        yield url


def test_a_zero_adapter_answers_as_the_base_model_under_eviction(server_url):
    body = {"prompt": LONG, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    answers = {}
    for model in ("SmolLM2-135M-Instruct", "zero"):
        status, out = send(server_url, {**body, "model": model})
        assert status == 200, out
        answers[model] = out["choices"][0]["text"]
    assert answers["zero"] == answers["SmolLM2-135M-Instruct"]
    text = urllib.request.urlopen(server_url + "/metrics", timeout=10).read().decode()
    assert metric(text, "vllm:kv_evicted_tokens_total") > 0  # LONG > budget
    assert metric(text, "vllm:kv_cache_usage_perc") == 0
