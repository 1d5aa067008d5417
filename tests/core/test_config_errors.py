"""Every violated constraint of a config at once (core/config_errors.py): one error as it always read,
several as one ConfigErrors with a line each, and a check that reads a section already found wrong
left out (so nothing is reported twice, and no check runs on a value known to be wrong)."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest

from core import config as config_lib
from core.config_errors import ConfigErrors, check_each, check_independent, section_of
from core.exceptions import ConfigError, ExitCode
from models.config_checks import validate_model
from tests import launch
from training.command_line import check_before_ranks

TINY = str(launch.ROOT / "configs" / "tiny.yaml")
THREE_WRONG = ["train.lr=-1", "model.num_layers=0", "data.seq_len=-5"]
CONFIGS = launch.ROOT / "configs"


def _refusal(overrides: list[str], world_size: int | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config_lib.load(TINY, overrides, world_size=world_size)
    return info.value


def test_several_violations_are_named_together_one_a_line():
    error = _refusal(THREE_WRONG)
    assert isinstance(error, ConfigErrors) and error.exit_code == ExitCode.CONFIG
    assert str(error).splitlines() == [
        "config error: 3 violated constraints, one a line:",
        "  train.lr must be a finite number >= 0, got -1.0 [key=train.lr]",
        "  data.seq_len must be > 0, got -5 [key=data.seq_len]",
        "  model.num_layers must be > 0, got 0 [key=model.num_layers]",
    ]
    assert error.context == {"key": "train.lr"}  # the first one's, as a loader stopping there raised it


def test_checks_of_every_layer_and_their_hints_are_listed():
    """Core's fields, a registered check (distributed/), the objective kind's and held-out generation's."""
    error = _refusal(["runtime.gc_interval=-1", "parallel.fsdp_unit_blocks=0", "objective.kind=dpo",
                      "train.eval_generate.source.path=x", "train.eval_generate.source.record=prompt",
                      "train.eval_generate.prompts=0", "train.eval_generate.samples=-1"])
    assert [e.context["key"] for e in error.errors] == [
        "runtime.gc_interval", "parallel.fsdp_unit_blocks", "data.sources",
        "train.eval_generate.prompts", "train.eval_generate.samples"]
    lines = str(error).splitlines()[1:]
    assert len(lines) == 5 and all(f"[key={e.context['key']}]" in line for e, line in zip(error.errors, lines))
    assert lines[0].endswith("-> 0 leaves Python's automatic garbage collection on")
    assert lines[1].endswith("-> 1 shards every transformer block on its own")


def test_one_violation_reads_as_it_always_did():
    error = _refusal(["train.lr=-1"])
    assert type(error) is ConfigError
    assert str(error) == "config error: train.lr must be a finite number >= 0, got -1.0 [key=train.lr]"
    error = _refusal(["data.sources=[{path: x, weight: .inf}]"])
    assert str(error) == ("config error: data.sources[0].weight must be a finite number > 0, got inf "
                          "[key=data.sources[0].weight]")


def test_a_check_reading_a_wrong_section_is_left_out():
    """The batch shape divides by the micro-batch: with it refused, the check does not run (it would
    divide by zero) and says nothing about divisibility."""
    error = _refusal(["train.micro_batch_size=0", "data.seq_len=-5"], world_size=2)
    assert [e.context["key"] for e in error.errors] == ["train.micro_batch_size", "data.seq_len"]
    assert "divisible" not in str(error)


def test_a_violation_two_checks_see_is_reported_once():
    """qwen3_moe's settings are checked by the family's own validate and again where its shape
    resolves (core.config_checks.check_model_shape, asked last): the second reads the section the
    first found wrong and stops."""
    error = _refusal(["model.arch=qwen3_moe", "model.qwen3_moe.num_experts=0", "train.lr=-1"])
    assert [e.context["key"] for e in error.errors] == ["train.lr", "model.qwen3_moe.num_experts"]
    error = _refusal(["model.arch=qwen3_moe", "model.num_layers=0"])
    assert str(error) == ("config error: model.qwen3_moe: no layer of model.num_layers=0 is a mixture of experts "
                          "(decoder_sparse_step=1, mlp_only_layers=[]) [key=model.qwen3_moe.decoder_sparse_step] "
                          "-> use model.arch qwen3 for a dense model")


def test_a_check_called_on_its_own_raises_all_it_found():
    """validate_model outside the loader collects on its own: the vocabulary and LoRA at once."""
    config = config_lib.from_dict({"model": {"vocab_size": 0, "lora": {"rank": -1}}})
    with pytest.raises(ConfigErrors) as info:
        validate_model(config)
    assert [e.context["key"] for e in info.value.errors] == ["model.vocab_size", "model.lora.rank"]
    check_each(config_lib.load(TINY), (validate_model, None))  # a valid config: nothing raised


