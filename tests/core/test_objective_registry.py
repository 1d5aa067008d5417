"""The objective kinds core.config reads configs with come from above (core/objective_kinds.py,
filled by training/registry.py):
the loader's errors, hashing, resumable keys and describe() cover what was registered, and a
kind registered by a test behaves as the built-in ones do."""

from __future__ import annotations

import dataclasses
import math
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest

from core import config as config_lib
from core import objective_kinds as registry
from core import registration
from core.exceptions import ConfigError
from core.objective_kinds import ObjectiveCapabilities, ObjectiveKind
from training.registry import OBJECTIVE_KINDS, register_all

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


@dataclass(frozen=True)
class ToySettings:
    strength: float = 1.0
    """How hard the toy objective pushes; > 0."""
    rounds: int = 2
    """Rounds per step (resumable)."""


def _validate_toy(config) -> None:
    strength = config.objective.toy.strength
    if not math.isfinite(strength) or strength <= 0:
        raise ConfigError(f"objective.toy.strength must be > 0, got {strength}", key="objective.toy.strength")


TOY = ObjectiveKind(
    name="toy",
    summary="a test's own objective",
    capabilities=ObjectiveCapabilities(bounded_tokens=True),
    settings=ToySettings,
    validate=_validate_toy,
    resumable=("rounds",),
)


@pytest.fixture
def toy():
    registry.register_objective(TOY)
    try:
        yield TOY
    finally:
        registry.unregister_objective(TOY.name)


