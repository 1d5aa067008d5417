"""benchmarks/train_throughput.py's per-GPU scaling table: every several-GPU run against the
1-GPU run of the same shape, seq, micro-batch and mode, from the mean throughput and from
the median step time. Checked on recorded four-H200 results (docs/bench) and on made-up
results for the pairing rules."""

from __future__ import annotations

import pytest

from tests.benchmarks.test_harness import ROOT, _module

BENCH = ROOT / "docs" / "bench"


def test_recorded_four_gpu_results_give_the_documented_scaling(capsys):
    tt = _module("train_throughput")
    files = [BENCH / f"2026-11-27d-4xh200-call3-tp-{name}.json" for name in ("05-g1", "05-g4-b100", "17-g1", "17-g4-b100")]
    assert tt.main(["--report", *map(str, files)]) == 0
    printed = capsys.readouterr().out
    settings = "`parallel.compile_mode=reduce-overhead` `parallel.ddp_bucket_mb=100`"
    assert f"| qwen2.5-0.5b-s2048-b2-g4-fast | ddp | {settings} | 63,751 | 84,874 | 75.1% | 75.4% |" in printed
    assert f"| qwen3-1.7b-s2048-b2-g4-fast | ddp | {settings} | 30,126 | 36,048 | 83.6% | 84.6% |" in printed


def test_recorded_repeats_give_the_documented_median(capsys):
    """2026-11-28b call 2: the 1-GPU run twice and the 4-GPU preset three times, two invocations
    merged (Qwen3-1.7B at 4,096 tokens per GPU, docs/performance.md)."""
    tt = _module("train_throughput")
    names = ("tp-17-mb2-g1-graphs-x2", "tp-17-mb2-g4-fsdp-u14-x3")
    assert tt.main(["--report", *(str(BENCH / f"2026-11-28b-4xh200-call2-{n}.json") for n in names)]) == 0
    printed = capsys.readouterr().out
    assert "| qwen3-1.7b-s2048-b2-g4-fast | fsdp | - | 3 (2) | 96.5% | 96.4% | 97.0% | 96.9% |" in printed
    assert "CPU: unknown" in printed  # recorded before the probe asked for the host's CPU


def test_the_environment_probe_names_the_host_cpu():
    tt = _module("train_throughput")
    env = tt.probe_environment()
    assert "error" not in env, env
    assert env["cpu_model"] and env["cpu_count"] >= 1 and env["numa_nodes"] >= 0
    assert tt.host_cpu(env).startswith(env["cpu_model"])
    assert tt.host_cpu({}) == "unknown"
    assert len(env["host_boot"]) == 12 and tt.probe_environment()["host_boot"] == env["host_boot"]


def test_merged_reports_from_two_hosts_are_flagged(tmp_path, capsys):
    """Hosts whose CPUs read alike (four-H200 hosts all say "Intel(R) Xeon(R) Processor") are
    told apart by env.host_boot."""
    import json

    tt = _module("train_throughput")
    env = {"gpu_names": ["NVIDIA H200"], "cpu_model": "Intel(R) Xeon(R) Processor", "cpu_count": 64, "numa_nodes": 1}
    paths = []
    for i, host in enumerate(["aaaaaaaaaaaa", "aaaaaaaaaaaa", "bbbbbbbbbbbb"]):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps({"env": {**env, "host_boot": host}, "results": [_result(1, 100.0 + i, 0.1)]}))
        paths.append(str(path))
    tt.merge_reports(paths[:2])
    assert "hosts or boots" not in capsys.readouterr().err
    tt.merge_reports(paths)
    err = capsys.readouterr().err
    assert "2 hosts or boots" in err and "bbbbbbbbbbbb" in err and "different host CPUs" not in err


def test_merged_runs_of_one_case_say_which_settings_they_ran_with(capsys):
    """Several invocations of the same case (here Qwen2.5-0.5B at 16,384 tokens per GPU with
    FSDP, three settings) merge into rows told apart by their overrides."""
    tt = _module("train_throughput")
    names = ("tp-05-mb8-g1", "tp-05-mb8-fsdp-z2", "tp-05-mb8-fsdp-z2-u8", "tp-05-mb8-fsdp-z2-bf16")
    assert tt.main(["--report", *(str(BENCH / f"2026-11-27g-4xh200-call3-{n}.json") for n in names)]) == 0
    printed = capsys.readouterr().out
    z2 = "`parallel.reshard_after_forward=false`"
    assert f"| fsdp | {z2} | 111,741 | 118,519 | 94.3% | 95.6% |" in printed
    assert f"| fsdp | {z2} `parallel.fsdp_unit_blocks=8` | 113,172 | 118,519 | 95.5% | 96.0% |" in printed
    assert f"| fsdp | {z2} `parallel.reduce_dtype=bf16` | 110,544 | 118,519 | 93.3% | 94.0% |" in printed


