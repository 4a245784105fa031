"""Streaming-input sessions (AsyncLLM.generate over StreamingInput chunks).

The engine core serves a session as one request that grows chunk by chunk;
vToken registers it with its first chunk's policy and budget. On an H2O engine
(budget 64): a three-chunk session evicts, and vtoken equals naive-evict token
for token; a session whose second chunk asks for another budget is refused
there (patch 0095), its first chunk served; a session after it runs as usual.
Every step of both engines runs the integrity checks (VTOKEN_CHECK_INTEGRITY).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

GEN = 16


def chunk(tokens: int, **extra) -> dict:
    return {"tokens": tokens, "max_tokens": GEN, "extra_args": extra or None}


SESSIONS = [
    {
        "sharegpt": {"n": 1, "min_tokens": 240, "max_tokens": 240},
        "chunks": [chunk(80)] * 3,
    },
    {
        "sharegpt": {"n": 2, "min_tokens": 160, "max_tokens": 160},
        "chunks": [chunk(80, kv_budget_tokens=64), chunk(80, kv_budget_tokens=128)],
    },
    {
        "sharegpt": {"n": 3, "min_tokens": 100, "max_tokens": 100},
        "chunks": [chunk(100)],
    },
]


@pytest.fixture(scope="module")
def runs(engine):
    def spec(reclaim):
        return {
            "engine": {
                "kv_eviction_policy": "h2o",
                "kv_budget_tokens": 64,
                "kv_reclaim": reclaim,
            },
            "sessions": SESSIONS,
        }

    return {mode: engine(spec(mode)) for mode in ("vtoken", "naive")}


def test_a_session_evicts_and_vtoken_equals_naive(runs):
    for mode, run in runs.items():
        first = run["sessions"][0]
        assert first["error"] is None, (mode, first["error"])
        assert len(first["outputs"]) == 3 * GEN, mode
        # 80-token chunks over a 64-token budget: the policy ran in the session.
        assert run["counters"]["vllm:kv_evicted_tokens"] > 0, mode
    assert runs["vtoken"]["sessions"][0] == runs["naive"]["sessions"][0]


def test_a_chunk_changing_its_session_s_budget_is_refused_the_engine_goes_on(runs):
    for mode, run in runs.items():
        refused, after = run["sessions"][1], run["sessions"][2]
        assert "chunk 2 asks for kv_eviction_policy='h2o', kv_budget_tokens=128" in (
            refused["error"] or ""
        ), (mode, refused["error"])
        assert len(refused["outputs"]) == GEN, mode  # its first chunk was served
        assert after["error"] is None and len(after["outputs"]) == GEN, mode
    assert runs["vtoken"]["sessions"][2] == runs["naive"]["sessions"][2]
