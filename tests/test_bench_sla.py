"""The SLA benchmark's workload and its check of each run
(scripts/bench_vtoken.py sla): every mode serves the same requests to the
same length, or the run stops. The served runs are the benchmark's."""

from __future__ import annotations

import pathlib
from types import SimpleNamespace

import pytest

from tests.conftest import load_script

bench = load_script("bench_vtoken")


def sla_args(prompts="sharegpt", num_prompts=24, gen_len=128):
    return SimpleNamespace(
        prompts=prompts, num_prompts=num_prompts, gen_len=gen_len, prompt_len=96
    )


@pytest.mark.parametrize("prompts", ["sharegpt", "random"])
def test_every_request_generates_its_length_in_every_mode(prompts):
    # ShareGPT runs stopped at EOS, each mode where its own tokens led it,
    # so a mode that ended its answers sooner looked faster (found by review).
    assert bench.sla_dataset(sla_args(prompts))["ignore_eos"] is True


def test_the_engine_fits_the_longest_prompt_the_dataset_sends():
    # vllm bench serve keeps ShareGPT prompts of up to 1,024 tokens; with a
    # max_model_len of 1,024, 2 of the 24 were refused (HTTP 400) and the
    # table timed the other 22 (found by review).
    assert bench.sla_max_model_len(sla_args("sharegpt")) == 1024 + 128
    assert bench.sla_max_model_len(sla_args("random")) == 96 + 128


def test_a_run_with_a_failed_or_short_request_stops_the_benchmark():
    args, log = sla_args(), pathlib.Path("/tmp/x.log")
    full = {"completed": 24, "total_output_tokens": 24 * 128}
    bench.check_sla_run(full, args, "sla native rate 1", log)
    with pytest.raises(RuntimeError, match="22 of 24 requests completed"):
        bench.check_sla_run(full | {"completed": 22}, args, "sla native", log)
    with pytest.raises(RuntimeError, match="3000 of 3072 tokens"):
        bench.check_sla_run(full | {"total_output_tokens": 3000}, args, "sla", log)


def test_modes_picks_the_servers_and_native_always_runs():
    # --modes trims the smoke run (bench_gpu.sh --smoke) to two servers; the
    # SLA is 1.05x native's p95, so native runs whatever is asked.
    def names(modes):
        return [m for m, _, _ in bench.sla_modes(SimpleNamespace(modes=modes))]

    assert names(["vtoken"]) == ["native", "vtoken"]
    assert names(["vtoken", "naive"]) == ["native", "naive", "vtoken"]
    assert names(["native"]) == ["native"]
    default = bench.parse_args(["sla"]).modes
    assert names(default) == ["native", "naive", "vtoken"]
