"""Engine processes for the end-to-end tests and the benchmarks; imports no vLLM.

`serve` runs `vllm serve`, `bench_serve` the upstream `vllm bench serve`, and
`run_driver(spec)` this file (`engine_driver.py SPEC.json OUT.json`): one engine,
patched or stock, its core in-process, stepped through LLMEngine so that the
scheduler's state is sampled after every step, into OUT as JSON. SPEC keys:

  engine      LLM(...) keyword arguments (model defaults to VTOKEN_MODEL_DIR)
  the workload:
    prompts     list of prompt token-id lists, or
    sharegpt    {"n": N, "min_tokens": a, "max_tokens": b}: the first N human turns
                of the repaired ShareGPT file of at least a tokens, cut to b
    random      the same keys (a is ignored): N prompts of b uniformly random
                token ids, for dummy-weight models, where text means nothing
    max_tokens  generation length (int, or one per prompt); EOS is ignored
    arrivals, aborts, extra_args   optional, per request: the step it is added
                at (default 0), {index: step} to abort it, SamplingParams.extra_args
    resets      optional, steps before which the prefix cache is reset with
                every running request preempted (vLLM's weight-update path:
                reset_prefix_cache(reset_running_requests=True)); "resets" in
                the output counts the requests so preempted
    turns       {"kind": "prefix" or "chat", "prefix": P, "ask": A}: one request
                at a time; request i asks prompt i + 1 cut to A after prompt 0 cut
                to P ("prefix"), or after request i - 1's prompt and output
  histogram, record_dead   record how many held blocks have 0..B live tokens
              (every step), each request's evicted tokens (as of its last step)
  count_calls  count the Python and C calls engine steps make (slower)
  count_hook_calls  count those inside vToken's hooks, and the lines of the
              overlay's code they run, and time a fixed probe
              of NumPy calls as the scheduler's begin_step starts (after the
              last forward and vLLM's output processing) and again at once
              (warm): what a call costs there
  time_hooks  time each of vToken's step hooks (steps record "hook_ns", each
              hook's running total): where the host time goes
  time_kernels  time every call of the overlay's compiled kernels from Python
              (steps record "kernel_ns", each kernel's running total): how much
              of the hooks' time is compiled passes, and which
  light       record no per-request block state per step (large batches)
  alternate_eviction  path of another overlay's eviction_kernels.py: its
              one-pass eviction and this overlay's take turns step by step;
              "eviction_calls" lists [which ("this" or "baseline"), rows, ns]
              for every call (TokenTablePool.evict_lowest)
  alternate_kernel  {"path": another overlay's kernel module (e.g.
              .../vllm/vtoken/table_kernels.py), "name": one of its kernels}:
              that kernel and this overlay's take turns step by step;
              "kernel_calls" lists [which, rows (its first argument's
              length), ns] for every call
  force       per request, token ids to emit (teacher forcing, ForceTokens); the
              run then records "logprobs": the model's own for each forced token
  search      {"lo": a, "hi": b, "wave": W}: instead, bisect on one engine for
              the largest N in [a, b] such that workload W with N prompts runs
              them all at once with no preemption; every run is under "tried"
  waves       instead, a list of workloads run in turn on one engine (results
              under "waves"), e.g. one per policy through extra_args
  record_scores  each request's live tokens and their running scores, as of
              its last step (score-based policies)
  sessions    instead, streaming-input sessions through AsyncLLM (its core in a
              process of its own: no per-step state), one after another: a list
              of sessions, each {"sharegpt": {...} (its last prompt, cut into the
              chunks), "chunks": [{"tokens": n, "max_tokens": m, "extra_args":
              {...}}, ...]}, a chunk sent once the one before is answered; each
              session's output token ids and the error that ended it, if any,
              and vToken's Prometheus counters at the end
"""

import collections
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from itertools import count