def test_checks_of_a_section_collect_into_the_loaders_collection():
    """check_each on a section's view, from inside a check: each check gets that section, and what
    they raise joins the outer collection, gated by what it found before."""
    def lora_checks(view):
        check_each(view.model.lora, (lambda lora: lora.rank, refuse_alpha, refuse_rank))

    def refuse_alpha(lora):
        raise ConfigError(f"alpha {lora.alpha}", key="model.lora.alpha")

    def refuse_rank(lora):
        raise ConfigError(f"rank {lora.rank}", key="model.lora.rank")  # model.lora is wrong by then: left out

    def refuse_lr(view):
        raise ConfigError("lr", key="train.lr")

    with pytest.raises(ConfigErrors) as info:
        check_each(config_lib.load(TINY), (refuse_lr, lora_checks))
    assert [e.message for e in info.value.errors] == ["lr", "alpha 16.0"]


def test_the_check_before_ranks_lists_them_all():
    with pytest.raises(ConfigErrors) as info:
        check_before_ranks(["--config", TINY, *THREE_WRONG, "parallel.device=cpu"], 2)
    assert len(info.value.errors) == 3


def test_a_keys_section_is_the_dataclass_that_holds_it():
    config = config_lib.load(TINY)
    assert section_of(config, "train.lr") == "train"
    assert section_of(config, "parallel") == "parallel"
    assert section_of(config, "model.lora.rank") == "model.lora"
    assert section_of(config, "data.sources[0].path") == "data"
    assert section_of(config, "train.eval_generate.prompts") == "train.eval_generate"
    assert section_of(config, "") == section_of(config, "no.such.key") == ""


def test_a_check_sees_sections_as_they_are_until_one_is_wrong():
    config = config_lib.load(TINY)
    seen = []

    def look(view):
        seen.append((isinstance(view.model, type(config.model)), view.model == config.model,
                     view.model.lora == config.model.lora, view.data.sources == config.data.sources))

    def refuse_lr(view):
        raise ConfigError("wrong", key="train.lr")

    check_each(config, (look,))
    def compares_train(view):
        if view.train == config.train:
            raise ZeroDivisionError  # never reached: train is wrong by then

    def reads_lr(view):
        raise ZeroDivisionError(view.train.lr)  # the same

    with pytest.raises(ConfigError) as info:
        check_each(config, (refuse_lr, compares_train, reads_lr, look))
    assert str(info.value) == "config error: wrong [key=train.lr]"
    assert seen == [(True, True, True, True)] * 2


def test_independent_checks_are_each_gated_only_by_what_was_found_before_them():
    """check_each leaves out a check reading a section an earlier one found wrong; check_independent runs
    each as if it were the first, so both train.* violations are named, while a check reading the section
    found wrong before the group (train, by refuse_lr) is still left out."""
    def refuse_warmup(view):
        raise ConfigError(f"warmup {view.train.warmup_steps}", key="train.warmup_steps")

    def refuse_max_steps(view):
        raise ConfigError(f"max_steps {view.train.max_steps}", key="train.max_steps")

    def refuse_vocab(view):
        raise ConfigError(f"vocab {view.model.vocab_size}", key="model.vocab_size")

    def refuse_layers(view):
        raise ConfigError(f"layers {view.model.num_layers}", key="model.num_layers")

    config = config_lib.load(TINY)
    with pytest.raises(ConfigErrors) as info:
        check_independent(config, (refuse_warmup, None, refuse_max_steps))
    warmup, max_steps = f"warmup {config.train.warmup_steps}", f"max_steps {config.train.max_steps}"
    assert [e.message for e in info.value.errors] == [warmup, max_steps]
    with pytest.raises(ConfigError) as single:
        check_each(config, (refuse_warmup, refuse_max_steps))
    assert type(single.value) is ConfigError and single.value.message == warmup

    def refuse_lr(view):
        raise ConfigError("lr", key="train.lr")

    with pytest.raises(ConfigErrors) as info:
        check_each(config, (refuse_lr, lambda view: check_independent(view, (refuse_warmup, refuse_vocab,
                                                                             refuse_layers))))
    assert [e.message for e in info.value.errors] == ["lr", f"vocab {config.model.vocab_size}",
                                                      f"layers {config.model.num_layers}"]


def test_a_group_inside_a_check_ends_that_check_unless_all_of_it_passed():
    """Code after a group (check_each or check_independent, called with a view) runs only once every
    check of the group passed: not after a violation, nor after a check left out at a wrong section."""
    ran = []

    def group_then_more(checks):
        def check(view):
            check_independent(view, checks)
            ran.append(len(checks))
        return check

    def refuse_lr(view):
        raise ConfigError("lr", key="train.lr")

    def reads_lr(view):
        return view.train.lr

    config = config_lib.load(TINY)
    check_each(config, (group_then_more((reads_lr,)),))
    assert ran == [1]
    with pytest.raises(ConfigError, match="lr"):
        check_each(config, (group_then_more((reads_lr, refuse_lr)),))
    with pytest.raises(ConfigError, match="lr"):
        check_each(config, (refuse_lr, group_then_more((reads_lr, reads_lr, reads_lr))))
    assert ran == [1]


