# SPDX-License-Identifier: Apache-2.0
"""Per-request eviction settings, from `SamplingParams.extra_args`.

The OpenAI server fills `extra_args` from a request's `vllm_xargs`; `LLM` users
pass `SamplingParams(extra_args=...)`. `extra_args` is shared with logits
processors and other extensions, so vToken reads only its own keys, named as
the engine flags they override:

    kv_budget_tokens     int in [1, max_model_len] (as the flag), or "none"
    kv_eviction_policy   a policy this engine can serve, or "none"

"none" (either key) opts the request out: nothing of it is evicted, and its
attention takes vLLM's own kernel. Any other `kv_` key is refused (a typo must
not silently serve without eviction), except vLLM's own `kv_transfer_params`.
The engine flags are the defaults; an engine started with a policy and no
`--kv-budget-tokens` evicts only for requests that ask for a budget.

Checked by the front end (patch 0090; the OpenAI server's before its response
starts, patch 0097) before the request is scheduled, so a bad value is the
client's error (HTTP 400), and read again by the scheduler and the
worker when the request arrives. A streaming-input session is one request to the
engine core, registered with its first chunk's settings: a later chunk asking
for others is refused (`SessionEviction`, patch 0095).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Any

from vllm.exceptions import VLLMValidationError
from vllm.vtoken.policies import BROKEN, POLICIES, create_policy
from vllm.vtoken.policies.base import keeps_dead_listed

if TYPE_CHECKING:
    from vllm.vtoken.config import VTokenConfig

BUDGET_KEY = "kv_budget_tokens"
POLICY_KEY = "kv_eviction_policy"
KEYS = (BUDGET_KEY, POLICY_KEY)
NOT_OURS = frozenset({"kv_transfer_params"})  # vLLM's KV connectors
OPT_OUT = "none"


@dataclass(frozen=True)
class RequestEviction:
    """What one request gets: a policy and a budget, or no eviction."""

    policy: str  # "none": no eviction
    budget: int | None

    @property
    def evicts(self) -> bool:
        return self.policy != OPT_OUT

    @property
    def score_mode(self) -> str | None:
        """The attention scores this request's policy reads, if any."""
        return POLICIES[self.policy].score_mode if self.evicts else None

    @property
    def keeps_dead_listed(self) -> bool:
        """Whether its Token Tables leave victims listed a while
        (policies.base.keeps_dead_listed)."""
        return keeps_dead_listed(POLICIES[self.policy] if self.evicts else None)


def request_eviction(
    extra_args: dict[str, Any] | None,
    cfg: VTokenConfig,
    *,
    max_model_len: int | None,
) -> RequestEviction:
    """The request's eviction settings: its own keys over the engine's flags.
    `max_model_len` None: the budget's upper bound was checked where the
    request came in (the engine core's may be smaller: vLLM's auto-fit
    shrinks it there alone), so a request the front end took never fails
    in a step.

    Raises:
        VLLMValidationError: A ValueError naming the key (`parameter`) and the
            rule it breaks; the OpenAI server answers it with HTTP 400.
    """
    args = {
        k: v
        for k, v in (extra_args or {}).items()
        if isinstance(k, str) and k.startswith("kv_") and k not in NOT_OURS
    }
    engine = _engine_eviction(cfg)
    if not args:
        return engine
    unknown = sorted(set(args) - set(KEYS))
    if unknown:
        raise VLLMValidationError(
            f"unknown vToken request key(s) {unknown} in vllm_xargs/extra_args; "
            f"valid: {list(KEYS)}",
            parameter=unknown[0],
        )
    if not cfg.enabled:
        if all(v == OPT_OUT for v in args.values()):
            return engine  # opting out of what this server never does
        raise VLLMValidationError(
            f"{', '.join(sorted(args))}: per-request eviction needs a server "
            "started with --kv-eviction-policy",
            parameter=sorted(args)[0],
        )
    policy = args.get(POLICY_KEY, cfg.kv_eviction_policy)
    _check_policy(policy, cfg)
    budget = args[BUDGET_KEY] if BUDGET_KEY in args else cfg.kv_budget_tokens
    if BUDGET_KEY in args and budget != OPT_OUT:  # checked, even opting out
        _check_budget(budget, max_model_len)
    if policy == OPT_OUT or budget == OPT_OUT:
        return RequestEviction(OPT_OUT, None)
    if budget is None and BUDGET_KEY not in args:
        raise VLLMValidationError(
            f"{POLICY_KEY}={policy!r} needs {BUDGET_KEY}: this server has no "
            "default budget (--kv-budget-tokens)",
            parameter=BUDGET_KEY,
        )
    try:  # the knobs must suit this budget too (e.g. StreamingLLM's sinks)
        knobs = cfg.policy_knobs() if policy == cfg.kv_eviction_policy else None
        create_policy(policy, budget, knobs)
    except ValueError as err:
        raise VLLMValidationError(
            f"{BUDGET_KEY}={budget}: {err}", parameter=BUDGET_KEY
        ) from None
    return RequestEviction(policy, budget)


