"""The Qwen3-MoE family (models/qwen3_moe/): Hugging Face parity, the load-balancing loss, deterministic
dispatch, the checkpoint layout both ways and its config checks."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from core.config import config_hash, load
from core.config_schema import model_config_class
from core.exceptions import ConfigError
from models.builder import build
from models.flops import num_params
from models.forward import INPUT_TOKEN, ModelInputs, model_forward
from models.generation.kv_cache import KVCache
from models.hf_config import model_config_from_hf
from models.hf_weights import load_pretrained, save_pretrained
from models.qwen3_moe.dims import resolve_moe_dims
from models.qwen3_moe.family import Qwen3MoeSettings
from models.qwen3_moe.generation_copy import generation_copy
from models.qwen3_moe.moe import (BIAS, Experts, SparseMoe, bias_step, load_balancing_loss, plan_dispatch,
                                  top_k_experts)

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 96


def _config(**settings):
    """A tiny Qwen3-MoE ModelConfig: 3 layers (the middle one dense), 6 experts, top-2."""
    section = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=(1,),
                   norm_topk_prob=False, router_aux_loss_coef=0.02)
    section.update(settings)
    return model_config_class()(arch="qwen3_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=40,
                                num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, tie_embeddings=False,
                                max_position_embeddings=128, qwen3_moe=Qwen3MoeSettings(**section))


def _hf_model(norm_topk_prob: bool, directory: Path, **shape):
    """transformers' Qwen3MoeForCausalLM of ``_config``'s shape (``shape`` overrides its config keys), seeded,
    norms moved off 1, saved to ``directory``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    keys = dict(num_hidden_layers=3, mlp_only_layers=[1]) | shape
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=24, norm_topk_prob=norm_topk_prob, router_aux_loss_coef=0.02, **keys)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        model = Qwen3MoeForCausalLM(config).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(0.2 * torch.randn(param.shape))
                elif "mlp.gate." in name:
                    param.mul_(20.0)  # a router far from uniform: the top-k choice matters
    model.save_pretrained(directory)
    return model


def _ids(seed: int = 0, batch: int = 2, seq_len: int = 11) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_logits_and_aux_loss_equal_transformers(tmp_path, norm_topk_prob):
    theirs = _hf_model(norm_topk_prob, tmp_path)
    ours = load_pretrained(tmp_path, base=_config()).eval()
    assert ours.dims.norm_topk_prob is norm_topk_prob and ours.dims.sparse == (True, False, True)
    ids = _ids()
    with torch.no_grad():
        reference = theirs(ids, output_router_logits=True)
        out = model_forward(ours, ModelInputs(ids))
    torch.testing.assert_close(out.logits, reference.logits, rtol=0, atol=1e-5)
    aux = out.aux_losses["load_balance"]
    assert aux.per == INPUT_TOKEN and aux.weight == 0.02
    torch.testing.assert_close(aux.sum / ids.numel(), reference.aux_loss, rtol=1e-6, atol=1e-6)


