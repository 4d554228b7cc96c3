"""loadgen.workloads: trace loaders, scaling, arrivals, prompt materialization."""
import json
import statistics

import pytest

from loadgen.workloads import (build_workload, data_dir, gamma_arrivals, load_azure, load_mooncake,
                                   materialize_prompts)

TRACES = data_dir() / "traces"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"shared traces absent at {TRACES}")


@pytest.fixture
def small_mooncake(tmp_path):
    p = tmp_path / "m.jsonl"
    rows = [{"timestamp": 1000, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
            {"timestamp": 3000, "input_length": 1500, "output_length": 20, "hash_ids": [0, 1, 3]},
            {"timestamp": 4000, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_azure_small_file_and_time_scale(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n5.0,100,10\n7.0,200,20\n")
    wl = load_azure(p)
    assert [(r.prompt_len, r.output_len) for r in wl.requests] == [(100, 10), (200, 20)]
    wl = build_workload("azure", path=p, time_scale=0.5)
    assert [r.arrival_s for r in wl.requests] == [0.0, 1.0]


def test_mooncake_length_scaling_keeps_blocks_consistent(small_mooncake):
    wl = load_mooncake(small_mooncake)
    assert wl.block_tokens == 512 and wl.requests[1].arrival_s == 3.0
    wl = build_workload("mooncake", path=small_mooncake, max_model_len=256)
    assert wl.block_tokens == round(512 * wl.meta["length_scale"])
    for r in wl.requests:
        assert r.prompt_len + r.output_len <= 256 and r.output_len >= 1
        assert len(r.prefix_blocks) * wl.block_tokens <= r.prompt_len
    assert [r.arrival_s for r in wl.requests] == [0.0, 2.0, 3.0]


def test_materialize_shared_prefixes(small_mooncake):
    wl = build_workload("mooncake", path=small_mooncake, length_scale=0.05)
    materialize_prompts(wl, vocab_size=1000, seed=1)
    a, b, c = (r.prompt_token_ids for r in wl.requests)
    bt = wl.block_tokens
    assert len(a) == wl.requests[0].prompt_len and min(a + b + c) >= 10 and max(a + b + c) < 1000
    assert a[: 2 * bt] == b[: 2 * bt]          # blocks 0,1 shared
    assert a[2 * bt: 3 * bt] != b[2 * bt: 3 * bt]  # block 2 vs 3
    assert a[:bt] != c[:bt]


def test_gamma_arrivals_mean_rate():
    times = gamma_arrivals(4000, request_rate=20.0, burstiness=0.5, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=0.08)
    assert gamma_arrivals(10, 20.0, 1.0, seed=3) == gamma_arrivals(10, 20.0, 1.0, seed=3)


def test_random_and_errors():
    wl = build_workload("random", num_requests=7, input_range=(4, 8), output_range=(2, 3), request_rate=10, seed=0)
    assert len(wl.requests) == 7 and all(4 <= r.prompt_len <= 8 for r in wl.requests)
    with pytest.raises(ValueError, match="input_range"):
        build_workload("random", num_requests=3, input_range=(9, 2))
    with pytest.raises(ValueError, match="neither a dataset name .* nor a trace file"):
        build_workload("nope")


def test_the_shared_data_beside_the_repository_is_found(monkeypatch):
    """The trace and profile tests skip without the shared data; they must not skip because a
    module looks for it in the wrong place (as after a package move)."""
    from pathlib import Path

    from loadgen.workloads import data_dir

    monkeypatch.delenv("PDCLUSTER_DATA", raising=False)
    beside = Path(__file__).resolve().parents[2].parent / "shared" / "data"
    assert data_dir().resolve() == beside.resolve()


@needs_traces
@pytest.mark.parametrize("name", ["azure-conv", "azure-code", "mooncake-conv", "mooncake-synth"])
def test_shipped_traces(name):
    wl = build_workload(name, num_requests=50, max_model_len=1024)
    assert len(wl.requests) == 50 and wl.requests[0].arrival_s == 0.0
    assert all(r.prompt_len + r.output_len <= 1024 for r in wl.requests)
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(wl.requests, wl.requests[1:]))


def test_the_published_azure_format_loads(tmp_path):
    """AzureLLMInferenceTrace_conv.csv as Azure/AzurePublicDataset publishes it, seven fractional digits."""
    p = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:50.9951690,396,109\n")
    wl = build_workload("azure", path=p)
    assert [(r.prompt_len, r.output_len) for r in wl.requests] == [(374, 44), (396, 109)]
    assert wl.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-5)


def test_dataset_path_and_published_names_in_the_data_folder(tmp_path, monkeypatch, small_mooncake):
    """--dataset takes a file's path (format from its name), and a named dataset is found under
    the name its publisher gives the file, in $PDCLUSTER_DATA/traces."""
    import argparse

    from loadgen.workload_args import add_workload_arguments, validate_workload_arguments, workload_from_args

    p = argparse.ArgumentParser()
    add_workload_arguments(p)
    args = p.parse_args(["--dataset", str(small_mooncake)])
    validate_workload_arguments(args)
    wl = workload_from_args(args, None)
    assert [r.prompt_len for r in wl.requests] == [1100, 1500, 600] and wl.block_tokens == 512
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "conversation_trace.jsonl").write_text(small_mooncake.read_text())
    monkeypatch.setenv("PDCLUSTER_DATA", str(tmp_path))
    assert len(build_workload("mooncake-conv").requests) == 3


def test_a_missing_dataset_says_where_to_get_it(tmp_path, monkeypatch):
    import argparse

    from loadgen.workload_args import add_workload_arguments, validate_workload_arguments

    monkeypatch.setenv("PDCLUSTER_DATA", str(tmp_path))
    with pytest.raises(ValueError, match=r"azure-conv: no trace file .*github.com/Azure/AzurePublicDataset.*--dataset PATH"):
        build_workload("azure-conv")
    p = argparse.ArgumentParser()
    add_workload_arguments(p)
    with pytest.raises(ValueError, match="--dataset must be one of .* or a trace file's path, got 'nope.csv'"):
        validate_workload_arguments(p.parse_args(["--dataset", "nope.csv"]))