def request_evictions(
    params: Sequence[Any], cfg: VTokenConfig
) -> list[RequestEviction]:
    """`request_eviction` of each of a step's new requests (their
    `SamplingParams`, None for a request without), as the hooks read them:
    the engine's settings, one object, for every request without
    `extra_args` (the usual step: no Python call a request)."""
    extra = list(map(getattr, params, repeat("extra_args"), repeat(None)))
    engine = _engine_eviction(cfg)
    if not any(extra):
        return [engine] * len(extra)
    return [
        request_eviction(x, cfg, max_model_len=None) if x else engine for x in extra
    ]


def _engine_eviction(cfg: VTokenConfig) -> RequestEviction:
    """What a request setting no key of its own gets: the engine's flags."""
    return RequestEviction(
        cfg.kv_eviction_policy if cfg.kv_budget_tokens is not None else OPT_OUT,
        cfg.kv_budget_tokens,
    )


def _check_budget(budget: Any, max_model_len: int | None) -> None:
    """A request's own budget: an integer from 1 (as --kv-budget-tokens) to
    `max_model_len` (None: no upper bound checked; an inherited engine
    budget was taken at start-up, as for a request that sets no key)."""
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise VLLMValidationError(
            f"{BUDGET_KEY} must be an integer or {OPT_OUT!r}, got {budget!r}",
            parameter=BUDGET_KEY,
        )
    top = budget if max_model_len is None else max_model_len
    if not 1 <= budget <= top:
        raise VLLMValidationError(
            f"{BUDGET_KEY}={budget} must be in [1, {top}] (up to max_model_len)",
            parameter=BUDGET_KEY,
        )


def _check_policy(policy: Any, cfg: VTokenConfig) -> None:
    if policy == OPT_OUT:
        return
    if isinstance(policy, str) and policy in BROKEN:
        raise VLLMValidationError(
            f"{POLICY_KEY}={policy!r} is unavailable: {BROKEN[policy]}",
            parameter=POLICY_KEY,
        )
    if not isinstance(policy, str) or policy not in POLICIES:
        raise VLLMValidationError(
            f"{POLICY_KEY} must be one of {[OPT_OUT, *sorted(POLICIES)]}, "
            f"got {policy!r}",
            parameter=POLICY_KEY,
        )
    need = POLICIES[policy].score_mode
    have = POLICIES[cfg.kv_eviction_policy].score_mode
    if need is not None and need != have:
        raise VLLMValidationError(
            f"{POLICY_KEY}={policy!r} needs {need!r} attention scores, which this "
            f"server does not compute (it was started with --kv-eviction-policy "
            f"{cfg.kv_eviction_policy}); choose a policy without scores or "
            f"{cfg.kv_eviction_policy!r}",
            parameter=POLICY_KEY,
        )


def check_request_args(extra_args: dict[str, Any] | None, vllm_config) -> None:
    """The front end's check (input processor): ValueError -> HTTP 400."""
    if extra_args:
        _front_end_eviction(extra_args, vllm_config)


def check_openai_request(
    xargs: dict[str, Any] | None, beam_search: bool, vllm_config
) -> None:
    """The OpenAI server's check of a request's `vllm_xargs`, before its
    response starts (patch 0097): a streamed response is sent with status 200
    before the input processor's check runs, so a bad value came back as an
    error event, not an HTTP 400. Beam search runs its beams as requests
    without the request's `extra_args`, never evicted: asking it for a
    policy or budget of its own is refused (opting out is what it gets)."""
    check_request_args(xargs, vllm_config)
    if beam_search and xargs:
        asked = [k for k in KEYS if k in xargs and xargs[k] != OPT_OUT]
        if asked:
            raise VLLMValidationError(
                f"{asked[0]}: beam search takes no per-request eviction "
                "settings (vLLM runs its beams without vllm_xargs, never "
                f"evicted); drop the key or set it to {OPT_OUT!r}",
                parameter=asked[0],
            )


def _front_end_eviction(extra_args, vllm_config) -> RequestEviction:
    return request_eviction(
        extra_args,
        vllm_config.vtoken_config,
        max_model_len=vllm_config.model_config.max_model_len,
    )


class SessionEviction:
    """One streaming-input session's settings (AsyncLLM.generate over
    StreamingInput chunks, each with its own SamplingParams).

    The engine core serves a session as one request: its scheduler and worker
    read the policy and budget once, when the first chunk arrives, and a later
    chunk's `extra_args` replace the request's sampling parameters without
    being read again. So a later chunk must ask for what the first did; one
    that asks for another policy or budget is refused before it is sent (its
    session ends there, the chunks before it served), not served silently with
    the first's settings.
    """

    def __init__(self, vllm_config) -> None:
        self._config = vllm_config
        self._first: RequestEviction | None = None
        self._chunks = 0

    def check(self, extra_args: dict[str, Any] | None) -> None:
        """Each chunk in order, after vLLM's streaming-input checks of its
        parameters and before it is processed or sent.

        Raises:
            VLLMValidationError: The chunk's settings are not the first's.
        """
        self._chunks += 1
        got = _front_end_eviction(extra_args, self._config)
        if self._first is None:
            self._first = got
        elif got != (first := self._first):
            key = POLICY_KEY if got.policy != first.policy else BUDGET_KEY
            raise VLLMValidationError(
                f"streaming input: chunk {self._chunks} asks for "
                f"{POLICY_KEY}={got.policy!r}, {BUDGET_KEY}={got.budget!r}, but "
                f"its session runs with {first.policy!r}, {first.budget!r} (set "
                "by its first chunk); a session keeps one policy and budget",
                parameter=key,
            )