def _result(gpus: int, tokens_per_s: float, median: float, **extra) -> dict:
    base = dict(kind="lockstep", status="ok", case=f"x-g{gpus}", shape="x", seq=2048, micro_batch=2, mode="fast",
                compile="preset", gpus=gpus, strategy="ddp" if gpus > 1 else "none", tokens_per_s=tokens_per_s,
                tokens_per_s_per_gpu=tokens_per_s / gpus, step_time_median_s=median)
    return {**base, **extra}


def test_runs_pair_only_with_the_same_shape_seq_micro_batch_and_mode():
    tt = _module("train_throughput")
    one = _result(1, 100.0, 0.040)
    rows = tt.scaling_rows([
        one,
        _result(4, 320.0, 0.050),
        _result(4, 999.0, 0.010, micro_batch=8),  # no 1-GPU run at micro-batch 8
        _result(4, 999.0, 0.010, mode="bitwise"),
        _result(4, 999.0, 0.010, status="failed"),
        {"kind": "hf", "status": "ok", "gpus": 4, "tokens_per_s": 1.0},
    ])
    assert len(rows) == 1
    assert rows[0]["scaling"] == pytest.approx(0.8) and rows[0]["scaling_by_median_step"] == pytest.approx(0.8)
    assert rows[0]["one_gpu_case"] == one["case"]


def test_repeated_runs_scale_against_the_median_one_gpu_run_and_are_summarised():
    """``--repeat``: every several-GPU run is compared with the median of the 1-GPU runs of its
    key, and the runs of one case and settings are summarised by median, lowest and highest."""
    tt = _module("train_throughput")
    ones = [_result(1, tokens, median, repeat=i) for i, (tokens, median) in enumerate(
        [(100.0, 0.040), (90.0, 0.044), (110.0, 0.036)])]
    fours = [_result(4, tokens, 0.050, repeat=i) for i, tokens in enumerate([320.0, 360.0, 280.0])]
    other = _result(4, 400.0, 0.040, overrides=["parallel.ddp_bucket_mb=100"])
    rows = tt.scaling_rows([*ones, *fours, other])
    assert [row["one_gpu_tokens_per_s"] for row in rows] == [100.0] * 4  # the median, not the last run
    assert [row["scaling"] for row in rows] == pytest.approx([0.8, 0.9, 0.7, 1.0])
    assert rows[0]["scaling_by_median_step"] == pytest.approx(0.040 / 0.050)
    assert all(row["one_gpu_runs"] == 3 for row in rows)
    summary = {tuple(row["overrides"]): row for row in tt.repeat_summary(rows)}
    plain = summary[()]
    assert (plain["runs"], plain["scaling_median"], plain["scaling_min"], plain["scaling_max"]) == \
        (3, pytest.approx(0.8), pytest.approx(0.7), pytest.approx(0.9))
    assert summary[("parallel.ddp_bucket_mb=100",)]["runs"] == 1
    table = tt.repeat_table(tt.repeat_summary(rows))
    assert "| x-g4 | ddp | - | 3 (3) | 80.0% | 70.0% | 90.0% | 80.0% |" in table
    assert tt.repeat_table(tt.repeat_summary(tt.scaling_rows([ones[0], fours[0]]))) == ""  # nothing repeated


def test_repeat_runs_the_case_list_round_and_rejects_zero(tmp_path, capsys):
    tt = _module("train_throughput")
    out = tmp_path / "tp.json"
    assert tt.main(["--shapes", "tiny", "--seqs", "128", "--gpus", "1,2", "--modes", "fast", "--device", "cpu",
                    "--no-baseline", "--repeat", "2", "--dry-run", "--out", str(out)]) == 0
    import json
    results = json.loads(out.read_text())["results"]
    assert [(r["gpus"], r["repeat"]) for r in results] == [(1, 0), (2, 0), (1, 1), (2, 1)]
    with pytest.raises(SystemExit):
        tt.parse_args(["--repeat", "0"])


def test_recorded_fp8_runs_give_the_documented_ratios(capsys):
    """2026-11-28d call 3, card 0: bf16 at micro-batch 16 and FP8 + fast accumulation at 16 and
    24, three invocations merged; the variants are told apart by their overrides, the first
    file's (bf16: none) is the reference (docs/performance.md)."""
    tt = _module("train_throughput")
    names = ("bf16-mb16", "fp8key-mb16", "fp8key-mb24")
    assert tt.main(["--report", *(str(BENCH / f"2026-11-28d-4xh200-call3-g0-tp-17-{n}.json") for n in names)]) == 0
    printed = capsys.readouterr().out
    fp8 = "parallel.float8=tensorwise parallel.float8_backward_fast_accum=true"
    assert f"| qwen3-1.7b | 2048 | 1 | fast | {fp8} | 16 (1) | 57,038 | base | 16 (1) | 46,753 | 1.220x |" in printed
    assert (f"| qwen3-1.7b | 2048 | 1 | fast | {fp8} | 24 (1) (each at its fastest) | 58,229 | base | 16 (1) | "
            "46,753 | 1.245x |") in printed


