"""LoRA adapters (models/lora.py) and the NF4 base (models/nf4.py): keyed init, frozen base,
merge and PEFT equivalence, typed errors, and the adapters under DDP, FSDP2 and TP."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import models
import models.qwen.model
from core import config as config_lib
from core.config import LoRAConfig, ModelConfig
from core.exceptions import ConfigError
from distributed.activation_checkpoint import apply_activation_checkpointing
from models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_state_dict,
    adapters_disabled,
    apply_lora,
    base_identity,
    load_peft_adapter,
    lora_modules,
    merge_lora,
    save_peft_adapter,
    set_dropout_key,
    store_base_as,
)
from models.qwen.lora_targets import LORA_TARGETS
from tests.distributed.dist_harness import run_on_ranks
from tests.models.conftest import VOCAB

TOLERANCE = 1e-5
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LORA = LoRAConfig(rank=4, alpha=8.0)
# Every NF4 weight needs a multiple of 64 x 256 elements: 128 x 128 projections, kv = q width.
NF4_SHAPE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=4)
# Under FSDP2 each NF4 weight is sharded by its 16384-weight blocks: at least 2 per weight.
NF4_FSDP_SHAPE = {**NF4_SHAPE, "hidden_size": 256, "intermediate_size": 512}


def _config(arch: str = "qwen3", **overrides) -> ModelConfig:
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)
    return ModelConfig(arch=arch, init_std=0.1, **{**shape, **overrides})


def _model(arch: str = "qwen3", seed: int = 0, **overrides) -> torch.nn.Module:
    return models.build(_config(arch, **overrides), generator=torch.Generator().manual_seed(seed))


def _batch(step: int = 0, rows: int = 4, seq: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (rows, seq + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(inputs).float().flatten(0, 1), labels.flatten())


def _train(model: torch.nn.Module, steps: int = 3) -> None:
    """A few AdamW steps (with weight decay, which would move any parameter that got a gradient)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        _loss(model, *_batch(step)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def _randomize_b(model: torch.nn.Module, seed: int = 5) -> None:
    """Non-zero B matrices, so the adapters change the logits (B starts at zero)."""
    generator = torch.Generator().manual_seed(seed)
    for module in lora_modules(model):
        module.lora_B.weight.copy_(0.1 * torch.randn(module.lora_B.weight.shape, generator=generator))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# --------------------------------------------------------------------------- keyed init


def test_adapter_init_is_keyed_by_seed_and_name_only():
    at_once = _model()
    apply_lora(at_once, LORA, seed=3)
    # Another base, another construction order: two calls, the second one's targets reversed,
    # with unrelated draws from the global RNG in between.
    piecewise = _model(seed=9)
    apply_lora(piecewise, dataclasses.replace(LORA, targets=("v_proj", "down_proj")), seed=3)
    torch.rand(100)
    rest = tuple(reversed([t for t in LORA.targets if t not in ("v_proj", "down_proj")]))
    apply_lora(piecewise, dataclasses.replace(LORA, targets=rest), seed=3)
    other_seed = _model()
    apply_lora(other_seed, LORA, seed=4)

    first, second, third = (adapter_state_dict(m) for m in (at_once, piecewise, other_seed))
    assert len(first) == 2 * 7 * 2 and first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    a_keys = [k for k in first if ".lora_A." in k]
    assert not any(torch.equal(first[k], third[k]) for k in a_keys)  # the seed matters
    assert len({first[k].sum().item() for k in a_keys}) == len(a_keys)  # and so does the name
    assert all(not first[k].any() for k in first if ".lora_B." in k)
    bound = 1 / 64**0.5  # uniform in +-1/sqrt(in_features), as PEFT's kaiming init
    assert all(first[k].abs().max() <= bound for k in a_keys if "down_proj" not in k)


def test_step_zero_computes_the_base_model():
    model = _model()
    inputs, _ = _batch()
    with torch.no_grad():
        before = model(inputs)
        apply_lora(model, LORA, seed=0)
        after = model(inputs)
    assert torch.equal(before, after)


def test_a_bf16_stored_base_changes_no_bit_under_bf16_autocast():
    """models.lora.store_base_as: what the loop does under parallel.precision=bf16."""
    fp32_base = _model()
    apply_lora(fp32_base, LORA, seed=0)
    _randomize_b(fp32_base)
    bf16_base = copy.deepcopy(fp32_base)
    store_base_as(bf16_base, torch.bfloat16)
    assert all(m.base_layer.weight.dtype == torch.bfloat16 for m in lora_modules(bf16_base))
    assert bf16_base.norm.weight.dtype == torch.float32  # only what a matmul alone reads
    inputs, labels = _batch()
    losses, grads = [], []
    for model in (fp32_base, bf16_base):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, inputs, labels)
        loss.backward()
        losses.append(loss)
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert torch.equal(losses[0], losses[1])
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
    with pytest.raises(ValueError, match="trainable"):
        model = _model()
        apply_lora(model, LORA, seed=0)
        lora_modules(model)[0].base_layer.weight.requires_grad_(True)
        store_base_as(model, torch.bfloat16)


