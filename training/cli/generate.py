"""``python -m training generate``: sample from a run's checkpoint or a Hugging Face directory.

    python -m training generate --from RUN_ID|RUN_DIR|HF_DIR [--step S] (--prompt TEXT [--image PATH ...] | --prompts FILE.jsonl)
        [--max-new-tokens N] [--temperature T] [--top-p P] [--top-k K] [--samples N] [--seed S]
        [--num-beams N [--length-penalty L] [--early-stopping false|true|never]]
        [--chat | --no-chat] [--out FILE.jsonl [--overwrite]] [--root runs]

- ``--from``: a run directory (it holds ``config.yaml``), a Hugging Face directory (``config.json``
  and safetensors), else a run ID under ``--root``. A run gives the weights of its newest
  checkpoint (or ``--step``), verified against the manifest, and its tokenizer and chat
  template (``data.tokenizer``, ``data.chat_template``, ``data.template_thinking``); a Hugging Face
  directory gives its own, and a Lockstep export the run's ``template_thinking`` (its marker).
- **Chat template.** A prompt given as messages (``{"prompt": [...]}`` or ``{"messages": [...]}``
  in a prompts file) is always rendered with the template and ``add_generation_prompt``. A text
  prompt is rendered as one user message with ``--chat``, sent as raw text with ``--no-chat``,
  and by default: rendered for runs whose ``objective.kind`` is not ``causal_lm`` (they were
  fine-tuned on chat data) and for their exports (``lockstep_export.json``'s ``chat_model``: an
  export of a pretraining run has the template too, but generates raw like its run); for other
  Hugging Face directories, rendered when their ``tokenizer_config.json`` has a ``chat_template``;
  raw otherwise.
- **Randomness.** Sample ``j`` of prompt ``i`` (its line number in the file; 0 for ``--prompt``)
  uses ``SampleKey(seed, "generate", 0, i, j)``: it does not depend on the other prompts, the
  batch or the order (models/generation/sampler.py). ``--temperature 0`` is greedy. Sampling goes
  through the same ``Generator`` and ``Decoder`` as GRPO's rollouts (training/rollout/generator.py).
- **Beam search.** ``--num-beams N`` (N > 1) searches N greedy beams per prompt instead of sampling
  (models/generation/beam.py; transformers' ``num_beams`` search, ``do_sample=False``): the temperature
  is 0 unless given (a positive ``--temperature``, ``--top-p`` or ``--top-k`` is refused), ``--samples
  J`` (at most N) writes the J best beams, sample ``j`` the ``j``-th best, and ``--batch`` (rows per
  forward) must hold N. ``--length-penalty`` (default 1.0) and ``--early-stopping`` (default false)
  are transformers' settings of the same names.
- **Stopping.** A sample ends at the tokenizer's EOS, or at the template's end-of-turn marker
  (a single token such as Qwen's ``<|im_end|>``; a marker of several tokens, as with the byte
  tokenizer, is cut on the host: the tokens after it are dropped).
- **Images.** A vision-language model (one whose forward reads a prompt's media, ``prompt_media``: qwen2_5_vl,
  qwen3_vl) is shown images by ``--image PATH`` (repeatable: the images of ``--prompt``, in order) or by a prompts
  file's ``"images": ["cat.png", ...]`` (paths relative to the file). Each ``<image>`` of the prompt (a user turn's,
  for messages) stands for the next image; a text prompt without one shows its images before its text. They are
  shown as the pipeline shows an ``image_prompt`` record's (data/vision/prompt_images.py): the vision tokens in
  the rendered text, each image decoded and cut into patches under the run's ``data.images``, or a Hugging Face
  directory's ``preprocessor_config.json`` (an export of a run writes the run's), its pad repeated once per merged
  patch. ``prompt`` in the output is the rendered text with one pad per image. A missing, corrupt or unreadable
  ``--image``, images for a text-only model, a directory without ``preprocessor_config.json`` or a prompt whose
  placeholders do not match its images is a usage error (exit 2) naming the file; a prompts file's bad image is a
  data error (exit 3) naming the file, its line and the image, as its other bad lines are. Missing files are
  found before the model is loaded.
- **Prompts.** A prompts file larger than 64 MiB (or endless, like ``/dev/zero``) is refused, and so
  is a prompt holding a lone surrogate (``"\\ud83d"``: valid JSON, but no text), naming the file
  and line, or ``--prompt``; both before the model is loaded.
- **``--out``.** Never a path inside a run directory (its ``ledger.jsonl``, ``meta.json``, ...: what
  replay and resume read), even through a link; an existing file only with ``--overwrite``. The
  samples are written into a sibling ``.<name>.generate-<pid>`` that replaces ``--out`` when all
  are written, so a failed run leaves the previous file whole (a device such as ``/dev/null`` is
  written directly).
- **Output.** One JSON line per sample (stdout, or ``--out``): ``prompt_index``,
  ``sample_index``, ``prompt`` (the text fed to the model), ``completion`` (decoded, without
  stop tokens and end-of-turn marker), ``token_ids``, ``logprobs`` (the model's untempered
  log-probs of the generated tokens), ``finish_reason`` (``stop`` | ``length``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from core.exceptions import ConfigError, DataError, LockstepError, UsageError
from core.objective_kinds import objective_kind
from data.chat_template import ChatTemplate
from data.tokenizers import build_tokenizer
from data.vision.images import ImageProcessing, processing_of
from data.vision.prompt_images import (
    PROCESSOR_CONFIG,
    PromptImages,
    ShownPrompt,
    read_processor_config,
    shown_messages,
    shown_text,
)
from models.generation.prompts import Prompt, context_length, read_prompts, sample_record
from models.generation.sampler import SamplingParams
from models.hf_config import model_config_from_hf
from training.cli.export_target import enclosing_run_dir, exported_chat_model, exported_template_thinking
from training.memory_estimate import check_model_fits_for_inference, trained_model_config
from training.rollout.generator import Decoder, Generator

PURPOSE = "generate"
_STAGING_TAG = ".generate-"


@dataclass
class Source:
    """What sampling needs from ``--from``."""

    model: torch.nn.Module
    tokenizer_spec: str
    chat_template: Optional[str]
    """A template file overriding the tokenizer's (a run's data.chat_template)."""
    chat_by_default: bool
    label: str
    template_clock: Optional[str] = None
    """What the template's strftime_now reads (a run's data.template_clock; none for a Hugging Face directory)."""
    template_thinking: Optional[bool] = None
    """The template's enable_thinking: a run's data.template_thinking, or what an export's marker recorded of it."""
    images: Optional[ImageProcessing] = None
    """How its images are cut into patches: a run's data.images, a directory's preprocessor_config.json (None: it has none)."""


