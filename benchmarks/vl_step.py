"""One vision-language training step on one GPU: Lockstep against transformers' Qwen2_5_VLForConditionalGeneration.

    python benchmarks/vl_step.py --budget 570 --out bench_out/vl_step.json   # Qwen2.5-VL-3B, text cut to 8 layers
    python benchmarks/vl_step.py --smoke --out /tmp/vl_step.json             # the same code on CPU, a tiny shape, seconds

The shape is configs/qwen2.5-vl-3b.yaml (the vision tower of 32 blocks whole) with ``model.num_layers``
cut (``--layers``, default 8), random init, ``--micro-batch`` rows of ``--seq`` tokens a step (default
1 x 4096), each row holding ``--images`` images of ``--image-size`` pixels square (default 4 of 448: a
patch grid (1, 32, 32), 256 merged tokens each), bf16.

- **Lockstep** trains through train.py, as a user runs it (benchmarks/lockstep_runs.py's overrides):
  ``parallel.strategy=none`` (bf16 autocast over fp32 master weights, fused AdamW on CUDA), the default
  ``determinism.mode=bitwise`` (``--mode fast`` changes it), ``parallel.compile=false`` (``--compile``
  turns it on), SFT on the answers, no accumulation, checkpoint or evaluation, metrics every step. Its
  data is an image-chat corpus written under the run root (record ``image_chat``): PNG files of seeded
  noise, and one conversation per row whose user turn shows the row's images and whose answer fills the
  row to the last token (so every row holds exactly ``--images`` images and no padding); the tokenizer is
  the byte tokenizer with Qwen's chat and vision tokens (data/vision/chat_data.py), written there too,
  and the model's vision token ids are set to its ids (the vocabulary stays 151,936). Nothing needs
  ``python -m data prepare``. The images are decoded, resized and cut into patches in the pipeline's
  worker processes (``--data-workers``), so the step's data wait (the loop's ``data_wait`` phase,
  metrics.jsonl's ``time_data_wait``) includes image decoding. It runs twice with the same settings and seed: the first run is the
  measurement, and the two ledgers must be equal line for line (losses, gradient norms, batch hashes
  with the pixels in them, the last step's parameter hash): the bitwise repeat. On CUDA each run is a
  child process ``python train.py ...``; ``--in-process`` (the default on CPU) calls ``train.main``.
- **transformers** (``Qwen2_5_VLForConditionalGeneration`` from the same shape's config.json,
  benchmarks/hf_baseline.py's recipe: bf16 weights and AdamW state, ``torch.optim.AdamW(fused=True)``,
  clipping at 1.0, sdpa attention) runs in this process first, on the same batch shape as its processor
  gives for these images: per row random text ids around ``--images`` blocks of
  ``<|vision_start|>``, one ``<|image_pad|>`` per merged patch and ``<|vision_end|>``, ``pixel_values`` of
  (patches, 3 x 2 x 14 x 14) and ``image_grid_thw`` (1, 32, 32) per image; labels are the ids with the
  vision tokens masked (-100).

Reported for each: s/step, tokens/s (``micro-batch x seq`` per step), MFU over both towers (the language
model's FLOPs per token times the tokens plus the vision tower's and merger's over the step's images,
models/qwen_vl/flops.py ``vision_flops``; "all matmuls" with the output head, "torchtitan" without)
against the card's dense bf16 peak, peak GiB allocated; Lockstep's data wait as a share of its step (the
issue's target: under 2%). Prints a table, writes JSON (``--out``); exits 1 when a part fails or the
repeat differs.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import hf_baseline as hfb  # noqa: E402  (the benchmarks folder is not a package)
import lockstep_runs as lr  # noqa: E402
import train_throughput as tt  # noqa: E402

PRESET = "configs/qwen2.5-vl-3b.yaml"
TOKEN_KEYS = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
"""model.qwen2_5_vl's token ids, set to the written tokenizer's."""
TOKEN_NAMES = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""The tokens of ``TOKEN_KEYS``, in the same order."""