SOURCES = ("sharegpt", "random")  # prompt sources, sized by their "n"
# The `vllm` command of this very Python (its console script may not be on PATH).
VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def run_driver(spec: dict, *, pristine=False, env=None, timeout=None) -> dict:
    """Runs this driver for `spec` in a fresh process and returns its JSON.

    Stock vLLM when `pristine`; `env` is added to the environment. Raises
    RuntimeError, with the end of the engine's stderr, when the run fails."""
    full_env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", **(env or {}))
    if pristine:
        full_env["PYTHONPATH"] = os.environ["VTOKEN_PRISTINE"]
    # A run asked of another vLLM tree (stock, a --baseline overlay: a folder
    # with a vllm/ first on PYTHONPATH) must load its vLLM from there: a
    # broken one falls back to the venv's, silently. (A folder of plug-ins
    # holds no vllm/.)
    tree = full_env.get("PYTHONPATH")
    if not pristine and not (env and tree and pathlib.Path(tree, "vllm").is_dir()):
        tree = None
    with tempfile.TemporaryDirectory() as tmp:
        spec_f, out_f = pathlib.Path(tmp, "spec.json"), pathlib.Path(tmp, "out.json")
        spec_f.write_text(json.dumps(spec))
        cmd = [sys.executable, __file__, str(spec_f), str(out_f)]
        proc = subprocess.run(
            cmd, env=full_env, capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0:
            engine = "stock" if pristine else "patched"
            raise RuntimeError(f"engine run failed ({engine}):\n{proc.stderr[-6000:]}")
        result = json.loads(out_f.read_text())
    check_tree(result["vllm_path"], tree)
    return result


def check_tree(loaded: str, tree: str | None) -> None:
    """RuntimeError unless a run asked of `tree` loaded vLLM from inside it."""
    if tree is None:
        return
    root = os.path.realpath(tree) + os.sep
    if not (loaded + os.sep).startswith(root):
        raise RuntimeError(f"the run loaded vLLM from {loaded}, not from {tree}")


# A fork server's imports: most of an engine's start-up on two cores (~5 of ~9
# s), and none of them reads VTOKEN_* when imported (vllm.vtoken.integrity,
# which does, is imported by the forked run itself).
FORK_PRELOAD = ("torch", "vllm.entrypoints.llm")
FORK_ENV = frozenset({"VTOKEN_CHECK_INTEGRITY"})  # what a forked run may set


def forkable(spec: dict, env: dict | None) -> bool:
    """Whether ForkServer runs `spec` as run_driver would: an engine of one
    rank, setting only FORK_ENV's variables (another PYTHONPATH or vLLM tree
    needs a fresh interpreter). A multi-rank engine (its workers spawned, on
    CPU) started from a forked run decoded 3x slower (TP=2 on two cores: 1.2
    s a wave against 0.36; not looked into): such engines get run_driver."""
    e = spec.get("engine", {})
    sizes = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
    ranks = math.prod(e.get(k) or 1 for k in sizes)
    return ranks == 1 and (env or {}).keys() <= FORK_ENV


class ForkServer:
    """`run_driver` for many runs of the installed vLLM, each in a process
    forked from one server that imported FORK_PRELOAD once (`--fork-server`):
    a fresh interpreter's sys.path and environment, then the run's `env`
    (`forkable` specs only). The server is started again when this process's
    environment or folder changed, as a fresh interpreter would see them, and
    after anything that left it out of step (a timeout, an interrupt).

      client (tests)  --{"spec", "out", "log", "env"}-->  server  --fork-->  run
                      <--{"pid"} ... {"exit"}----------          <--waitpid--
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._started_in: tuple[dict, str] | None = None
        self._stderr = tempfile.TemporaryFile()  # the server's own: its imports

    def run(self, spec: dict, *, env=None, timeout=None) -> dict:
        env = dict(env or {})
        if not forkable(spec, env):
            raise ValueError(f"not a run to fork (engine_driver.forkable): {env}")
        where = (_environment(), os.getcwd())
        if self._proc is not None and (
            self._proc.poll() is not None or self._started_in != where
        ):
            self._stop()
        if self._proc is None:
            self._started_in = where
            self._proc = subprocess.Popen(
                [sys.executable, __file__, "--fork-server"],
                env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                bufsize=0,  # a line at a time: select() then sees the next
            )
        with tempfile.TemporaryDirectory() as tmp:
            files = {k: str(pathlib.Path(tmp, k)) for k in ("spec", "out", "log")}
            pathlib.Path(files["spec"]).write_text(json.dumps(spec))
            try:
                self._send({**files, "env": env})
                self._receive(timeout)  # {"pid"}: once the server's imports ran
                code = self._receive(timeout)["exit"]
            except BaseException as err:  # the next answer would be this run's
                self._stop()
                if isinstance(err, TimeoutError):
                    raise RuntimeError(
                        f"engine run timed out after {timeout} s"
                    ) from None
                raise
            if code != 0:
                log = pathlib.Path(files["log"]).read_text(errors="replace")
                raise RuntimeError(
                    f"engine run failed (forked, exit {code}):\n{log[-6000:]}"
                )
            return json.loads(pathlib.Path(files["out"]).read_text())

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()  # the server's loop ends
            try:
                self._proc.wait(timeout=60)
                self._proc = None
            except subprocess.TimeoutExpired:
                self._stop()

    def _stop(self) -> None:
        """The server killed: it kills the run it waits for (SIGTERM)."""
        self._proc.terminate()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def _send(self, msg: dict) -> None:
        self._proc.stdin.write(json.dumps(msg).encode() + b"\n")

    def _receive(self, timeout) -> dict:
        import select

        if not select.select([self._proc.stdout], [], [], timeout)[0]:
            raise TimeoutError
        line = self._proc.stdout.readline()
        if not line:
            self._stderr.seek(0)
            err = self._stderr.read().decode(errors="replace")[-6000:]
            raise RuntimeError(f"the fork server exited:\n{err}")
        return json.loads(line)


def _environment() -> dict:
    """What a fresh run's environment would be, less pytest's note of the
    current test (a new one each test: no cause to start the server again)."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


def fork_server() -> None:
    """ForkServer's server: imports FORK_PRELOAD, then forks a run for each
    request on stdin, answering on the stdout it was given (the imports' and
    the runs' logs go to stderr and the run's log file). A run's process
    group is killed once it exits (what it left behind) or when the server
    is stopped (SIGTERM), or dies of an interrupt, while it waits."""
    import importlib

    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for name in FORK_PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the finally below
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            answers.close()  # the client sees EOF when the server dies
            _forked_run(req)  # never returns
        with contextlib.suppress(OSError):  # both sides: no kill misses it
            os.setpgid(pid, pid)
        try:
            answers.write(json.dumps({"pid": pid}) + "\n")
            answers.flush()
            _, status = os.waitpid(pid, 0)
        finally:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        answers.write(json.dumps({"exit": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()


def _forked_run(req: dict) -> None:
    """A forked run: `main` on the request's files, in a process group of its
    own, its output to the log file; the exit handlers run, as they would in
    an interpreter of its own."""
    import atexit
    import traceback

    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setpgid(0, 0)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the server's requests
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        read_env = "vllm.vtoken.integrity"
        assert read_env not in sys.modules, f"the fork server imported {read_env}"
        os.environ.update(req["env"])
        sys.argv = [__file__, req["spec"], req["out"]]
        main()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def cli_flags(options: dict) -> list[str]:
    """Keyword arguments as command-line flags: `--some-name VALUE`, `--flag`
    for True, `--no-flag` for False, a dict as JSON."""
    flags = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


@contextlib.contextmanager
def serve(cmd: list[str], log: pathlib.Path, timeout: float = 300) -> Iterator[str]:
    """Runs the server command `cmd` on a free local port (it gets `--host` and
    `--port`) until the block ends; yields its URL once /health answers. Raises
    RuntimeError, with the end of the log, when it does not start."""
    with socket.socket() as s:  # a free port, for the server to bind right after
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log, "w") as out:
        # A process group of its own: stopping it stops the engine core too.
        proc = subprocess.Popen(
            [*cmd, "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):  # refused or timed out: not up yet
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text()[-4000:]
                raise RuntimeError(f"server did not start (log: {log}):\n{tail}")
            time.sleep(2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have died alone
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


_EXCEPTION_LINE = re.compile(r"(?:^|\) )[\w.]+(?:Error|Exception)(?::|$)")


def server_errors(log: pathlib.Path, expected=("VLLMValidationError",)) -> str:
    """The server log's first traceback that does not end in an `expected`
    error (a client's 400), for a test's failure message; "" if none."""
    lines = log.read_text(errors="replace").splitlines()
    start = None
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" in line:
            start = i if start is None else start
        elif start is not None and _EXCEPTION_LINE.search(line):
            if not any(e in line for e in expected):
                return "\n".join(lines[max(start - 5, 0) : i + 1][-120:])
            start = None
    return ""


def bench_serve(url: str, timeout: float | None = None, **options) -> dict:
    """Runs `vllm bench serve --base-url URL` with `options` as its flags and
    returns its result JSON. Raises RuntimeError, with its output, on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        out = {"save_result": True, "result_dir": tmp, "result_filename": "r.json"}
        cmd = [*VLLM, "bench", "serve", "--base-url", url, *cli_flags(options | out)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            tail = r.stdout[-3000:] + r.stderr[-3000:]
            raise RuntimeError(f"vllm bench serve failed:\n{tail}")
        return json.loads(pathlib.Path(tmp, "r.json").read_text())


def sharegpt_prompts(tokenizer, n: int, min_tokens: int, max_tokens: int):
    with open(os.environ["VTOKEN_SHAREGPT"]) as f:
        records = json.load(f)
    prompts = []
    for rec in records:
        turns = rec["conversations"]  # the repaired file holds well-formed ones
        if len(turns) < 2 or turns[0]["from"] != "human":
            continue
        ids = tokenizer.encode(turns[0]["value"])
        if len(ids) >= min_tokens:
            prompts.append(ids[:max_tokens])
        if len(prompts) == n:
            break
    return prompts


def random_prompts(tokenizer, n: int, min_tokens: int, max_tokens: int):
    import numpy as np

    vocab = np.setdiff1d(np.arange(len(tokenizer)), tokenizer.all_special_ids)
    rng = np.random.default_rng(0)
    return [rng.choice(vocab, size=max_tokens).tolist() for _ in range(n)]


def block_state(sched, histogram: bool) -> dict:
    """Blocks and live tokens held by running requests, from the scheduler, and
    (`histogram`) how many held blocks have 0..B of the holder's live tokens:
    a block two requests share (the prefix cache) counts for each, with the
    tokens each still has live (the pool's `block_live` counts both's)."""
    B, vt = sched.block_size, getattr(sched, "vtoken", None)
    mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]
    out, hist = {"held": {}, "live": {}}, [0] * (B + 1)
    for req in sched.running:
        rid, n = req.request_id, req.num_computed_tokens
        blocks = [b for b in mgr.req_to_blocks.get(rid, ()) if not b.is_null]
        out["held"][rid] = len(blocks)
        if vt is None:  # native: the computed tokens fill the blocks in order
            out["live"][rid] = n
            fills = (n - i * B for i in range(len(blocks)))
        elif rid not in vt.pool:  # no table yet: no live count (memory_figures)
            fills = (0 for _ in blocks)
        else:
            out["live"][rid] = vt.pool.num_live(rid)
            if histogram:
                _, _, slots = vt.pool.live_tokens(vt.pool.rows([rid]))
                own = collections.Counter((slots // B).tolist())
                fills = (own[b.block_id] for b in blocks)
        for fill in fills if histogram else ():
            hist[max(0, min(B, fill))] += 1
    return {**out, "hist": hist} if histogram else out


def counted(step, calls: dict[str, int]):
    """Runs `step()`, counting in `calls` the Python ("call") and C ("c_call")
    calls on this thread, where the engine core, scheduler and worker all run."""

    def hook(frame, event, arg) -> None:
        if event in calls:
            calls[event] += 1

    sys.setprofile(hook)
    try:
        return step()
    finally:
        sys.setprofile(None)


# Python and C calls inside vToken's per-step hooks, both sides (the engine
# core, scheduler and worker share this thread), and the lines of the
# overlay's code they run: the spec's "count_hook_calls" (`call_counter`).
HOOK_COUNTS = {"call": 0, "c_call": 0, "line": 0}
HOOKS = {
    "vllm.vtoken.scheduler:VTokenScheduler": ("begin_step", "end_step", "on_output"),
    "vllm.vtoken.worker:VTokenWorker": ("begin_step", "prepare_attention", "end_step"),
}


# Nanoseconds, summed over steps, of `probe` run first thing in the scheduler's
# begin_step (after the last forward, sampling and update_from_output: "cold")
# and once more at once ("warm").
PROBE_NS = {"cold": 0, "warm": 0}


def probe() -> int:
    """Ten small NumPy operations of the kinds the hooks make (a mask, a
    nonzero, a cumsum, indexing, a concatenate, a tolist, an all); their wall
    time."""
    import numpy as np

    a = np.arange(64, dtype=np.int64)
    t = time.perf_counter_ns()
    keep = a % 3 != 0
    np.flatnonzero(keep).cumsum()
    np.concatenate([a[keep], a[:4]]).tolist()
    keep.all()
    return time.perf_counter_ns() - t


# Nanoseconds inside each of vToken's step hooks ("Class.method"), summed over
# steps: the spec's "time_hooks".
HOOK_NS: dict[str, int] = {}


def _wrap_hooks(wrap) -> None:
    """Replaces each of vToken's step hooks (HOOKS) by `wrap(cls, name, fn)`
    (a function that calls `fn`)."""
    import functools
    import importlib

    import vllm.config  # noqa: F401 (first: the overlay's modules import it)

    for where, names in HOOKS.items():
        module, cls = where.split(":")
        cls = getattr(importlib.import_module(module), cls)
        for name in names:
            fn = getattr(cls, name)
            setattr(cls, name, functools.wraps(fn)(wrap(cls, name, fn)))


# The scheduler's one-pass eviction calls: [which, rows, ns] (the spec's
# "alternate_eviction").
EVICTION_CALLS: list[list] = []


def alternate_eviction(path: str):
    """Loads another overlay's eviction_kernels.py (`path`) beside this one's
    and times every TokenTablePool.evict_lowest (EVICTION_CALLS); returns a
    function turn(step) that picks the kernel step `step` runs (even: this
    overlay's, odd: the other's). Both kernels see the same tables and
    scores: one engine, the version swapped between steps, so a drift of the
    machine falls on both alike. The other kernel must take this overlay's
    arguments (a TypeError on its first call otherwise). Only that file is
    the other overlay's: the helpers it imports (table_kernels,
    selection_kernels) are this overlay's (load_beside compiles a copy of
    it afresh); compare kernels whose helpers did not change."""
    this, other = load_beside(path)
    import vllm.vtoken.token_table as tt

    kernels, which = {"this": this, "baseline": other}, ["this"]
    tt._eviction_kernels = lambda: kernels[which[0]]
    evict = tt.TokenTablePool.evict_lowest

    def timed(self, rows, *args, **kwargs):
        t = time.perf_counter_ns()
        try:
            return evict(self, rows, *args, **kwargs)
        finally:
            EVICTION_CALLS.append([which[0], len(rows), time.perf_counter_ns() - t])

    tt.TokenTablePool.evict_lowest = timed
    return taking_turns(which)


def load_beside(path: str):
    """(this overlay's kernel module, the other overlay's copy of it at
    `path`, loaded beside it as baseline_<module>).

    Loaded from a copy in a folder of its own, compiled there: numba caches
    a module's kernels beside its file, keyed by the file alone and pickled
    with the module's name, so loading `path` itself left the other site a
    cache its own engine could not load (a scale run with that --baseline
    after a kernel run: "No module named 'baseline_table_kernels'"), and
    could load a build that inlined older helpers. The folder goes at exit;
    a run killed leaves it in the temporary directory (vtoken-baseline-*)."""
    import atexit
    import importlib
    import importlib.util
    import shutil

    import vllm.config  # noqa: F401 (first: the overlay's modules import it)

    stem = os.path.splitext(os.path.basename(path))[0]
    folder = tempfile.mkdtemp(prefix="vtoken-baseline-")
    atexit.register(shutil.rmtree, folder, True)
    copy = shutil.copyfile(path, os.path.join(folder, f"baseline_{stem}.py"))
    spec = importlib.util.spec_from_file_location(f"baseline_{stem}", copy)
    other = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = other
    spec.loader.exec_module(other)
    return importlib.import_module(f"vllm.vtoken.{stem}"), other


def taking_turns(which: list[str]):
    """turn(step): step `step` runs this overlay's kernel (even) or the
    baseline's (odd), as which[0] says to the wrapper that reads it."""

    def turn(step: int) -> None:
        which[0] = ("this", "baseline")[step % 2]

    return turn


# The calls of the spec's "alternate_kernel": [which, rows, ns].
KERNEL_CALLS: list[list] = []


def alternate_kernel(path: str, name: str):
    """`alternate_eviction` for any one compiled kernel: `path` is another
    overlay's copy of one of this overlay's kernel modules (vllm/vtoken/
    <module>.py), loaded beside it; its `name` and this overlay's take turns
    (turn(step): even steps this overlay's) and every call is timed
    (KERNEL_CALLS, rows: the call's first argument's length). The overlay
    calls its kernels through their module (`TokenTablePool._k.append_read`),
    so the module's attribute is what is swapped: a caller holding the
    function itself would call this overlay's every step and none would be
    timed (the benchmark then fails). As with alternate_eviction, only that
    file is the other overlay's."""
    this, other = load_beside(path)
    kernels = {"this": getattr(this, name), "baseline": getattr(other, name)}
    which = ["this"]

    def timed(*args):
        t = time.perf_counter_ns()
        try:
            return kernels[which[0]](*args)
        finally:
            KERNEL_CALLS.append([which[0], len(args[0]), time.perf_counter_ns() - t])

    setattr(this, name, timed)
    return taking_turns(which)


def time_hooks() -> None:
    """Wraps each of vToken's step hooks in a timer (HOOK_NS)."""

    def wrap(cls, name, fn):
        key = f"{cls.__name__}.{name}"
        HOOK_NS[key] = 0

        def timing(*args, **kwargs):
            t = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                HOOK_NS[key] += time.perf_counter_ns() - t

        return timing

    _wrap_hooks(wrap)


# Nanoseconds inside each of the overlay's compiled kernels ("module.name"),
# summed over steps: the spec's "time_kernels".
KERNEL_NS: dict[str, int] = {}
# The overlay's modules of compiled (numba) kernels: vllm.vtoken.<name>.
KERNEL_MODULES = (
    "table_kernels",
    "eviction_kernels",
    "fold_kernels",
    "read_kernels",
    "planner_kernels",
    "block_kernels",
    "kv_copy_cpu",
    "policies.selection_kernels",
)


def time_kernels() -> None:
    """Times every call of the overlay's compiled kernels made from Python
    (KERNEL_NS): each kernel's dispatcher takes a subclass whose __call__
    is timed, so a caller holding the kernel (bound at construction) is
    timed too, while a kernel calling another inside compiled code (a
    native call, no dispatch) is not counted twice. Each call costs ~0.5 µs
    more: the hooks' own time in such a run is that much higher."""
    import importlib

    from numba.core.registry import CPUDispatcher

    import vllm.config  # noqa: F401 (first: the overlay's modules import it)

    class TimedKernel(CPUDispatcher):
        def __call__(self, *args, **kwargs):
            t = time.perf_counter_ns()
            try:
                return super().__call__(*args, **kwargs)
            finally:
                KERNEL_NS[self.vtoken_key] += time.perf_counter_ns() - t

    for name in KERNEL_MODULES:
        module = importlib.import_module(f"vllm.vtoken.{name}")
        for attr, fn in vars(module).items():
            # Its own kernels (not those it imports), each once.
            if type(fn) is CPUDispatcher and fn.py_func.__module__ == module.__name__:
                fn.vtoken_key = f"{name.rpartition('.')[2]}.{attr}"
                KERNEL_NS[fn.vtoken_key] = 0
                fn.__class__ = TimedKernel


def call_counter(into: dict[str, int], overlay_only: bool = False):
    """A function run(fn, *args, **kwargs) that calls fn and counts into
    `into` the Python and C calls it makes ("call", "c_call") and the lines
    of the overlay's code run ("line"): a loop that makes no call (a `for`
    setting attributes, a comprehension) shows in the lines only. Not
    counted: fn's own call and the profiler's switching off. With
    `overlay_only`, only the calls the overlay's own code makes (not those
    inside vLLM's functions it calls: vLLM's own loops are vLLM's)."""

    def hook(frame, event, arg) -> None:
        if event in ("call", "c_call"):
            # A Python call's frame is the callee's; a C call's, the caller's.
            caller = frame.f_back if event == "call" else frame
            if overlay_only and not (
                caller is not None and "/vllm/vtoken/" in caller.f_code.co_filename
            ):
                return
            into[event] += 1

    def line(frame, event, arg):
        if event == "line":
            into["line"] += 1
        return line

    def trace(frame, event, arg):
        return line if "/vllm/vtoken/" in frame.f_code.co_filename else None

    def run(fn, *args, **kwargs):
        # The tracer first and off last: the profiler sees no settrace call.
        sys.settrace(trace)
        sys.setprofile(hook)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.setprofile(None)
            sys.settrace(None)
            if not overlay_only:  # (the overlay makes neither)
                into["call"] -= 1  # fn itself
                into["c_call"] -= 1  # setprofile(None)

    return run


def count_hook_calls() -> None:
    """Wraps vToken's step hooks so that the calls they make, and the lines
    of the overlay they run, are counted (HOOK_COUNTS), and the scheduler's
    begin_step so that `probe` runs cold and warm before it."""
    run = call_counter(HOOK_COUNTS)

    def wrap(cls, name, fn):
        first = (cls.__name__, name) == ("VTokenScheduler", "begin_step")

        def counting(*args, **kwargs):
            if first:
                PROBE_NS["cold"] += probe()
                PROBE_NS["warm"] += probe()
            return run(fn, *args, **kwargs)

        return counting

    _wrap_hooks(wrap)


def engine_defaults() -> dict:
    """The engine arguments a spec's "engine" is laid over."""
    return dict(
        model=os.environ["VTOKEN_MODEL_DIR"],
        dtype="bfloat16",
        block_size=16,
        enforce_eager=True,
        seed=0,
        max_model_len=1024,
    )


class Driver:
    """One engine, stepped by hand, counting preemptions and batch sizes."""

    def __init__(self, engine_args: dict) -> None:
        from vllm import LLM

        llm = LLM(**{**engine_defaults(), **engine_args})
        self.engine, self.tok = llm.llm_engine, llm.get_tokenizer()
        self.sched = self.engine.engine_core.engine_core.scheduler
        schedule = self.sched.schedule

        def counting_schedule():
            out = schedule()
            self.counts["preemptions"] += len(out.preempted_req_ids or ())
            batch = len(out.num_scheduled_tokens)
            self.counts["max_scheduled"] = max(self.counts["max_scheduled"], batch)
            return out

        self.sched.schedule = counting_schedule

    def run(self, wave: dict, tag: str, histogram=False, calls=None) -> dict:
        """Runs workload `wave` to its end; request ids are `tag` + index."""
        from vllm import SamplingParams

        engine, sched, prompts = self.engine, self.sched, wave.get("prompts")
        if "random" in wave:
            prompts = random_prompts(self.tok, **wave["random"])
        elif "sharegpt" in wave:
            prompts = sharegpt_prompts(self.tok, **wave["sharegpt"])
        arrivals = wave.get("arrivals") or [0] * len(prompts)
        if turns := wave.get("turns"):
            head, asks = prompts[0][: turns["prefix"]], prompts[1:]
            asks = [ask[: turns["ask"]] for ask in asks]
            prompts = [head + ask for ask in asks]
            arrivals = [0] + [-1] * (len(asks) - 1)  # set as each turn ends
        pool = sched.kv_cache_manager.block_pool
        lengths = wave["max_tokens"]
        if isinstance(lengths, int):
            lengths = [lengths] * len(prompts)
        extra = wave.get("extra_args") or [None] * len(prompts)
        aborts = {int(k): v for k, v in (wave.get("aborts") or {}).items()}
        resets = set(wave.get("resets") or ())
        free_start, outputs, finish_t, steps = pool.get_num_free_blocks(), {}, {}, []
        cached, dead, logprobs, vt = {}, {}, {}, getattr(sched, "vtoken", None)
        scores = {}
        self.counts = {"preemptions": 0, "max_scheduled": 0, "resets": 0}
        t0, added = time.monotonic(), 0
        while added < len(prompts) or engine.has_unfinished_requests():
            step = len(steps)
            for i in (i for i, at in enumerate(arrivals) if at == step):
                force = {"force": wave["force"][i]} if "force" in wave else None
                params = SamplingParams(
                    temperature=0.0,
                    max_tokens=lengths[i],
                    ignore_eos=True,
                    extra_args=force or extra[i],
                    logprobs=0 if force else None,  # raw: before ForceTokens
                )
                prompt = {"prompt_token_ids": prompts[i]}  # a TokensPrompt
                engine.add_request(f"{tag}{i}", prompt, params)
                added += 1
            if to_abort := [f"{tag}{i}" for i, at in aborts.items() if at == step]:
                engine.abort_request(to_abort)
            if step in resets:
                self.counts["resets"] += len(sched.running)
                assert engine.reset_prefix_cache(reset_running_requests=True)
            t_step = time.perf_counter()
            outs = counted(engine.step, calls) if calls else engine.step()
            t_step = time.perf_counter() - t_step
            for out in (o for o in outs if o.finished):
                rid = out.request_id.removeprefix(tag)
                outputs[rid] = list(out.outputs[0].token_ids)
                finish_t[rid] = time.monotonic() - t0
                cached[rid] = out.num_cached_tokens  # prefix-cache hits
                if "force" in wave:
                    pairs = zip(out.outputs[0].logprobs, outputs[rid], strict=True)
                    logprobs[rid] = [lp[t].logprob for lp, t in pairs]
                if turns and (i := int(rid) + 1) < len(prompts):
                    arrivals[i] = step + 1
                    if turns["kind"] == "chat":
                        prompts[i] = prompts[i - 1] + outputs[rid] + asks[i]
            # Requests whose last step's output is in (under PP the batch queue
            # keeps one in flight): the same points in a request's life, however
            # the steps are pipelined.
            settled = [r for r in sched.running if r.num_computed_tokens < r.num_tokens]
            for r in settled if wave.get("record_dead") and vt else ():
                dead[r.request_id] = vt.pool.dead_idx(r.request_id)
            for r in settled if wave.get("record_scores") and vt else ():
                live = vt.pool.live_idx(r.request_id)
                got = vt.scores.scores(r.request_id, live)
                scores[r.request_id] = [live.tolist(), got.tolist()]
            t, free = time.monotonic() - t0, pool.get_num_free_blocks()
            state = dict(step=step, t=t, free=free, running=len(sched.running))
            state["step_ms"] = 1e3 * t_step
            if vt is not None:  # vToken's hooks, both sides, so far
                c = vt.counters  # (getattr: older overlays lack them)
                state["vtoken_ns"] = getattr(c, "scheduler_ns", 0) + getattr(
                    c, "worker_ns", 0
                )
                state["plan_calls"] = getattr(c, "plan_calls", 0)
                state["hook_calls"] = HOOK_COUNTS["call"] + HOOK_COUNTS["c_call"]
                state["hook_lines"] = HOOK_COUNTS["line"]
                state["probe_cold_ns"] = PROBE_NS["cold"]
                state["probe_warm_ns"] = PROBE_NS["warm"]
                if HOOK_NS:
                    state["hook_ns"] = dict(HOOK_NS)
                if KERNEL_NS:
                    state["kernel_ns"] = dict(KERNEL_NS)
            light = wave.get("light")  # no per-request state: scale runs
            steps.append(state if light else block_state(sched, histogram) | state)
            if len(steps) > 20000:
                raise RuntimeError("engine did not finish")
        return {
            "prompt_lens": [len(p) for p in prompts],
            "max_tokens": lengths,
            "outputs": outputs,
            "texts": {k: self.tok.decode(v) for k, v in outputs.items()},
            "steps": steps,
            "free_start": free_start,
            "free_end": pool.get_num_free_blocks(),
            **self.counts,
            "generate_s": time.monotonic() - t0,
            "finish_t": finish_t,
            "cached_tokens": cached,
            "logprobs": logprobs,
            "dead": {k[len(tag) :].split("-")[0]: v.tolist() for k, v in dead.items()},
            "scores": {k[len(tag) :].split("-")[0]: v for k, v in scores.items()},
            # All requests ran in one step at some point, and none was preempted.
            "sustained": self.counts["preemptions"] == 0
            and self.counts["max_scheduled"] == len(prompts),
        }

    def search(self, lo: int, hi: int, wave: dict) -> dict:
        """Bisects for the largest N in [lo, hi] that `wave` with N requests
        sustains; below the range, it reports lo - 1."""
        tried = []

        def sustains(n: int) -> bool:
            sized = {k: {**v, "n": n} if k in SOURCES else v for k, v in wave.items()}
            tried.append({**self.run(sized, f"n{n}-"), "n": n})
            return tried[-1]["sustained"]

        if not sustains(lo):
            lo -= 1
        while lo < hi:  # invariant: lo sustained (or below range), hi + 1 not
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if sustains(mid) else (lo, mid - 1)
        best = [r for r in tried if r["n"] == lo]
        at_max = best[0] if best else None
        return {"tried": tried, "max_concurrency": lo, "at_max": at_max}


def force_tokens():
    """A logits processor that makes a request emit extra_args["force"]."""
    import torch

    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class ForceTokens(AdapterLogitsProcessor):
        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params):
            force = (params.extra_args or {}).get("force")

            def forced(output_ids, logits):
                only = torch.full_like(logits, float("-inf"))
                only[force[min(len(output_ids), len(force) - 1)]] = 0.0
                return only

            return forced if force else None

    return ForceTokens


def run_sessions(spec: dict) -> dict:
    """The `sessions` workload (see the module's docstring)."""
    import asyncio

    from transformers import AutoTokenizer

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

    args = {**engine_defaults(), **spec.get("engine", {})}
    tok = AutoTokenizer.from_pretrained(args["model"])

    def params(chunk: dict) -> SamplingParams:
        return SamplingParams(
            max_tokens=chunk["max_tokens"],
            temperature=0.0,
            ignore_eos=True,
            extra_args=chunk.get("extra_args"),
        )

    async def one(engine, k: int, session: dict) -> dict:
        prompt = sharegpt_prompts(tok, **session["sharegpt"])[-1]
        chunks, at = [], 0
        for c in session["chunks"]:
            chunks.append((prompt[at : at + c["tokens"]], params(c)))
            at += c["tokens"]

        out, error, grew = [], None, asyncio.Event()

        async def inputs():  # a chunk once the one before it is answered
            want = 0
            for ids, sp in chunks:
                while len(out) < want:
                    await grew.wait()
                    grew.clear()
                yield StreamingInput(TokensPrompt(prompt_token_ids=ids), sp)
                want += sp.max_tokens

        try:
            async for o in engine.generate(inputs(), chunks[0][1], f"s{k}"):
                out[:] = o.outputs[0].token_ids
                grew.set()
        except Exception as err:  # what ended the session: reported
            error = f"{type(err).__name__}: {err}"
        return {"outputs": out, "error": error}

    async def run() -> dict:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        try:
            done = [await one(engine, k, s) for k, s in enumerate(spec["sessions"])]
        finally:
            engine.shutdown()
        counters = {
            m.name: m.value
            for m in get_metrics_snapshot()
            if isinstance(m, Counter) and m.name.startswith("vllm:kv_")
        }
        return {"sessions": done, "counters": counters}

    return asyncio.run(run())


def run_steps(spec: dict) -> dict:
    """Every workload but `sessions`: one LLMEngine, its core in-process."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    processors = {"logits_processors": [force_tokens()]} if "force" in spec else {}
    if spec.get("count_hook_calls"):
        count_hook_calls()
    if spec.get("time_hooks"):
        time_hooks()
    if spec.get("time_kernels"):
        time_kernels()
    driver = Driver({**spec.get("engine", {}), **processors})
    turns = []
    if path := spec.get("alternate_eviction"):
        turns.append(alternate_eviction(path))
    if alt := spec.get("alternate_kernel"):
        turns.append(alternate_kernel(alt["path"], alt["name"]))
    if turns:
        step, steps = driver.engine.step, count()

        def alternating():
            k = next(steps)
            for turn in turns:
                turn(k)
            return step()

        driver.engine.step = alternating
    if "search" in spec:
        result = driver.search(**spec["search"])
    elif "waves" in spec:  # one engine, workloads in turn
        waves = enumerate(spec["waves"])
        result = {"waves": [driver.run(w, f"w{k}-") for k, w in waves]}
    else:
        calls = {"call": 0, "c_call": 0} if spec.get("count_calls") else None
        result = driver.run(spec, "w0-", bool(spec.get("histogram")), calls)
        if calls:
            result.update(python_calls=calls["call"], c_calls=calls["c_call"])
    if EVICTION_CALLS:
        result["eviction_calls"] = EVICTION_CALLS
    if KERNEL_CALLS:
        result["kernel_calls"] = KERNEL_CALLS
    vt = getattr(driver.sched, "vtoken", None)
    result.update(
        block_size=driver.sched.block_size,
        counters=dataclasses.asdict(vt.counters) if vt is not None else None,
    )
    if vt is not None:
        vt.check_integrity()
        result["pool_live_end"] = vt.pool.total_live()
    return result


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    result = run_sessions(spec) if "sessions" in spec else run_steps(spec)
    import importlib.util

    import vllm

    result["vllm_path"] = os.path.realpath(os.path.dirname(vllm.__file__))
    if importlib.util.find_spec("vllm.vtoken") is not None:  # patched
        from vllm.vtoken import integrity

        result["integrity"] = integrity.CHECK  # DESIGN.md §4 checked every step
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    fork_server() if sys.argv[1:] == ["--fork-server"] else main()
