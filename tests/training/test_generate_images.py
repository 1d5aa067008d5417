"""``python -m training generate`` with images (training/cli/generate.py, data/vision/prompt_images.py) on a
tiny Qwen2.5-VL Hugging Face directory as ``python -m training export`` writes one: the byte tokenizer with
the vision tokens, the ChatML template and ``preprocessor_config.json``.

The command line's greedy answer equals the in-process sampler's over the ids and media the pipeline's
``image_prompt`` encoder makes of the same prompt and photograph; ``--image`` and a prompts file's
``images`` give the same sample; bad images, images for a text-only model and a directory that does not
say how to cut them are one line with their exit code, naming the file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import models
from core import seeding
from core.config import ModelConfig
from core.config_schema import model_config_class
from data.chat_template import CHATML_TEMPLATE
from data.fields import TARGET_MASK
from data.kinds.image_chat import GRIDS, PIXELS
from data.tokenizers import ByteTokenizer
from data.vision.chat_data import TOKEN_IDS, tokenizer_json
from data.vision.images import ImageProcessing
from data.vision.prompt_images import PROCESSOR_CONFIG, read_processor_config, write_processor_config
from models.generation.prompts import context_length
from models.generation.sampler import SampleKey, Sampler, SamplingParams
from models.hf_weights import load_pretrained, save_pretrained
from models.qwen_vl.family import QwenVLSettings
from tests.data.image_cases import SMALL, encoder_of, write_images_root
from training.__main__ import main

PROCESSING = ImageProcessing(min_pixels=SMALL.min_pixels, max_pixels=SMALL.max_pixels)
"""How the tiny export cuts its images: 1 to 4 image tokens a photograph, as the image record tests."""
QUESTION = "What is in the picture? <image>"


def _write_tokenizer(path) -> None:
    (path / "tokenizer.json").write_text(tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|pad|>",
                                                            "chat_template": CHATML_TEMPLATE}))


@pytest.fixture(scope="module")
def images_root(tmp_path_factory):
    """The photographs and the tokenizer with the vision tokens, as ``python -m data prepare`` writes them."""
    return write_images_root(tmp_path_factory.mktemp("images"), chat=False)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL export reading the tokenizer's vision tokens."""
    path = tmp_path_factory.mktemp("tiny-vl")
    settings = QwenVLSettings(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, window_size=56,
                              fullatt_block_indexes=(1,), mrope_section=(2, 3, 3), **TOKEN_IDS)
    config = model_config_class()(arch="qwen2_5_vl", vocab_size=320, hidden_size=64, intermediate_size=96,
                                  num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=512,
                                  qwen2_5_vl=settings)
    save_pretrained(models.build(config, generator=seeding.generator(4, "model_init")), path)
    _write_tokenizer(path)
    write_processor_config(path, PROCESSING)
    return path


def generate(model_dir, tmp_path, *args) -> tuple[int, list[dict]]:
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}.jsonl"
    code = main(["generate", "--from", str(model_dir), "--device", "cpu", "--out", str(out), *args])
    return code, [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []


def test_the_answer_is_the_in_process_samplers_over_the_pipelines_encoding(vl_dir, images_root, tmp_path):
    photo = images_root / "photographs" / "chelsea.png"
    code, [record] = generate(vl_dir, tmp_path, "--prompt", QUESTION, "--image", str(photo), "--temperature", "0",
                              "--max-new-tokens", "6")
    assert code == 0
    # the pipeline's image_prompt encoder over the same prompt and photograph: prompt ids, then the answer's
    encoder = encoder_of(images_root, "image_prompt")
    as_record = {"prompt": QUESTION, "answer": "x", "images": ["photographs/chelsea.png"]}
    encoded = encoder.document(as_record, str(images_root / "records.jsonl"))
    prompt_ids = [int(i) for i in encoded.ids[~encoded.fields[TARGET_MASK.name]]]
    assert prompt_ids.count(TOKEN_IDS["image_token_id"]) >= 1
    media = {name: [torch.from_numpy(np.asarray(item)) for item in encoded.fields[name]] for name in (PIXELS.name,
                                                                                                        GRIDS.name)}
    model = load_pretrained(vl_dir).eval()
    sampler = Sampler(model, max_batch=8, max_len=context_length([len(prompt_ids)], 6, limit=512))
    params = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=tuple(record_stop_ids(vl_dir)))
    [sample] = sampler.generate([prompt_ids], [SampleKey(0, "generate", 0, 0)], params, media=[media])
    assert record["token_ids"] == sample.tokens and record["logprobs"] == sample.logprobs
    assert record["prompt"].count("<|image_pad|>") == 1 and "<image>" not in record["prompt"]
    # a prompts file's images (relative to the file) give the same sample; another photograph another one
    prompts = images_root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": QUESTION, "images": ["photographs/chelsea.png"]}) + "\n"
                       + json.dumps({"prompt": "And this?", "images": ["photographs/coffee.png"]}) + "\n")
    code, (same, other) = generate(vl_dir, tmp_path, "--prompts", str(prompts), "--temperature", "0",
                                   "--max-new-tokens", "6")
    assert code == 0 and same["token_ids"] == record["token_ids"] and same["logprobs"] == record["logprobs"]
    assert other["prompt"].startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>And this?")