def test_every_second_layer_sparse_equals_transformers(tmp_path):
    """decoder_sparse_step=2 over 4 layers, layer 3 also dense by mlp_only_layers: only layer 1 is a mixture,
    the shape read from transformers' config.json."""
    theirs = _hf_model(True, tmp_path, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    ours = load_pretrained(tmp_path).eval()
    assert ours.dims.sparse == (False, True, False, False)
    ids = _ids(seed=2)
    with torch.no_grad():
        reference = theirs(ids, output_router_logits=True)
        out = model_forward(ours, ModelInputs(ids))
    torch.testing.assert_close(out.logits, reference.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.aux_losses["load_balance"].sum / ids.numel(), reference.aux_loss,
                               rtol=1e-6, atol=1e-6)


def test_checkpoint_keys_are_per_expert_and_fill_their_slots(tmp_path):
    theirs = _hf_model(False, tmp_path)
    ours = load_pretrained(tmp_path, base=_config())
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        expert = f.get_tensor("model.layers.2.mlp.experts.4.down_proj.weight")
    assert "model.layers.0.mlp.experts.5.gate_proj.weight" in keys and "model.layers.1.mlp.gate_proj.weight" in keys
    assert torch.equal(ours.layers[2].mlp.experts.down_proj[4], expert)
    gate, up = theirs.model.layers[0].mlp.experts.gate_up_proj[3].detach().chunk(2, dim=0)  # transformers fuses them
    assert torch.equal(ours.layers[0].mlp.experts.gate_proj[3], gate)
    assert torch.equal(ours.layers[0].mlp.experts.up_proj[3], up)


def test_export_loads_in_transformers_and_reads_back(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    config = _config(norm_topk_prob=True)
    ours = build(config, generator=torch.Generator().manual_seed(3)).eval()
    save_pretrained(ours, tmp_path)
    exported = json.loads((tmp_path / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3MoeForCausalLM"] and exported["mlp_only_layers"] == [1]
    theirs = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = _ids(seed=1)
    with torch.no_grad():
        mine = model_forward(ours, ModelInputs(ids))
        reference = theirs(ids, output_router_logits=True)
    torch.testing.assert_close(mine.logits, reference.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(mine.aux_losses["load_balance"].sum / ids.numel(), reference.aux_loss)
    back = load_pretrained(tmp_path, base=config)
    assert back.config.qwen3_moe == config.qwen3_moe
    assert model_config_from_hf(tmp_path, config) == back.config
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_load_balancing_loss_on_hand_computed_router_probabilities():
    # One block with hidden = experts and an identity router: the logits are the input itself, so
    # an input of log-probabilities routes by exactly those probabilities.
    config = _config(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    dims = dataclasses.replace(resolve_moe_dims(config), hidden_size=4)
    block = SparseMoe(dims)
    with torch.no_grad():
        block.gate.weight.copy_(torch.eye(4))
        for p in (block.experts.gate_proj, block.experts.up_proj, block.experts.down_proj):
            p.normal_(generator=torch.Generator().manual_seed(0))
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])
    _, prob_sum, counts = block(probs.log().view(1, 3, 4))
    assert counts.tolist() == [2, 2, 1, 1]  # tokens 0 and 2 pick experts 0, 1; token 1 picks 3, 2
    torch.testing.assert_close(prob_sum, torch.tensor([0.9, 0.8, 0.7, 0.6]))
    # E * sum_e f_e P_e with f = counts / N, P = prob_sum / N (N = 3 tokens, one layer)
    expected = 4 * (2 / 3 * 0.3 + 2 / 3 * 0.8 / 3 + 1 / 3 * 0.7 / 3 + 1 / 3 * 0.2)
    assert math.isclose(float(load_balancing_loss([prob_sum], [counts], 3)), expected, rel_tol=1e-6)
    # two layers pool their counts and probabilities before the product (transformers' formula)
    even = load_balancing_loss([torch.full((4,), 0.75)] * 2, [torch.tensor([1, 2, 2, 1]), torch.tensor([2, 1, 1, 2])], 3)
    assert math.isclose(float(even), 4 * 4 * (3 / 6 * 1.5 / 6), rel_tol=1e-6)  # = top_k: an even load


def test_ties_go_to_the_lower_expert():
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.1, 0.3, 0.3, 0.3]])
    values, experts = top_k_experts(probs, 2)
    assert experts.tolist() == [[0, 1], [1, 2]]
    assert values.tolist() == [[0.25, 0.25], [0.30000001192092896, 0.30000001192092896]]


def test_dispatch_groups_by_expert_in_token_order():
    experts = torch.tensor([[2, 0], [0, 2], [2, 1], [0, 2]])  # repeated experts, in both slots
    dispatch = plan_dispatch(experts, num_experts=4)
    assert dispatch.counts.tolist() == [3, 1, 4, 0]
    assert dispatch.order.tolist() == [1, 2, 6, 5, 0, 3, 4, 7]  # assignment t * k + s, ascending within an expert
    assert torch.equal(dispatch.order[dispatch.inverse], torch.arange(8))


def _moe_block(kernel: str, seed: int = 0) -> SparseMoe:
    dims = resolve_moe_dims(_config(num_experts=5, num_experts_per_tok=3, norm_topk_prob=True))
    block = SparseMoe(dims)
    block.experts.kernel = kernel
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return block


def _run(block: SparseMoe, x: torch.Tensor):
    x = x.clone().requires_grad_(True)
    out, prob_sum, counts = block(x)
    ((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + prob_sum.pow(2).sum()).backward()
    grads = {name: p.grad.clone() for name, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads, counts


def test_permuting_tokens_permutes_outputs_exactly():
    block = _moe_block("loop")
    rows = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    x = rows[torch.tensor([0, 1, 0, 2, 3, 1, 4, 0, 5, 2, 1, 3])].view(1, 12, 32)  # repeated tokens: repeated experts
    out, _, _, counts = _run(block, x)
    assert int(counts.max()) >= 4
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(2))
    out_p, _, _, counts_p = _run(block, x[:, perm])
    assert torch.equal(counts_p, counts)
    assert torch.equal(out_p, out[:, perm])  # bitwise: each token's sum runs in its own fixed slot order
    again = _run(block, x)
    assert torch.equal(again[0], out) and torch.equal(again[1], _run(block, x)[1])


def test_grouped_matmuls_equal_the_loop_and_idle_experts_get_zero_gradients():
    x = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(4))
    loop, grouped = _moe_block("loop"), _moe_block("grouped")
    with torch.no_grad():  # expert 4 gets no token: its router row far below the others
        for block in (loop, grouped):
            block.gate.weight[4] = -100.0 * x[0].mean(0) / x[0].mean(0).norm()
    out_l, dx_l, grads_l, counts = _run(loop, x)
    out_g, dx_g, grads_g, _ = _run(grouped, x)
    assert counts[4] == 0
    torch.testing.assert_close(out_g, out_l, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx_g, dx_l, rtol=1e-6, atol=1e-6)
    for name, grad in grads_l.items():
        torch.testing.assert_close(grads_g[name], grad, rtol=1e-6, atol=1e-6)
        assert torch.isfinite(grads_g[name]).all(), name
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert not grads_l[f"experts.{name}"][4].any() and not grads_g[f"experts.{name}"][4].any()


def test_expert_kernel_is_the_loop_on_cpu():
    block = _moe_block("auto")
    assert isinstance(block.experts, Experts)
    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(5))
    forced = _moe_block("loop")
    assert torch.equal(block(x)[0], forced(x)[0])


