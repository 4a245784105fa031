"""Measure vToken like the paper, on the real patched engine.

    scripts/bench_all.sh                       # the whole CPU-sized suite + report
    python scripts/bench_vtoken.py memory      # one experiment (see --help)

Experiments (each writes docs/bench/<name>.json and a PNG plot):
  memory     fragmentation (per-block utilization histogram, waste F) and
             memory utilization / retained blocks: ShareGPT requests, native,
             then each policy in naive-evict and vtoken mode; planner CPU time
             and copy bytes per step come from the same vtoken runs
  capacity   the largest number of concurrent requests each mode sustains with
             no preemption on a fixed KV pool (two sizes), and its decode
             throughput
  sla        the patched server driven by the upstream `vllm bench serve` on
             ShareGPT at rising request rates, per mode
  overhead   stock vLLM vs the patched engine with policy none, alternated
  report     docs/RESULTS.md from the JSON files

Every engine run is scripts/engine_driver.py in a fresh process. `--model`,
`--engine-json` and the sizes let the same script run on a GPU with a 7B/8B
model. Run it through the project's environment (bench_all.sh does).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from engine_driver import run_driver  # scripts/ is this script's folder

REPO = pathlib.Path(__file__).resolve().parents[1]
POLICIES = ["h2o", "streamingllm", "scissorhands", "random"]
# (mode, policy, reclaim) compared side by side; naive and vtoken run H2O.
MODES = [
    ("native", "none", "-"),
    ("naive", "h2o", "naive"),
    ("vtoken", "h2o", "vtoken"),
]


def prompts(args, n: int | None, min_tokens: int, max_tokens: int) -> dict:
    """The driver's prompt source: ShareGPT first turns, or random token ids."""
    src = {"min_tokens": min_tokens, "max_tokens": max_tokens}
    if n is not None:
        src["n"] = n
    return {args.prompts: src}


def engine_args(args, **extra) -> dict:
    eng = {"model": args.model} if args.model else {}
    eng.update(json.loads(args.engine_json))
    eng.update(extra)
    return eng


def cli_flags(kwargs: dict) -> list[str]:
    """LLM(...) keyword arguments as `vllm serve` flags."""
    flags = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def policy_args(policy: str, budget: int, reclaim: str) -> dict:
    if policy == "none":
        return {}
    return {
        "kv_eviction_policy": policy,
        "kv_budget_tokens": budget,
        "kv_reclaim": reclaim,
        "kv_eviction_config": {"seed": 0} if policy == "random" else {},
    }


# ------------------------------------------------------------------ memory
def memory_figures(run: dict, block_size: int) -> dict:
    """Time averages over the steps where every request is decoding."""
    n = len(run["prompt_lens"])
    steps = [s for s in run["steps"] if s["running"] == n and len(s["live"]) == n]
    steps = steps[1:]  # the first holds a prefill
    util, perfect, held, hist = [], [], [], [0] * (block_size + 1)
    for s in steps:
        live = sum(s["live"].values())
        blocks = sum(s["held"].values())
        need = sum(math.ceil(v / block_size) for v in s["live"].values())
        util.append(live / (blocks * block_size))
        perfect.append(live / (need * block_size))
        held.append(blocks)
        for i, c in enumerate(s.get("hist", [])):
            hist[i] += c
    total = sum(hist) or 1
    dead_share = sum(c * (block_size - i) for i, c in enumerate(hist)) / (
        total * block_size
    )
    return {
        "utilization": statistics.fmean(util),
        "perfect_packing": statistics.fmean(perfect),
        "retained_blocks": statistics.fmean(held),
        "hist": [c / total for c in hist],
        "non_live_share": dead_share,
        "steps_averaged": len(steps),
    }