def _keys(error: ConfigError) -> list[str]:
    return [e.context["key"] for e in error.errors] if isinstance(error, ConfigErrors) else [error.context["key"]]


def test_parallel_checks_name_every_violation():
    """distributed/config_checks.py: parallel.* on its own, against the model (ddp_embedding_grad) and the
    objective, and FP8's keys, each violation named with its own message and hint."""
    error = _refusal(["parallel.ep=0", "parallel.fsdp_unit_blocks=0", "parallel.ddp_embedding_grad=gathered",
                      "model.tie_embeddings=false"])
    assert str(error).splitlines() == [
        "config error: 3 violated constraints, one a line:",
        "  parallel.ep must be >= 1, got 0 [key=parallel.ep] -> 1 keeps every expert on every rank (no expert "
        "parallelism)",
        "  parallel.fsdp_unit_blocks must be >= 1, got 0 [key=parallel.fsdp_unit_blocks] -> 1 shards every "
        "transformer block on its own",
        "  parallel.ddp_embedding_grad=gathered applies to tied embeddings; model.tie_embeddings is false "
        "[key=parallel.ddp_embedding_grad] -> remove parallel.ddp_embedding_grad (dense is the default): an untied "
        "embedding's gradient has no head part to reduce early",
    ]
    error = _refusal(["parallel.float8=tensorwise", "parallel.tp=2", "parallel.float8_head=true",
                      "train.loss_chunk_tokens=0", "model.hidden_size=65"])
    assert _keys(error) == ["parallel.precision", "parallel.float8", "parallel.float8_head", "parallel.float8_head",
                            "model.hidden_size"]
    assert "train.loss_chunk_tokens=0 computes the full logits" in str(error.errors[3])


def test_optimizer_checks_name_every_violation():
    error = _refusal(["train.optimizer=schedule_free_adamw", "train.muon_ns_steps=0", "train.lion_beta1=2"])
    assert str(error).splitlines()[1:] == [
        "  train.optimizer=schedule_free_adamw averages its iterates instead of decaying the LR; train.schedule=cosine "
        "would decay it as well [key=train.schedule] -> set train.schedule=constant (train.warmup_steps still applies)",
        "  train.muon_ns_steps must lie in [1, 100), got 0 [key=train.muon_ns_steps]",
        "  train.lion_beta1 must lie in [0, 1), got 2.0 [key=train.lion_beta1]",
    ]


def test_the_models_shape_names_every_violation_and_relates_only_valid_sizes():
    error = _refusal(["model.num_heads=6", "model.num_kv_heads=4", "model.rope_theta=-1", "model.init_std=0"])
    assert str(error).splitlines()[1:] == [
        "  model.num_heads=6 is not divisible by model.num_kv_heads=4 [key=model.num_kv_heads]",
        "  model.rope_theta must be > 0, got -1.0 [key=model.rope_theta]",
        "  model.init_std must be > 0, got 0.0 [key=model.init_std]",
    ]
    from models.qwen.dims import resolve_dims  # its own checks, as the family's parameter count asks them

    model = config_lib.load(TINY, []).model
    with pytest.raises(ConfigErrors) as info:
        resolve_dims(dataclasses.replace(model, num_kv_heads=0, head_dim=None, hidden_size=64, num_heads=6,
                                         rms_norm_eps=0.0))
    assert [e.context["key"] for e in info.value.errors] == ["model.num_kv_heads", "model.head_dim", "model.rms_norm_eps"]


def test_a_familys_validate_names_every_violation():
    """models/qwen3_moe/family.py: its section's sizes, its balancing rates and model.qk_norm at once;
    num_experts_per_tok and parallel.ep's split are judged against num_experts only once it is valid."""
    moe = str(CONFIGS / "tiny-moe.yaml")
    with pytest.raises(ConfigErrors) as info:
        config_lib.load(moe, ["model.qwen3_moe.num_experts=0", "model.qwen3_moe.router_aux_loss_coef=-1",
                              "model.qk_norm=false", "parallel.ep=2"])
    assert str(info.value).splitlines()[1:] == [
        "  model.qwen3_moe.num_experts must be >= 1, got 0 [key=model.qwen3_moe.num_experts]",
        "  model.qwen3_moe.router_aux_loss_coef must be a finite number >= 0, got -1.0 "
        "[key=model.qwen3_moe.router_aux_loss_coef]",
        "  Qwen3-MoE's attention always normalizes q and k per head: model.qk_norm=false has no Qwen3MoeForCausalLM "
        "to compute it [key=model.qk_norm] -> leave model.qk_norm unset",
    ]
    with pytest.raises(ConfigErrors) as info:  # the vision family: its tower, the images and parallel.tp
        config_lib.load(str(CONFIGS / "tiny-vl-sft.yaml"), ["model.qwen2_5_vl.depth=0", "data.images.merge_size=3",
                                                          "parallel.tp=2"])
    assert _keys(info.value) == ["model.qwen2_5_vl.depth", "data.images.merge_size", "parallel.tp"]


