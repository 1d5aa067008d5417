"""benchmarks/generate.py: the transformers variants measure the cache they name."""

from __future__ import annotations

import types

import pytest
import torch

from benchmarks import generate as bench
from benchmarks.hf_baseline import build_hf_model, load_model_config


@pytest.fixture(scope="module")
def hf_model():
    model, _ = build_hf_model(load_model_config("tiny", None), torch.device("cpu"))
    model.config.use_cache = True
    return model.eval()


@pytest.mark.parametrize("static, expected", [(False, "DynamicCache"), (True, "StaticCache")])
def test_transformers_variant_uses_the_cache_it_names(hf_model, static, expected):
    args = types.SimpleNamespace(new_tokens=3, greedy=True, top_p=1.0)
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    tokens, used = bench.run_hf(hf_model, ids, args, static)
    assert tokens.shape == (2, 3)
    assert used["cache_class"] == expected
    bench.check_hf_variant("hf_static" if static else "hf", used, torch.device("cpu"))


def test_a_variant_whose_option_did_not_take_effect_is_refused():
    with pytest.raises(RuntimeError, match="not a static cache"):
        bench.check_hf_variant("hf_static", {"cache_class": "DynamicCache", "compiled_forward": False},
                               torch.device("cpu"))
    with pytest.raises(RuntimeError, match="not compiled"):
        bench.check_hf_variant("hf_static", {"cache_class": "StaticCache", "compiled_forward": False},
                               torch.device("cuda"))


def test_sampling_settings_reach_both_generators():
    args = types.SimpleNamespace(new_tokens=7, greedy=False, top_p=0.95)
    model = types.SimpleNamespace(generation_config=__import__("transformers").GenerationConfig())
    config = bench.hf_generation_config(model, args, static=True)
    assert (config.do_sample, config.temperature, config.top_k, config.top_p) == (True, 1.0, 0, 0.95)
    assert (config.max_new_tokens, config.min_new_tokens, config.cache_implementation) == (7, 7, "static")
    assert config.use_cache


def test_the_rollout_phase_compares_refill_with_groups_on_mixed_lengths(tmp_path, request, monkeypatch):
    """--tiny --stop-fraction on the CPU: both schedules give bitwise the same samples, and the checks hold."""
    import json

    profiled = {}  # --profile-rollout's calls (the profiler's own cost is write_profiles' test's)
    monkeypatch.setattr(bench, "write_profiles", lambda path, calls, device: profiled.update(path=path, calls=calls))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads on a busy machine wait on each other
    request.addfinalizer(lambda: torch.set_num_threads(threads))

    out, profile = tmp_path / "generate.json", tmp_path / "profile.txt"
    assert bench.main(["--tiny", "--variants", "eager", "--rollout-only", "--stop-fraction", "0.125", "--samples", "10",
                       "--rollout-new-tokens", "24", "--refill-every", "4,16", "--prefill-ahead", "both", "--prefill-rows", "2",
                       "--profile-rollout", str(profile), "--step-times", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["results"] == {}  # --rollout-only: no throughput variants
    rollout = report["rollout"]
    refills = {f"refill_every_{k}{suffix}" for k in (4, 16) for suffix in ("_ahead", "_not_ahead")}
    assert set(rollout["ms_per_decode_step"]) == {"groups", "groups_prefill_all_rows"} | refills
    assert rollout["prefill_ahead"] == {name: not name.endswith("_not_ahead") for name in refills}
    assert profiled["path"] == str(profile)
    assert list(profiled["calls"]) == ["groups_prefill_all_rows", rollout["refill_best"]]
    assert len(profiled["calls"]["groups_prefill_all_rows"]()) == 10  # one generate call: every sample
    assert rollout["refill_equals_groups"] is True and rollout["prefill_rows"] == 2
    assert rollout["groups_prefill_all_rows"]["tokens_per_s"] > 0
    steps = rollout["decode_steps"]
    assert steps["refill_every_4_ahead"] < steps["groups"] and rollout["step_bound_refill_vs_groups"] > 1
    assert all(check["equal"] for check in rollout["determinism_refill"].values()), rollout["determinism_refill"]
    lengths = rollout["lengths"]
    assert lengths["min"] < lengths["mean"] < lengths["max"] <= 24
    assert rollout["refill_best"] in refills
    # --step-times: one timed interval per decode step the schedule ran, by place between points
    times = rollout["step_times"]
    assert list(times) == ["groups_prefill_all_rows", rollout["refill_best"]]
    for name, timed in times.items():
        assert timed["clock"] == "host" and timed["steps"] == steps[name], name
        assert len(timed["mean_ms_by_place"]) == timed["every"] and timed["mean_ms"] > 0
    assert all(rollout[name]["tokens_per_s"] > 0 for name in refills | {"groups"})


def test_write_profiles_tables_each_call_by_device_and_host_time(tmp_path):
    path = tmp_path / "profile.txt"
    bench.write_profiles(str(path), {"first": lambda: torch.ones(8, 8) @ torch.ones(8, 8),
                                     "second": lambda: torch.ones(4).sum()}, torch.device("cpu"))
    text = path.read_text()
    assert [line.split(":")[0] for line in text.splitlines() if line.startswith("## ")] == ["## first", "## second"]
    assert "aten::mm" in text and "aten::sum" in text


def test_the_invariant_variant_samples_through_a_batch_invariant_copy():
    """``invariant`` times the sampler a batch_invariant run builds, on a copy: the other variants keep
    the stock kernels, and its samples repeat."""
    from models.generation.sampler import SampleKey, SamplingParams

    args = types.SimpleNamespace(shape="tiny", config=None, batch=2, prompt_len=4, new_tokens=3, prefill_rows=None)
    _, ours, _, _ = bench.build_models(args, torch.device("cpu"))
    sampler = bench.ours_variant(ours, args, "invariant")
    assert sampler.numerics.batch_invariant and not ours.numerics.batch_invariant
    assert sampler.model is not ours
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    keys = [SampleKey(0, "benchmark", 0, i) for i in range(2)]
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    first, again = (bench.run_ours(sampler, prompts, keys, params) for _ in range(2))
    assert [(s.tokens, s.logprobs) for s in first] == [(s.tokens, s.logprobs) for s in again]