# --smoke: the preset's code path at a shape that trains on CPU in seconds (tiny-vl-sft.yaml's model).
SMOKE_MODEL = (
    "model.vocab_size=512", "model.hidden_size=64", "model.intermediate_size=192", "model.num_heads=4",
    "model.num_kv_heads=2", "model.qwen2_5_vl.depth=2", "model.qwen2_5_vl.hidden_size=32",
    "model.qwen2_5_vl.num_heads=2", "model.qwen2_5_vl.intermediate_size=64", "model.qwen2_5_vl.window_size=56",
    "model.qwen2_5_vl.fullatt_block_indexes=[1]", "model.qwen2_5_vl.mrope_section=[2,3,3]",
)
SMOKE_SETTINGS = dict(layers=2, seq=160, micro_batch=1, images=4, image_size=56, warmup=1, steps=1, device="cpu",
                      precision="fp32", data_workers=1)


# --------------------------------------------------------------------------- settings


def model_overrides(args: argparse.Namespace, token_ids: dict[str, int]) -> list[str]:
    return [f"model.num_layers={args.layers}", *(SMOKE_MODEL if args.smoke else ()),
            *(f"model.qwen2_5_vl.{key}={value}" for key, value in token_ids.items())]


def train_overrides(args: argparse.Namespace, name: str, run_root: Path, corpus: Path,
                    token_ids: dict[str, int]) -> list[str]:
    """train.py's overrides for one Lockstep run (module docstring)."""
    source = f'[{{path: "{corpus / "chat"}", name: vl-chat, record: image_chat}}]'
    return lr.train_overrides(args, name, run_root, model_overrides(args, token_ids), [
        f"data.sources={source}",
        "data.eval_source=null",
        f"data.tokenizer={corpus / 'tokenizer'}",
        f"data.seq_len={args.seq}",
        "data.loss_on=assistant",
        "data.num_streams=1",
        f"data.workers={args.data_workers}",
        f"data.process_pool={'true' if args.data_workers > 1 else 'false'}",
    ])


def load_config(args: argparse.Namespace, run_root: Path, corpus: Path, token_ids: dict[str, int]):
    """The resolved config of a Lockstep run of this call: the shape both sides train, and its data settings."""
    from core.config import load

    return load(ROOT / PRESET, train_overrides(args, "probe", run_root, corpus, token_ids))


def image_grid(args: argparse.Namespace, config) -> tuple[int, int, int]:
    """The patch grid (t, h, w) of one ``--image-size`` square image; ValueError where the processor would
    resize it (a side that is not a multiple of patch x merge, or outside data.images' pixel range)."""
    images = config.data.images
    unit = images.patch_size * images.merge_size
    if args.image_size % unit or not images.min_pixels <= args.image_size**2 <= images.max_pixels:
        raise ValueError(f"--image-size {args.image_size} must be a multiple of {unit} pixels within "
                         f"data.images' [{images.min_pixels}, {images.max_pixels}] pixels, so that no resize changes it")
    side = args.image_size // images.patch_size
    return (1, side, side)


# --------------------------------------------------------------------------- the corpus


def write_tokenizer(directory: Path) -> dict[str, int]:
    """The byte tokenizer with Qwen's chat and vision tokens (data/vision/chat_data.py) under ``directory``;
    its ids of ``TOKEN_NAMES`` by ``TOKEN_KEYS``."""
    from data.tokenizers import build_tokenizer
    from data.vision.chat_data import write_tokenizer as write

    write(directory, force=True)
    tokenizer = build_tokenizer(str(directory))
    ids = {}
    for key, name in zip(TOKEN_KEYS, TOKEN_NAMES):
        encoded = list(tokenizer.encode(name))
        if len(encoded) != 1:
            raise RuntimeError(f"the written tokenizer encodes {name} as {encoded}, not one token")
        ids[key] = encoded[0]
    return ids