def load_source(spec: str, *, root: str, step: Optional[int], device: torch.device) -> Source:
    """The model, tokenizer and template ``--from`` names (module docstring)."""
    path = Path(spec)
    if (path / "config.json").is_file() and not (path / "config.yaml").is_file():
        if step is not None:
            raise UsageError("--step applies to runs, not to a Hugging Face directory", hint="drop --step")
        from models.hf_weights import load_pretrained
        from training.cli.export import check_tokenizer_config

        check_tokenizer_config(str(path))  # a DataError naming the file, before anything reads it
        _check_fits(model_config_from_hf(path), device)
        model = load_pretrained(path, device=device)
        return Source(model, str(path), None, _directory_is_chat(path), str(path),
                      template_thinking=exported_template_thinking(path), images=read_processor_config(path))
    from core.run_context import load_recorded_config
    from training.cli.export import check_tokenizer_config
    from training.checkpoint.load import checkpoint_dir, load_checkpoint_model, resolve_run

    paths = resolve_run(spec, root)
    config = load_recorded_config(paths)  # verified against meta.json before anything in it is used
    check_tokenizer_config(config.data.tokenizer)
    checkpoint = checkpoint_dir(paths, step)
    _check_fits(trained_model_config(config), device)
    model = load_checkpoint_model(config, checkpoint).to(device)
    chat = objective_kind(config.objective.kind).capabilities.chat_model
    return Source(model, config.data.tokenizer, config.data.chat_template, chat,
                  str(checkpoint), config.data.template_clock, template_thinking=config.data.template_thinking,
                  images=processing_of(config.data.images))