def _refused(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as error:
        config_lib.load(TINY, list(overrides))
    return error.value


def test_the_registered_kinds_in_order_with_causal_lm_the_default():
    assert [k.name for k in registry.objective_kinds()] == ["causal_lm", "sft", "grpo", "dpo", "distill", "ppo", "reward_model"]
    assert registry.objective_kinds() == OBJECTIVE_KINDS
    objective = config_lib.Config().objective
    assert [f.name for f in dataclasses.fields(objective)] == ["kind", "grpo", "dpo", "distill", "ppo", "reward_model"]
    assert objective.kind == "causal_lm"


def test_an_unknown_kind_names_the_nearest_registered_one():
    error = _refused("objective.kind=dpoo")
    assert error.context["key"] == "objective.kind" and "did you mean 'dpo'?" in error.hint
    assert "'causal_lm' | 'sft' | 'grpo' | 'dpo' | 'distill'" in str(error)


def test_a_preference_loss_given_as_a_kind_gets_dpos_hint():
    for loss in ("orpo", "ORPO", "simpo", "ipo"):
        error = _refused(f"objective.kind={loss}")
        assert f"objective.kind=dpo objective.dpo.loss={loss.lower()}" in error.hint


def test_an_unknown_key_under_a_registered_section_names_the_nearest_key():
    error = _refused("objective.grpo.group_sise=4")
    assert error.context["key"] == "objective.grpo.group_sise" and "objective.grpo.group_size" in error.hint
    error = _refused("objective.dpoo.beta=0.1")
    assert "objective.dpo" in error.hint


def test_a_registered_kinds_checks_run_at_load():
    error = _refused("objective.kind=dpo", "objective.dpo.beta=0")  # dpo_settings.validate
    assert error.context["key"] == "objective.dpo.beta"
    error = _refused("objective.kind=sft")  # sft_settings.validate: tiny.yaml's source is text
    assert error.context["key"] == "data.sources"


def test_capabilities_decide_what_the_config_checks_refuse():
    error = _refused("objective.kind=dpo", "parallel.float8_head=true")
    assert "objective.kind causal_lm and sft" in str(error)
    error = _refused("objective.kind=dpo", "parallel.ddp_embedding_grad=gathered")
    assert "it supports causal_lm, sft, distill" in str(error)


def test_describe_has_a_row_for_every_field_of_every_registered_section():
    keys = [key for key, *_ in config_lib.describe()]
    for kind in registry.objective_kinds():
        if kind.settings is not None:
            expected = [f.name for f in dataclasses.fields(kind.settings)]
            prefix = f"objective.{kind.name}."
            rows = [k[len(prefix):] for k in keys if k.startswith(prefix) and "[i]" not in k]
            # A nested section (objective.grpo.environment) has a row per field of its own.
            assert list(dict.fromkeys(row.split(".")[0] for row in rows)) == expected
    kind_row = next(row for row in config_lib.describe() if row[0] == "objective.kind")
    assert all(f"{k.name} ({k.summary})" in kind_row[3] for k in registry.objective_kinds())


def test_a_kind_registered_by_a_test_loads_checks_describes_and_resumes(toy):
    config = config_lib.load(TINY, ["objective.kind=toy", "objective.toy.strength=2.5"])
    assert config.objective.kind == "toy" and config.objective.toy == ToySettings(strength=2.5)
    error = _refused("objective.kind=toy", "objective.toy.strength=-1")
    assert error.context["key"] == "objective.toy.strength"
    error = _refused("objective.kind=toy", "objective.toy.strenght=1")
    assert "objective.toy.strength" in error.hint
    rows = {key: doc for key, _, _, doc in config_lib.describe()}
    assert rows["objective.toy.strength"] == "How hard the toy objective pushes; > 0."
    assert config_lib.is_resumable("objective.toy.rounds") and not config_lib.is_resumable("objective.toy.strength")
    assert registry.objective_kind("toy").capabilities.bounded_tokens
    config_lib.load(TINY, ["objective.kind=toy", "parallel.ddp_embedding_grad=gathered"])  # it bounds its tokens


def test_registering_a_kind_leaves_every_other_configs_hash_alone(toy):
    """A kind registered after the built-in ones has its section hashed only once set."""
    registry.unregister_objective(toy.name)
    before = config_lib.config_hash(config_lib.load(TINY))
    registry.register_objective(toy)
    assert config_lib.config_hash(config_lib.load(TINY)) == before
    assert config_lib.config_hash(config_lib.load(TINY, ["objective.toy.rounds=3"])) != before


def test_a_name_is_registered_once():
    register_all()  # again: nothing changes
    with pytest.raises(ConfigError, match="registered twice"):
        registry.register_objective(dataclasses.replace(OBJECTIVE_KINDS[2], summary="another grpo"))
    with pytest.raises(ConfigError, match="must be a dataclass"):
        registry.register_objective(ObjectiveKind(name="bad", summary="", settings=dict))
    assert [k.name for k in registry.objective_kinds()] == ["causal_lm", "sft", "grpo", "dpo", "distill", "ppo", "reward_model"]


def test_every_kind_names_its_objective_class_once():
    from training.objectives import objective_class

    for kind in OBJECTIVE_KINDS:
        built = objective_class(kind.name)
        assert built.name == kind.name and built.capabilities is kind.capabilities, kind.objective


def test_a_kind_naming_no_class_or_not_a_class_is_a_config_error(toy):
    from training.objectives import objective_class

    with pytest.raises(ConfigError, match="names no objective class") as error:
        objective_class(TOY.name)  # TOY names none
    assert error.value.context["key"] == "objective.kind" and "objective=" in error.value.hint
    not_a_class = dataclasses.replace(TOY, name="toy_function", objective="core.config:load")
    registry.register_objective(not_a_class)
    try:
        with pytest.raises(ConfigError, match="'core.config:load' is not a class"):
            objective_class(not_a_class.name)
    finally:
        registry.unregister_objective(not_a_class.name)


def test_an_entry_script_builds_another_class_for_a_kind_in_its_place(monkeypatch):
    from training.objectives import objective_class

    monkeypatch.setattr(registry, "_REGISTERED", registry._Registered())
    with pytest.raises(ConfigError, match="no objective kind \\['nope'\\]"):
        register_all(objectives={"nope": "training.objectives.causal_lm:CausalLMObjective"})
    register_all(objectives={"ppo": "training.objectives.causal_lm:CausalLMObjective"})
    assert [k.name for k in registry.objective_kinds()] == [k.name for k in OBJECTIVE_KINDS]
    assert objective_class("ppo") is objective_class("causal_lm")
    assert registry.objective_kind("ppo").capabilities is OBJECTIVE_KINDS[5].capabilities
    register_all()  # train.main()'s own call keeps what the entry script registered
    assert objective_class("ppo") is objective_class("causal_lm")


def test_an_empty_registry_is_filled_by_the_registration_hook(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTERED", registry._Registered())
    monkeypatch.setattr(registration, "_CALLED", set())  # as in a fresh process
    config = config_lib.load(TINY)  # the loader calls training.registry:register_all itself
    assert [k.name for k in registry.objective_kinds()] == [k.name for k in OBJECTIVE_KINDS]
    assert config.objective.kind == "causal_lm"


def test_nothing_registered_is_an_error_saying_what_to_do(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTERED", registry._Registered())  # the hook ran already: nothing refills it
    with pytest.raises(ConfigError, match="no objective kinds are registered") as error:
        config_lib.load(TINY)
    assert "register_objective" in error.value.hint


def test_lora_targets_come_from_the_model_family():
    from core.model_families import model_family
    from models.qwen.lora_targets import LORA_TARGETS

    assert config_lib.LoRAConfig().targets == model_family("qwen3").lora_targets == LORA_TARGETS
    error = _refused("model.lora.rank=8", "model.lora.targets=[q_proj, gate_prj]")
    assert "did you mean 'gate_proj'?" in error.hint


def test_a_config_pickles_and_copies_whole():
    config = config_lib.load(TINY, ["objective.kind=dpo", "objective.dpo.beta=0.2",
                                    "data.sources=[{path: x, record: preference}]", "data.eval_source=null"])
    for copy in (pickle.loads(pickle.dumps(config)), dataclasses.replace(config)):
        assert copy == config and copy.hash == config.hash
        assert type(copy.objective) is config_lib.objective_config_class()
