"""Generation throughput: models/generation/sampler.py against `transformers` `generate`, and what holds bitwise.

    python benchmarks/generate.py --shape qwen2.5-0.5b --batch 64 --prompt-len 128 --new-tokens 256 \
        --check-determinism --out bench_out/generate-0.5b.json
    python benchmarks/generate.py --tiny --out bench_out/generate-tiny.json      # CPU smoke test

Both generators get the same weights (a random init of the preset's shape, copied from the
transformers model into ours, bf16), the same ``--batch`` prompts of ``--prompt-len`` random
token ids and produce exactly ``--new-tokens`` tokens per prompt (no stop token), sampling at
temperature 1 (``--top-p P``: with a nucleus filter; ``--greedy``: argmax). tokens/s = batch x new tokens / wall
time of one whole ``generate`` call (prefill included), median of ``--repeats`` calls after
one warm-up call (which includes compilation and CUDA-graph capture; reported separately).

Variants of ours: ``eager``; ``compiled`` (decode step under torch.compile, no CUDA graphs);
``graphs`` (compiled and replayed as a CUDA graph, the default on CUDA); ``invariant`` (the sampler
as a run with ``determinism.batch_invariant: true`` builds it: a copy of the model under the
batch-invariant kernels, models/batch_invariant.py, whose eager launches are replayed as CUDA
graphs, timed under ``torch.use_deterministic_algorithms(True)`` as bitwise mode sets; its
log-probs are the trainer's bit for bit). transformers:
``hf`` (``model.generate`` with its default dynamic cache) and, with ``--hf-static``,
``hf_static`` (``cache_implementation="static"`` in a ``GenerationConfig``; transformers compiles its
forward by itself for a static cache on GPU). Each transformers result records the cache class that
``generate`` really used and whether its forward ran compiled; a variant whose option did not take
effect (a dynamic cache under ``hf_static``, or no compilation on GPU) is reported as an error.
A variant that fails is reported with its error and the others still run.

``--check-determinism`` (ours, sampling, the fastest variant) reports, for the default
settings and again under ``torch.use_deterministic_algorithms(True)`` (what
``determinism.mode=bitwise`` sets): the same batch twice; each of the first ``--probe``
prompts alone (batch of 1, padded to max_batch) vs inside the full batch; the batch in
shuffled order. ``equal`` means tokens and log-probs are bitwise equal for every probed sample.

``--stop-fraction F`` adds a rollout phase with mixed completion lengths: every round(1/F)-th
token id is a stop token, so sampled completions of the random-weight model end after about
1/F tokens (geometrically, capped at ``--rollout-new-tokens``, default ``--new-tokens``), and
``--samples`` prompts (default 4 x batch) go through ``--batch`` rows, once with the sampler's
continuous refill (``schedule="refill"``) and once with the group-by-group schedule before
it (``"groups"``: each group of ``--batch`` decodes until its longest sample ends), both the
first of our variants in ``--variants``, in the same call; refill once per value of
``--refill-every`` (decode steps between refill points; with ``--prefill-ahead both``, with and
without the Sampler's ``prefill_ahead``), the fastest reported as ``refill``.
Both prefill ``--prefill-rows`` prompts per forward; the group schedule runs once more as it
ran before that setting existed, a group's prompts in one forward of all ``--batch`` rows
(``groups_prefill_all_rows``), and refill's speedup is reported against both, with the decode
steps each schedule ran for these completion lengths (``models.generation.scheduler.decode_steps``):
their ratio bounds the speedup refill can give, since a step costs about the same in both
(refill's a little more where the next prompts' prefill runs beside it, ``prefill_ahead``).
It reports each schedule's tokens/s
(generated tokens, stop tokens included) and median wall time, refill's speedup, the
completion-length distribution, whether the two schedules give bitwise the same samples, and
the determinism checks above under refill (the whole rollout twice, the first ``--probe``
prompts alone, shuffled order). ``--step-times`` adds one more call of the fastest refill and of
the groups prefilling all rows, timing each decode step from its start to the next's (CUDA events
on the GPU, so the device's idle time counts) by its place between refill points: where a
refill's extra time goes, at its points or at every step:

    python benchmarks/generate.py --variants graphs --batch 64 --prompt-len 128 --new-tokens 256 \
        --stop-fraction 0.015625 --samples 1024 --refill-every 8,16,32 --out bench_out/generate-rollout.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

# Deterministic cuBLAS needs this before CUDA initializes (torch.use_deterministic_algorithms).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.hf_baseline import build_hf_model, load_model_config, write_json  # noqa: E402

TINY = {"shape": "tiny", "batch": 4, "prompt_len": 8, "new_tokens": 8, "repeats": 1, "probe": 2}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], device) -> tuple[float, Any]:
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - start, result


def _measure(fn: Callable[[], Any], device, repeats: int, generated: int) -> dict[str, Any]:
    warmup_s, result = _timed(fn, device)
    times = [_timed(fn, device)[0] for _ in range(repeats)]
    median = statistics.median(times)
    return {"warmup_s": warmup_s, "times_s": times, "median_s": median, "tokens_per_s": generated / median,
            "result": result}


def build_models(args, device):
    """(transformers model, our model): the same bf16 weights."""
    import torch

    from models.hf_weights import empty_model, weight_adapter

    model_config = load_model_config(args.shape, args.config)
    torch.manual_seed(0)  # the same random weights in every call, so that calls' rollouts compare
    hf_model, class_name = build_hf_model(model_config, device)
    hf_model.config.use_cache = True
    hf_model.eval()
    ours = empty_model(model_config, device=device, dtype=torch.bfloat16)
    adapter = weight_adapter(model_config)  # the family's Hugging Face names (ModelFamily.weights): one-to-one here
    ours.load_state_dict({adapter.from_hf(k).key: v for k, v in hf_model.state_dict().items()}, strict=True)
    ours.tie_weights()
    return hf_model, ours.eval(), class_name, model_config


def invariant_model(model):
    """A copy of ``model`` under the batch-invariant kernels (bf16 parameters, no autocast)."""
    import copy

    from models.numerics import Numerics

    invariant = copy.deepcopy(model)
    invariant.use_numerics(Numerics(batch_invariant=True, precision="bf16", wrapper_casts=True))
    return invariant


def ours_variant(model, args, name: str):
    from models.generation.sampler import Sampler

    if name == "invariant":  # compile and CUDA graphs as the sampler chooses them for these kernels
        return Sampler(invariant_model(model), max_batch=args.batch, max_len=args.prompt_len + args.new_tokens,
                       prefill_chunk=args.prompt_len, prefill_rows=args.prefill_rows)
    compile_, graphs = {"eager": (False, False), "compiled": (True, False), "graphs": (True, True)}[name]
    return Sampler(model, max_batch=args.batch, max_len=args.prompt_len + args.new_tokens,
                   prefill_chunk=args.prompt_len, prefill_rows=args.prefill_rows, compile=compile_, cuda_graphs=graphs)


def run_ours(sampler, prompts, keys, params):
    samples = sampler.generate(prompts, keys, params)
    assert all(len(s.tokens) == params.max_new_tokens for s in samples), "a sample ended early"
    return samples


def hf_generation_config(hf_model, args, static: bool):
    """The transformers settings as one ``GenerationConfig``, with the cache enabled so that
    ``cache_implementation`` takes effect."""
    import copy

    config = copy.deepcopy(hf_model.generation_config)
    config.max_new_tokens = config.min_new_tokens = args.new_tokens
    config.pad_token_id = 0
    config.eos_token_id = None
    if args.greedy:
        config.do_sample, config.temperature, config.top_k, config.top_p = False, None, None, None
    else:
        config.do_sample, config.temperature, config.top_k, config.top_p = True, 1.0, 0, args.top_p
    # Without use_cache transformers drops cache_implementation ("generation flags are not valid and may
    # be ignored"), which is how the static variant silently measured the dynamic cache before.
    config.use_cache, config.return_dict_in_generate = True, True
    config.cache_implementation = "static" if static else None
    return config


def run_hf(hf_model, input_ids, args, static: bool):
    """transformers ``generate``; returns the new tokens and what it really used: the cache class and
    whether its forward ran compiled (transformers compiles by itself only with a static cache on GPU)."""
    import torch

    config = hf_generation_config(hf_model, args, static)
    with torch.no_grad():
        out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    sequences = out.sequences
    assert sequences.shape[1] == input_ids.shape[1] + args.new_tokens, tuple(sequences.shape)
    # The returned cache is ``past_key_values`` in older 5.x releases and ``cache`` in newer ones.
    cache = next((getattr(out, k) for k in ("cache", "past_key_values") if getattr(out, k, None) is not None), None)
    used = {"cache_class": type(cache).__name__, "compiled_forward": hasattr(hf_model, "_compiled_call")}
    return sequences[:, input_ids.shape[1]:], used


def check_hf_variant(name: str, used: dict[str, Any], device) -> None:
    """Refuse to publish a transformers figure whose named option did not take effect."""
    if name == "hf_static":
        if "Static" not in used["cache_class"]:
            raise RuntimeError(f"hf_static ran with {used['cache_class']}, not a static cache")
        if device.type == "cuda" and not used["compiled_forward"]:
            raise RuntimeError("hf_static's forward was not compiled by transformers")
    elif "Static" in used["cache_class"]:
        raise RuntimeError(f"hf ran with {used['cache_class']}, expected its default dynamic cache")


def check_determinism(sampler, prompts, keys, params, probe: int) -> dict[str, Any]:
    base = sampler.generate(prompts, keys, params)
    again = sampler.generate(prompts, keys, params)
    alone = [sampler.generate([prompts[i]], [keys[i]], params)[0] for i in range(probe)]
    order = list(reversed(range(len(prompts))))
    shuffled = sampler.generate([prompts[i] for i in order], [keys[i] for i in order], params)
    unshuffled = [shuffled[order.index(i)] for i in range(len(prompts))]

    def compare(a, b) -> dict[str, Any]:
        differing = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        first = None
        if differing:
            x, y = a[differing[0]], b[differing[0]]
            first = next((t for t, (u, v) in enumerate(zip(x.logprobs, y.logprobs)) if u != v or x.tokens[t] != y.tokens[t]), None)
        return {"equal": not differing, "differing_samples": len(differing), "compared": len(a),
                "first_differing_position": first}

    return {"same_batch_twice": compare(base, again), "batch_1_vs_full": compare(base[:probe], alone),
            "shuffled_order": compare(base, unshuffled)}


def rollout_phase(model, args, variant: str, device) -> dict[str, Any]:
    """The --stop-fraction rollout: refill against the group schedule on the same samples (module docstring)."""
    import torch

    from models.generation.sampler import SampleKey, Sampler, SamplingParams
    from models.generation.scheduler import decode_steps

    vocab = model.dims.vocab_size
    every = max(1, round(1 / args.stop_fraction))
    new_tokens = args.rollout_new_tokens or args.new_tokens
    samples = args.samples or 4 * args.batch
    params = SamplingParams(temperature=1.0, top_p=args.top_p, max_new_tokens=new_tokens,
                            stop_token_ids=tuple(range(0, vocab, every)))
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (samples, args.prompt_len), generator=generator).tolist()
    keys = [SampleKey(0, "benchmark.rollout", 0, i) for i in range(samples)]
    compile_, graphs = {"eager": (False, False), "compiled": (True, False), "graphs": (True, True)}[variant]
    report: dict[str, Any] = {"variant": variant, "samples": samples, "rows": args.batch, "new_tokens": new_tokens,
                              "stop_tokens": len(params.stop_token_ids), "vocab": vocab}
    intervals = [int(k) for k in str(args.refill_every).split(",") if k]
    aheads = {"default": [(None, "")], "on": [(True, "")], "off": [(False, "")],
              "both": [(True, "_ahead"), (False, "_not_ahead")]}[args.prefill_ahead]
    # (name, schedule, refill interval, prefill ahead, prefill rows): the group schedule also as it
    # ran before prefills of prefill_rows, every prompt of a group in one forward of all rows.
    runs = [("groups", "groups", 16, None, args.prefill_rows), ("groups_prefill_all_rows", "groups", 16, None, args.batch)]
    runs += [(f"refill_every_{k}{suffix}", "refill", k, ahead, args.prefill_rows) for k in intervals for ahead, suffix in aheads]
    outputs, samplers = {}, {}
    for name, schedule, every, ahead, prefill_rows in runs:
        print(f"[generate] rollout phase, {name} ...", flush=True)
        sampler = Sampler(model, max_batch=args.batch, max_len=args.prompt_len + new_tokens,
                          prefill_chunk=args.prompt_len, prefill_rows=prefill_rows, schedule=schedule,
                          refill_every=every, prefill_ahead=ahead, compile=compile_, cuda_graphs=graphs)
        samplers[name] = sampler
        report.setdefault("prefill_rows", sampler.prefill_rows)
        measured = _measure(lambda: sampler.generate(prompts, keys, params), device, args.repeats, 1)
        outputs[name] = measured.pop("result")
        measured["tokens_per_s"] = sum(len(s.tokens) for s in outputs[name]) / measured["median_s"]
        report[name] = measured
        if name == runs[2][0]:
            report["determinism_refill"] = check_determinism(sampler, prompts, keys, params,
                                                             min(args.probe, samples))
    best = min((name for name, schedule, *_ in runs if schedule == "refill"), key=lambda n: report[n]["median_s"])
    report["refill"] = report[best]
    report["refill_best"] = best
    lengths = [len(s.tokens) for s in outputs["groups"]]
    report["lengths"] = {"min": min(lengths), "mean": statistics.mean(lengths), "max": max(lengths),
                         "median": statistics.median(lengths), "tokens": sum(lengths),
                         "stopped": sum(s.finish_reason == "stop" for s in outputs["groups"])}
    report["refill_equals_groups"] = all(outputs[name] == outputs["groups"] for name, *_ in runs[2:])
    report["groups_prefill_all_rows_equals_groups"] = outputs["groups_prefill_all_rows"] == outputs["groups"]
    report["speedup_refill_vs_groups"] = report["groups"]["median_s"] / report["refill"]["median_s"]
    report["speedup_refill_vs_groups_prefill_all_rows"] = (report["groups_prefill_all_rows"]["median_s"]
                                                           / report["refill"]["median_s"])
    # The decode steps each schedule ran for these lengths: their ratio bounds refill's speedup
    # (a refill step costs a group step; prefills, host syncs and the tail are the rest).
    steps = {name: decode_steps(lengths, args.batch, every, schedule, budget=new_tokens)
             for name, schedule, every, *_ in runs}
    report["prefill_ahead"] = {name: samplers[name].prefill_ahead for name, schedule, *_ in runs if schedule == "refill"}
    report["decode_steps"] = steps
    report["step_bound_refill_vs_groups"] = steps["groups"] / steps[best]
    # Wall time per decode step: what a schedule pays beyond its steps (prefills, refill points) shows here.
    report["ms_per_decode_step"] = {name: 1e3 * report[name]["median_s"] / steps[name] for name, *_ in runs}
    if args.step_times:
        report["step_times"] = {name: step_times(samplers[name], lambda s=samplers[name]: s.generate(prompts, keys, params),
                                                 device, every=samplers[name].refill_every if name == best else 16)
                                for name in ("groups_prefill_all_rows", best)}
    if args.profile_rollout:
        write_profiles(args.profile_rollout, {n: (lambda s=samplers[n]: s.generate(prompts, keys, params))
                                              for n in ("groups_prefill_all_rows", best)}, device)
    return report


def step_times(sampler, call: Callable[[], Any], device, every: int) -> dict[str, Any]:
    """Where one ``generate`` call's time goes between decode steps: the time from each decode step's
    start to the next's (on CUDA by events on the stream, so the device's idle time between them
    counts; elsewhere by the host's clock), in ms, their mean and median, and their means by the
    step's place between refill points (``step % every``; the groups: between done checks)."""
    import torch

    stamps: list[Any] = []
    on_cuda = device.type == "cuda"

    def stamp() -> None:
        if on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            stamps.append(event)
        else:
            stamps.append(time.perf_counter())

    def stamped(build: Callable) -> Callable:  # a builder of decode steps -> one of timed steps
        def built(params):
            step = build(params)

            def timed(*inputs):
                stamp()
                return step(*inputs)

            return timed

        return built

    # The groups' decode step is a function of the step's inputs; refill's, of none (the rows' state).
    builders = ("_decode_step", "_refill_step")
    for name in builders:
        setattr(sampler, name, stamped(getattr(sampler, name)))
    try:
        wall, _ = _timed(call, device)
    finally:
        for name in builders:
            delattr(sampler, name)  # the class's methods again
    stamp()  # the end of the last step's work (and of whatever followed it)
    _sync(device)
    gaps = ([a.elapsed_time(b) for a, b in zip(stamps, stamps[1:])] if on_cuda
            else [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])])
    by_place = [statistics.mean(gaps[i::every]) if gaps[i::every] else None for i in range(every)]
    return {"clock": "cuda events" if on_cuda else "host", "steps": len(gaps), "wall_s": wall,
            "mean_ms": statistics.mean(gaps), "median_ms": statistics.median(gaps), "every": every,
            "mean_ms_by_place": by_place}