def test_only_adapters_and_named_extra_modules_train():
    model = _model()
    identity = base_identity(model)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = apply_lora(model, dataclasses.replace(LORA, modules_to_save=("norm",)), seed=0)
    assert trainable[-1] == "norm.weight" and all(".lora_" in n for n in trainable[:-1])
    assert base_identity(model) == identity  # wrapping moves no base weight
    adapters_before = {k: v.clone() for k, v in adapter_state_dict(model).items()}
    _train(model)
    assert base_identity(model) != identity  # the final norm trained: it is part of the base
    after = {n.replace(".base_layer", ""): p for n, p in model.named_parameters()}
    changed = sorted(n for n, p in base_before.items() if not torch.equal(p, after[n]))
    assert changed == ["norm.weight"]
    adapters_after = adapter_state_dict(model)
    assert all(not torch.equal(adapters_before[k], adapters_after[k]) for k in adapters_before)


def test_base_identity_of_a_directory_equals_that_of_its_model(qwen2_hf):
    _, directory = qwen2_hf
    model = models.load_pretrained(directory)
    apply_lora(model, LORA, seed=0)
    assert base_identity(directory) == base_identity(model)
    assert base_identity(directory) != base_identity(_model("qwen2"))


# --------------------------------------------------------------------------- merge and PEFT


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_merged_model_matches_the_adapters(arch):
    model = _model(arch)
    apply_lora(model, LORA, seed=0)
    _train(model, steps=2)
    inputs, _ = _batch(7)
    with torch.no_grad():
        unmerged = model(inputs)
        merged_model = merge_lora(model)
        merged = merged_model(inputs)
        base = _model(arch)(inputs)
    assert _max_diff(unmerged, merged) <= TOLERANCE
    assert _max_diff(unmerged, base) > 100 * TOLERANCE  # the adapters do change the logits
    assert not lora_modules(merged_model) and lora_modules(model)  # the input keeps its adapters
    assert all(p.requires_grad for p in merged_model.parameters())