def test_cached_generation_matches_the_full_forward():
    model = build(_config(), generator=torch.Generator().manual_seed(1)).eval()
    ids = _ids(seed=6, batch=1, seq_len=9)
    spec = model.generation_spec()
    cache = KVCache.for_spec(spec, batch=1, slots=16)
    with torch.no_grad():
        full = model_forward(model, ModelInputs(ids)).logits
        model_forward(model, ModelInputs(ids[:, :6], position_ids=torch.arange(6).unsqueeze(0)), cache=cache)
        step = model_forward(model, ModelInputs(ids[:, 6:], position_ids=torch.arange(6, 9).unsqueeze(0)), cache=cache)
    torch.testing.assert_close(step.logits, full[:, -1], rtol=1e-5, atol=1e-5)


def test_forward_reports_per_layer_load_and_omits_a_zero_coefficient():
    model = build(_config(router_aux_loss_coef=0.0), generator=torch.Generator().manual_seed(2))
    out = model_forward(model, ModelInputs(_ids()))
    assert out.aux_losses == {}
    assert sorted(out.metrics) == ["layer0_load_max", "layer0_load_min", "layer2_load_max", "layer2_load_min"]
    low, high = out.metrics["layer0_load_min"], out.metrics["layer0_load_max"]
    assert low.count == 22 * 2 / 6 and 0 <= float(low.sum) <= float(high.sum)
    assert num_params(model.config) == sum(p.numel() for p in model.parameters())


def test_top_k_above_the_experts_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"num_experts_per_tok=9 .*num_experts=8") as err:
        load(ROOT / "configs" / "tiny-moe.yaml", ["model.qwen3_moe.num_experts_per_tok=9"])
    assert err.value.context["key"] == "model.qwen3_moe.num_experts_per_tok"


