# SPDX-License-Identifier: Apache-2.0
"""Eviction policies, registered by name (scheduler side).

Importing this package registers every built-in policy in `POLICIES`, then the
policies other installed packages declare in the `vtoken.policies` entry point
group (`name = "module:PolicyClass"`, an `EvictionPolicy` whose `name` is the
entry point's); `create_policy` builds one from the engine arguments. A
plug-in that fails to load does not fail `import vllm` (this package is
imported with vLLM's input processor, vToken on or off): it is logged, and
choosing it raises, naming the entry point and why.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from vllm.logger import init_logger
from vllm.vtoken.policies import (
    h2o,
    random_policy,
    scissorhands,
    snapkv,
    streaming_llm,
)
from vllm.vtoken.policies.base import (
    POLICIES,
    EvictionPolicy,
    RequestView,
    register_policy,
)

del h2o, random_policy, scissorhands, snapkv, streaming_llm  # imported to register

ENTRY_POINT_GROUP = "vtoken.policies"
BROKEN: dict[str, str] = {}  # plug-in name -> why it did not load

logger = init_logger(__name__)


def _load_plugin(ep: importlib.metadata.EntryPoint) -> type[EvictionPolicy]:
    where = f"{ENTRY_POINT_GROUP} entry point {ep.name} = {ep.value}"
    try:
        cls = ep.load()
    except Exception as e:
        raise ValueError(f"{where} failed to load: {type(e).__name__}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise ValueError(f"{where} is not an EvictionPolicy subclass")
    if getattr(cls, "name", None) != ep.name:
        raise ValueError(
            f"{ENTRY_POINT_GROUP} entry point {ep.name} names "
            f"a policy called {getattr(cls, 'name', None)!r}"
        )
    return cls


def _register_plugins() -> None:
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        before = POLICIES.get(ep.name)
        try:
            cls = _load_plugin(ep)
            if POLICIES.get(ep.name) is not cls:  # its module may register it too
                register_policy(cls)  # a name taken already: ValueError
        except ValueError as e:
            # Left as it was (a module may have registered, then failed); a
            # name another policy holds keeps that one.
            POLICIES.pop(ep.name, None)
            if before is not None:
                POLICIES[ep.name] = before
            else:
                BROKEN[ep.name] = str(e)
            logger.warning("vToken: policy %r is unavailable: %s", ep.name, e)
            continue
        BROKEN.pop(ep.name, None)


_register_plugins()


def create_policy(
    name: str, budget: int, config: dict[str, Any] | None = None
) -> EvictionPolicy:
    """Builds a registered policy.

    Args:
        name: A key of `POLICIES` ("h2o", "streamingllm", "scissorhands",
            "snapkv", "random", or an installed plug-in's).
        budget: Live tokens kept per request (> 0).
        config: Policy knobs; see each policy's docstring.

    Returns:
        The policy.

    Raises:
        ValueError: On an unknown name (the message lists the valid ones), a
            plug-in that failed to load (the message says why), a bad budget
            or bad knobs.
    """
    cls = POLICIES.get(name)
    if cls is None and name in BROKEN:
        raise ValueError(f"eviction policy {name!r} is unavailable: {BROKEN[name]}")
    if cls is None:
        raise ValueError(
            f"unknown eviction policy {name!r}; valid: {', '.join(sorted(POLICIES))}"
        )
    return cls(budget, **(config or {}))


__all__ = [
    "ENTRY_POINT_GROUP",
    "POLICIES",
    "EvictionPolicy",
    "RequestView",
    "create_policy",
    "register_policy",
]