@pytest.mark.parametrize("fixture", ["qwen2_hf", "qwen3_hf"])
def test_peft_and_transformers_compute_our_logits(fixture, token_ids, request, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, directory = request.getfixturevalue(fixture)
    ours = models.load_pretrained(directory)
    apply_lora(ours, LORA, seed=0)
    _randomize_b(ours)
    save_peft_adapter(ours, tmp_path / "adapter", str(directory))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, str(directory))

    # A fresh transformers model: PeftModel injects its layers into the model it is given.
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory), tmp_path / "adapter")
    with torch.no_grad():
        expected = reference.eval()(token_ids).logits
        got = ours(token_ids)
        base = models.load_pretrained(directory)(token_ids)
    assert _max_diff(got, expected) <= TOLERANCE
    assert _max_diff(got, base) > 100 * TOLERANCE

    # Back into Lockstep: other init seed, same adapters after the load.
    again = models.load_pretrained(directory)
    apply_lora(again, LORA, seed=1)
    load_peft_adapter(again, tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(again(token_ids), got)

    # Merged export: a plain Hugging Face directory.
    models.save_pretrained(merge_lora(ours), tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert _max_diff(merged(token_ids).logits, expected) <= TOLERANCE


def test_modules_to_save_round_trip_through_peft(qwen2_hf, token_ids, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, directory = qwen2_hf  # untied head: lm_head trains in full beside the adapters
    ours = models.load_pretrained(directory)
    apply_lora(ours, dataclasses.replace(LORA, targets=("q_proj", "v_proj"), modules_to_save=("lm_head",)), seed=0)
    _randomize_b(ours)
    with torch.no_grad():
        ours.lm_head.weight.mul_(1.5)
    save_peft_adapter(ours, tmp_path, str(directory))
    assert json.loads((tmp_path / ADAPTER_CONFIG).read_text())["modules_to_save"] == ["lm_head"]
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory), tmp_path).eval()
    with torch.no_grad():
        assert _max_diff(ours(token_ids), reference(token_ids).logits) <= TOLERANCE


# --------------------------------------------------------------------------- dropout


def test_dropout_masks_are_keyed_and_survive_recomputation():
    model = _model()
    apply_lora(model, dataclasses.replace(LORA, dropout=0.5), seed=0)
    _randomize_b(model)
    inputs, labels = _batch()
    with pytest.raises(RuntimeError, match="set_dropout_key"):
        model(inputs)

    def logits(step: int, micro_batch: int = 0) -> torch.Tensor:
        set_dropout_key(model, seed=0, step=step, rank=0, micro_batch=micro_batch)
        with torch.no_grad():
            return model(inputs)

    dropped = logits(1)
    assert torch.equal(dropped, logits(1))
    assert not torch.equal(dropped, logits(2)) and not torch.equal(dropped, logits(1, micro_batch=1))
    model.eval()
    assert torch.equal(logits(1), logits(2))  # no dropout in eval mode
    assert not torch.equal(logits(1), dropped)
    model.train()

    def grads(net: torch.nn.Module) -> list[torch.Tensor]:
        set_dropout_key(net, seed=0, step=3, rank=0, micro_batch=0)
        _loss(net, inputs, labels).backward()
        return [p.grad for p in net.parameters() if p.requires_grad]

    recomputing = copy.deepcopy(model)
    apply_activation_checkpointing(recomputing, "full")  # reruns each block's forward in backward
    # Mask draws are keyed, not taken from torch's RNG: shifting that RNG changes nothing.
    with torch.random.fork_rng():
        torch.rand(10)
        with_recompute = grads(recomputing)
    assert all(torch.equal(a, b) for a, b in zip(grads(model), with_recompute))


# --------------------------------------------------------------------------- adapters off


def test_adapters_off_compute_the_base_bit_for_bit_and_come_back_on():
    base = _model()
    model = copy.deepcopy(base)
    apply_lora(model, dataclasses.replace(LORA, dropout=0.1), seed=3)  # no dropout key: a draw would raise
    _randomize_b(model)
    inputs, _ = _batch()
    with torch.no_grad():
        want_base, want_on = base(inputs), model.eval()(inputs)
        model.train()
        with adapters_disabled(model):
            with adapters_disabled(model):
                nested = model(inputs)
            off = model(inputs)  # the inner block restored the outer state: still off
        model.eval()
        on = model(inputs)
    assert torch.equal(nested, want_base) and torch.equal(off, want_base)
    assert torch.equal(on, want_on) and not torch.equal(on, want_base)
    assert not any(m.adapter_disabled for m in lora_modules(model))
    with pytest.raises(ValueError, match="apply_lora"):
        with adapters_disabled(base):
            pass


def test_adapters_off_under_compile_and_activation_checkpointing():
    """Compiled blocks guard on the switch (no graph of one state serves the other), and a
    checkpointed block recomputed in backward after a no_grad adapters-off forward recomputes
    with the adapters on, as its forward ran. The "eager" backend keeps eager numerics, so the
    comparisons are bitwise; dynamo's guards are the same for every backend."""
    base = _model(num_layers=1)
    eager = copy.deepcopy(base)
    apply_lora(eager, LORA, seed=3)
    _randomize_b(eager)
    model = copy.deepcopy(eager)
    apply_activation_checkpointing(model, "full")
    for block in model.layers:
        block.compile(backend="eager")
    inputs, labels = _batch()
    with torch.no_grad():
        want_base = base(inputs)
    _loss(eager, inputs, labels).backward()
    want_grads = {n: p.grad for n, p in eager.named_parameters() if p.requires_grad}
    torch._dynamo.reset()
    try:
        for _ in range(2):
            loss = _loss(model, inputs, labels)  # a graph is recorded with the adapters on ...
            with torch.no_grad(), adapters_disabled(model):
                off = model(inputs)  # ... then the reference forward, adapters off ...
            loss.backward()  # ... then the recomputation, adapters on again
            assert torch.equal(off, want_base)
            for name, param in model.named_parameters():
                if param.requires_grad:
                    assert torch.equal(param.grad, want_grads[name.replace("._checkpoint_wrapped_module", "")]), name
                    param.grad = None
    finally:
        torch._dynamo.reset()


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.lora.rank=-1"], "model.lora.rank"),
        (["model.quantize_base=nf4"], "model.lora.rank"),
        (["model.lora.init_from=somewhere"], "model.lora.rank"),
        (["model.lora.rank=8", "model.lora.alpha=0"], "model.lora.alpha"),
        (["model.lora.rank=8", "model.lora.dropout=1.0"], "model.lora.dropout"),
        (["model.lora.rank=8", "model.lora.targets=[]"], "model.lora.targets"),
        (["model.lora.rank=8", "model.lora.targets=[q_proj, qkv_proj]"], "model.lora.targets"),
        (["model.lora.rank=8", "model.quantize_base=nf4", "parallel.tp=2"], "model.quantize_base"),
        (["model.lora.rank=8", "parallel.strategy=xla_spmd"], "parallel.strategy"),
    ],
)
def test_bad_lora_config_is_a_config_error_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        config_lib.load(None, overrides)
    assert info.value.context["key"] == key


