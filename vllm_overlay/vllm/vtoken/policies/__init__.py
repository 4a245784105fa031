# SPDX-License-Identifier: Apache-2.0
"""Eviction policies, registered by name (scheduler side).

Importing this package registers every built-in policy in `POLICIES`;
`create_policy` builds one from the engine arguments.
"""

from __future__ import annotations

from typing import Any

from vllm.vtoken.policies import h2o, random_policy, scissorhands, streaming_llm
from vllm.vtoken.policies.base import (
    POLICIES,
    EvictionPolicy,
    RequestView,
    register_policy,
)

del h2o, random_policy, scissorhands, streaming_llm  # imported to register


def create_policy(
    name: str, budget: int, config: dict[str, Any] | None = None
) -> EvictionPolicy:
    """Builds a registered policy.

    Args:
        name: A key of `POLICIES` ("h2o", "streamingllm", "scissorhands",
            "random").
        budget: Live tokens kept per request (> 0).
        config: Policy knobs; see each policy's docstring.

    Returns:
        The policy.

    Raises:
        ValueError: On an unknown name (the message lists the valid ones), a bad
            budget or bad knobs.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(
            f"unknown eviction policy {name!r}; valid: {', '.join(sorted(POLICIES))}"
        )
    return cls(budget, **(config or {}))


__all__ = [
    "POLICIES",
    "EvictionPolicy",
    "RequestView",
    "create_policy",
    "register_policy",
]
