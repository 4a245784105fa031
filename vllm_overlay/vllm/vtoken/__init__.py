# SPDX-License-Identifier: Apache-2.0
"""vToken: token-level KV-cache virtualization for vLLM.

Eviction policies decide per token; vLLM frees memory per block. vToken keeps a
Token Table per request (slot + liveness bit per token), lets a policy mark tokens
dead through two calls (`sync_new_tokens`, `evict_token`), and compacts the live
tokens of under-used blocks into fewer blocks so the emptied blocks go back to
vLLM's block pool.

Scheduler side: token_table, policies, eviction, planner, packing,
                request_state, block_index, reclaimer, scheduler.
Worker side:    copy_executor, kv_copy_cpu, kv_copy_triton, cpu_attention,
                triton_attention, score_kernel, score_triton, context, scores,
                worker.
Both:           config, messages, stats, metrics, integrity.
docs/DESIGN.md §8 maps which call lives where.
The core modules import only numpy and torch; vLLM types appear under
TYPE_CHECKING only, so they can be tested without starting an engine.
"""
