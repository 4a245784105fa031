"""Per-request eviction settings (`extra_args` / `vllm_xargs`) against the flags."""

from types import SimpleNamespace

import numpy as np
import pytest

from vllm.vtoken.eviction import EvictionRuntime
from vllm.vtoken.policies import create_policy
from vllm.vtoken.request_args import (
    RequestEviction,
    SessionEviction,
    request_eviction,
)
from vllm.vtoken.token_table import TokenTablePool

B, MAX_LEN = 16, 2048


class Cfg:
    """The VTokenConfig fields request_eviction reads (no vLLM config import)."""

    def __init__(self, policy="h2o", budget=256, **knobs):
        self.kv_eviction_policy, self.kv_budget_tokens = policy, budget
        self.enabled = policy != "none"
        self.knobs = knobs

    def policy_knobs(self):
        return self.knobs


def parse(args, cfg=None):
    return request_eviction(args, cfg or Cfg(), max_model_len=MAX_LEN)


def test_engine_flags_are_the_defaults():
    assert parse(None) == RequestEviction("h2o", 256)
    assert parse({"top_k_logits": 3}) == RequestEviction("h2o", 256)  # not ours
    assert parse({1: 2}) == RequestEviction("h2o", 256)  # an AttributeError before
    assert parse({"kv_transfer_params": {}}) == RequestEviction("h2o", 256)
    assert parse(None, Cfg(budget=None)) == RequestEviction("none", None)
    assert not parse(None, Cfg("none", None)).evicts


def test_a_request_brings_its_own_budget_policy_or_opt_out():
    assert parse({"kv_budget_tokens": 64}) == RequestEviction("h2o", 64)
    assert parse({"kv_budget_tokens": 64}, Cfg(budget=None)).budget == 64
    got = parse({"kv_eviction_policy": "streamingllm"})
    assert got == RequestEviction("streamingllm", 256) and got.score_mode is None
    for opt_out in ({"kv_budget_tokens": "none"}, {"kv_eviction_policy": "none"}):
        assert parse(opt_out) == RequestEviction("none", None)
        assert parse(opt_out, Cfg("none", None)) == RequestEviction("none", None)
    assert parse({"kv_budget_tokens": B}).budget == B
    assert parse({"kv_budget_tokens": MAX_LEN}).budget == MAX_LEN
    # Below a block, as the flag may be (a CPU block is 128 tokens): refused
    # per request before 2026-12-06 (found by review).
    assert parse({"kv_budget_tokens": 1}).budget == 1


def test_a_request_setting_only_the_policy_keeps_the_engine_s_budget():
    """The engine's budget, whatever start-up took (past max_model_len: a
    warning), is a request's unless it sets its own: one setting only the
    policy is not refused for a budget it never sent."""
    budget = MAX_LEN + 100
    for args in (None, {"kv_eviction_policy": "streamingllm"}):
        got = parse(args, Cfg(budget=budget))
        assert got.budget == budget and got.evicts
    with pytest.raises(ValueError, match=r"must be in \[1, 2048\]"):
        parse({"kv_budget_tokens": budget})


def test_the_engine_takes_a_budget_the_front_end_took():
    """The engine core parses a request the front end checked with no upper
    bound of its own (max_model_len None): vLLM's auto-fit may have shrunk
    its max_model_len alone, and a refusal there, inside a step, would end
    the engine. The other rules still hold."""
    args = {"kv_budget_tokens": MAX_LEN + 100}
    with pytest.raises(ValueError, match=r"must be in \[1, 2048\]"):
        parse(args)  # the front end
    got = request_eviction(args, Cfg(), max_model_len=None)
    assert got == RequestEviction("h2o", MAX_LEN + 100)
    with pytest.raises(ValueError, match=r"kv_budget_tokens=0 must be in \[1,"):
        request_eviction({"kv_budget_tokens": 0}, Cfg(), max_model_len=None)