def cmd_memory(args) -> dict:
    wave = {
        **prompts(args, args.requests, args.prompt_len, args.prompt_len),
        "max_tokens": args.gen_len,
    }
    results = {}
    for policy in ["none"] + args.policies:
        for reclaim in ["naive", "vtoken"] if policy != "none" else ["-"]:
            spec = {
                "engine": engine_args(
                    args, **policy_args(policy, args.budget, reclaim)
                ),
                "histogram": True,
                **wave,
            }
            run = run_driver(spec)
            fig = memory_figures(run, run["block_size"])
            c = run["counters"] or {}
            steps = len(run["steps"])
            fig.update(
                evicted_tokens=c.get("evicted_tokens", 0),
                moved_tokens=c.get("moved_tokens", 0),
                reclaimed_blocks=c.get("reclaimed_blocks", 0),
                copy_bytes_per_step=c.get("copy_bytes", 0) / steps,
                planner_us_per_call=(
                    c["planner_ns"] / c["plan_calls"] / 1e3
                    if c.get("plan_calls")
                    else 0
                ),
                planner_share=c.get("planner_ns", 0) / (1e9 * run["generate_s"]),
                step_ms=1e3 * run["generate_s"] / steps,
                generate_s=run["generate_s"],
            )
            results[f"{policy}/{reclaim}"] = fig
            print(
                f"memory {policy:12s} {reclaim:6s} util {fig['utilization']:.3f} "
                f"retained {fig['retained_blocks']:.1f}",
                flush=True,
            )
    return {
        "workload": wave,
        "budget": args.budget,
        "policies": args.policies,
        "results": results,
    }


