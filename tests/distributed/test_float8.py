"""distributed/float8.py: which linears go FP8, the clear error where FP8 cannot run, and
the FP8 all-gather's scales computed once per forward.

The FP8 matmuls themselves need a CUDA GPU of compute capability 8.9+ (benchmarks cover
them there); here the conversion runs with torchao's CPU emulation, and FSDP2's FP8
all-gather runs on 2 spawned gloo ranks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import models
from core.config import ModelConfig, ParallelConfig, load
from core.exceptions import ConfigError
from distributed.float8 import (
    PrecomputeFloat8Scales,
    apply_float8,
    float8_module_filter,
    precast_local_shards,
    precompute_scales_each_forward,
    require_float8,
    require_float8_head,
    shard_amax,
)
from tests.distributed.dist_harness import run_on_ranks

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=16, tie_embeddings=False)
# Every block linear a multiple of 16, so the MLP converts too: 7 FP8 weights per block.
SHARDED = replace(TINY, intermediate_size=48, num_layers=2)
STEPS = 3


def test_require_float8_names_the_key_and_what_to_do():
    require_float8(ParallelConfig(), torch.device("cpu"))  # float8=none: nothing to check
    with pytest.raises(ConfigError) as err:
        require_float8(ParallelConfig(float8="tensorwise", precision="bf16"), torch.device("cpu"))
    assert err.value.context["key"] == "parallel.float8" and "CUDA" in str(err.value)
    assert "parallel.float8=none" in err.value.hint


def test_eligible_linears_convert_and_keep_their_parameters():
    pytest.importorskip("torchao.float8")
    model = models.build(TINY)
    before = dict(model.named_parameters())
    converted = apply_float8(model, ParallelConfig(float8="tensorwise", precision="bf16"), fsdp=False, emulate=True)
    # q/k/v/o are 32x32 or 16x32; the MLP's 40 is not a multiple of 16; the head never converts.
    assert sorted(converted) == [f"layers.0.self_attn.{n}_proj" for n in "koqv"]
    kinds = {name: type(module).__name__ for name, module in model.named_modules()}
    assert all(kinds[name] == "Float8Linear" for name in converted)
    assert kinds["lm_head"] == "Linear" and kinds["layers.0.mlp.up_proj"] == "Linear"
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()  # checkpoints load with FP8 on or off
    assert all(after[k].dtype == torch.float32 for k in after)  # master weights stay fp32
    ids = torch.randint(0, 64, (2, 16))
    loss = model(ids, position_ids=torch.arange(16).expand(2, 16), document_ids=torch.zeros(2, 16, dtype=torch.long)).float().mean()
    loss.backward()
    assert model.layers[0].self_attn.q_proj.weight.grad is not None


def test_backward_fast_accum_reaches_every_fp8_matmul_config():
    pytest.importorskip("torchao.float8")

    def accumulation(parallel: ParallelConfig) -> set[tuple[bool, bool, bool]]:
        model = models.build(TINY)
        apply_float8(model, parallel, fsdp=False, emulate=True)
        configs = [m.linear_mm_config for m in model.modules() if type(m).__name__ == "Float8Linear"]
        assert configs
        return {(c.output.use_fast_accum, c.grad_input.use_fast_accum, c.grad_weight.use_fast_accum) for c in configs}

    for recipe in ("tensorwise", "rowwise"):
        parallel = ParallelConfig(float8=recipe, precision="bf16")
        assert accumulation(parallel) == {(True, False, False)}  # torchao's recipe: only the forward
        assert accumulation(replace(parallel, float8_backward_fast_accum=True)) == {(True, True, True)}


def test_backward_fast_accum_needs_fp8():
    with pytest.raises(ConfigError) as err:
        load(None, ["parallel.float8_backward_fast_accum=true", "parallel.device=cuda"])
    assert err.value.context["key"] == "parallel.float8_backward_fast_accum"
    assert "parallel.float8=tensorwise" in err.value.hint
    loaded = load(None, ["parallel.float8=tensorwise", "parallel.float8_backward_fast_accum=true",
                         "parallel.device=cuda", "parallel.precision=bf16"])
    assert loaded.parallel.float8_backward_fast_accum


FP8_GPU = ["parallel.float8=tensorwise", "parallel.device=cuda", "parallel.precision=bf16"]


@pytest.mark.parametrize(
    "overrides, key, says",
    [
        (["parallel.tp=2", "parallel.strategy=none"], "parallel.float8_head", "parallel.tp=2"),
        (["parallel.strategy=xla_spmd"], "parallel.float8_head", "parallel.strategy=xla_spmd"),
        (FP8_GPU + ["objective.kind=dpo"], "parallel.float8_head", "objective.kind=dpo"),
        (FP8_GPU + ["train.loss_chunk_tokens=0"], "parallel.float8_head", "train.loss_chunk_tokens=0"),
        (FP8_GPU + ["model.vocab_size=500"], "model.vocab_size", "a multiple of 16 (FP8 matmul shapes); got 500"),
        (FP8_GPU + ["model.hidden_size=120", "model.head_dim=30", "model.num_heads=4"], "model.hidden_size", "got 120"),
    ],
)
def test_float8_head_refusals_name_their_key(overrides, key, says):
    with pytest.raises(ConfigError) as err:
        load(None, overrides + ["parallel.float8_head=true"])
    assert err.value.context["key"] == key
    assert says in str(err.value) and err.value.hint


def test_float8_head_stands_alone_and_runs_where_fp8_matmuls_run():
    """Without parallel.float8 too, and on the CPU (torch emulates the FP8 matmuls: tests)."""
    config = load(None, ["parallel.float8_head=true"])
    assert config.parallel.float8_head and config.parallel.float8 == "none"
    require_float8_head(config.parallel, torch.device("cpu"))
    require_float8_head(ParallelConfig(), torch.device("meta"))  # off: nothing is checked


def test_float8_head_reaches_the_fused_loss_of_causal_lm_and_sft():
    from training.objectives.causal_lm import CausalLMObjective
    from training.objectives.sft import SFTObjective

    config = load(None, FP8_GPU + ["parallel.float8_head=true", "parallel.float8_backward_fast_accum=true",
                                   "data.loss_on=all"])  # lets SFT take the default text source
    for objective in (CausalLMObjective(config), SFTObjective(config)):
        assert objective.loss_fn.float8 and objective.loss_fn.fuses_head
    assert not CausalLMObjective(load(None, FP8_GPU)).loss_fn.float8


def test_filter_rule():
    linear = torch.nn.Linear(32, 48)
    assert float8_module_filter(linear, "layers.0.mlp.up_proj", output="lm_head")
    assert not float8_module_filter(linear, "lm_head", output="lm_head")
    assert not float8_module_filter(torch.nn.Linear(32, 40), "layers.0.mlp.up_proj", output="lm_head")
    assert not float8_module_filter(torch.nn.LayerNorm(32), "norm", output="lm_head")


def test_scale_hook_only_where_weights_are_gathered_in_fp8():
    pytest.importorskip("torchao.float8")

    def hooked(parallel: ParallelConfig) -> bool:
        model = models.build(TINY)
        apply_float8(model, parallel, fsdp=True, emulate=True)
        registered = precompute_scales_each_forward(model, parallel)
        hooks = [hook for hook in model._forward_pre_hooks.values() if isinstance(hook, PrecomputeFloat8Scales)]
        assert registered == bool(hooks)
        return registered

    tensorwise = ParallelConfig(float8="tensorwise", precision="bf16")
    assert hooked(tensorwise)
    assert not hooked(replace(tensorwise, float8="rowwise"))  # rowwise gathers in bf16
    assert not hooked(replace(tensorwise, cpu_offload=True))  # the copy to the GPU drops the scale
    assert not precompute_scales_each_forward(models.build(TINY), tensorwise)  # no FP8 linear


def test_shard_amax_counts_an_empty_shard_as_zero():
    shards = [torch.tensor([[1.0, -3.0]]), torch.empty(0, 2), torch.tensor([[-0.5, 0.25]])]
    assert torch.equal(shard_amax(shards), torch.tensor([3.0, 0.0, 0.5]))
    assert torch.equal(shard_amax([torch.empty(0, 4)]), torch.zeros(1))
    assert torch.equal(shard_amax(shards[::2]), torch.tensor([3.0, 0.5]))


def _all_reduces(comm) -> int:
    return sum(n for op, n in comm.get_comm_counts().items() if "all_reduce" in str(op))


def _fsdp_float8_runs() -> dict:
    """On each of 2 ranks: STEPS AdamW steps of SHARDED under FSDP2 (distributed/fsdp.py's
    layout) with FP8 all-gather, scales from the hook, from torchao's per-weight path, and
    precomputed once only (stale after the first step). Per step: the forward's and the
    backward's all-reduces, whether every stored scale equals torchao's per-weight scale of
    the weights that forward began with (None if none is stored), and the loss."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_utils import tensor_to_scale
    from torchao.float8.fsdp_utils import precompute_float8_dynamic_scale_for_fsdp

    from distributed.fsdp import apply_fsdp
    from tests.distributed.scenarios import cpu_parallel

    # torchao is imported above, before gloo's threads exist (see tests/models/test_lora.py).
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    parallel = cpu_parallel(strategy="fsdp", precision="bf16", float8="tensorwise")
    tokens = torch.randint(0, SHARDED.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    results = {}
    for mode in ("hook", "per_weight", "stale"):
        model = models.build(SHARDED, generator=torch.Generator().manual_seed(0))
        converted = apply_float8(model, parallel, fsdp=True, emulate=True)
        apply_fsdp(model, mesh, parallel, torch.device("cpu"))  # block 0 is regathered in the backward
        if mode == "hook":
            assert precompute_scales_each_forward(model, parallel)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, all_reduces, scales_match, hook_first = [], [], [], []
        consumed, precast_used, precast_like_torchao, used_once, stale_skipped = [], [], [], [], []
        for step in range(STEPS):
            if mode == "stale" and step == 0:
                precompute_float8_dynamic_scale_for_fsdp(model)
            with CommDebugMode() as comm:
                logits = model(tokens[:, :-1])
            hook_first.append(isinstance(next(iter(model._forward_pre_hooks.values())), PrecomputeFloat8Scales))
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            with CommDebugMode() as backward_comm:
                loss.backward()
            all_reduces.append((_all_reduces(comm), _all_reduces(backward_comm)))
            if mode == "hook":  # sharded again, and not yet stepped: the weights this forward began with
                matches = []
                for module in model.modules():
                    if isinstance(module, Float8Linear):
                        local = module.weight._local_tensor
                        dynamic = tensor_to_scale(local._tensor, local._dtype, reduce_amax=True, device_mesh=mesh)
                        scale = local._precomputed_scale
                        matches.append(None if scale is None else torch.equal(scale, dynamic))
                scales_match.append(matches)
                weights = [m.weight for m in model.modules() if isinstance(m, Float8Linear)]
                shards = [weight._local_tensor for weight in weights]
                consumed.append(["_lockstep_float8_cast" not in shard.__dict__ for shard in shards])
                scales = [shard._precomputed_scale for shard in shards]
                precast_local_shards(weights, scales, shards[0]._dtype)  # as the hook did
                casts = [shard._lockstep_float8_cast.data for shard in shards]
                gathered = [shard.fsdp_pre_all_gather(mesh) for shard in shards]
                precast_used.append([inputs[0] is cast for cast, (inputs, _) in zip(casts, gathered)])
                precast_like_torchao.append([_same_gather(mine, type(shard).fsdp_pre_all_gather(shard, mesh))
                                             for shard, mine in zip(shards, gathered)])
                again = [shard.fsdp_pre_all_gather(mesh) for shard in shards]  # used once: torchao's cast now
                used_once.append([inputs[0] is not cast and _same_gather((inputs, meta), mine)
                                  for cast, (inputs, meta), mine in zip(casts, again, gathered)])
                precast_local_shards(weights, scales, shards[0]._dtype)
                casts = [shard._lockstep_float8_cast.data for shard in shards]
            optimizer.step()
            if mode == "hook":  # stepped: the casts are stale, and torchao's cast of the new weights is used
                after = [shard.fsdp_pre_all_gather(mesh) for shard in shards]
                stale_skipped.append([inputs[0] is not cast
                                      and _same_gather((inputs, metadata), type(shard).fsdp_pre_all_gather(shard, mesh))
                                      for cast, shard, (inputs, metadata) in zip(casts, shards, after)])
            optimizer.zero_grad()
            losses.append(loss.detach())
        load_makes_stale = None
        if mode == "hook":  # a checkpoint load, as training/checkpoint/manager.py does it, after a forward's casts
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

            model(tokens[:, :-1])
            precast_local_shards(weights, [shard._precomputed_scale for shard in shards], shards[0]._dtype)
            assert all(shard._lockstep_float8_cast.current(shard) for shard in shards)
            set_model_state_dict(model, {k: v.detach().clone() for k, v in get_model_state_dict(model).items()})
            load_makes_stale = [not shard._lockstep_float8_cast.current(shard) for shard in shards]
        results[mode] = {"converted": len(converted), "losses": torch.stack(losses), "all_reduces": all_reduces,
                         "scales_match": scales_match, "hook_first": hook_first, "precast_used": precast_used,
                         "precast_like_torchao": precast_like_torchao, "stale_skipped": stale_skipped,
                         "consumed": consumed, "used_once": used_once,
                         "load_makes_stale": load_makes_stale}
    return results


def _same_gather(a, b) -> bool:
    """Two ``fsdp_pre_all_gather`` results: the same FP8 bytes and the same scales."""
    (inputs_a, meta_a), (inputs_b, meta_b) = a, b
    return (len(inputs_a) == len(inputs_b) and all(x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                                                   for x, y in zip(inputs_a, inputs_b))
            and all(torch.equal(x, y) for x, y in zip(meta_a, meta_b)))


def test_precomputed_scales_train_bitwise_like_the_per_weight_path():
    pytest.importorskip("torchao.float8")
    for ranks in run_on_ranks(_fsdp_float8_runs, 2):
        hook, per_weight, stale = ranks["hook"], ranks["per_weight"], ranks["stale"]
        assert hook["converted"] == 14
        assert torch.equal(hook["losses"], per_weight["losses"])
        assert hook["hook_first"] == [True] * STEPS  # ahead of FSDP's root hook
        assert hook["scales_match"] == [[True] * 14] * STEPS
        # The hook's batched casts are what the all-gathers send (the forward's gathers consumed
        # every one), byte for byte torchao's casts, once each, and once an optimizer step
        # changed the weights they are not used.
        assert hook["consumed"] == [[True] * 14] * STEPS
        assert hook["precast_used"] == [[True] * 14] * STEPS
        assert hook["used_once"] == [[True] * 14] * STEPS
        assert hook["precast_like_torchao"] == [[True] * 14] * STEPS
        assert hook["stale_skipped"] == [[True] * 14] * STEPS
        assert hook["load_makes_stale"] == [True] * 14
        # (forward, backward) all-reduces: one per forward instead of one per FP8 weight, and
        # none instead of block 0's 7 when the backward gathers it again.
        assert hook["all_reduces"] == [(1, 0)] * STEPS
        assert per_weight["all_reduces"] == [(14, 7)] * STEPS
        # Scales kept past an optimizer step change the training: the comparison above would see it.
        assert torch.equal(stale["losses"][0], hook["losses"][0])
        assert not torch.equal(stale["losses"][1:], hook["losses"][1:])


def _local_shard_optimizer_runs() -> dict:
    """On each of 2 ranks: SHARDED with FP8 all-gather under FSDP2, 3 AdamW steps stepping on
    the local shards (FP8 weights: the fp32 tensor inside torchao's wrapper) and 3 through
    DTensor's dispatch; whether losses, parameters and state agree bit for bit, and whether
    the state kept its DTensor layout."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear

    from distributed.fsdp import apply_fsdp
    from tests.distributed.scenarios import cpu_parallel
    from training.optimizers.local_shards import LocalShardAdamW, _swappable

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    parallel = cpu_parallel(strategy="fsdp", precision="bf16", float8="tensorwise")
    tokens = torch.randint(0, SHARDED.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    runs = {}
    for local in (True, False):
        model = models.build(SHARDED, generator=torch.Generator().manual_seed(0))
        apply_float8(model, parallel, fsdp=True, emulate=True)
        apply_fsdp(model, mesh, parallel, torch.device("cpu"))
        precompute_scales_each_forward(model, parallel)
        optimizer = LocalShardAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        optimizer.step_on_local_shards = local
        losses, swappable, stale = [], [], []
        for _ in range(STEPS):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            swappable.append(all(_swappable(m.weight) for m in model.modules() if isinstance(m, Float8Linear)))
            weights = [m.weight for m in model.modules() if isinstance(m, Float8Linear)]
            shards = [weight._local_tensor for weight in weights]
            precast_local_shards(weights, [shard._precomputed_scale for shard in shards], shards[0]._dtype)
            optimizer.step()
            stale.append([not shard._lockstep_float8_cast.current(shard) for shard in shards])
            optimizer.zero_grad()
            losses.append(loss.detach())
        params = [p.to_local() for p in model.parameters()]
        params = [getattr(p, "_tensor", p) for p in params]  # FP8 weights: the fp32 tensor inside
        state = [{k: v for k, v in optimizer.state[p].items()} for p in model.parameters()]
        layout = all(isinstance(v, DTensor) and v.placements == p.placements
                     for p in model.parameters() for k, v in optimizer.state[p].items() if k != "step")
        runs[local] = {"losses": torch.stack(losses), "params": params, "state": state, "layout": layout,
                       "fp8_swappable": swappable, "stale": stale}
    same_state = all(
        sorted(a) == sorted(b) and all(torch.equal(getattr(a[k], "_local_tensor", a[k]), getattr(b[k], "_local_tensor", b[k]))
                                       for k in a)
        for a, b in zip(runs[True]["state"], runs[False]["state"])
    )
    return {
        "losses_equal": torch.equal(runs[True]["losses"], runs[False]["losses"]),
        "params_equal": all(torch.equal(a, b) for a, b in zip(runs[True]["params"], runs[False]["params"])),
        "state_equal": same_state, "layout_kept": runs[True]["layout"],
        "fp8_swappable": runs[True]["fp8_swappable"],
        # A step on the local shards (True) or through DTensor (False) makes the forward's FP8 casts stale.
        "stale_after_step": {local: run["stale"] for local, run in runs.items()},
    }


def test_fp8_weights_step_on_their_local_shards_like_through_dtensor():
    pytest.importorskip("torchao.float8")
    for result in run_on_ranks(_local_shard_optimizer_runs, 2):
        assert result["fp8_swappable"] == [True] * STEPS  # FP8 weights take the local path
        assert result["losses_equal"] and result["params_equal"] and result["state_equal"], result
        assert result["layout_kept"]
        assert result["stale_after_step"] == {True: [[True] * 14] * STEPS, False: [[True] * 14] * STEPS}