def write_profiles(path: str, calls: dict[str, Callable[[], Any]], device) -> None:
    """Where one call's time goes, per variant (``calls``: name -> one ``generate`` call): the profiler's
    table of device kernels and host operators (sorted by device time, then by host time), with the
    wall time of the profiled call."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sections = []
    for name, call in calls.items():
        with profile(activities=activities) as prof:
            wall, _ = _timed(call, device)
        events = prof.key_averages()
        sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        sections.append(f"## {name}: one generate call, {wall:.3f} s wall (profiled)\n\n"
                        + events.table(sort_by=sort, row_limit=40, max_name_column_width=90)
                        + "\n\n" + events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=90))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n\n".join(sections) + "\n")
    print(f"[generate] profiles written to {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--config", default=None, help="a config YAML instead of --shape's preset")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=None,
                        help="of graphs, compiled, eager, hf, hf_static (default graphs,compiled,eager,hf; --tiny: eager,hf)")
    parser.add_argument("--hf-static", action="store_true", help="add the hf_static variant")
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus filter when sampling (both generators)")
    parser.add_argument("--check-determinism", action="store_true")
    parser.add_argument("--probe", type=int, default=4, help="prompts checked alone in --check-determinism")
    parser.add_argument("--profile", default=None, metavar="TXT",
                        help="profile one call of each of our measured variants; kernel tables go to TXT")
    parser.add_argument("--profile-rollout", default=None, metavar="TXT",
                        help="rollout phase: profile one call of the fastest refill and of groups_prefill_all_rows")
    parser.add_argument("--step-times", action="store_true",
                        help="rollout phase: time each decode step of one more call of the fastest refill and of "
                             "groups_prefill_all_rows, by its place between refill points (step_times)")
    parser.add_argument("--stop-fraction", type=float, default=None, metavar="F",
                        help="add the mixed-length rollout phase: this fraction of the vocabulary stops a sample")
    parser.add_argument("--refill-every", default="16", metavar="K[,K...]",
                        help="rollout phase: decode steps between refill points; refill is measured for each")
    parser.add_argument("--prefill-ahead", choices=("default", "on", "off", "both"), default="default",
                        help="rollout phase: the Sampler's prefill_ahead for refill (default its own: on CUDA); "
                             "both: each refill interval with and without")
    parser.add_argument("--samples", type=int, default=None, help="rollout phase: samples (default 4 x --batch)")
    parser.add_argument("--prefill-rows", type=int, default=None,
                        help="our sampler's rows per prefill forward (default: the Sampler's, 16 or --batch if fewer)")
    parser.add_argument("--rollout-only", action="store_true",
                        help="run only the rollout phase (with the first of --variants), not the throughput variants")
    parser.add_argument("--rollout-new-tokens", type=int, default=None,
                        help="rollout phase: the cap on a completion's length (default --new-tokens)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized smoke test of this script")
    parser.add_argument("--out", default="bench_out/generate.json")
    args = parser.parse_args(argv)
    if args.stop_fraction is not None and not 0 < args.stop_fraction <= 1:
        parser.error(f"--stop-fraction must be in (0, 1], got {args.stop_fraction}")
    if args.rollout_only and args.stop_fraction is None:
        parser.error("--rollout-only needs --stop-fraction (the rollout phase)")
    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
        args.device = args.device or "cpu"
        args.variants = "eager,hf" if args.variants is None else args.variants
        args.check_determinism = True

    import torch
    import transformers

    from models.generation.sampler import SampleKey, SamplingParams

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # TF32 stays off (torch's default): it would round the sampler's fp32 attention matmuls.
    hf_model, ours, class_name, model_config = build_models(args, device)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model_config.vocab_size, (args.batch, args.prompt_len), generator=generator)
    prompts = input_ids.tolist()
    keys = [SampleKey(0, "benchmark", 0, i) for i in range(args.batch)]
    params = SamplingParams(temperature=0.0 if args.greedy else 1.0, top_p=1.0 if args.greedy else args.top_p,
                            max_new_tokens=args.new_tokens)
    generated = args.batch * args.new_tokens
    variants = [v for v in (args.variants or "graphs,compiled,eager,hf").split(",") if v] + (["hf_static"] if args.hf_static else [])

    results: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    fastest = None
    samplers: dict[str, Any] = {}
    for name in [] if args.rollout_only else variants:
        print(f"[generate] {name} ...", flush=True)
        try:
            if name.startswith("hf"):
                ids = input_ids.to(device)
                measured = _measure(lambda: run_hf(hf_model, ids, args, name == "hf_static"), device, args.repeats, generated)
                tokens, used = measured.pop("result")
                check_hf_variant(name, used, device)
                measured.update(used)
                outputs[name] = tokens.tolist()
            else:
                sampler = samplers[name] = ours_variant(ours, args, name)
                previous = torch.are_deterministic_algorithms_enabled()
                torch.use_deterministic_algorithms(previous or name == "invariant")
                try:
                    measured = _measure(lambda: run_ours(sampler, prompts, keys, params), device, args.repeats,
                                        generated)
                finally:
                    torch.use_deterministic_algorithms(previous)
                measured["compiled"], measured["cuda_graphs"] = sampler.compile, sampler.cuda_graphs
                outputs[name] = [s.tokens for s in measured.pop("result")]
                if fastest is None or measured["tokens_per_s"] > results[fastest]["tokens_per_s"]:
                    fastest = name
            if device.type == "cuda":
                measured["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()
            results[name] = measured
        except Exception as exc:  # report and go on with the other variants
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}

    if args.profile:
        write_profiles(args.profile, {n: (lambda s=s: run_ours(s, prompts, keys, params)) for n, s in samplers.items()},
                       device)

    determinism = {}
    if args.check_determinism and fastest is not None:
        for label, deterministic in (("default", False), ("deterministic_algorithms", True)):
            print(f"[generate] determinism ({label}) with {fastest} ...", flush=True)
            previous = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(deterministic)
            try:
                # The default check reuses the measured sampler; deterministic algorithms need a new compile.
                sampler = ours_variant(ours, args, fastest) if deterministic else samplers[fastest]
                determinism[label] = check_determinism(sampler, prompts, keys,
                                                       SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens),
                                                       min(args.probe, args.batch))
            except Exception as exc:
                traceback.print_exc()
                determinism[label] = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                torch.use_deterministic_algorithms(previous)

    rollout = {}
    if args.stop_fraction is not None:
        ours_names = [v for v in variants if not v.startswith("hf")] or ["eager"]
        try:
            rollout = rollout_phase(ours, args, ours_names[0], device)
        except Exception as exc:
            traceback.print_exc()
            rollout = {"error": f"{type(exc).__name__}: {exc}"}

    agreement = {}
    if args.greedy and "hf" in outputs:
        for name, tokens in outputs.items():
            if name != "hf":
                same_first = sum(a[0] == b[0] for a, b in zip(tokens, outputs["hf"]))
                prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(tokens, outputs["hf"])]
                agreement[name] = {"first_token_equal": same_first / len(tokens), "mean_equal_prefix": statistics.mean(prefix)}

    hf_speed = results.get("hf", {}).get("tokens_per_s")
    static_speed = results.get("hf_static", {}).get("tokens_per_s")
    payload = {
        "shape": args.shape, "model_class": class_name, "batch": args.batch, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "greedy": args.greedy, "top_p": None if args.greedy else args.top_p, "dtype": "bfloat16", "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "command": " ".join([sys.executable, *sys.argv]),
        "results": results, "speedup_vs_hf": {n: r["tokens_per_s"] / hf_speed for n, r in results.items()
                                              if hf_speed and "tokens_per_s" in r},
        "speedup_vs_hf_static": {n: r["tokens_per_s"] / static_speed for n, r in results.items()
                                 if static_speed and "tokens_per_s" in r},
        "determinism": determinism, "greedy_agreement_with_hf": agreement, "rollout": rollout,
    }
    write_json(args.out, payload)
    print(f"\n{args.shape} ({class_name}), batch {args.batch} x {args.prompt_len} prompt tokens, "
          f"{args.new_tokens} new, bf16, {payload['gpu'] or device}")
    print("| variant | tokens/s | median s | warm-up s | vs hf | vs hf_static |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | error: {r['error'][:80]} | | | | |")
        else:
            ratios = (payload["speedup_vs_hf"].get(name), payload["speedup_vs_hf_static"].get(name))
            print(f"| {name} | {r['tokens_per_s']:.0f} | {r['median_s']:.3f} | {r['warmup_s']:.1f} | "
                  + " | ".join("" if ratio is None else f"{ratio:.2f}x" for ratio in ratios) + " |")
    for label, checks in determinism.items():
        print(f"determinism ({label}): " + ", ".join(
            f"{k}={v['equal']} ({v['differing_samples']}/{v['compared']} differ)" if "equal" in v else f"{k}={v}"
            for k, v in checks.items()))
    if agreement:
        print(f"greedy agreement with hf: {agreement}")
    if "error" in rollout:
        print(f"rollout phase: error: {rollout['error']}")
    elif rollout:
        lengths = rollout["lengths"]
        print(f"rollout phase ({rollout['variant']}, {rollout['samples']} samples through {rollout['rows']} rows, "
              f"lengths min {lengths['min']} mean {lengths['mean']:.1f} max {lengths['max']}):")
        for name, r in rollout.items():
            if name.startswith("groups") and isinstance(r, dict) or name.startswith("refill_every_"):
                print(f"  {name}: {r['tokens_per_s']:.0f} tokens/s, {r['median_s']:.3f} s")
        print(f"  refill ({rollout['refill_best']}, prefill {rollout['prefill_rows']} rows) "
              f"{rollout['speedup_refill_vs_groups']:.2f}x groups, "
              f"{rollout['speedup_refill_vs_groups_prefill_all_rows']:.2f}x groups prefilling all rows at once "
              f"(decode steps {rollout['decode_steps']['groups']} against "
              f"{rollout['decode_steps'][rollout['refill_best']]}: at most "
              f"{rollout['step_bound_refill_vs_groups']:.2f}x); "
              f"bitwise equal: {rollout['refill_equals_groups']}; "
              "determinism under refill: " + ", ".join(f"{k}={v['equal']}" for k, v in rollout["determinism_refill"].items()))
        for name, times in rollout.get("step_times", {}).items():
            places = " / ".join(f"{t:.3f}" for t in times["mean_ms_by_place"] if t is not None)
            print(f"  step times, {name} ({times['clock']}): mean {times['mean_ms']:.3f} ms, median "
                  f"{times['median_ms']:.3f} ms; by place between points (every {times['every']}): {places}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
