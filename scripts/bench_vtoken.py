"""Measure vToken like the paper, on the real patched engine.

    scripts/bench_all.sh                       # the whole CPU-sized suite + report
    python scripts/bench_vtoken.py memory      # one experiment

Experiments (EXPERIMENTS; docs/RESULTS.md says what each measures) write
docs/bench/<name>.json (and a PNG where they plot); scripts/bench_report.py
turns them into docs/RESULTS.md. Engines run as scripts/engine_driver.py
processes; `--model`, `--engine-json` and the sizes let the same script run a
7B/8B model on a GPU (bench_gpu.sh does).
"""

import argparse
import contextlib
import importlib.util
import itertools
import json
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator

# scripts/ is this script's folder, so engine_driver imports as a module.
from engine_driver import VLLM, bench_serve, cli_flags, run_driver, serve

REPO = pathlib.Path(__file__).resolve().parents[1]
POLICIES = ["h2o", "streamingllm", "scissorhands", "snapkv", "random"]
# (mode, policy, reclaim) compared side by side; naive and vtoken run H2O.
MODES = [
    ("native", "none", "-"),
    ("naive", "h2o", "naive"),
    ("vtoken", "h2o", "vtoken"),
]
MODE_NAMES = [mode for mode, _, _ in MODES]
RECLAIMS = ("naive", "vtoken")  # the memory experiment runs every policy in both
COUNTERS = ("evicted_tokens", "moved_tokens", "reclaimed_blocks")
PREFIX_COUNTERS = ("evacuated_blocks", "tight_plans", "moved_tokens")
SLA_FIELDS = (
    "output_throughput",
    "p95_e2el_ms",
    "p50_e2el_ms",
    "completed",
    "total_output_tokens",
)
# `vllm bench serve` keeps ShareGPT prompts of up to this many tokens.
SHAREGPT_MAX_PROMPT = 1024


def in_turns(repeats: int, *axes) -> Iterator[tuple]:
    """(repeat, *item) for every item of the axes' product, `repeats` times
    taking turns: forward, then backward (ABBA), so that a drift of the
    machine over a turn falls on every item alike (run first in each turn,
    native looked the fastest of a memory run's 11 on a drifting VM)."""
    items = list(itertools.product(*axes))
    for rep in range(repeats):
        for item in items if rep % 2 == 0 else items[::-1]:
            yield (rep, *item)


def workload(args, n: int | None, min_tokens: int) -> dict:
    """The driver's workload: `n` prompts (None: the search sets it) of
    --prompt-len tokens, ShareGPT first turns or random ids, --gen-len each."""
    src = {"min_tokens": min_tokens, "max_tokens": args.prompt_len}
    if n is not None:
        src["n"] = n
    return {args.prompts: src, "max_tokens": args.gen_len}


def engine_args(args, **extra) -> dict:
    model = {"model": args.model} if args.model else {}
    return {**model, **json.loads(args.engine_json), **extra}