def test_variant_ratios_use_medians_per_micro_batch_and_each_ones_fastest():
    tt = _module("train_throughput")

    def run(variant, micro, tokens, gpus=1, repeat=0):
        return _result(gpus, tokens * gpus, 0.1, variant=variant, micro_batch=micro, repeat=repeat)

    results = [
        run("bf16", 16, 100.0), run("fp8", 16, 120.0), run("bf16", 24, 98.0), run("fp8", 24, 126.0),
        run("bf16", 16, 104.0, repeat=1), run("fp8", 16, 118.0, repeat=1), run("bf16", 16, 90.0, repeat=2),
        run("fp8", 16, 119.0, repeat=2),
        run("fp8", 32, 500.0, gpus=4),  # another GPU count, with no bf16 run: no row
        {**run("fp8", 16, 999.0), "status": "failed"},
    ]
    rows = tt.variant_rows(results)
    assert [(r["micro_batch"], r["reference_micro_batch"], r.get("fastest", False)) for r in rows] == \
        [(16, 16, False), (24, 24, False), (24, 16, True)]
    at16, at24, fastest = rows
    assert (at16["runs"], at16["reference_runs"]) == (3, 3)
    assert at16["ratio"] == pytest.approx(119.0 / 100.0)  # the medians of three runs each
    assert at24["ratio"] == pytest.approx(126.0 / 98.0)
    assert fastest["ratio"] == pytest.approx(126.0 / 100.0)  # fp8 at 24 against bf16 at 16
    assert all(r["reference"] == "bf16" and r["variant"] == "fp8" for r in rows)
    table = tt.variant_table(rows)
    assert "| x | 2048 | 1 | fast | fp8 | 24 (1) (each at its fastest) | 126 | bf16 | 16 (3) | 100 | 1.260x |" in table
    assert tt.variant_rows([run("bf16", 16, 100.0), run("bf16", 24, 98.0)]) == []  # one variant: nothing to compare
    plain, other = _result(1, 100.0, 0.1), _result(1, 110.0, 0.1, overrides=["parallel.float8=tensorwise"])
    assert tt.variant_rows([plain, other])[0]["variant"] == "parallel.float8=tensorwise"  # no names: overrides


@pytest.mark.parametrize("argv, named", [
    (["--variant", "fp 8"], "the name must match"),
    (["--variant", "fp8:parallel.float8"], "KEY=VALUE"),
    (["--micro-batch", "0"], "--micro-batch"),
])
def test_bad_variants_and_micro_batches_are_refused(argv, named, capsys):
    tt = _module("train_throughput")
    with pytest.raises(SystemExit):
        tt.parse_args(argv)
    assert named in capsys.readouterr().err


def test_variants_run_through_train_py_one_after_the_other(tmp_path):
    """Two variants of one case on CPU: each run gets its own overrides (seen in the run's
    resolved config), in the order given, and the JSON holds the ratio row."""
    import json

    tt = _module("train_throughput")
    out = tmp_path / "tp.json"
    assert tt.main(["--shapes", "tiny", "--seqs", "128", "--gpus", "1", "--modes", "fast", "--device", "cpu",
                    "--no-baseline", "--steps", "2", "--warmup", "1", "--micro-batch", "2", "--variant", "plain",
                    "--variant", "ckpt:parallel.activation_checkpointing=full", "--variant",
                    "ckpt:train.grad_clip=0.5", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    plain, ckpt = payload["results"]
    assert (plain["case"], ckpt["case"]) == ("tiny-s128-b2-g1-fast-plain", "tiny-s128-b2-g1-fast-ckpt")
    assert plain["overrides"] == [] and ckpt["overrides"] == ["parallel.activation_checkpointing=full",
                                                              "train.grad_clip=0.5"]
    assert plain["resolved"]["activation_checkpointing"] == "none"
    assert ckpt["resolved"]["activation_checkpointing"] == "full"
    [row] = payload["variants"]
    assert (row["variant"], row["reference"]) == ("ckpt", "plain")
    assert row["ratio"] == pytest.approx(ckpt["tokens_per_s_per_gpu"] / plain["tokens_per_s_per_gpu"])