def test_the_section_is_hashed_only_when_set():
    tiny = load(ROOT / "configs" / "tiny.yaml")
    assert config_hash(tiny) == config_hash(load(ROOT / "configs" / "tiny.yaml", ["model.arch=qwen3"]))
    moe = load(ROOT / "configs" / "tiny-moe.yaml")
    changed = load(ROOT / "configs" / "tiny-moe.yaml", ["model.qwen3_moe.router_aux_loss_coef=0.001"])
    assert config_hash(moe) != config_hash(changed)


# ------------------------------------------------------------------ auxiliary-loss-free balancing, bad input


def test_bias_step_on_hand_computed_loads():
    # 4 experts, 12 assignments: mean load 3; loads 5, 3, 1, 3 -> signs -1, 0, +1, 0
    bias = torch.tensor([0.5, -0.25, 0.0, 0.125])
    moved = bias_step(bias, torch.tensor([5, 3, 1, 3]), 0.01)
    assert torch.equal(moved, torch.tensor([0.5 - 0.01, -0.25, 0.01, 0.125]))
    # a mean that is no integer (7 over 4 = 1.75): every expert moves
    assert torch.equal(bias_step(torch.zeros(4), torch.tensor([2, 1, 4, 0]), 0.5), torch.tensor([-0.5, 0.5, -0.5, 0.5]))


def test_the_bias_chooses_the_experts_and_the_probabilities_weigh_them():
    model = build(_config(bias_update_rate=0.01, norm_topk_prob=False), generator=torch.Generator().manual_seed(3))
    router = model.layers[0].mlp.gate
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    plain = router(x)
    getattr(router, BIAS).copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 10.0]))  # expert 5 always wins a slot
    biased = router(x)
    assert torch.equal(biased.experts[:, 0], torch.full((5,), 5))
    assert torch.equal(biased.weights, plain.probs.gather(-1, biased.experts))  # unbiased probabilities
    assert torch.equal(biased.probs, plain.probs)  # the balancing loss reads the same probabilities


def _bias_after_one_update(model, ids, rows_per_forward):
    for start in range(0, ids.shape[0], rows_per_forward):
        model_forward(model, ModelInputs(ids[start:start + rows_per_forward]))
    counts = model.step_counts.clone()
    model.after_update(lambda t: t)
    return counts, [getattr(router, BIAS).clone() for _, router in model.routers_with_bias()]


def test_the_bias_moves_by_the_steps_counts_whatever_the_micro_batches():
    config = _config(bias_update_rate=0.01)
    ids = _ids(seed=5, batch=4)
    model = build(config, generator=torch.Generator().manual_seed(6))
    counts_1x4, bias_1x4 = _bias_after_one_update(model, ids, 4)
    model = build(config, generator=torch.Generator().manual_seed(6))
    counts_4x1, bias_4x1 = _bias_after_one_update(model, ids, 1)
    assert counts_1x4.shape == (2, 6) and counts_1x4.sum() == 2 * 4 * 11 * 2  # sparse layers 0 and 2, top-2
    assert torch.equal(counts_1x4, counts_4x1)
    assert all(torch.equal(a, b) for a, b in zip(bias_1x4, bias_4x1))
    assert [torch.equal(b, bias_step(torch.zeros(6), c, 0.01)) for b, c in zip(bias_1x4, counts_1x4)] == [True, True]
    assert model.step_counts is None  # counted again from the next step's forwards
    with torch.no_grad():  # an evaluation or a reference forward counts nothing
        model_forward(model, ModelInputs(ids))
    assert model.step_counts is None