def _directory_is_chat(path: Path) -> bool:
    """A Lockstep export is a chat model if its run was (its marker says); another directory if its
    tokenizer_config.json has a chat_template."""
    recorded = exported_chat_model(path)
    if recorded is not None:
        return recorded
    config_file = path / "tokenizer_config.json"
    return config_file.is_file() and bool(json.loads(config_file.read_text()).get("chat_template"))


def _check_fits(model, device: torch.device) -> None:
    """A model whose weights cannot fit is a ConfigError (exit 2) before any is read."""
    check_model_fits_for_inference(model, device, key="--from", what="the model")


def run_generate(args) -> int:
    """The ``generate`` subcommand (arguments: training/__main__.py)."""
    if (args.prompt is None) == (args.prompts is None):
        raise UsageError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
    if args.samples < 1:
        raise UsageError(f"--samples must be >= 1, got {args.samples}")
    if args.num_beams > 1 and args.samples > args.num_beams:
        raise UsageError(f"--samples {args.samples} asks for more than the --num-beams {args.num_beams} beams a "
                         "search keeps", hint="pass --samples at most --num-beams (sample j is the j-th best beam)")
    if args.num_beams > args.batch:
        raise UsageError(f"--num-beams {args.num_beams} needs as many rows per forward, but --batch is {args.batch}",
                         hint=f"pass --batch {args.num_beams} or more")
    if args.image and args.prompt is None:
        raise UsageError("--image shows images to --prompt; a prompts file lists each line's own",
                         hint='give the images in the file: {"prompt": "...", "images": ["cat.png"]}')
    if args.prompt is not None:
        check_prompt_argument(args.prompt)
    prompts = ([Prompt(index=0, text=args.prompt, images=tuple(args.image or ()))] if args.prompt is not None
               else read_prompts(args.prompts))
    for prompt in prompts:
        for path in prompt.images:
            if not path.is_file():
                raise _image_error(DataError("image file is missing" if not path.exists() else "not a file",
                                             file=str(path)), prompt, args.prompts)
    if args.out is not None:
        check_out(args.out, overwrite=args.overwrite)  # before minutes of loading and sampling
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    source = load_source(args.from_, root=args.root, step=args.step, device=device)
    model = source.model.eval()
    tokenizer = build_tokenizer(source.tokenizer_spec)
    template = ChatTemplate.for_tokenizer(source.tokenizer_spec, source.chat_template, clock=source.template_clock,
                                          thinking=source.template_thinking)
    chat = source.chat_by_default if args.chat is None else args.chat
    shown = _shown_prompts(prompts, source, tokenizer, template, chat, args.prompts)
    texts, ids = [s.text for s in shown], [s.ids for s in shown]
    media = None
    if any(s.media is not None for s in shown):  # the sampler takes tensors, as Batch.media holds them
        media = [None if s.media is None else {name: [torch.from_numpy(item) for item in items]
                                               for name, items in s.media.items()} for s in shown]
    decoder = Decoder(tokenizer, template)
    params = sampling_params(args, stop_token_ids=decoder.stop_ids)
    limit = model.config.max_position_embeddings
    generator = Generator.over(model, rows=args.batch, seed=args.seed,
                               max_len=context_length([len(i) for i in ids], args.max_new_tokens, limit=limit))
    samples = generator.generate(ids, [p.index for p in prompts], params, purpose=PURPOSE, samples=args.samples,
                                 media=media)
    by_index = {p.index: text for p, text in zip(prompts, texts)}
    lines = _record_lines(samples, decoder, by_index)
    try:
        if args.out is None:
            sys.stdout.writelines(line + "\n" for line in lines)
        else:
            write_out(args.out, lines, overwrite=args.overwrite)
    except OSError as exc:  # a full disk, a vanished directory: one line, not a traceback
        raise LockstepError(f"could not write the samples: {exc.strerror or exc}", file=str(args.out or "stdout"),
                            hint="free disk space or pass --out on another disk, then run generate again") from None
    return 0