@pytest.mark.parametrize(
    "args, cfg, message",
    [
        ({"kv_budget": 64}, None, "unknown vToken request key"),
        ({"kv_budget_tokens": 64}, Cfg("none", None), "needs a server started"),
        ({"kv_budget_tokens": 0}, None, r"must be in \[1, 2048\]"),
        ({"kv_budget_tokens": -3}, None, r"must be in \[1, 2048\]"),
        ({"kv_budget_tokens": MAX_LEN + 1}, None, r"must be in \[1, 2048\]"),
        # Checked when the policy opts out too (accepted before 2026-12-06).
        (
            {"kv_eviction_policy": "none", "kv_budget_tokens": "junk"},
            None,
            "must be an integer",
        ),
        ({"kv_eviction_policy": "none", "kv_budget_tokens": 0}, None, r"\[1, 2048\]"),
        ({"kv_budget_tokens": "64"}, None, "must be an integer"),
        ({"kv_budget_tokens": 64.0}, None, "must be an integer"),
        ({"kv_budget_tokens": True}, None, "must be an integer"),
        ({"kv_budget_tokens": None}, None, "must be an integer"),
        (
            {"kv_budget_tokens": 16},
            Cfg("streamingllm", None, num_sinks=32),
            r"kv_budget_tokens=16: streamingllm: num_sinks \(32\) must be < budget",
        ),
        (  # SnapKV keeps its window whole (32 by default)
            {"kv_budget_tokens": 32},
            Cfg("snapkv", None),
            r"kv_budget_tokens=32: snapkv: window \(32\) must be < budget",
        ),
        ({"kv_eviction_policy": "lru"}, None, "must be one of"),
        ({"kv_eviction_policy": "scissorhands"}, None, "'persistence' attention"),
        ({"kv_eviction_policy": "h2o"}, Cfg("random", 64), "'sum' attention"),
        ({"kv_eviction_policy": "random"}, Cfg(budget=None), "needs kv_budget"),
    ],
)
def test_bad_values_name_the_key_and_the_rule(args, cfg, message):
    with pytest.raises(ValueError, match=message):
        parse(args, cfg)


def test_a_plugin_that_failed_to_load_is_refused_with_the_reason(monkeypatch):
    import vllm.vtoken.policies as policies

    why = "vtoken.policies entry point gone = x:Y failed to load: ImportError"
    monkeypatch.setitem(policies.BROKEN, "gone", why)
    with pytest.raises(
        ValueError, match=f"kv_eviction_policy='gone' is unavailable: {why}"
    ):
        parse({"kv_eviction_policy": "gone"})


def session(cfg=None) -> SessionEviction:
    return SessionEviction(
        SimpleNamespace(
            vtoken_config=cfg or Cfg(),
            model_config=SimpleNamespace(max_model_len=MAX_LEN),
        )
    )


@pytest.mark.parametrize(
    "chunks",
    [
        [None, None, {}],
        [None, {"kv_budget_tokens": 256}, {"kv_eviction_policy": "h2o"}],  # same
        [{"kv_budget_tokens": 64}] * 3,
        [{"kv_eviction_policy": "none"}, {"kv_budget_tokens": "none"}],  # opt-out
    ],
)
def test_a_streaming_session_may_repeat_its_first_chunk_s_settings(chunks):
    s = session()
    for args in chunks:
        s.check(args)


@pytest.mark.parametrize(
    "first, later, key",
    [
        (None, {"kv_budget_tokens": 64}, "kv_budget_tokens"),
        ({"kv_budget_tokens": 64}, None, "kv_budget_tokens"),
        (None, {"kv_eviction_policy": "random"}, "kv_eviction_policy"),
        (None, {"kv_eviction_policy": "none"}, "kv_eviction_policy"),
        ({"kv_budget_tokens": "none"}, {"kv_budget_tokens": 128}, "kv_eviction_policy"),
    ],
)
def test_a_later_chunk_may_not_change_its_session_s_settings(first, later, key):
    s = session()
    s.check(first)
    s.check(first)  # a repeat is fine
    with pytest.raises(
        ValueError, match="chunk 3 asks for .* a session keeps one"
    ) as e:
        s.check(later)
    assert e.value.parameter == key


def test_a_session_chunk_s_bad_value_is_refused_as_a_request_s():
    s = session()
    s.check(None)
    with pytest.raises(ValueError, match=r"must be in \[1, 2048\]"):
        s.check({"kv_budget_tokens": 0})
    off = session(Cfg("none", None))
    off.check(None)
    off.check({"kv_budget_tokens": "none"})  # opting out of what it never does
    with pytest.raises(ValueError, match="needs a server started with"):
        off.check({"kv_budget_tokens": 64})


def test_runtime_keeps_each_request_within_its_own_budget():
    pool = TokenTablePool(64, B)
    rt = EvictionRuntime(pool, create_policy("streamingllm", 8), 8)
    rt.sync_new_tokens("default", np.arange(0, 40))
    rt.sync_new_tokens("small", np.arange(40, 80), evict=RequestEviction("random", 4))
    rt.sync_new_tokens("out", np.arange(80, 120), evict=RequestEviction("none", None))
    for rid, budget in (("default", 8), ("small", 4), ("out", 40)):
        rt.enforce_budget(rid, 40)
        assert pool.num_live(rid) == budget, rid
    # Policy objects are shared per (name, budget); the engine's is the default.
    rt.sync_new_tokens(
        "small2", np.arange(120, 130), evict=RequestEviction("random", 4)
    )
    assert rt._reqs["small"].policy is rt._reqs["small2"].policy
    assert rt._reqs["default"].policy is rt.policy
    for rid in ("default", "small", "out", "small2"):
        rt.release(rid)
    assert pool.block_live.sum() == 0
