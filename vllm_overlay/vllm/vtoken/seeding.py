# SPDX-License-Identifier: Apache-2.0
"""What makes eviction reproducible: each request's random generator.

Scheduler side. A request's generator is seeded from the engine's `seed` knob
and a SHA-256 of its prompt (engine request ids carry a random suffix), so the
same prompt and seed give the same draws in any batch order and any run.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm.v1.request import Request


def request_rng(seed: int, key: bytes) -> np.random.Generator:
    """The per-request generator: same (seed, key), same draws. Built when a
    policy may read it (~14 µs: NumPy's seeding), not at registration."""
    digest = np.frombuffer(hashlib.sha256(key).digest()[:16], dtype=np.uint32)
    return np.random.default_rng([int(seed), *digest.tolist()])


def request_seed(seed: int, key: bytes) -> int:
    """The request's 63-bit seed for the batch path's counter-based draws
    (selection.hash_uniform): same (seed, key), same seed, whatever the
    generator's state; ~1 µs, where drawing it from the generator needed
    the generator built (~14 µs a request at registration, and the draw)."""
    digest = hashlib.sha256(b"%d:" % int(seed) + key).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def prompt_key(req: Request) -> bytes:
    """What seeds a request's generator: same prompt and seed, same random
    draws, whatever the request id (engine ids carry a random suffix)."""
    if req.prompt_token_ids is not None:
        return np.asarray(req.prompt_token_ids, np.int64).tobytes()
    if req.prompt_embeds is not None:  # --enable-prompt-embeds: no token ids
        embeds = req.prompt_embeds.detach().cpu().contiguous()
        return embeds.view(-1).view(torch.uint8).numpy().tobytes()
    return req.request_id.encode()