def test_lora_with_float8_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        config_lib.load(None, ["model.lora.rank=8", "parallel.float8=tensorwise", "parallel.device=cuda",
                               "parallel.precision=bf16"])
    assert info.value.context["key"] == "parallel.float8" and "model.lora" in info.value.message


def test_lora_off_by_default_and_valid_settings_load():
    assert config_lib.load(None).model.lora.rank == 0
    loaded = config_lib.load(None, ["model.lora.rank=8", "model.lora.targets=[q_proj, v_proj]"])
    assert loaded.model.lora.targets == ("q_proj", "v_proj")


def test_apply_lora_rejects_what_the_model_lacks():
    with pytest.raises(ConfigError) as info:
        apply_lora(_model(), dataclasses.replace(LORA, targets=("q_proj", "lm_head")), seed=0)
    assert info.value.context["key"] == "model.lora.targets"
    assert "'lm_head'" in info.value.message and "down_proj" in info.value.hint  # names the valid ones
    with pytest.raises(ConfigError) as info:
        apply_lora(_model(), dataclasses.replace(LORA, rank=0), seed=0)
    assert info.value.context["key"] == "model.lora.rank"
    with pytest.raises(ConfigError) as info:
        apply_lora(_model(), dataclasses.replace(LORA, modules_to_save=("embeddings",)), seed=0)
    assert info.value.context["key"] == "model.lora.modules_to_save" and "embed_tokens" in info.value.hint
    model = _model()
    apply_lora(model, LORA, seed=0)
    with pytest.raises(ValueError, match="already has adapters"):
        apply_lora(model, LORA, seed=0)