def write_images(directory: Path, count: int, size: int, *, seed: int = 0) -> list[str]:
    """``count`` PNG files of seeded RGB noise, ``size`` pixels square; their names."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(count):
        name = f"image-{i:04d}.png"
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(directory / name)
        names.append(name)
    return names


WORDS = ("picture", "image", "colour", "noise", "pixel", "left", "right", "top", "bottom", "bright", "dark",
         "grain", "pattern", "first", "second", "third", "fourth", "shows", "random", "texture")


def conversation(images: list[str], answer_chars: int, rng: random.Random) -> dict:
    """An image_chat record showing ``images`` whose answer is exactly ``answer_chars`` ASCII characters."""
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < answer_chars + 1:
        words.append(rng.choice(WORDS))
    answer = " ".join(words)[:answer_chars]
    user = "<image>" * len(images) + "Describe the pictures."
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
            "images": [f"../images/{name}" for name in images]}


def write_corpus(directory: Path, args: argparse.Namespace, config, records: int) -> dict[str, Any]:
    """``records`` conversations under ``directory/chat``, each filling one row of ``args.seq`` tokens
    (with the separator) and showing ``args.images`` of a pool of noise PNGs under ``directory/images``;
    checked with the run's own encoder."""
    from data.pipeline.plan import record_encoders
    from data.record_kinds import record_kind
    from data.tokenizers import build_tokenizer

    names = write_images(directory / "images", min(records * args.images, 64), args.image_size)
    tokenizer = build_tokenizer(config.data.tokenizer)
    _, (encoder,) = record_encoders(config.data, [record_kind("image_chat")], tokenizer)
    shard = directory / "chat" / "part-00000.jsonl"
    shard.parent.mkdir(parents=True, exist_ok=True)

    def length(record: dict) -> int:
        return len(encoder.document(record, shard=str(shard)).ids)

    rng = random.Random(0)
    shown = [names[i % len(names)] for i in range(args.images)]
    answer = args.seq - 1 - length(conversation(shown, 1, rng)) + 1  # one token per ASCII character
    if answer < 1:
        raise ValueError(f"--seq {args.seq} holds no answer beside {args.images} images of {args.image_size} pixels")
    lines = []
    for r in range(records):
        shown = [names[(r * args.images + i) % len(names)] for i in range(args.images)]
        lines.append(json.dumps(conversation(shown, answer, rng)) + "\n")
    shard.write_text("".join(lines))
    first = length(json.loads(lines[0]))
    if first != args.seq - 1:
        raise RuntimeError(f"a written conversation encodes to {first} tokens, not seq - 1 = {args.seq - 1}")
    return {"records": records, "images": len(names), "answer_chars": answer, "tokens_per_record": first + 1}


# --------------------------------------------------------------------------- FLOPs


def flop_counts(config, seq: int, grids: list[tuple[int, int, int]]) -> dict[str, Any]:
    """Training FLOPs per token over both towers: the language model's (both conventions) plus the
    vision tower's and merger's over one row's images, spread over the row's tokens."""
    from models.qwen_vl.flops import vision_flops

    text = hfb.flop_counts(config.model, seq)
    vision_row = vision_flops(config.model, grids)
    return {"text": text, "vision_per_row": vision_row,
            "all_matmuls": text["all_matmuls"] + vision_row / seq, "torchtitan": text["torchtitan"] + vision_row / seq}


def with_mfu(part: dict[str, Any], flops: dict[str, Any], peak: float | None) -> dict[str, Any]:
    """``part`` with MFU over both towers from its tokens/s (the Lockstep summary's text-only MFU kept as such)."""
    for key in ("mfu_all_matmuls", "mfu_torchtitan"):
        if key in part:
            part[f"{key}_text_only"] = part.pop(key)
    part["flops_per_token"] = flops
    part["mfu_all_matmuls"] = hfb.mfu(flops["all_matmuls"], part.get("tokens_per_s"), peak, 1)
    part["mfu_torchtitan"] = hfb.mfu(flops["torchtitan"], part.get("tokens_per_s"), peak, 1)
    return part


# --------------------------------------------------------------------------- Lockstep


