"""Image prompts through the sampler (models/generation/sampler.py) on model.arch qwen2_5_vl (models/qwen_vl/model.py).

A tiny random Qwen2.5-VL in fp32, prompts whose tokens show images (``Sampler.generate(media=...)``),
prefilled in chunks of 8 so that an image's placeholders straddle chunks: each greedy token is the
argmax of the trainer's full forward over prompt + generated tokens at its position, and each
log-prob the trainer's (fp32 tolerance: the sampler's tower runs over each image alone, the trainer's
over its batch's). Rows with and without images share a prefill group; a prompt shows two images of
different sizes; more prompts than rows go through refill, whose row copies carry the rows'
position offsets. A text prompt, and an image prompt, give bitwise their sample alone, beside
other image prompts; a prompt that ends on a placeholder and media for a text-only family are refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.config_schema import model_config_class
from core.exceptions import ConfigError, DataError
from models.forward import ModelInputs, model_forward
from models.generation.sampler import SampleKey, Sampler, SamplingParams
from models.qwen_vl.family import QwenVLSettings
from models.qwen_vl.model import empty_model
from tests.models.sampler_model import build_sampler_model
from tests.models.vl_cases import END, IMAGE, PATCH_VALUES, START, VIDEO

SETTINGS = QwenVLSettings(depth=2, hidden_size=32, num_heads=4, intermediate_size=48, patch_size=14,
                          temporal_patch_size=2, spatial_merge_size=2, window_size=56, fullatt_block_indexes=(1,),
                          image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                          vision_end_token_id=END, mrope_section=(2, 1, 1))
GREEDY = SamplingParams(temperature=0, max_new_tokens=10)


@pytest.fixture(scope="module")
def model():
    config = model_config_class()(arch="qwen2_5_vl", vocab_size=99, hidden_size=32, intermediate_size=37,
                                  num_layers=2, num_heads=4, num_kv_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5,
                                  tie_embeddings=False, max_position_embeddings=512, qwen2_5_vl=SETTINGS)
    built = empty_model(config)
    built.init_weights(torch.Generator().manual_seed(1))
    with torch.no_grad():  # logit 0 for the placeholders: a random model would otherwise emit them
        built.lm_head.weight[[IMAGE, VIDEO]] = 0.0
    return built.eval()


def _image(grid, seed):
    """One image's media items: (t * h * w, patch values) patches and its (t, h, w) grid."""
    t, h, w = grid
    patches = torch.randn(t * h * w, PATCH_VALUES, generator=torch.Generator().manual_seed(seed))
    return patches, torch.tensor(grid)