def test_adapter_that_does_not_fit_the_base_is_refused(tmp_path):
    source = _model()
    apply_lora(source, LORA, seed=0)
    save_peft_adapter(source, tmp_path / "adapter", None)

    wider = _model(hidden_size=96)
    apply_lora(wider, LORA, seed=0)
    with pytest.raises(ConfigError) as info:
        load_peft_adapter(wider, tmp_path / "adapter")
    assert info.value.context["key"] == "model.lora.init_from"
    assert "down_proj.lora_B" in info.value.message  # the first misfit, with both shapes:
    assert "[64, 4]" in info.value.message and "[96, 4]" in info.value.message

    other_rank = _model()
    apply_lora(other_rank, dataclasses.replace(LORA, rank=8), seed=0)
    with pytest.raises(ConfigError) as info:
        load_peft_adapter(other_rank, tmp_path / "adapter")
    assert info.value.context["key"] == "model.lora.rank" and "r=4" in info.value.message

    fewer = _model()
    apply_lora(fewer, dataclasses.replace(LORA, targets=("q_proj",)), seed=0)
    with pytest.raises(ConfigError) as info:
        load_peft_adapter(fewer, tmp_path / "adapter")
    assert "down_proj.lora_A" in info.value.message and "no adapter" in info.value.message  # no place for it

    (tmp_path / "adapter" / ADAPTER_WEIGHTS).unlink()
    with pytest.raises(ConfigError) as info:
        load_peft_adapter(source, tmp_path / "adapter")
    assert ADAPTER_WEIGHTS in info.value.message


@pytest.mark.parametrize("name", ["tiny-lora", "qwen2.5-0.5b-lora", "qwen3-1.7b-lora", "qwen3-1.7b-qlora"])
def test_lora_presets_load(name):
    loaded = config_lib.load(CONFIGS / f"{name}.yaml")
    assert loaded.model.lora.rank > 0 and set(loaded.model.lora.targets) == set(LORA_TARGETS)
    assert loaded.model.quantize_base == ("nf4" if "qlora" in name else "none")


def test_adapters_of_qwen3_1_7b_at_rank_16_have_the_expected_size():
    config = config_lib.load(CONFIGS / "qwen3-1.7b.yaml").model
    with torch.device("meta"):  # the real shape, no memory
        model = models.qwen.model.QwenForCausalLM(config)
    trainable = apply_lora(model, LoRAConfig(rank=16, alpha=32.0), seed=0)
    hidden, mlp, q, kv = 2048, 6144, 16 * 128, 8 * 128
    per_block = 16 * sum(i + o for i, o in [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden),
                                            (hidden, mlp), (hidden, mlp), (mlp, hidden)])
    params = dict(model.named_parameters())
    assert sum(params[n].numel() for n in trainable) == 28 * per_block == 17_432_576  # ~70 MB in fp32
    assert all(not p.requires_grad for n, p in params.items() if ".lora_" not in n)


# --------------------------------------------------------------------------- NF4 (QLoRA)


def test_nf4_quantization_is_deterministic_and_close_to_its_reference():
    from models.nf4 import NF4Linear, nf4_bytes, quantize_base

    def qlora(seed: int) -> torch.nn.Module:
        model = models.build(ModelConfig(**NF4_SHAPE), generator=torch.Generator().manual_seed(seed))
        apply_lora(model, LORA, seed=0)
        assert len(quantize_base(model)) == 2 * 7
        return model

    first, second, other = qlora(0), qlora(0), qlora(1)
    a, b = first.layers[0].mlp.up_proj.base_layer.weight, second.layers[0].mlp.up_proj.base_layer.weight
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(nf4_bytes(a), nf4_bytes(b)))
    assert base_identity(first) == base_identity(second) != base_identity(other)

    linear = first.layers[1].self_attn.o_proj.base_layer
    assert isinstance(linear, NF4Linear) and not linear.weight.requires_grad
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    dequantized = linear.dequantized_weight()
    assert torch.allclose(linear(x), F.linear(x, dequantized), atol=1e-6)
    original = models.build(ModelConfig(**NF4_SHAPE), generator=torch.Generator().manual_seed(0))
    full = original.layers[1].self_attn.o_proj.weight
    assert 0 < (dequantized - full).norm() / full.norm() < 0.15  # 4 bits: close, not equal

    inputs, _ = _batch()
    _randomize_b(first)
    _train(first, steps=1)
    assert base_identity(first) == base_identity(second)  # the NF4 base did not move
    with torch.no_grad():
        assert _max_diff(merge_lora(first)(inputs), first(inputs)) <= TOLERANCE