def run_lockstep(args: argparse.Namespace, name: str, run_root: Path, corpus: Path, token_ids: dict[str, int],
                 peak: float | None, budget: tt.Budget) -> dict[str, Any]:
    """One train.py run (a child process, or ``train.main`` here with ``--in-process``) and its summary."""
    argv = ["--config", PRESET, *train_overrides(args, name, run_root, corpus, token_ids)]
    return lr.run_lockstep(args, name, run_root, argv, peak, budget)


# --------------------------------------------------------------------------- transformers


def build_hf_model(model_config, device):
    """transformers' Qwen2_5_VLForConditionalGeneration of ``model_config``'s shape (its config.json as
    models.hf_config writes it), bf16 on ``device``, sdpa attention."""
    import torch
    import transformers

    from models.hf_config import hf_config_dict
    from models.hf_weights import empty_model

    dims = empty_model(model_config, device="meta").dims
    raw = hf_config_dict(model_config, dims, "bfloat16")
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "dtype")}
    hf_config = transformers.Qwen2_5_VLConfig(**fields)
    hf_config.use_cache = False
    hf_config.text_config.use_cache = False
    model_class = getattr(transformers, raw["architectures"][0])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device, as hf_baseline.py does
    try:
        with torch.device(device):
            model = model_class._from_config(hf_config, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(previous)
    model = model.to(device=device, dtype=torch.bfloat16)
    model.train()
    return model, raw["architectures"][0]


def hf_batch(args: argparse.Namespace, config, grid: tuple[int, int, int], token_ids: dict[str, int], device,
             generator) -> dict[str, Any]:
    """One batch as transformers' processor gives it for ``args.images`` images of ``grid`` per row: random
    text ids (no vision token among them), then per image its start token, one pad per merged patch and its
    end token followed by two text ids, then text to the row's end (module docstring)."""
    import torch

    t, h, w = grid
    merged = t * h * w // config.data.images.merge_size**2
    start, end, pad = (token_ids[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id"))
    vision = torch.tensor(sorted(set(token_ids.values())))
    text_ids = torch.arange(config.model.vocab_size)
    text_ids = text_ids[~torch.isin(text_ids, vision)]
    ids = text_ids[torch.randint(len(text_ids), (args.micro_batch, args.seq), generator=generator)]  # (B, T)
    block = torch.tensor([start, *[pad] * merged, end])
    cursor = 16
    for _ in range(args.images):
        ids[:, cursor:cursor + len(block)] = block
        cursor += len(block) + 2
    if cursor > args.seq:
        raise ValueError(f"--seq {args.seq} is shorter than {args.images} images of {merged} tokens")
    patches = args.micro_batch * args.images * t * h * w
    patch_values = 3 * config.data.images.temporal_patch_size * config.data.images.patch_size**2
    return {"input_ids": ids.to(device), "labels": ids.masked_fill(torch.isin(ids, vision), -100).to(device),
            "pixel_values": torch.randn(patches, patch_values, generator=generator).to(device, torch.bfloat16),
            "image_grid_thw": torch.tensor([grid] * (args.micro_batch * args.images), device=device),
            "mm_token_type_ids": (ids == pad).int().to(device)}


def run_transformers(args: argparse.Namespace, config, grid, token_ids: dict[str, int], device,
                     peak: float | None, flops: dict[str, Any]) -> dict[str, Any]:
    """hf_baseline.py's recipe on Qwen2_5_VLForConditionalGeneration of the same shape and batch; timed as
    hf_baseline.py times."""
    import torch

    lr.prepare_device(device)
    started = time.perf_counter()
    hf_model, class_name = build_hf_model(config.model, device)
    result: dict[str, Any] = {"hf_class": class_name, "build_s": time.perf_counter() - started,
                              "hf_params": sum(p.numel() for p in hf_model.parameters()),
                              "attn_implementation": hf_model.config._attn_implementation, "compile": False}
    optimizer = lr.hf_optimizer(hf_model, device)
    generator = torch.Generator().manual_seed(0)
    accepted = inspect.signature(hf_model.forward).parameters
    batches = [{k: v for k, v in hf_batch(args, config, grid, token_ids, device, generator).items() if k in accepted}
               for _ in range(min(2, args.warmup + args.steps))]
    result["image_tokens_per_row"] = int((batches[0]["input_ids"][0] == token_ids["image_token_id"]).sum())

    def loss_of(i: int) -> torch.Tensor:
        return hf_model(**batches[i % len(batches)]).loss  # (B, T) ids and the images' patches -> scalar

    result.update(lr.timed_steps(hf_model, optimizer, loss_of, args, device))
    return with_mfu(result, flops, peak)  # the model, its optimizer state and the batches go with this frame


# --------------------------------------------------------------------------- report


def table(report: dict[str, Any]) -> str:
    shape, settings = report["shape"], report["settings"]
    lines = [f"Qwen2.5-VL-3B shape, text stack {shape['num_layers']} layers, vision {shape['vision_depth']} blocks "
             f"({shape['params_total'] / 1e9:.2f}B parameters), seq {settings['seq']} x micro-batch "
             f"{settings['micro_batch']}, {settings['images']} images of {settings['image_size']} px a row, "
             f"{report['device_name']}; peak: {report['peak_source']}", "",
             "| run | status | s/step | tokens/s | MFU both towers, all matmuls | MFU both towers, torchtitan "
             "| peak GiB | data wait |",
             "|---|---|---|---|---|---|---|---|"]
    for label, part in ((f"lockstep ({settings['mode']})", report["lockstep"]), ("transformers", report["transformers"])):
        lines.append(lr.table_row(label, part, tt.fmt(part.get("data_wait_fraction"), ".2%")))
    note = (f" (target 1.5x); Lockstep's data wait {tt.fmt(report['lockstep'].get('data_wait_fraction'), '.2%')} "
            "of its step (target < 2%)")
    return "\n".join([*lines, *lr.table_tail(report, note)])


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    lr.add_common_args(p, layers=8, layers_help="model.num_layers of the preset (the language model)")
    p.add_argument("--images", type=int, default=4, help="images in each row")
    p.add_argument("--image-size", type=int, default=448, help="side of each square image, pixels")
    lr.add_run_args(p)
    p.add_argument("--data-workers", type=int, default=4,
                   help="Lockstep's data.workers (worker processes decoding the images when above 1)")
    lr.add_launch_args(p, run_root_help="where the runs and the corpus go (default: a temporary directory, deleted)",
                       out="bench_out/vl_step.json")
    return lr.finish_args(p, p.parse_args(argv), SMOKE_SETTINGS,
                          ("--layers", "--seq", "--micro-batch", "--images", "--image-size", "--warmup", "--steps",
                           "--data-workers"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import models

    started = lr.header("vl_step", args)
    if started is None:
        return 2
    device, peak, report = started
    budget = tt.Budget(args.budget)
    with lr.run_root_of(args, "lockstep-vl-step-", report) as run_root:
        corpus = run_root / "corpus"
        token_ids = write_tokenizer(corpus / "tokenizer")
        config = load_config(args, run_root, corpus, token_ids)
        grid = image_grid(args, config)
        flops = flop_counts(config, args.seq, [grid] * args.images)
        report["shape"] = {"preset": PRESET, "num_layers": config.model.num_layers,
                           "vision_depth": config.model.qwen2_5_vl.depth, "params_total": models.num_params(config.model),
                           "image_grid_thw": list(grid), "token_ids": token_ids, "flops_per_token": flops}
        report["corpus"] = write_corpus(corpus, args, config, 2 * (args.warmup + args.steps + 1) * args.micro_batch)
        report["transformers"] = lr.guarded_transformers(
            lambda: run_transformers(args, config, grid, token_ids, device, peak, flops), device)
        lr.compare(report, lambda name: with_mfu(run_lockstep(args, name, run_root, corpus, token_ids, peak,
                                                                   budget), flops, peak),
                   ("vl-step-a", "vl-step-b"))
    return lr.finish("vl_step", args, report, table(report))


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