def record_stop_ids(model_dir) -> list[int]:
    """The stop ids generate uses for the directory's tokenizer and template (its Decoder's)."""
    from data.chat_template import ChatTemplate
    from data.tokenizers import build_tokenizer
    from training.rollout.generator import Decoder

    return list(Decoder(build_tokenizer(str(model_dir)), ChatTemplate.for_tokenizer(str(model_dir))).stop_ids)


def test_the_processor_config_round_trips_and_reads_transformers_spelling(tmp_path):
    write_processor_config(tmp_path, PROCESSING)
    assert read_processor_config(tmp_path) == PROCESSING
    (tmp_path / PROCESSOR_CONFIG).write_text(json.dumps({"size": {"shortest_edge": 65536, "longest_edge": 16777216},
                                                         "patch_size": 16, "image_mean": [0.5, 0.5, 0.5],
                                                         "image_std": [0.5, 0.5, 0.5]}))
    read = read_processor_config(tmp_path)
    assert (read.min_pixels, read.max_pixels, read.patch_size, read.image_mean) == (65536, 16777216, 16,
                                                                                     (0.5, 0.5, 0.5))
    assert read_processor_config(tmp_path / "absent") is None


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-text")
    config = ModelConfig(arch="qwen3", vocab_size=320, hidden_size=32, intermediate_size=48, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16, attention="sdpa", max_position_embeddings=96)
    save_pretrained(models.build(config, generator=seeding.generator(3, "model_init")), path)
    (path / "tokenizer.json").write_text(ByteTokenizer().hf_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}))
    return path


def _bad_inputs(root, tmp_path):
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    photo = str(root / "photographs" / "chelsea.png")
    prompts = tmp_path / "bad-prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n" + json.dumps({"prompt": "<image>", "images": ["gone.png"]}))
    return [
        (("--prompt", "Hi", "--image", str(tmp_path / "gone.png")), 2, ["--image", "gone.png", "missing"]),
        (("--prompt", "Hi", "--image", str(tmp_path / "corrupt.png")), 2, ["--image", "corrupt.png", "corrupt"]),
        (("--prompt", "<image> and <image>", "--image", photo), 2, ["2 <image> placeholders for 1 images"]),
        (("--prompts", str(prompts), "--image", photo), 2, ["--image shows images to --prompt"]),
        (("--prompts", str(prompts)), 3, ["bad-prompts.jsonl line 2", "gone.png", "missing"]),
    ]


def test_bad_images_are_one_line_naming_the_file(vl_dir, images_root, tmp_path, capsys):
    for args, exit_code, words in _bad_inputs(images_root, tmp_path):
        code = main(["generate", "--from", str(vl_dir), "--device", "cpu", "--max-new-tokens", "2", *args])
        err = capsys.readouterr().err.strip()
        assert code == exit_code and len(err.splitlines()) == 1, (args, err)
        assert all(word in err for word in words), (args, err)


def test_images_for_a_text_model_or_an_unknown_processor_are_usage_errors(text_dir, vl_dir, images_root, tmp_path,
                                                                          capsys):
    photo = str(images_root / "photographs" / "chelsea.png")
    code = main(["generate", "--from", str(text_dir), "--device", "cpu", "--prompt", "Hi", "--image", photo])
    err = capsys.readouterr().err
    assert code == 2 and "text-only model" in err and "chelsea.png" in err
    bare = tmp_path / "no-processor"
    bare.mkdir()
    for item in vl_dir.iterdir():
        if item.name != PROCESSOR_CONFIG:
            (bare / item.name).write_bytes(item.read_bytes())
    code = main(["generate", "--from", str(bare), "--device", "cpu", "--prompt", "Hi", "--image", photo])
    err = capsys.readouterr().err
    assert code == 2 and PROCESSOR_CONFIG in err and "chelsea.png" in err