def test_nf4_needs_block_aligned_weights():
    from models.nf4 import check_nf4_layout, quantize_base

    with pytest.raises(ConfigError) as info:
        quantize_base(_model())
    assert info.value.context["key"] == "model.quantize_base" and "layers.0.self_attn.q_proj" in info.value.message
    # Before any process group: the shape alone, and how many FSDP shards split each weight.
    check_nf4_layout(ModelConfig(**NF4_SHAPE))
    with pytest.raises(ConfigError, match="over 2 FSDP shards") as info:
        check_nf4_layout(ModelConfig(**NF4_SHAPE), shards=2)  # 128 x 128: one scale block
    assert info.value.context["key"] == "model.quantize_base"
    check_nf4_layout(ModelConfig(**NF4_FSDP_SHAPE), shards=2)
    qwen25 = config_lib.load(CONFIGS / "qwen2.5-0.5b-lora.yaml").model
    check_nf4_layout(qwen25)
    with pytest.raises(ConfigError, match="896 x 896"):
        check_nf4_layout(qwen25, shards=2)
    check_nf4_layout(config_lib.load(CONFIGS / "qwen3-1.7b-qlora.yaml").model, shards=8)


def test_add_adapters_identifies_the_base_then_loads_init_from_then_quantizes(tmp_path):
    from models.lora import add_adapters
    from models.nf4 import NF4Linear

    trained = models.build(ModelConfig(**NF4_SHAPE), generator=torch.Generator().manual_seed(0))
    apply_lora(trained, LORA, seed=3)
    _randomize_b(trained)
    save_peft_adapter(trained, tmp_path / "adapter", None)
    models.save_pretrained(models.build(ModelConfig(**NF4_SHAPE), generator=torch.Generator().manual_seed(0)),
                           tmp_path / "base")
    config = ModelConfig(**NF4_SHAPE, init_from=str(tmp_path / "base"), quantize_base="nf4",
                         lora=dataclasses.replace(LORA, init_from=str(tmp_path / "adapter")))
    model = models.build(config)
    identity = add_adapters(model, config, seed=11)  # another seed: the adapters come from init_from
    assert identity == {"path": str(tmp_path / "base"), "sha256": base_identity(tmp_path / "base")}
    loaded = dict(model.named_parameters())
    for name, param in trained.named_parameters():
        if ".lora_" in name:
            assert torch.equal(loaded[name], param), name
    assert all(isinstance(m.base_layer, NF4Linear) for m in lora_modules(model))
    fresh = models.build(config)
    add_adapters(fresh, config, seed=11, load_init=False)
    assert not torch.equal(fresh.layers[0].self_attn.q_proj.lora_A.weight,
                           model.layers[0].self_attn.q_proj.lora_A.weight)


def test_param_hash_of_an_nf4_base_is_repeatable_and_sees_the_base():
    """The ledger's param_hash covers NF4 weights through their packed parts."""
    from distributed import param_hash
    from models.lora import add_adapters

    config = ModelConfig(**NF4_SHAPE, lora=LORA, quantize_base="nf4")

    def qlora(seed: int) -> torch.nn.Module:
        model = models.build(config, generator=torch.Generator().manual_seed(seed))
        add_adapters(model, config, seed=3)
        return model

    assert param_hash(qlora(0)) == param_hash(qlora(0)) != param_hash(qlora(1))


# --------------------------------------------------------------------------- several ranks