def test_the_bias_is_model_state_reported_and_copied_for_the_sampler():
    model = build(_config(bias_update_rate=0.01), generator=torch.Generator().manual_seed(2))
    keys = [k for k in model.state_dict() if k.endswith(BIAS)]
    assert keys == [f"layers.0.mlp.gate.{BIAS}", f"layers.2.mlp.gate.{BIAS}"]
    assert all(float(model.state_dict()[k].abs().sum()) == 0.0 for k in keys)  # starts at 0
    getattr(model.layers[2].mlp.gate, BIAS).copy_(torch.tensor([0.1, -0.2, 0.0, 0.0, 0.3, 0.0]))
    out = model_forward(model, ModelInputs(_ids()))
    assert (float(out.metrics["layer2_bias_min"].sum), float(out.metrics["layer2_bias_max"].sum)) == \
        (pytest.approx(-0.2), pytest.approx(0.3))
    copy = generation_copy(model, dict(model.named_parameters()), dtype=torch.bfloat16)
    assert getattr(copy.layers[2].mlp.gate, BIAS).dtype == torch.float32  # the bias stays fp32
    assert torch.equal(getattr(copy.layers[2].mlp.gate, BIAS), getattr(model.layers[2].mlp.gate, BIAS))
    plain = build(_config(), generator=torch.Generator().manual_seed(2))
    assert plain.routers_with_bias() == [] and not any(k.endswith(BIAS) for k in plain.state_dict())


def test_bias_update_rate_is_hashed_only_when_set():
    moe = load(ROOT / "configs" / "tiny-moe.yaml")
    assert config_hash(moe) == config_hash(load(ROOT / "configs" / "tiny-moe.yaml",
                                                 ["model.qwen3_moe.bias_update_rate=0.0"]))
    assert config_hash(moe) != config_hash(load(ROOT / "configs" / "tiny-moe.yaml",
                                                 ["model.qwen3_moe.bias_update_rate=0.001"]))
    with pytest.raises(ConfigError, match="bias_update_rate must be a finite number >= 0") as err:
        load(ROOT / "configs" / "tiny-moe.yaml", ["model.qwen3_moe.bias_update_rate=-0.1"])
    assert err.value.context["key"] == "model.qwen3_moe.bias_update_rate"


def test_an_expert_parallel_degree_that_does_not_divide_the_experts_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"parallel.ep=3 does not divide model.qwen3_moe.num_experts=8") as err:
        load(ROOT / "configs" / "tiny-moe.yaml", ["parallel.ep=3"])
    assert err.value.context["key"] == "parallel.ep" and err.value.exit_code == 2


def test_a_checkpoint_of_another_expert_count_is_refused_naming_both_shapes(tmp_path):
    from core.config import CheckpointConfig
    from core.distributed_context import DistributedContext
    from core.exceptions import CheckpointError
    from training.checkpoint.manager import CheckpointManager

    dist = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo",
                              timeout_s=60)
    manager = CheckpointManager(CheckpointConfig(), checkpoint_dir=tmp_path, dist=dist)
    saved = build(_config(num_experts=4), generator=torch.Generator().manual_seed(1))
    manager.save(1, model=saved, optimizer=torch.optim.SGD(saved.parameters()), states={"trainer": {}, "data": {}})
    manager.wait()
    other = build(_config(num_experts=6), generator=torch.Generator().manual_seed(1))
    with pytest.raises(CheckpointError, match=r"layers.0.mlp.gate.weight has shape \[4, 32\] in the checkpoint, "
                                              r"but \[6, 32\]") as err:
        manager.load(manager.latest_intact()[1], model=other, optimizer=torch.optim.SGD(other.parameters()))
    assert err.value.exit_code == 4


def test_an_export_carries_the_balancing_bias_and_reads_back(tmp_path):
    config = _config(bias_update_rate=0.01)
    ours = build(config, generator=torch.Generator().manual_seed(3)).eval()
    getattr(ours.layers[2].mlp.gate, BIAS).copy_(torch.tensor([0.0, 0.5, 0.0, -0.5, 0.0, 0.25]))
    save_pretrained(ours, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["bias_update_rate"] == 0.01
    back = load_pretrained(tmp_path)  # no base: config.json alone says the routers carry a bias
    assert back.config.qwen3_moe.bias_update_rate == 0.01
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    ids = _ids(seed=1)
    with torch.no_grad():
        assert torch.equal(model_forward(ours, ModelInputs(ids)).logits, model_forward(back, ModelInputs(ids)).logits)
    plain = tmp_path / "plain"
    save_pretrained(build(_config(), generator=torch.Generator().manual_seed(3)), plain)
    started = load_pretrained(plain, base=config)  # a checkpoint without a bias: balancing starts at 0
    assert [float(getattr(r, BIAS).abs().sum()) for _, r in started.routers_with_bias()] == [0.0, 0.0]