def policy_args(policy: str, budget: int, reclaim: str) -> dict:
    if policy == "none":
        return {}
    knobs = {"seed": 0} if policy == "random" else {}
    if policy == "snapkv" and budget <= 32:  # its window (32) must be < budget
        knobs = {"window": budget // 2}
    return {
        "kv_eviction_policy": policy,
        "kv_budget_tokens": budget,
        "kv_reclaim": reclaim,
        "kv_eviction_config": knobs,
    }


def pick(args, *names: str) -> dict:
    """The named arguments, as the experiment's JSON records them."""
    return {name: getattr(args, name) for name in names}


@contextlib.contextmanager
def figure(png: pathlib.Path, ncols: int = 1, width: float = 6):
    """Axes to draw on, saved as `png` when the block ends."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, 4))
    yield axes
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def memory_figures(run: dict) -> dict:
    """Time averages over the steps where every request is decoding, and the
    run's vToken counters (none for native)."""
    B, n, c = run["block_size"], len(run["prompt_lens"]), run["counters"] or {}
    steps = [s for s in run["steps"] if s["running"] == n and len(s["live"]) == n]
    steps = steps[1:]  # the first holds a prefill
    util, perfect, held, hist = [], [], [], [0] * (B + 1)
    for s in steps:
        live, blocks = sum(s["live"].values()), sum(s["held"].values())
        need = sum(math.ceil(v / B) for v in s["live"].values())
        util.append(live / (blocks * B))
        perfect.append(live / (need * B))
        held.append(blocks)
        hist = [h + k for h, k in zip(hist, s["hist"], strict=True)]
    total, num_steps, secs = sum(hist) or 1, len(run["steps"]), run["generate_s"]
    planner_ns = c.get("planner_ns", 0)
    return {
        "utilization": statistics.fmean(util),
        "perfect_packing": statistics.fmean(perfect),
        "retained_blocks": statistics.fmean(held),
        "hist": [k / total for k in hist],
        "non_live_share": sum(k * (B - i) for i, k in enumerate(hist)) / (total * B),
        "steps_averaged": len(steps),
        **{k: c.get(k, 0) for k in COUNTERS},
        "copy_bytes_per_step": c.get("copy_bytes", 0) / num_steps,
        "planner_us_per_call": planner_ns / 1e3 / (c.get("plan_calls") or 1),
        "planner_share": planner_ns / (1e9 * secs),
        "step_ms": 1e3 * secs / num_steps,
        # The CPU decode target's measure: a step with every request decoding.
        "decode_step_ms": statistics.median(s["step_ms"] for s in steps),
        "generate_s": secs,
    }


def cmd_memory(args) -> dict:
    """The memory figures of each mode (deterministic: the first run's), and
    its decode step time, the median over --repeats runs taking turns (with
    --baseline, the older overlay's runs next to each)."""
    wave = workload(args, args.requests, args.prompt_len)
    runs = [("none", "-"), *((p, r) for p in args.policies for r in RECLAIMS)]
    results, steps = {}, {}
    for rep, (policy, reclaim) in in_turns(args.repeats, runs):
        key = f"{policy}/{reclaim}"
        eng = engine_args(args, **policy_args(policy, args.budget, reclaim))
        spec = {"engine": eng, "histogram": True, **wave}
        fig = memory_figures(run_driver(spec))
        steps.setdefault(key, []).append(fig["decode_step_ms"])
        if args.baseline and reclaim != "-":  # the older overlay, next
            old = memory_figures(run_driver(spec, env=versions(args)["before"]))
            steps.setdefault(f"{key}/before", []).append(old["decode_step_ms"])
        if rep == 0:
            results[key] = fig
            print(
                f"memory {policy:12s} {reclaim:6s} util {fig['utilization']:.3f} "
                f"retained {fig['retained_blocks']:.1f}"
            )
    for key, fig in results.items():
        fig["decode_step_ms"] = statistics.median(steps[key])
        fig["decode_step_ms_runs"] = steps[key]
        if f"{key}/before" in steps:
            fig["before_decode_step_ms"] = statistics.median(steps[f"{key}/before"])
    keys = ("budget", "policies", "repeats")
    return {"workload": wave, **pick(args, *keys), "results": results}


def plot_memory(data: dict, png: pathlib.Path) -> None:
    res, policies = data["results"], data["policies"]
    with figure(png, ncols=2, width=12) as (a, b):
        for key in ["none/-"] + [f"{p}/naive" for p in policies]:
            h = res[key]["hist"]
            a.plot(range(len(h)), h, marker="o", label=key.replace("/-", " (native)"))
        a.set_xlabel("live tokens in a held block")
        a.set_ylabel("share of held blocks")
        a.set_title("Fragmentation: per-block utilization (naive-evict)")
        a.legend(fontsize=8)
        for off, mode in [(-0.2, "naive"), (0.2, "vtoken")]:
            util = [res[f"{p}/{mode}"]["utilization"] for p in policies]
            b.bar([i + off for i in range(len(policies))], util, width=0.4, label=mode)
        b.set_xticks(range(len(policies)), policies)
        b.set_ylabel("time-averaged token utilization")
        b.set_ylim(0, 1)
        b.set_title("Memory utilization")
        b.legend()


def cmd_capacity(args) -> dict:
    budget, B = (args.prompt_len + args.gen_len) // 2, 16
    # Blocks one request holds at its peak. Native: every token but the last
    # sampled one has KV. vToken: budget + 1 live tokens at the forward (the new
    # token is written before the policy evicts), densely packed, plus one block
    # of slack (the tail being filled and the holes that wait for a plan).
    per_req = {
        "native": math.ceil((args.prompt_len + args.gen_len - 1) / B),
        "vtoken": math.ceil((budget + 1) / B) + 1,
    }
    wave, out = workload(args, None, args.prompt_len), {}
    for pool in args.pools:
        for mode, policy, reclaim in MODES:
            theory = (pool - 1) // per_req["native" if mode == "native" else "vtoken"]
            # Requests that start a step apart peak apart, so a mode may beat
            # the theory: search above it, and say so if the top was reached.
            hi = theory + max(2, theory // 8)
            eng = engine_args(
                args,
                num_gpu_blocks_override=pool,
                max_num_seqs=hi,
                max_model_len=args.prompt_len + args.gen_len,
                **policy_args(policy, budget, reclaim),
            )
            run = run_driver(
                {"engine": eng, "search": {"lo": 1, "hi": hi, "wave": wave}}
            )
            best, at = run["max_concurrency"], run["at_max"]
            tput = sum(at["max_tokens"]) / at["generate_s"] if at else 0.0
            out[f"{pool}/{mode}"] = {
                "max_concurrency": best,
                "decode_tok_s": tput,
                "tried": {w["n"]: w["sustained"] for w in run["tried"]},
                "search_top": hi,
                "capped": best == hi,
            }
            print(f"capacity pool {pool} {mode:7s} {best} ({tput:.1f} tok/s)")
        for name, mode in [("theory", "vtoken"), ("native_theory", "native")]:
            out[f"{pool}/{name}"] = {"max_concurrency": (pool - 1) // per_req[mode]}
    return {
        "budget": budget,
        **pick(args, "prompt_len", "gen_len", "pools"),
        "blocks_per_request": per_req,
        "results": out,
    }


def plot_capacity(data: dict, png: pathlib.Path) -> None:
    modes = ["native", "naive", "vtoken", "theory"]
    with figure(png) as ax:
        for i, pool in enumerate(data["pools"]):
            most = [data["results"][f"{pool}/{m}"]["max_concurrency"] for m in modes]
            x = [j + 0.4 * i for j in range(len(modes))]
            ax.bar(x, most, width=0.4, label=f"{pool} blocks")
        ax.set_xticks([j + 0.2 for j in range(len(modes))], modes)
        ax.set_ylabel("max concurrent requests, no preemption")
        ax.legend()


def sla_dataset(args) -> dict:
    """`vllm bench serve`'s prompts: ShareGPT, or random ids of --prompt-len;
    --gen-len tokens each, EOS ignored: every mode generates the same tokens
    (a mode stopping at EOS sooner would look faster; dummy weights sample
    EOS at random)."""
    if args.prompts == "sharegpt":
        data = {
            "dataset_name": "sharegpt",
            "dataset_path": os.environ["VTOKEN_SHAREGPT"],
            "sharegpt_output_len": args.gen_len,
        }
    else:
        data = {
            "dataset_name": "random",
            "random_input_len": args.prompt_len,
            "random_output_len": args.gen_len,
        }
    return {**data, "ignore_eos": True}


def sla_max_model_len(args) -> int:
    """Room for the longest prompt the dataset sends and its output: a
    request past it is an HTTP 400, and the run would time the others."""
    longest = SHAREGPT_MAX_PROMPT if args.prompts == "sharegpt" else args.prompt_len
    return longest + args.gen_len


def check_sla_run(res: dict, args, what: str, log: pathlib.Path) -> None:
    """Every request completed with its --gen-len tokens, or RuntimeError."""
    want = args.num_prompts
    if res["completed"] != want or res["total_output_tokens"] != want * args.gen_len:
        raise RuntimeError(
            f"{what}: {res['completed']} of {want} requests completed, "
            f"{res['total_output_tokens']} of {want * args.gen_len} tokens "
            f"(the server's log: {log})"
        )


def sla_modes(args) -> list[tuple[str, str, str]]:
    """The MODES --modes names, in MODES' order; native always (the SLA is
    1.05x its p95)."""
    return [m for m in MODES if m[0] == "native" or m[0] in args.modes]


def cmd_sla(args) -> dict:
    engine = {
        "max_model_len": sla_max_model_len(args),
        "max_num_seqs": 64,
        **engine_args(args),
    }
    model = engine.pop("model", None) or os.environ["VTOKEN_MODEL_DIR"]
    results, modes = {}, sla_modes(args)
    for mode, policy, reclaim in modes:
        server = {
            "block_size": 16,
            "served_model_name": "m",
            "num_gpu_blocks_override": args.pool,
            **engine,
            **policy_args(policy, args.budget, reclaim),
        }
        log = pathlib.Path(tempfile.gettempdir(), f"vtoken-sla-{mode}.log")
        with serve([*VLLM, "serve", model, *cli_flags(server)], log) as base:
            for rate in args.rates:
                res = bench_serve(
                    base,
                    model="m",
                    tokenizer=model,
                    num_prompts=args.num_prompts,
                    request_rate=rate,
                    seed=0,
                    percentile_metrics="ttft,tpot,e2el",
                    metric_percentiles="50,95",
                    **sla_dataset(args),
                    **({} if args.temperature is None else pick(args, "temperature")),
                )
                check_sla_run(res, args, f"sla {mode} rate {rate}", log)
                results[f"{mode}/{rate}"] = {k: res[k] for k in SLA_FIELDS}
                print(
                    f"sla {mode:7s} rate {rate}: {res['output_throughput']:.1f} tok/s "
                    f"p95 {res['p95_e2el_ms']:.0f} ms"
                )
    sla = 1.05 * results[f"native/{args.rates[0]}"]["p95_e2el_ms"]
    best = {}
    for mode, _, _ in modes:
        runs = [results[f"{mode}/{r}"] for r in args.rates]
        ok = [r["output_throughput"] for r in runs if r["p95_e2el_ms"] <= sla]
        best[mode] = max(ok, default=0.0)
    return {
        **pick(args, "rates", "pool", "budget", "num_prompts", "gen_len", "prompts"),
        "temperature": args.temperature,  # None: the model's default
        "modes": [mode for mode, _, _ in modes],
        "max_model_len": engine["max_model_len"],
        "sla_p95_ms": sla,
        "best_throughput": best,
        "results": results,
    }


def plot_sla(data: dict, png: pathlib.Path) -> None:
    with figure(png) as ax:
        for mode in data.get("modes", MODE_NAMES):
            pts = [data["results"][f"{mode}/{r}"] for r in data["rates"]]
            tput = [p["output_throughput"] for p in pts]
            ax.plot(tput, [p["p95_e2el_ms"] for p in pts], marker="o", label=mode)
        sla = data["sla_p95_ms"]
        ax.axhline(sla, ls="--", c="gray", label="SLA (1.05x native p95)")
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel("p95 end-to-end latency (ms)")
        ax.legend()


def timed(run: dict) -> dict:
    """Throughput, p95 request latency and median step time of one run."""
    lat = sorted(run["finish_t"].values())
    step_s = [b["t"] - a["t"] for a, b in itertools.pairwise(run["steps"])]
    return {
        "tok_s": sum(run["max_tokens"]) / run["generate_s"],
        "p95_s": lat[max(0, math.ceil(0.95 * len(lat)) - 1)],
        # Robust to the odd slow step a noisy machine throws in.
        "median_step_ms": 1e3 * statistics.median(step_s),
    }


def call_counts(spec: dict, pristine: bool) -> dict:
    """The work, deterministically: Python and C calls per engine step. Noise
    does not touch it; equal C calls mean no added tensor or NumPy op."""
    run = run_driver({**spec, "count_calls": True}, pristine=pristine)
    calls, c_calls, steps = run["python_calls"], run["c_calls"], len(run["steps"])
    return {
        "python_calls": calls,
        "c_calls": c_calls,
        "steps": steps,
        "per_step": calls / steps,
        "c_per_step": c_calls / steps,
    }


def cmd_overhead(args) -> dict:
    spec = {"engine": engine_args(args), **workload(args, args.requests, 32)}
    rows = {"stock": [], "patched": []}
    for i in range(args.repeats):
        # ABBA order: a drift that slows every later run cancels out in pairs.
        for name in ("stock", "patched")[:: 1 if i % 2 == 0 else -1]:
            rows[name].append(timed(run_driver(spec, pristine=(name == "stock"))))
            print(f"overhead {name:7s} {rows[name][-1]}")
    calls = {name: call_counts(spec, name == "stock") for name in ("stock", "patched")}
    print(f"overhead calls {calls}")
    # What an added call costs: the one the hot path makes per attention layer
    # with the feature off (get_token_read() returning None).
    import timeit

    from vllm.vtoken.context import get_token_read

    n = 1_000_000
    call_ns = min(timeit.repeat(get_token_read, number=n, repeat=5)) / n * 1e9
    extra = calls["patched"]["per_step"] - calls["stock"]["per_step"]
    step_ms = statistics.median(r["median_step_ms"] for r in rows["stock"])
    pairs = list(zip(rows["stock"], rows["patched"], strict=True))
    ratio_t = [p["tok_s"] / s["tok_s"] for s, p in pairs]
    ratio_l = [p["p95_s"] / s["p95_s"] for s, p in pairs]
    ratio_s = [p["median_step_ms"] / s["median_step_ms"] for s, p in pairs]
    return {
        "runs": rows,
        "throughput_ratio_median": statistics.median(ratio_t),
        "throughput_ratios": ratio_t,
        "p95_ratio_median": statistics.median(ratio_l),
        "p95_ratios": ratio_l,
        "step_time_ratio_median": statistics.median(ratio_s),
        "step_time_ratios": ratio_s,
        "python_calls": calls,
        "python_calls_ratio": calls["patched"]["per_step"] / calls["stock"]["per_step"],
        "extra_calls_per_step": extra,
        "call_ns": call_ns,
        "hook_bound_fraction": extra * call_ns / (step_ms * 1e6),
        "workload": spec,
    }


def cmd_prefix(args) -> dict:
    """Prefix-cache hits under eviction, one request at a time: "prefix" asks 32
    tokens after a shared --prompt-len head, "chat" after the previous turn's
    prompt and output (hits / prompt tokens, as vLLM's prefix_cache metrics)."""
    out = {}
    for kind in ("prefix", "chat"):
        wave = workload(args, args.requests + 1, args.prompt_len)
        wave["turns"] = {"kind": kind, "prefix": args.prompt_len, "ask": 32}
        for mode, policy, reclaim in MODES:
            eng = {"enable_prefix_caching": True, "max_model_len": 2048}
            eng = engine_args(args, **eng, **policy_args(policy, args.budget, reclaim))
            run = run_driver({"engine": eng, **wave})
            hits, asked = sum(run["cached_tokens"].values()), sum(run["prompt_lens"])
            held = [sum(s["held"].values()) for s in run["steps"] if s["running"]]
            out[f"{kind}/{mode}"] = r = {
                "hit_rate": hits / asked,
                "retained_blocks": statistics.fmean(held),
                "peak_blocks": max(held),
                **{k: (run["counters"] or {}).get(k, 0) for k in PREFIX_COUNTERS},
            }
            print(f"prefix {kind:6s} {mode:7s} {r}")
    return {**pick(args, "prompt_len", "gen_len", "budget", "requests"), "results": out}


def agreement(ref: list[int], out: list[int]) -> dict:
    """Greedy agreement of one output with native's (as long): exact, common
    prefix, ROUGE-L F1 (longest common subsequence over tokens)."""
    pairs = enumerate(zip(ref, out, strict=True))
    prefix = next((i for i, (a, b) in pairs if a != b), len(ref))
    lcs = [0] * (len(out) + 1)  # one row of the LCS table at a time
    for a in ref:
        diag = 0
        for j, b in enumerate(out):
            diag, lcs[j + 1] = (
                lcs[j + 1],
                diag + 1 if a == b else max(lcs[j + 1], lcs[j]),
            )
    return {"exact": float(ref == out), "prefix": prefix, "rouge_l": lcs[-1] / len(ref)}


def cmd_quality(args) -> dict:
    """Per policy and budget (a share of each full sequence), how far outputs
    move from native's: greedy agreement, and the mean log-probability the
    evicted cache gives native's tokens, teacher-forced along them (the
    drop from native's own). A budget past every sequence evicts nothing."""
    wave = workload(args, args.requests, args.prompt_len)
    native = run_driver({"engine": engine_args(args), **wave})["outputs"]
    ref = [native[str(i)] for i in range(len(native))]
    forced = {**wave, "force": ref}
    own = run_driver({"engine": engine_args(args), **forced})["logprobs"]
    full, out = args.prompt_len + args.gen_len, {}
    for policy, share in itertools.product(args.policies, (0.25, 0.5, 0.75, 2.0)):
        eng = engine_args(args, **policy_args(policy, int(share * full), "vtoken"))
        run, tf = (
            run_driver({"engine": eng, **wave}),
            run_driver({"engine": eng, **forced}),
        )
        rows = [agreement(r, run["outputs"][str(i)]) for i, r in enumerate(ref)]
        drop = [
            statistics.fmean(own[k]) - statistics.fmean(tf["logprobs"][k]) for k in own
        ]
        out[f"{policy}/{share}"] = r = {
            **{k: statistics.fmean(x[k] for x in rows) for k in rows[0]},
            "logprob_drop": statistics.fmean(drop),
            **{k: run["counters"][k] for k in ("evicted_tokens", "moved_tokens")},
        }
        print(f"quality {policy:12s} {share:4.2f} {r}")
    return {
        **pick(args, "prompt_len", "gen_len", "requests", "policies"),
        "results": out,
    }


def plot_quality(data: dict, png: pathlib.Path) -> None:
    with figure(png, ncols=2, width=12) as (a, b):
        for policy in data["policies"]:
            pts = [
                (float(k.split("/")[1]), v)
                for k, v in data["results"].items()
                if k.startswith(policy + "/") and float(k.split("/")[1]) <= 1
            ]
            x = [100 * p for p, _ in pts]
            a.plot(x, [v["rouge_l"] for _, v in pts], marker="o", label=policy)
            b.plot(x, [v["logprob_drop"] for _, v in pts], marker="o", label=policy)
        a.set_ylabel("ROUGE-L F1 vs native (greedy)")
        b.set_ylabel("log-prob drop on native's tokens (nats/token)")
        for ax in (a, b):
            ax.set_xlabel("budget, % of the sequence")
            ax.legend()


def all_running(run: dict, n: int) -> list[dict]:
    """The steps where all n requests run."""
    return [s for s in run["steps"] if s["running"] == n]


def steady(run: dict, n: int) -> list[dict]:
    """The steps where all n requests run, the first two (prefill) left out."""
    return all_running(run, n)[2:]


def per_step(run: dict, n: int, counter: str) -> list[int]:
    """How much a running total of the driver's (`vtoken_ns`: vToken's host
    time; `hook_calls`: the calls in its hooks) grew in each steady step."""
    return [b[counter] - a[counter] for a, b in itertools.pairwise(steady(run, n))]


def versions(args) -> dict:
    """The overlays compared: this one, and `--baseline` (a site folder with
    an older series applied, put first on PYTHONPATH) when given."""
    out = {"vtoken": None}
    if args.baseline:
        if not (args.baseline / "vllm" / "vtoken").is_dir():
            raise SystemExit(
                f"--baseline {args.baseline}: no vllm/vtoken/ there (a site "
                "folder with an older series applied: docs/DEVELOPING.md)"
            )
        out["before"] = {"PYTHONPATH": str(args.baseline)}
    return out


def all_at_once(args, n: int) -> dict:
    """Engine arguments for `n` requests of --prompt-len + --gen-len tokens on
    dummy weights (--model), admitted at once: a batch and a KV pool with
    room for every one (no preemption; the prompts' prefill may take a few
    steps)."""
    total = args.prompt_len + args.gen_len
    return engine_args(
        args,
        load_format="dummy",
        max_num_seqs=n,
        max_num_batched_tokens=max(8192, n),
        num_gpu_blocks_override=-(-n * total // 16) + 2 * n,
        max_model_len=total,
    )


def cmd_history(args) -> dict:
    """vToken's host time per step as each request's history outgrows its
    budget: a step walks the requests' live tokens (the live lists), so the
    time stays flat while the dead tokens pile up. Dummy weights (--model),
    --requests at once; host time in each quarter of the decode, medians over
    --repeats runs, each version's runs taking turns."""
    n = args.requests
    eng = all_at_once(args, n)
    src = {"n": n, "min_tokens": args.prompt_len, "max_tokens": args.prompt_len}
    spec = {"random": src, "max_tokens": args.gen_len, "light": True}
    quarters: dict[str, list] = {}
    for _, policy, (ver, env) in in_turns(
        args.repeats, args.policies, versions(args).items()
    ):
        extra = policy_args(policy, args.budget, "vtoken")
        run = run_driver({"engine": {**eng, **extra}, **spec}, env=env)
        ns = per_step(run, n, "vtoken_ns")
        q = [1e-6 * statistics.median(part) for part in _quarters(ns)]
        quarters.setdefault(f"{policy}/{ver}", []).append(q)
        print(f"history {policy:13s} {ver:7s} host ms by quarter {q}")
    rows = {
        k: [statistics.median(q) for q in zip(*v, strict=True)]
        for k, v in quarters.items()
    }
    return {"rows": rows, **pick(args, "requests", "prompt_len", "gen_len", "budget")}


def cmd_arrivals(args) -> dict:
    """Step time with requests arriving: one every --every steps, so most
    steps mix requests under budget with evicting ones, which the memory
    experiment (all at once) never does. Native, then each policy per
    version (--baseline too), --repeats times taking turns; each run's median
    and total step time."""
    n = args.requests
    longest = max(1024, args.prompt_len + args.gen_len)
    eng = engine_args(args, num_gpu_blocks_override=args.pool, max_model_len=longest)
    spec = {**workload(args, n, 32), "arrivals": [args.every * i for i in range(n)]}
    runs: dict[str, list] = {}
    for _, policy, (ver, env) in in_turns(
        args.repeats, ["none", *args.policies], versions(args).items()
    ):
        if policy == "none" and ver != "vtoken":
            continue  # native is the same on every overlay
        extra = policy_args(policy, args.budget, "vtoken")
        run = run_driver({"engine": {**eng, **extra}, **spec}, env=env)
        ms = [s["step_ms"] for s in run["steps"]]
        key = "native" if policy == "none" else f"{policy}/{ver}"
        runs.setdefault(key, []).append(
            {
                "steps": len(ms),
                "median_ms": statistics.median(ms),
                "total_s": sum(ms) / 1e3,
            }
        )
        print(f"arrivals {key:20s} {runs[key][-1]}")
    rows = {
        k: {
            f: statistics.median(r[f] for r in v)
            for f in ("steps", "median_ms", "total_s")
        }
        for k, v in runs.items()
    }
    return {
        "rows": rows,
        "runs": runs,
        **pick(args, "requests", "every", "pool", "prompt_len", "gen_len", "budget"),
        **pick(args, "prompts", "repeats"),
    }


def _quarters(xs: list) -> list[list]:
    k = len(xs) // 4
    return [xs[i * k : (i + 1) * k] for i in range(4)]


def growth(pairs: list[tuple[dict, dict]], field: str) -> dict[str, list[int]]:
    """Per key of the driver's running totals `field` ("hook_ns",
    "kernel_ns"), how much it grew in each step of `pairs` (consecutive
    steady steps); {} without pairs."""
    keys = pairs[0][0].get(field, {}) if pairs else {}
    return {k: [b[field][k] - a[field][k] for a, b in pairs] for k in keys}


def scale_run(run: dict, n: int, hooked: bool = True) -> dict:
    """One scale run's medians over its steady steps (`steady`): the step's
    wall time, and vToken's host time in it (`hooked`; 0 for native)."""
    host = per_step(run, n, "vtoken_ns") if hooked else [0]
    pairs = list(itertools.pairwise(steady(run, n))) if hooked else []
    # A step that plans compaction also copies and acknowledges: its host
    # time is about twice a quiet step's, and about half the steps plan, so
    # the median jumps between the two; the mean and each kind's median say
    # more (a driver older than its "plan_calls" records no split).
    split = {}
    if hooked and "plan_calls" in run["steps"][0]:
        planned = [p > 0 for p in per_step(run, n, "plan_calls")]
        for kind, want in (("plan", True), ("quiet", False)):
            mine = [h for h, p in zip(host, planned, strict=True) if p == want]
            split[f"host_ms_{kind}"] = 1e-6 * statistics.median(mine) if mine else 0.0
        split["plan_share"] = sum(planned) / len(planned)
    if hooked:
        # Admitting the batch: vToken's host time in every step until the
        # steady ones (registration, the prompts' slots, the first decodes),
        # a request: what arrivals cost, which the steady steps leave out.
        split["admit_us"] = 1e-3 * all_running(run, n)[1]["vtoken_ns"] / n
    return {
        "step_ms": statistics.median(s["step_ms"] for s in steady(run, n)),
        "host_ms": 1e-6 * statistics.median(host),
        "host_mean_ms": 1e-6 * statistics.mean(host),
        **split,
        # Where it goes: each hook's own (the spec's "time_hooks").
        "hooks_ms": {
            hook: 1e-6 * statistics.median(ns)
            for hook, ns in growth(pairs, "hook_ns").items()
        },
        "counters": run["counters"],
    }


def _split_median(runs: list[dict]) -> dict:
    """The runs' medians of scale_run's mean and plan/quiet split, those
    every run has."""
    keys = ("host_mean_ms", "host_ms_plan", "host_ms_quiet", "plan_share", "admit_us")
    return {
        k: statistics.median(r[k] for r in runs)
        for k in keys
        if all(k in r for r in runs)
    }


def _hooks_median(runs: list[dict]) -> dict:
    """Each hook's median over runs that timed their hooks (else none)."""
    hooks = runs[0].get("hooks_ms", {})
    return {h: statistics.median(r["hooks_ms"][h] for r in runs) for h in hooks}


def scale_row(
    mine: list[dict],
    native_ms: float,
    calls: list[int],
    before: list[dict] | None = None,
    before_calls: list[int] | None = None,
) -> dict:
    """A policy's row of the scale table from its runs (`scale_run`), the
    native step, and the per-step calls of its counting run; `before`, the
    same of the --baseline overlay. Medians over the runs, the planner's time
    per plan over all of them."""
    plans = [r["counters"] for r in mine]
    # The runs are deterministic (the e2e oracles hold them to it): they
    # evict and plan alike, only their times differ.
    for key in ("evicted_tokens", "plan_calls"):
        assert len({c[key] for c in plans}) == 1, (key, plans)
    row = {
        "step_ms": statistics.median(r["step_ms"] for r in mine),
        "host_ms": statistics.median(r["host_ms"] for r in mine),
        "host_ms_runs": [r["host_ms"] for r in mine],
        # The mean over the steady steps, and the steps that plan and the
        # others apart (scale_run), medians over the runs.
        **_split_median(mine),
        "hook_calls": statistics.median(calls),
        "hooks_ms": _hooks_median(mine),
        "planner_ms": 1e-6
        * sum(c["planner_ns"] for c in plans)
        / max(1, sum(c["plan_calls"] for c in plans)),
        "plan_calls": plans[0]["plan_calls"],
        "evicted_tokens": plans[0]["evicted_tokens"],
    }
    row["step_ratio"] = row["step_ms"] / native_ms
    if before is not None:
        row["before_host_ms"] = statistics.median(r["host_ms"] for r in before)
        row["before_host_ms_runs"] = [r["host_ms"] for r in before]
        row |= {f"before_{k}": v for k, v in _split_median(before).items()}
        row["before_hook_calls"] = statistics.median(before_calls)
        row["before_hooks_ms"] = _hooks_median(before)
    return row


def cmd_scale(args) -> dict:
    """vToken's host time per step at large batches, against native in the same
    run: a dummy-weight model (--model; build one with `scripts/prepare.py
    tiny-llama`), so the forward is cheap and per-step host work shows. Medians
    over the steps where every request runs, the first two (prefill) left out;
    then over --repeats runs, native and each policy per version (--baseline
    too) taking turns. The calls in the hooks are counted once per version, in
    a shorter run of their own (counting slows the hooks down); each hook's
    own time (`hooks_ms`, the runs' "time_hooks") says where the host time
    goes, and the steps that plan compaction and the quiet ones, apart, with
    the mean over all, say what compaction's events cost (scale_run)."""
    out = {}
    for n in args.batches:
        eng = all_at_once(args, n)
        src = {"n": n, "min_tokens": 0, "max_tokens": args.prompt_len}
        spec = {"random": src, "max_tokens": args.gen_len, "light": True}
        short = {**spec, "max_tokens": 16, "count_hook_calls": True}
        runs: dict[tuple[str, str], list] = {}
        for _, policy, (ver, env) in in_turns(
            args.repeats, ["none", *args.policies], versions(args).items()
        ):
            if policy == "none" and ver != "vtoken":
                continue  # native is the same on every overlay
            extra = policy_args(policy, args.budget, "vtoken")
            hooked = policy != "none"  # then each hook's share is timed too
            timed = {**spec, "time_hooks": hooked}
            run = run_driver({"engine": {**eng, **extra}, **timed}, env=env)
            runs.setdefault((policy, ver), []).append(scale_run(run, n, hooked))
            print(
                f"scale {n:5d} {policy:13s} {ver:7s} {runs[policy, ver][-1]['host_ms']}"
            )
        native_ms = statistics.median(r["step_ms"] for r in runs["none", "vtoken"])
        out[f"{n}/none"] = {"step_ms": native_ms}
        for policy in args.policies:
            mine = runs[policy, "vtoken"]
            extra = policy_args(policy, args.budget, "vtoken")
            counted = run_driver({"engine": {**eng, **extra}, **short})
            before = before_calls = None
            if args.baseline:
                before = runs[policy, "before"]
                env = versions(args)["before"]
                old = run_driver({"engine": {**eng, **extra}, **short}, env=env)
                before_calls = per_step(old, n, "hook_calls")
            calls = per_step(counted, n, "hook_calls")
            row = scale_row(mine, native_ms, calls, before, before_calls)
            # What ten small NumPy operations take as the hooks start, and again.
            for when in ("cold", "warm"):
                ns = per_step(counted, n, f"probe_{when}_ns")
                row[f"probe_{when}_us"] = 1e-3 * statistics.median(ns)
            out[f"{n}/{policy}"] = row
            print(f"scale {n:5d} {policy:13s} {row}")
    return {
        "rows": out,
        **pick(args, "batches", "prompt_len", "gen_len", "budget", "repeats"),
    }


def turns_row(calls: list[list], n: int, what: str) -> dict:
    """Per version ("this", "baseline") the calls on `n` rows of a run whose
    kernels took turns (the driver's [which, rows, ns]): how many, median and
    mean µs; and now / baseline of the medians."""
    row = {}
    for which in ("this", "baseline"):
        ns = [c[2] for c in calls if c[:2] == [which, n]]
        if not ns:
            raise RuntimeError(f"{what}: no call on every request")
        row[which] = {
            "calls": len(ns),
            "median_us": statistics.median(ns) / 1e3,
            "mean_us": statistics.mean(ns) / 1e3,
        }
    row["ratio"] = row["this"]["median_us"] / row["baseline"]["median_us"]
    return row


def baseline_file(args, what: str, module: str) -> pathlib.Path:
    """--baseline's copy of the overlay's `module` (a SystemExit without)."""
    if not args.baseline:
        raise SystemExit(f"{what}: --baseline (the overlay to compare with) is needed")
    path = args.baseline / f"vllm/vtoken/{module}.py"
    if not path.is_file():
        raise SystemExit(f"{what}: no {path} (a site folder with an overlay)")
    return path


def baseline_series(args) -> str:
    manifest = args.baseline / ".vtoken/manifest"  # apply.sh's: "hash <series>"
    series = manifest.read_text().split()[1] if manifest.is_file() else "?"
    return f"{args.baseline} (series {series})"


def cmd_eviction(args) -> dict:
    """The scheduler's one-pass eviction (eviction_kernels.evict_lowest, the
    call in its begin_step) of this overlay against --baseline's, in one
    engine per policy, the two kernels taking turns step by step (the
    driver's "alternate_eviction"): both see the same tables, scores and
    machine. --requests prompts of --prompt-len random tokens (a dummy-weight
    --model), --gen-len generated, --budget: every request evicts from its
    first decode on. Median and mean µs a call over the calls that evict
    every request, per kernel; a scale run's hook times are too noisy on a
    2-core VM to resolve one kernel's change."""
    path = baseline_file(args, "eviction", "eviction_kernels")
    return taking_turns(args, {"alternate_eviction": str(path)}, "eviction_calls")


def cmd_kernel(args) -> dict:
    """`eviction` for any one compiled kernel (--kernel module:function, e.g.
    table_kernels:append_read, the worker's step on its tables): this
    overlay's and --baseline's take turns step by step in one engine per
    policy (the driver's "alternate_kernel"); µs a call of the kernel alone
    over the calls on every request (its first argument as long as
    --requests)."""
    module, _, name = (args.kernel or "").partition(":")
    if not name:
        raise SystemExit("kernel: --kernel module:function is needed")
    path = baseline_file(args, "kernel", module)
    alt = {"alternate_kernel": {"path": str(path), "name": name}}
    return {**taking_turns(args, alt, "kernel_calls"), "kernel": args.kernel}


def taking_turns(args, alternate: dict, calls: str) -> dict:
    """eviction's and kernel's runs: one engine per policy of --requests at
    once, the driver's `alternate` key making two kernels take turns; per
    policy turns_row of the run's `calls`."""
    n = args.requests
    eng = all_at_once(args, n)
    spec = {**workload(args, n, args.prompt_len), "light": True, **alternate}
    what = args.experiment + (f" {args.kernel}" if args.experiment == "kernel" else "")
    rows = {}
    for policy in args.policies:
        extra = policy_args(policy, args.budget, "vtoken")
        run = run_driver({"engine": {**eng, **extra}, **spec})
        rows[policy] = turns_row(run.get(calls, []), n, f"{what} {policy}")
        print(f"{args.experiment} {policy:13s} {rows[policy]}")
    return {
        "rows": rows,
        "baseline": baseline_series(args),
        **pick(args, "requests", "prompt_len", "gen_len", "budget"),
    }


def kernels_run(run: dict, n: int) -> dict:
    """One time_kernels run over its steady steps (`steady`): vToken's host
    time a step, the compiled kernels' share of it and each kernel's (µs,
    medians of each step's growth of the running totals; a kernel a step
    never called is left out), and the quiet steps' (no plan) apart."""
    per = growth(list(itertools.pairwise(steady(run, n))), "kernel_ns")
    total = [sum(v) for v in zip(*per.values(), strict=True)]
    host = per_step(run, n, "vtoken_ns")
    quiet = [p == 0 for p in per_step(run, n, "plan_calls")]

    def median_us(ns, steps=None) -> float:
        ns = list(ns if steps is None else itertools.compress(ns, steps))
        return 1e-3 * statistics.median(ns) if ns else 0.0

    return {
        "host_us": median_us(host),
        "kernels_us": median_us(total),
        "quiet_host_us": median_us(host, quiet),
        "quiet_kernels_us": median_us(total, quiet),
        "kernel_us": {k: 1e-3 * statistics.median(v) for k, v in per.items() if any(v)},
    }


def cmd_kernels(args) -> dict:
    """Where vToken's host time goes, kernel by kernel: every Python-level
    call of the overlay's compiled kernels timed in-engine (the driver's
    "time_kernels"), on the scale benchmark's workload (--batches requests
    at once of --prompt-len random tokens, a dummy-weight --model,
    --gen-len generated, --budget); medians over the steady steps
    (kernels_run), then over --repeats runs. What is not in a kernel is the
    hooks' glue: their Python and NumPy calls."""
    out = {}
    for n in args.batches:
        eng = all_at_once(args, n)
        src = {"n": n, "min_tokens": 0, "max_tokens": args.prompt_len}
        spec = {"random": src, "max_tokens": args.gen_len, "light": True}
        runs: dict[str, list] = {}
        for _, policy in in_turns(args.repeats, args.policies):
            extra = policy_args(policy, args.budget, "vtoken")
            run = run_driver({"engine": {**eng, **extra}, **spec, "time_kernels": True})
            runs.setdefault(policy, []).append(kernels_run(run, n))
        for policy, mine in runs.items():
            row = {
                k: statistics.median(r[k] for r in mine)
                for k in ("host_us", "kernels_us", "quiet_host_us", "quiet_kernels_us")
            }
            names = set().union(*(r["kernel_us"] for r in mine))
            row["kernel_us"] = {
                k: statistics.median(r["kernel_us"].get(k, 0.0) for r in mine)
                for k in sorted(names)
            }
            out[f"{n}/{policy}"] = row
            host, kernels = row["host_us"], row["kernels_us"]
            print(f"kernels {n:5d} {policy:13s} {host:.0f} {kernels:.0f}")
    return {
        "rows": out,
        **pick(args, "batches", "prompt_len", "gen_len", "budget", "repeats"),
    }


def plot_scale(data: dict, png: pathlib.Path) -> None:
    rows, batches = data["rows"], data["batches"]
    policies = sorted({k.split("/")[1] for k in rows} - {"none"})
    with figure(png) as ax:
        for p in policies:
            ax.plot(
                batches, [rows[f"{n}/{p}"]["host_ms"] for n in batches], "o-", label=p
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("running requests")
        ax.set_ylabel("vToken host time per step (ms)")
        ax.legend()


def cmd_parallel(args) -> dict:
    """TP=2 and PP=2 against one rank, on the multiprocessing executor: the
    blocks requests hold and the tokens evicted must match one rank's (every
    rank frees a block at once), and each policy's step time against native
    at the same parallelism (the score reduction's cost). A dummy-weight
    model whose heads and layers divide by 2 (--model tiny-llama)."""
    out = {}
    for name, tp, pp in (("tp1", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2)):
        size = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
        if tp * pp > 1:
            size["distributed_executor_backend"] = "mp"
        # The workload --repeats times on one engine (no prefix cache: each
        # time alike), so the step time is a median over that many runs.
        eng = engine_args(args, load_format="dummy", enable_prefix_caching=False)
        waves = [workload(args, args.requests, 0)] * args.repeats
        for policy in ["none", *args.policies]:
            extra = policy_args(policy, args.budget, "vtoken")
            runs = run_driver({"engine": {**eng, **size, **extra}, "waves": waves})
            run = runs["waves"][0]
            held = [sum(s["held"].values()) for s in run["steps"]]
            steady = [s for w in runs["waves"] for s in w["steps"][2:]]
            row = {
                "step_ms": statistics.median(s["step_ms"] for s in steady),
                "mean_held_blocks": statistics.fmean(held),
                "max_held_blocks": max(held),
                "steps": len(run["steps"]),
                "evicted_tokens": (runs["counters"] or {}).get("evicted_tokens", 0)
                // args.repeats,  # per run
            }
            row["step_ratio"] = row["step_ms"] / out.get(f"{name}/none", row)["step_ms"]
            out[f"{name}/{policy}"] = row
            print(f"parallel {name} {policy:13s} {row}")
    keys = ("requests", "prompt_len", "gen_len", "budget", "repeats")
    return {"rows": out, **pick(args, *keys)}


EXPERIMENTS = {  # name: (run, plot or None)
    "memory": (cmd_memory, plot_memory),
    "capacity": (cmd_capacity, plot_capacity),
    "sla": (cmd_sla, plot_sla),
    "overhead": (cmd_overhead, None),
    "prefix": (cmd_prefix, None),
    "quality": (cmd_quality, plot_quality),
    "scale": (cmd_scale, plot_scale),
    "history": (cmd_history, None),
    "arrivals": (cmd_arrivals, None),
    "parallel": (cmd_parallel, None),
    "eviction": (cmd_eviction, None),
    "kernel": (cmd_kernel, None),
    "kernels": (cmd_kernels, None),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("experiment", choices=EXPERIMENTS)
    p.add_argument("--model", help="model folder (default: SmolLM2)")
    # Random token ids are for dummy-weight models, where text means nothing.
    p.add_argument("--prompts", choices=["sharegpt", "random"], default="sharegpt")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=POLICIES)
    p.add_argument("--engine-json", default="{}", help="extra LLM(...) arguments")
    p.add_argument("--out-dir", type=pathlib.Path, default=REPO / "docs/bench")
    p.add_argument("--name", help="output file stem (default: the experiment)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--pools", type=int, nargs="+", default=[64, 128])
    p.add_argument("--pool", type=int, default=96, help="sla, arrivals: KV blocks")
    p.add_argument("--every", type=int, default=20, help="arrivals: steps apart")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument(
        "--modes",
        nargs="+",
        choices=MODE_NAMES,
        default=MODE_NAMES,
        help="sla: the servers to run (native always runs)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        help="sla: `vllm bench serve --temperature` (default: the model's "
        "generation config)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument(
        "--baseline",
        type=pathlib.Path,
        help="memory, scale, history, arrivals: also time this site folder's overlay "
        "(an older series applied to a copy of vLLM; docs/DEVELOPING.md); "
        "eviction, kernel: its kernel against this overlay's, in one engine",
    )
    p.add_argument(
        "--kernel",
        help="kernel: the compiled kernel, module:function (table_kernels:append_read)",
    )
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    run, plot = EXPERIMENTS[args.experiment]
    name = args.name or args.experiment
    if args.experiment == "kernel" and not args.name:  # one file a kernel
        name = f"kernel-{(args.kernel or '').rpartition(':')[2]}-{args.requests}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sys.stdout.reconfigure(line_buffering=True)  # progress as it happens, piped too
    t0 = time.monotonic()
    try:
        data = run(args)
    except RuntimeError as err:  # an engine or server run failed: it says why
        sys.exit(str(err))
    from bench_report import machine  # scripts/ is this script's folder

    data.update(
        machine=machine(),  # the report's machine line is the one rendering it
        command="python scripts/bench_vtoken.py " + " ".join(sys.argv[1:]),
        seconds=time.monotonic() - t0,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        name=name,
    )
    (args.out_dir / f"{name}.json").write_text(json.dumps(data, indent=1))
    if plot and importlib.util.find_spec("matplotlib") is None:
        print(f"no plot for {name}: matplotlib is not installed", file=sys.stderr)
    elif plot:
        plot(data, args.out_dir / f"{name}.png")


if __name__ == "__main__":
    main()