def _record_lines(samples, decoder: Decoder, prompt_texts: dict[int, str]) -> Iterator[str]:
    """One JSON line per sample, decoded as it comes."""
    for prompt_index, sample_index, sample in samples:
        completion = decoder.completion(sample)
        record = {"prompt": prompt_texts[prompt_index],
                  **sample_record(prompt_index, sample_index, completion.sample, completion=completion.text)}
        yield json.dumps(record, ensure_ascii=False)


def check_prompt_argument(text: str) -> None:
    """``--prompt`` must be non-empty text: bytes that are not UTF-8 reach Python as lone surrogates."""
    if not text:
        raise DataError("--prompt is empty", hint="give the text to continue")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(f"--prompt holds a character that is not text (U+{ord(text[exc.start]):04X} at character "
                        f"{exc.start}: a byte that is not UTF-8, or a lone surrogate)",
                        hint="pass the prompt as UTF-8 text, or put it in a --prompts file") from None


def check_out(path: Path, *, overwrite: bool) -> None:
    """``--out`` must name a file whose directory exists, outside every run directory, and a new one
    unless ``overwrite`` (a UsageError before anything is loaded)."""
    if path.is_dir():
        raise UsageError(f"--out {path} is a directory", hint="pass a file path, e.g. samples.jsonl")
    if not path.parent.is_dir():
        raise UsageError(f"--out {path}: the directory {path.parent} does not exist",
                         hint="create it first or pass a path in an existing directory")
    run_dir = enclosing_run_dir(path.resolve())
    if run_dir is not None:
        raise UsageError(f"--out {path} is inside the run directory {run_dir}; generate never writes into a run "
                         "(its ledger, config and checkpoints are what resume and replay read)",
                         hint="pass a path outside run directories, e.g. samples.jsonl")
    if path.is_file() and not overwrite:
        raise UsageError(f"--out {path} exists", hint="pass --overwrite to replace it, or pick a new file")


def write_out(path: Path, lines: Iterator[str], *, overwrite: bool) -> None:
    """Write ``lines`` to ``path``: a regular file through a sibling that replaces it at the end (its
    previous content stays whole until then), anything else (a device, a pipe) directly."""
    if path.exists() and not path.is_file():
        with open(path, "w", encoding="utf-8") as out:
            out.writelines(line + "\n" for line in lines)
        return
    target = path.resolve()  # a link is replaced at what it points to, as open() would write
    staging = target.parent / f".{target.name}{_STAGING_TAG}{os.getpid()}"
    try:
        with open(staging, "w", encoding="utf-8") as out:
            out.writelines(line + "\n" for line in lines)
            out.flush()
            os.fsync(out.fileno())
        if overwrite:
            os.replace(staging, target)
        else:  # no-clobber: a file that appeared while this one sampled is kept
            os.link(staging, target)
            staging.unlink()
    except FileExistsError:
        raise UsageError(f"--out {path} appeared while generate ran; it was kept, and the samples are in {staging}",
                         hint="move them where you want them, or run again with --overwrite") from None
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def _prompt_text(prompt: Prompt, template: ChatTemplate, chat: bool) -> str:
    """The text fed to the model; a prompt with images has them written as their vision tokens."""
    shown = len(prompt.images)
    if prompt.messages is not None:
        messages = shown_messages(prompt.messages, shown) if shown else list(prompt.messages)
        return template.render(messages, add_generation_prompt=True)
    text = shown_text(prompt.text, shown) if shown else prompt.text
    if chat:
        return template.render([{"role": "user", "content": text}], add_generation_prompt=True)
    return text


def _shown_prompts(prompts: list[Prompt], source: Source, tokenizer, template: ChatTemplate, chat: bool,
                   prompts_file: Optional[Path]) -> list[ShownPrompt]:
    """Each prompt rendered and tokenized; one with images shown as the pipeline shows them (module docstring)."""
    vision = _prompt_images(prompts, source, tokenizer)
    shown = []
    for prompt in prompts:
        if not prompt.images:
            text = _prompt_text(prompt, template, chat)
            shown.append(ShownPrompt(text, list(tokenizer.encode_array(text)), None))
            continue
        try:
            images = vision.load(prompt.images)
            shown.append(vision.prompt(_prompt_text(prompt, template, chat), images))
        except DataError as exc:
            raise _image_error(exc, prompt, prompts_file) from None
    return shown