def _prompt(text_before, grids, text_after, seed):
    """Ids (each image's run of placeholders between vision start and end) and the prompt's media."""
    ids, images = list(text_before), [_image(grid, seed + i) for i, grid in enumerate(grids)]
    for t, h, w in grids:
        ids += [START] + [IMAGE] * (t * h * w // 4) + [END]
    return ids + list(text_after), {"pixel_values": [p for p, _ in images], "image_grid_thw": [g for _, g in images]}


def _trainer_check(model, prompt, media, sample):
    """Each sampled token is the trainer forward's argmax, and its log-prob the trainer's, at its position."""
    ids = torch.tensor([prompt + sample.tokens])
    batch_media = None if media is None else {name: [items] for name, items in media.items()}
    logits = model_forward(model, ModelInputs(ids, None, media=batch_media)).logits[0]  # (T, vocab)
    at = logits[len(prompt) - 1: len(prompt) - 1 + len(sample.tokens)]
    assert at.argmax(-1).tolist() == sample.tokens
    trainer = F.log_softmax(at.float(), -1).gather(1, torch.tensor(sample.tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(sample.logprobs), trainer, rtol=0, atol=2e-5)


def _prompts():
    return [
        _prompt([10, 11], [(1, 4, 4)], [12, 13, 14], seed=0),  # 4 placeholders across chunks 0 and 1
        ([20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], None),  # text only, in the same prefill group
        _prompt([15], [(1, 4, 6), (1, 2, 2)], [16, 17], seed=5),  # two images of different sizes
        _prompt([], [(1, 6, 4)], [18], seed=9),
    ]


@pytest.mark.parametrize("max_batch", [4, 2])  # 2: the last prompts refill rows the first ones held
def test_greedy_image_prompts_follow_the_trainer_forward(model, max_batch):
    prompts = _prompts()
    sampler = Sampler(model, max_batch=max_batch, max_len=48, prefill_chunk=8)
    keys = [SampleKey(0, "test", 0, i) for i in range(len(prompts))]
    samples = sampler.generate([p for p, _ in prompts], keys, GREEDY, media=[m for _, m in prompts])
    for (prompt, media), sample in zip(prompts, samples):
        assert len(sample.tokens) == GREEDY.max_new_tokens
        _trainer_check(model, prompt, media, sample)


def test_qwen3_vl_image_prompts_follow_the_trainer_forward():
    """The subclass family: interleaved M-RoPE and DeepStack's features added after the first blocks at
    the image tokens of a prefill chunk, as the trainer adds them."""
    from models.qwen3_vl.family import Qwen3VLSettings
    from models.qwen3_vl.model import empty_model as qwen3_vl_model

    settings = Qwen3VLSettings(depth=3, hidden_size=32, num_heads=4, intermediate_size=48, patch_size=14,
                               temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
                               deepstack_visual_indexes=(0, 2), image_token_id=IMAGE, video_token_id=VIDEO,
                               vision_start_token_id=START, vision_end_token_id=END, mrope_section=(4, 2, 2))
    config = model_config_class()(arch="qwen3_vl", vocab_size=99, hidden_size=32, intermediate_size=37, num_layers=3,
                                  num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                                  tie_embeddings=False, max_position_embeddings=512, qwen3_vl=settings)
    model = qwen3_vl_model(config)
    model.init_weights(torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.lm_head.weight[[IMAGE, VIDEO]] = 0.0
    model.eval()
    prompts = _prompts()
    sampler = Sampler(model, max_batch=4, max_len=48, prefill_chunk=8)
    keys = [SampleKey(0, "test", 0, i) for i in range(len(prompts))]
    samples = sampler.generate([p for p, _ in prompts], keys, GREEDY, media=[m for _, m in prompts])
    for (prompt, media), sample in zip(prompts, samples):
        _trainer_check(model, prompt, media, sample)


def test_sampled_log_probs_are_the_trainer_forwards(model):
    prompts = _prompts()
    sampler = Sampler(model, max_batch=4, max_len=48, prefill_chunk=8)
    keys = [SampleKey(3, "test", 1, i) for i in range(len(prompts))]
    params = SamplingParams(temperature=1.0, top_k=8, max_new_tokens=8)  # top_k: never a placeholder
    samples = sampler.generate([p for p, _ in prompts], keys, params, media=[m for _, m in prompts])
    for (prompt, media), sample in zip(prompts, samples):
        ids = torch.tensor([prompt + sample.tokens])
        batch_media = None if media is None else {name: [items] for name, items in media.items()}
        logits = model_forward(model, ModelInputs(ids, None, media=batch_media)).logits[0]
        at = logits[len(prompt) - 1: len(prompt) - 1 + len(sample.tokens)]
        trainer = F.log_softmax(at.float(), -1).gather(1, torch.tensor(sample.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(sample.logprobs), trainer, rtol=0, atol=2e-5)


def test_beam_search_over_image_prompts_scores_by_the_trainer_forward(model):
    """Each beam's cache row is copied from its parent's with its position offset: the best beam's
    log-probs are the trainer's."""
    prompts = _prompts()
    sampler = Sampler(model, max_batch=4, max_len=48, prefill_chunk=8)
    keys = [SampleKey(0, "test", 0, i) for i in range(len(prompts))]
    params = SamplingParams(temperature=0, num_beams=2, max_new_tokens=6)
    samples = sampler.generate([p for p, _ in prompts], keys, params, media=[m for _, m in prompts])
    for (prompt, media), sample in zip(prompts, samples):
        ids = torch.tensor([prompt + sample.tokens])
        batch_media = None if media is None else {name: [items] for name, items in media.items()}
        logits = model_forward(model, ModelInputs(ids, None, media=batch_media)).logits[0]
        at = logits[len(prompt) - 1: len(prompt) - 1 + len(sample.tokens)]
        trainer = F.log_softmax(at.float(), -1).gather(1, torch.tensor(sample.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(sample.logprobs), trainer, rtol=0, atol=2e-5)


def test_a_text_prompt_samples_the_same_beside_image_prompts(model):
    prompts = _prompts()
    sampler = Sampler(model, max_batch=4, max_len=48, prefill_chunk=8)
    keys = [SampleKey(0, "test", 0, i) for i in range(len(prompts))]
    mixed = sampler.generate([p for p, _ in prompts], keys, GREEDY, media=[m for _, m in prompts])
    alone = sampler.generate([prompts[1][0]], keys[1:2], GREEDY)
    assert mixed[1] == alone[0]


def test_an_image_prompt_samples_the_same_alone_as_beside_other_images(model):
    """The tower reads each image on its own (models/qwen_vl/model.py ``_each_image_alone``): over a
    group's every image at once its matmuls rounded by the group's patch count, so a prompt's
    log-probs changed with the photographs of the prompts beside it (its windows' attention batched
    with another image's windows of the same length)."""
    prompts = [_prompt([19], [(1, 2, 4)], [16], seed=13), _prompt([15], [(1, 2, 4)], [17], seed=14),
               *_prompts()[2:]]  # two images of one size: the old tower call batched their windows
    sampler = Sampler(model, max_batch=4, max_len=48, prefill_chunk=8)
    keys = [SampleKey(0, "test", 0, i) for i in range(len(prompts))]
    mixed = sampler.generate([p for p, _ in prompts], keys, GREEDY, media=[m for _, m in prompts])
    for i in range(len(prompts)):
        alone = sampler.generate([prompts[i][0]], keys[i:i + 1], GREEDY, media=[prompts[i][1]])
        assert mixed[i] == alone[0], i


def test_an_image_changes_the_sample(model):
    prompt, media = _prompts()[0]
    sampler = Sampler(model, max_batch=4, max_len=48, prefill_chunk=8)
    other = {"pixel_values": [-media["pixel_values"][0]], "image_grid_thw": media["image_grid_thw"]}
    key = [SampleKey(0, "test", 0, 0)]
    params = SamplingParams(temperature=0, max_new_tokens=4)
    first, second = (sampler.generate([prompt], key, params, media=[m])[0] for m in (media, other))
    assert first.logprobs != second.logprobs


def test_the_placeholders_are_never_sampled_and_keep_their_share_of_the_log_probs(model):
    """A model that favours the image and video placeholders over every other token: the sampler draws
    neither (GenerationSpec.never_sampled), greedy or sampled, and reports the trainer's log-probs."""
    import copy

    favouring = copy.deepcopy(model)
    with torch.no_grad():
        favouring.lm_head.weight[[IMAGE, VIDEO]] = 5.0 * favouring.lm_head.weight.abs().max(dim=0).values
    prompts = _prompts()
    sampler = Sampler(favouring, max_batch=4, max_len=48, prefill_chunk=8)
    keys = [SampleKey(0, "test", 0, i) for i in range(len(prompts))]
    for params in (GREEDY, SamplingParams(temperature=1.0, max_new_tokens=10)):
        samples = sampler.generate([p for p, _ in prompts], keys, params, media=[m for _, m in prompts])
        for (prompt, media), sample in zip(prompts, samples):
            assert not {IMAGE, VIDEO} & set(sample.tokens)
            ids = torch.tensor([prompt + sample.tokens])
            batch_media = None if media is None else {name: [items] for name, items in media.items()}
            logits = model_forward(favouring, ModelInputs(ids, None, media=batch_media)).logits[0]
            at = logits[len(prompt) - 1: len(prompt) - 1 + len(sample.tokens)]
            assert at.argmax(-1).tolist() != sample.tokens  # the model's own choice would be a placeholder
            trainer = F.log_softmax(at.float(), -1).gather(1, torch.tensor(sample.tokens)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(sample.logprobs), trainer, rtol=0, atol=2e-5)


def test_a_prompt_ending_on_a_placeholder_is_refused(model):
    prompt, media = _prompt([10], [(1, 4, 4)], [], seed=0)
    sampler = Sampler(model, max_batch=2, max_len=48, prefill_chunk=8)
    with pytest.raises(DataError, match="ends on an image placeholder"):
        sampler.generate([prompt[:-1]], [SampleKey(0, "test", 0, 0)], GREEDY, media=[media])


def test_media_for_a_text_family_are_refused():
    sampler = Sampler(build_sampler_model(), max_batch=2, max_len=16, prefill_chunk=8)
    with pytest.raises(ConfigError, match="reads text prompts only"):
        sampler.generate([[1, 2]], [SampleKey(0, "test", 0, 0)], GREEDY, media=[{"pixel_values": []}])


def test_log_probs_are_the_trainers_bit_for_bit_under_batch_invariant(model):
    """Under determinism.batch_invariant the sampler's log-probs are the trainer's exactly: the trainer's
    forward over every prompt and completion in one batch (as GRPO's update reads them), and over each
    alone (its final norm and head under the kernels too)."""
    from models.numerics import Numerics

    exact = Numerics(batch_invariant=True)
    model.use_numerics(exact)
    try:
        prompts = _prompts()
        sampler = Sampler(model, max_batch=4, max_len=48, prefill_chunk=8)
        keys = [SampleKey(3, "test", 1, i) for i in range(len(prompts))]
        params = SamplingParams(temperature=1.0, top_k=8, max_new_tokens=8)
        samples = sampler.generate([p for p, _ in prompts], keys, params, media=[m for _, m in prompts])
        rows = [prompt + sample.tokens for (prompt, _), sample in zip(prompts, samples)]
        ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
        media = {name: [[] if m is None else m[name] for _, m in prompts] for name in ("pixel_values", "image_grid_thw")}
        logits = model_forward(model, ModelInputs(ids, None, media=media)).logits
        for i, ((prompt, _), sample) in enumerate(zip(prompts, samples)):
            at = logits[i, len(prompt) - 1: len(prompt) - 1 + len(sample.tokens)]
            trainer = exact.token_logprobs()(at.float(), torch.tensor(sample.tokens))
            assert sample.logprobs == trainer.tolist()
            alone = {name: [items[i]] for name, items in media.items()}
            logits_alone = model_forward(model, ModelInputs(torch.tensor([rows[i]]), None, media=alone)).logits[0]
            at = logits_alone[len(prompt) - 1: len(prompt) - 1 + len(sample.tokens)]
            assert sample.logprobs == exact.token_logprobs()(at.float(), torch.tensor(sample.tokens)).tolist()
    finally:
        model.use_numerics(Numerics.for_model(model.config))