def test_an_objectives_validate_names_every_violation():
    """training/objectives/grpo_settings.py: its own keys and its data at once, beside core's train.lr;
    overlong_buffer is judged against max_new_tokens only once that is valid."""
    with pytest.raises(ConfigErrors) as info:
        config_lib.load(str(CONFIGS / "tiny-grpo.yaml"), [
            "train.lr=-1", "objective.grpo.group_size=1", "objective.grpo.max_new_tokens=0",
            "objective.grpo.overlong_buffer=5", "data.sources=[{path: x, record: text}]"])
    assert str(info.value).splitlines()[1:] == [
        "  train.lr must be a finite number >= 0, got -1.0 [key=train.lr]",
        "  objective.grpo.group_size must be >= 2 (advantages compare completions of one prompt), got 1 "
        "[key=objective.grpo.group_size]",
        "  objective.grpo.max_new_tokens must be >= 1, got 0 [key=objective.grpo.max_new_tokens]",
        "  objective.kind=grpo needs prompt sources only (data.sources[i].record: prompt) [key=data.sources] -> "
        'records {"prompt": ..., "answer": ...}; e.g. datasets/tasks/rl',
    ]
    with pytest.raises(ConfigErrors) as info:  # PPO's constraints between its keys, each named
        config_lib.load(str(CONFIGS / "tiny-ppo.yaml"), ["objective.ppo.kl_target=1", "objective.ppo.kl_coef=0",
                                                        "objective.ppo.kl_horizon=1", "objective.ppo.minibatches=3"])
    assert _keys(info.value) == ["objective.ppo.kl_coef", "objective.ppo.kl_horizon", "objective.ppo.minibatches"]


EVERY_OWNER = ["parallel.ep=0", "parallel.fsdp_unit_blocks=0", "train.lion_beta1=2", "train.muon_ns_steps=0",
               "model.arch=qwen3_moe", "model.qwen3_moe.num_experts=0", "model.qwen3_moe.router_aux_loss_coef=-1",
               "objective.kind=dpo", "objective.dpo.beta=0", "objective.dpo.lam=-1"]
EVERY_OWNER_LINES = [
    "parallel.ep must be >= 1, got 0 [key=parallel.ep]",
    "parallel.fsdp_unit_blocks must be >= 1, got 0 [key=parallel.fsdp_unit_blocks]",
    "train.muon_ns_steps must lie in [1, 100), got 0 [key=train.muon_ns_steps]",
    "train.lion_beta1 must lie in [0, 1), got 2.0 [key=train.lion_beta1]",
    "model.qwen3_moe.num_experts must be >= 1, got 0 [key=model.qwen3_moe.num_experts]",
    "model.qwen3_moe.router_aux_loss_coef must be a finite number >= 0, got -1.0",
    "objective.dpo.beta must be > 0, got 0.0 [key=objective.dpo.beta]",
    "objective.dpo.lam must be >= 0, got -1.0 [key=objective.dpo.lam]",
    "objective.kind=dpo needs preference sources only",
]


@pytest.mark.slow  # it starts train.py (tests/conftest.py, STARTS_PROCESSES)
def test_nproc_names_every_owners_violations_before_any_rank_starts(tmp_path):
    """python train.py --nproc 2: two violations of each owner (parallel, the optimizer, the family, the
    objective) and the objective's data, one a line, exit 2, no rank started and nothing written."""
    cmd = [launch.PYTHON, str(launch.ROOT / "train.py"), "--nproc", "2", "--config", TINY, *EVERY_OWNER]
    result = subprocess.run(cmd, cwd=tmp_path, env=launch.env(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == ExitCode.CONFIG, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == f"config error: {len(EVERY_OWNER_LINES)} violated constraints, one a line:", lines
    assert len(lines) == 1 + len(EVERY_OWNER_LINES), lines
    for line, expected in zip(lines[1:], EVERY_OWNER_LINES):
        assert line.startswith(f"  {expected}"), (line, expected)
    assert "[rank" not in result.stderr and "run_id:" not in result.stderr
    assert list(tmp_path.iterdir()) == [tmp_path / "tmp"] and not any((tmp_path / "tmp").iterdir())