def _prompt_images(prompts: list[Prompt], source: Source, tokenizer) -> Optional[PromptImages]:
    """What shows the prompts' images (None: no prompt has any); a UsageError naming the first image where
    the model reads no images or the source does not say how to cut them."""
    first = next((path for p in prompts for path in p.images), None)
    if first is None:
        return None
    if not callable(getattr(source.model, "prompt_media", None)):  # what the sampler asks of a model too
        raise UsageError(f"--from {source.label} is a text-only model ({type(source.model).__name__} reads no "
                         f"images), but the prompts show {first}", file=str(first),
                         hint="drop the images, or generate from a vision-language run or export")
    if source.images is None:
        raise UsageError(f"--from {source.label} has no {PROCESSOR_CONFIG}: how its images are cut into patches is "
                         f"not known, so {first} cannot be shown", file=str(first),
                         hint=f"write {PROCESSOR_CONFIG} (transformers' Qwen2-VL image processor's fields) there, "
                              "or generate from the run")
    return PromptImages(tokenizer, source.images)


def _image_error(exc: DataError, prompt: Prompt, prompts_file: Optional[Path]) -> LockstepError:
    """A prompt's image error: a UsageError naming ``--image``'s file, or a DataError naming the prompts
    file's line and the image."""
    image = exc.context.get("file")
    if prompts_file is None:
        where = f"--image {image}: " if image else "--prompt with --image: "
        return UsageError(where + exc.message, file=image, hint=exc.hint)
    about = f" ({image})" if image else ""
    return DataError(f"{prompts_file.name} line {prompt.index + 1}: {exc.message}{about}", file=str(prompts_file),
                     record=prompt.index + 1, hint=exc.hint)


def add_arguments(p) -> None:
    p.add_argument("--from", dest="from_", required=True, help="run ID (under --root), run directory or HF directory")
    p.add_argument("--root", default="runs", help="where run directories live (default: runs)")
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint step (default: the newest)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="one text prompt (prompt index 0)")
    src.add_argument("--prompts", type=Path, default=None, help="JSONL file, one prompt per line")
    p.add_argument("--image", type=Path, action="append", default=None,
                   help="an image --prompt shows (repeatable, in the order of its <image> placeholders)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: 1, or 0 with --num-beams)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-beams", type=int, default=1,
                   help="beam search with this many greedy beams per prompt (default 1: sample)")
    p.add_argument("--length-penalty", type=float, default=1.0,
                   help="beam search: a finished beam's score is its log-prob / length ** this (default 1.0)")
    p.add_argument("--early-stopping", choices=tuple(_EARLY_STOPPING), default="false",
                   help="beam search: stop a prompt's search as transformers' early_stopping does (default false)")
    p.add_argument("--batch", type=int, default=8, help="rows per forward (a sample's bits depend on it)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="render text prompts with the chat template")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="send text prompts as they are")
    p.add_argument("--out", type=Path, default=None,
                   help="output JSONL (default: stdout); never inside a run directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")


_EARLY_STOPPING = {"false": False, "true": True, "never": "never"}


def sampling_params(args, *, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    """The command line's SamplingParams: the temperature defaults to 1, or to 0 with ``--num-beams`` > 1."""
    temperature = args.temperature
    if temperature is None:
        temperature = 0.0 if args.num_beams > 1 else 1.0
    return SamplingParams(temperature=temperature, top_p=args.top_p, top_k=args.top_k,
                          max_new_tokens=args.max_new_tokens, stop_token_ids=stop_token_ids,
                          num_beams=args.num_beams, length_penalty=args.length_penalty,
                          early_stopping=_EARLY_STOPPING[args.early_stopping])


def check_sampling(args) -> None:
    """Sampling settings are checked by SamplingParams: its ConfigError, as a UsageError naming the flag."""
    try:
        sampling_params(args)
    except ConfigError as exc:
        key = exc.context.get("key", "")
        flag = "--" + key.removeprefix("sampling.").replace("_", "-") if key.startswith("sampling.") else None
        message = f"{flag}: {exc.message}" if flag else exc.message
        raise UsageError(message, hint=exc.hint or "see python -m training generate --help") from None