def plot_memory(data: dict, png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = data["results"]
    policies = data.get("policies", POLICIES)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for key in ["none/-"] + [f"{p}/naive" for p in policies]:
        h = res[key]["hist"]
        a.plot(range(len(h)), h, marker="o", label=key.replace("/-", " (native)"))
    a.set_xlabel("live tokens in a held block")
    a.set_ylabel("share of held blocks")
    a.set_title("Fragmentation: per-block utilization (naive-evict)")
    a.legend(fontsize=8)
    x = range(len(policies))
    for off, mode in [(-0.2, "naive"), (0.2, "vtoken")]:
        b.bar(
            [i + off for i in x],
            [res[f"{p}/{mode}"]["utilization"] for p in policies],
            width=0.4,
            label=mode,
        )
    b.set_xticks(list(x), policies)
    b.set_ylabel("time-averaged token utilization")
    b.set_ylim(0, 1)
    b.set_title("Memory utilization")
    b.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# ------------------------------------------------------------------ capacity
def cmd_capacity(args) -> dict:
    out = {}
    budget = (args.prompt_len + args.gen_len) // 2
    B = 16
    # Blocks one request holds at its peak. Native: every token but the last
    # sampled one has KV. vToken: budget + 1 live tokens at the forward (the new
    # token is written before the policy evicts), densely packed, plus one block
    # of slack (the tail being filled and the holes that wait for a plan).
    native_per_req = math.ceil((args.prompt_len + args.gen_len - 1) / B)
    vtoken_per_req = math.ceil((budget + 1) / B) + 1
    wave = {
        **prompts(args, None, args.prompt_len, args.prompt_len),
        "max_tokens": args.gen_len,
    }
    for pool in args.pools:
        for mode, policy, reclaim in MODES:
            theory = (pool - 1) // (
                native_per_req if mode == "native" else vtoken_per_req
            )
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
            print(
                f"capacity pool {pool} {mode:7s} {best} ({tput:.1f} tok/s)", flush=True
            )
        out[f"{pool}/theory"] = {"max_concurrency": (pool - 1) // vtoken_per_req}
        out[f"{pool}/native_theory"] = {"max_concurrency": (pool - 1) // native_per_req}
    return {
        "budget": budget,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "pools": args.pools,
        "blocks_per_request": {"native": native_per_req, "vtoken": vtoken_per_req},
        "results": out,
    }


def plot_capacity(data: dict, png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = data["results"]
    fig, ax = plt.subplots(figsize=(6, 4))
    modes = ["native", "naive", "vtoken", "theory"]
    for i, pool in enumerate(data["pools"]):
        ax.bar(
            [j + 0.4 * i for j in range(4)],
            [res[f"{pool}/{m}"]["max_concurrency"] for m in modes],
            width=0.4,
            label=f"{pool} blocks",
        )
    ax.set_xticks([j + 0.2 for j in range(4)], modes)
    ax.set_ylabel("max concurrent requests, no preemption")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# ------------------------------------------------------------------ sla
def cmd_sla(args) -> dict:
    import signal
    import socket
    import urllib.request

    vllm = shutil.which(
        "vllm",
        path=os.pathsep.join(
            [str(pathlib.Path(sys.executable).parent), os.environ.get("PATH", "")]
        ),
    )
    if vllm is None:
        sys.exit("no `vllm` command next to this Python or on PATH")
    results = {}
    budget = args.budget
    engine = {"max_model_len": 1024, "max_num_seqs": 64, **engine_args(args)}
    engine.pop("model", None)
    if args.prompts == "random":
        dataset = [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(args.prompt_len),
            "--random-output-len",
            str(args.gen_len),
            "--ignore-eos",  # dummy weights sample EOS at random
        ]
    else:
        dataset = [
            "--dataset-name", "sharegpt",
            "--dataset-path", os.environ["VTOKEN_SHAREGPT"],
            "--sharegpt-output-len", str(args.gen_len),
        ]  # fmt: skip
    for mode, policy, reclaim in MODES:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        flags = [
            "--host", "127.0.0.1",
            "--port", str(port),
            "--block-size", "16",
            "--served-model-name", "m",
            "--num-gpu-blocks-override", str(args.pool),
            *cli_flags(engine),
            *cli_flags(policy_args(policy, budget, reclaim)),
        ]  # fmt: skip
        model = args.model or os.environ["VTOKEN_MODEL_DIR"]
        cmd = [vllm, "serve", model, *flags, *args.serve_args]
        log = open(pathlib.Path(tempfile.gettempdir(), f"vtoken-sla-{mode}.log"), "w")
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        sys.exit(f"server for {mode} did not start; see {log.name}")
                    time.sleep(2)
            for rate in args.rates:
                with tempfile.TemporaryDirectory() as tmp:
                    r = subprocess.run(
                        [
                            vllm,
                            "bench",
                            "serve",
                            "--base-url",
                            f"http://127.0.0.1:{port}",
                            "--model",
                            "m",
                            "--tokenizer",
                            model,
                            *dataset,
                            "--num-prompts",
                            str(args.num_prompts),
                            "--request-rate",
                            str(rate),
                            "--seed",
                            "0",
                            "--percentile-metrics",
                            "ttft,tpot,e2el",
                            "--metric-percentiles",
                            "50,95",
                            "--save-result",
                            "--result-dir",
                            tmp,
                            "--result-filename",
                            "r.json",
                        ],
                        capture_output=True,
                        text=True,
                    )
                    if r.returncode != 0:
                        sys.exit(f"vllm bench serve failed:\n{r.stdout[-3000:]}")
                    res = json.loads(pathlib.Path(tmp, "r.json").read_text())
                results[f"{mode}/{rate}"] = {
                    "output_throughput": res["output_throughput"],
                    "p95_e2el_ms": res["p95_e2el_ms"],
                    "p50_e2el_ms": res["p50_e2el_ms"],
                    "completed": res["completed"],
                }
                print(
                    f"sla {mode:7s} rate {rate}: {res['output_throughput']:.1f} tok/s "
                    f"p95 {res['p95_e2el_ms']:.0f} ms",
                    flush=True,
                )
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    sla = 1.05 * results[f"native/{args.rates[0]}"]["p95_e2el_ms"]
    best = {}
    for mode in ["native", "naive", "vtoken"]:
        ok = [
            results[f"{mode}/{r}"]["output_throughput"]
            for r in args.rates
            if results[f"{mode}/{r}"]["p95_e2el_ms"] <= sla
        ]
        best[mode] = max(ok) if ok else 0.0
    return {
        "rates": args.rates,
        "pool": args.pool,
        "budget": budget,
        "sla_p95_ms": sla,
        "best_throughput": best,
        "results": results,
        "num_prompts": args.num_prompts,
        "gen_len": args.gen_len,
        "prompts": args.prompts,
    }


def plot_sla(data: dict, png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ["native", "naive", "vtoken"]:
        pts = [data["results"][f"{mode}/{r}"] for r in data["rates"]]
        ax.plot(
            [p["output_throughput"] for p in pts],
            [p["p95_e2el_ms"] for p in pts],
            marker="o",
            label=mode,
        )
    ax.axhline(data["sla_p95_ms"], ls="--", c="gray", label="SLA (1.05x native p95)")
    ax.set_xlabel("output throughput (tok/s)")
    ax.set_ylabel("p95 end-to-end latency (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# ------------------------------------------------------------------ overhead
def cmd_overhead(args) -> dict:
    spec = {
        "engine": engine_args(args),
        **prompts(args, args.requests, 32, args.prompt_len),
        "max_tokens": args.gen_len,
    }
    rows = {"stock": [], "patched": []}
    for i in range(args.repeats):
        # ABBA order: a drift that slows every later run cancels out in pairs.
        for name in ("stock", "patched")[:: 1 if i % 2 == 0 else -1]:
            run = run_driver(spec, pristine=(name == "stock"))
            lat = sorted(run["finish_t"].values())
            t = [s["t"] for s in run["steps"]]
            rows[name].append(
                {
                    "tok_s": sum(run["max_tokens"]) / run["generate_s"],
                    "p95_s": lat[max(0, math.ceil(0.95 * len(lat)) - 1)],
                    # Robust to the odd slow step a noisy machine throws in.
                    "median_step_ms": 1e3
                    * statistics.median(b - a for a, b in zip(t, t[1:], strict=False)),
                }
            )
            print(f"overhead {name:7s} {rows[name][-1]}", flush=True)
    # The work, deterministically: Python and C calls per engine step. Noise
    # does not touch it; equal C calls mean no added tensor or NumPy op.
    calls = {}
    for name in ("stock", "patched"):
        run = run_driver({**spec, "count_calls": True}, pristine=(name == "stock"))
        calls[name] = {
            "python_calls": run["python_calls"],
            "c_calls": run["c_calls"],
            "steps": len(run["steps"]),
            "per_step": run["python_calls"] / len(run["steps"]),
            "c_per_step": run["c_calls"] / len(run["steps"]),
        }
        print(f"overhead {name:7s} {calls[name]}", flush=True)
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


# ------------------------------------------------------------------ main
def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("experiment", choices=["memory", "capacity", "sla", "overhead"])
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2)")
    p.add_argument(
        "--prompts",
        choices=["sharegpt", "random"],
        default="sharegpt",
        help="prompt source: ShareGPT first turns, or random token ids of the "
        "same lengths (dummy-weight models)",
    )
    p.add_argument(
        "--policies", nargs="+", choices=POLICIES, default=POLICIES, help="memory"
    )
    p.add_argument("--engine-json", default="{}", help="extra LLM(...) arguments")
    p.add_argument("--out-dir", type=pathlib.Path, default=REPO / "docs/bench")
    p.add_argument(
        "--name", default=None, help="output file stem (default: the experiment)"
    )
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--pools", type=int, nargs="+", default=[64, 128])
    p.add_argument("--pool", type=int, default=96, help="sla: KV blocks")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        data = globals()[f"cmd_{args.experiment}"](args)
    except RuntimeError as err:  # an engine run failed: its stderr says why
        sys.exit(str(err))
    data["command"] = "python scripts/bench_vtoken.py " + " ".join(sys.argv[1:])
    data["seconds"] = time.monotonic() - t0
    data["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    name = args.name or args.experiment
    data["name"] = name
    (args.out_dir / f"{name}.json").write_text(json.dumps(data, indent=1))
    plot = globals().get(f"plot_{args.experiment}")
    if plot and importlib.util.find_spec("matplotlib") is None:
        print(f"no plot for {name}: matplotlib is not installed", file=sys.stderr)
    elif plot:
        plot(data, args.out_dir / f"{name}.png")


if __name__ == "__main__":
    main()