def _adapter_run(strategy: str) -> dict:
    """Init, then two steps on this rank's half of each global batch; full adapters out."""
    from core.distributed_context import DistributedContext
    from distributed import build_mesh, parallelize, unwrap
    from distributed.params import full_tensor
    from tests.distributed.scenarios import cpu_parallel

    parallel = cpu_parallel(strategy=strategy)
    with DistributedContext.from_env(parallel) as dist:
        model = _model()
        rank = dist.rank
        # Each rank creates its adapters in another order.
        targets = LORA.targets if rank == 0 else tuple(reversed(LORA.targets))
        for target in targets:
            apply_lora(model, dataclasses.replace(LORA, targets=(target,)), seed=3)
        identity = base_identity(model)
        model = parallelize(model, parallel, dist, build_mesh(parallel, dist))
        plain = unwrap(model)

        def adapters() -> dict[str, torch.Tensor]:
            return {n: full_tensor(p).detach().clone() for n, p in plain.named_parameters() if ".lora_" in n}

        initial = adapters()
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)  # linear in the gradient: no Adam rescaling of rounding differences
        for step in range(2):
            inputs, labels = _batch(step)
            rows = slice(2 * rank, 2 * rank + 2)
            _loss(model, inputs[rows], labels[rows]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        with torch.no_grad(), adapters_disabled(model):  # the switch reaches through the wrappers
            off = model(_batch()[0])
        return {"initial": initial, "trained": adapters(), "identity": identity, "off": off}


def _tp_run() -> dict:
    """TP=2 through distributed/tp.py (wrapped projections sharded by LoRALinear.tp_plan):
    logits and full adapter gradients."""
    from core.distributed_context import DistributedContext
    from distributed import build_mesh
    from distributed.params import full_tensor
    from distributed.tp import apply_tensor_parallel
    from tests.distributed.scenarios import cpu_parallel

    parallel = cpu_parallel(strategy="fsdp", tp=2)
    with DistributedContext.from_env(parallel) as dist:
        model = _model()
        apply_lora(model, LORA, seed=3)
        _randomize_b(model)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        apply_tensor_parallel(model, build_mesh(parallel, dist).tp_mesh)
        assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable  # q/k norms stay frozen
        sharded = {n for n, p in model.named_parameters() if hasattr(p, "placements")}
        inputs, labels = _batch()
        logits = model(inputs)
        F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
        grads = {n: full_tensor(p.grad).clone() for n, p in model.named_parameters() if ".lora_" in n}
        with torch.no_grad(), adapters_disabled(model):
            off = model(inputs)
        return {"logits": logits.detach(), "grads": grads, "sharded": sharded, "off": off}


def _qlora_model() -> torch.nn.Module:
    from models.nf4 import quantize_base

    model = models.build(ModelConfig(**NF4_FSDP_SHAPE), generator=torch.Generator().manual_seed(0))
    apply_lora(model, LORA, seed=3)
    _randomize_b(model)
    quantize_base(model)
    return model


def _qlora_fsdp_run() -> dict:
    """An NF4 base under FSDP2 (torchao shards the NF4 weights): full adapter gradients."""
    from core.distributed_context import DistributedContext
    from distributed import build_mesh, param_hash, parallelize, unwrap
    from distributed.params import full_tensor
    from models.nf4 import _torchao_nf4
    from tests.distributed.scenarios import cpu_parallel

    parallel = cpu_parallel(strategy="fsdp")
    with DistributedContext.from_env(parallel) as dist:
        model = parallelize(_qlora_model(), parallel, dist, build_mesh(parallel, dist))
        inputs, labels = _batch()
        rows = slice(2 * dist.rank, 2 * dist.rank + 2)
        _loss(model, inputs[rows], labels[rows]).backward()
        grads = {n: full_tensor(p.grad).clone() for n, p in unwrap(model).named_parameters() if p.grad is not None}
        # The ledger's hash gathers the NF4 weights as dequantized plain shards, never through
        # torchao's packed all-gather (whose waits crashed gloo ranks now and then).
        table = _torchao_nf4().NF4_OPS_TABLE
        packed_gather = torch.ops._c10d_functional.all_gather_into_tensor.default
        original = table[packed_gather]
        table[packed_gather] = _refuse_packed_gather
        try:
            return {"grads": grads, "param_hash": param_hash(model)}
        finally:
            table[packed_gather] = original


def _refuse_packed_gather(*args, **kwargs):
    raise AssertionError("param_hash gathered an NF4 tensor's packed parts")


@pytest.fixture(scope="module")
def single_process_adapters():
    model = _model()
    apply_lora(model, LORA, seed=3)
    identity = base_identity(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for step in range(2):
        _loss(model, *_batch(step)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}
    return {"initial": initial, "trained": trained, "identity": identity}


def _two_rank_runs() -> dict:
    from core.distributed_context import DistributedContext
    from models.nf4 import _torchao_nf4
    from tests.distributed.scenarios import cpu_parallel

    # torchao registers its ops when first imported; do that before gloo's threads exist.
    _torchao_nf4()
    with DistributedContext.from_env(cpu_parallel(strategy="ddp")):  # one group serves every run
        return {"ddp": _adapter_run("ddp"), "fsdp": _adapter_run("fsdp"), "tp": _tp_run(), "qlora": _qlora_fsdp_run()}


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(_two_rank_runs, 2)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_adapters_under_two_ranks_match_one_process(two_ranks, single_process_adapters, strategy):
    single = single_process_adapters
    for result in (r[strategy] for r in two_ranks):
        assert result["identity"] == single["identity"]
        assert result["initial"].keys() == single["initial"].keys()
        assert all(torch.equal(result["initial"][k], v) for k, v in single["initial"].items())
        assert max(_max_diff(result["trained"][k], v) for k, v in single["trained"].items()) <= 1e-6
        assert any(not torch.equal(result["trained"][k], v) for k, v in single["initial"].items())


def test_tensor_parallel_adapters_match_one_process(two_ranks):
    # colwise: base_layer and lora_B sharded on the output; rowwise: base_layer and lora_A on the input
    sharded = two_ranks[0]["tp"]["sharded"]
    assert "layers.0.self_attn.q_proj.lora_B.weight" in sharded
    assert "layers.0.self_attn.q_proj.lora_A.weight" not in sharded
    assert "layers.0.mlp.down_proj.lora_A.weight" in sharded
    assert "layers.0.mlp.down_proj.lora_B.weight" not in sharded
    assert "layers.0.mlp.down_proj.base_layer.weight" in sharded
    model = _model()
    apply_lora(model, LORA, seed=3)
    _randomize_b(model)
    inputs, labels = _batch()
    logits = model(inputs)
    F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
    for result in (r["tp"] for r in two_ranks):
        assert _max_diff(result["logits"], logits) <= TOLERANCE
        for name, param in model.named_parameters():
            if ".lora_" in name:
                assert _max_diff(result["grads"][name], param.grad) <= 1e-6, name


def test_adapters_off_give_the_base_under_ddp_fsdp_and_tp(two_ranks):
    with torch.no_grad():
        base = _model()(_batch()[0])
    for result in two_ranks:
        assert torch.equal(result["ddp"]["off"], base)  # a full replica
        assert torch.equal(result["fsdp"]["off"], base)  # the same weights, gathered
        assert _max_diff(result["tp"]["off"], base) <= TOLERANCE  # sharded matmuls, then a sum
        assert _max_diff(result["tp"]["logits"], base) > 1e-3  # the adapters were on before


def test_qlora_under_fsdp_matches_one_process(two_ranks):
    model = _qlora_model()
    _loss(model, *_batch()).backward()
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert len(expected) == 2 * 7 * 2  # adapters only: the NF4 base gets no gradient
    from distributed import param_hash

    plain_hash = param_hash(model)
    for result in (r["qlora"] for r in two_ranks):
        grads = result["grads"]
        assert result["param_hash"] == plain_hash
        assert grads.keys() == expected.keys()
        assert max(_max_diff(grads[n], g) for n, g in expected.items()) <= 1e-6
