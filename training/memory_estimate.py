"""What a run's models keep in memory, estimated from their configs before anything is built.

Every model a run builds is counted: the trained model (its fp32 parameters, their gradients
and the optimizer's state; with LoRA the frozen base's weights, the adapters being small) and
every frozen model its objective builds (``frozen_sources(config)`` of the objective class: a
reference, a teacher, a reward model), whose fp32 weights stay resident without gradients or
optimizer state, and every model the objective trains beside the policy (``part_sources(config)``:
PPO's critic), counted as the trained model is (its trunk and head, their gradients and the
optimizer's state). Under ``fsdp`` each rank holds 1/world of the policy and of every frozen model;
a part beside the policy is replicated on every rank (training/plan.py ``wrap_part``). Activations are not counted: this is a
lower bound, so a refusal is certain, never a guess.

``check_run_fits`` runs before the process group and the run dir exist, so a model that cannot
fit (a teacher with ``hidden_size`` 1e7, a million layers) is a ConfigError (exit 2) naming the
largest model's config key, instead of an allocation that takes the host down. Asking each
frozen source for its model config also refuses a bad source (neither ``init``, ``run:RUN_ID``
nor a Hugging Face directory) there, before the run dir, and so does a Hugging Face directory
(``model.init_from``, a reference, a teacher) whose safetensors files are missing (the files are
checked, not read).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import Config, ModelConfig
from core.distributed_context import ProcessInfo
from core.exceptions import ConfigError
from models import model_config_from_hf
from models.hf_weights import check_weight_files
from models.flops import num_params
from runtime.memory import check_training_state_fits

FROZEN_BYTES_PER_PARAM = 4
"""A frozen model's resident bytes per parameter: its fp32 weight (no gradient, no optimizer state)."""
# Bytes per trained parameter beyond activations: the fp32 parameter and its gradient, plus the
# optimizer's state (AdamW: two moments; Lion, Muon: one buffer).
_OPTIMIZER_STATE_BYTES = {"adamw": 8, "schedule_free_adamw": 8, "lion": 4, "muon": 4}


@dataclass(frozen=True)
class ModelFootprint:
    """One model of the run, as the estimate counts it."""

    key: str
    """The config key that names it (``model``, ``objective.distill.teacher``...)."""
    role: str
    """What it is: the trained model, a reference, a teacher."""
    params: int
    bytes_per_param: int
    weights: str | None = None
    """The Hugging Face directory its weights are read from (None: initialized, or a run's checkpoint)."""
    sharded: bool = True
    """Spread over the ranks under fsdp (False: a replica on every rank, as a part beside the policy)."""
    frozen_params: int = 0
    """Parameters of a trained model that are never trained (a critic's untied output projection): weights only."""

    @property
    def bytes(self) -> int:
        return self.params * self.bytes_per_param + self.frozen_params * FROZEN_BYTES_PER_PARAM

    def describe(self) -> str:
        return f"{self.role} of {(self.params + self.frozen_params) / 1e6:,.1f}M parameters"


def trained_model_config(config: Config) -> ModelConfig:
    model = config.model
    return model if model.init_from is None else model_config_from_hf(model.init_from, base=model)


def run_footprints(config: Config) -> list[ModelFootprint]:
    """The trained model, every frozen model the objective builds, then every model it trains beside
    the policy (ConfigError for a bad source)."""
    from training.objectives import objective_class

    model = trained_model_config(config)
    trained = 8 + _OPTIMIZER_STATE_BYTES.get(config.train.optimizer, 8)
    out = [ModelFootprint("model", "a model", num_params(model), 4 if model.lora.rank > 0 else trained,
                          weights=model.init_from)]
    objective = objective_class(config.objective.kind)
    declared = getattr(objective, "frozen_sources", None)
    for key, source in (declared(config) if declared is not None else {}).items():
        shape = _source_shape(config, model, source, key)
        out.append(ModelFootprint(key, _role(key), num_params(shape), FROZEN_BYTES_PER_PARAM, weights=shape.init_from))
    declared = getattr(objective, "part_sources", None)
    for key, source in (declared(config) if declared is not None else {}).items():
        shape = _source_shape(config, model, source, key)
        head = shape.hidden_size + 1  # a scalar head, Linear(hidden, 1) with its bias (PPO's value head)
        # An untied output projection is never used (the head replaces it) and so not trained.
        unused = 0 if shape.tie_embeddings else shape.vocab_size * shape.hidden_size
        out.append(ModelFootprint(key, _role(key), num_params(shape) - unused + head, trained,
                                  weights=shape.init_from, sharded=False, frozen_params=unused))
    return out


def _source_shape(config: Config, model: ModelConfig, source: str, key: str) -> ModelConfig:
    """The model config of a frozen or part source; ``init`` is the trained model's starting point
    (its shape is init_from's config.json's, if set)."""
    from training.objectives.frozen import frozen_model_config

    return model if source == "init" else frozen_model_config(config, source, key=key)


def _role(key: str) -> str:
    """What the model a config key names is: a reference, a teacher, a critic, a reward model (``...rewards[i].path``)."""
    leaf = key.rsplit(".", 1)[-1]
    return "a reward model" if leaf == "path" else f"a {leaf}"


def check_run_fits(config: Config, device, info: ProcessInfo) -> None:
    """Refuse (exit 2) a run whose models cannot fit where they live, before anything is allocated."""
    models = run_footprints(config)
    shards = info.world_size if config.parallel.strategy == "fsdp" else 1
    largest = max(models, key=lambda m: m.bytes)
    check_training_state_fits(
        sum(m.bytes for m in models if m.sharded) // shards + sum(m.bytes for m in models if not m.sharded),
        device,
        ranks_sharing=info.local_world_size if device.type != "cuda" else 1,
        what=" and ".join(m.describe() for m in models),
        key=largest.key,
    )
    for footprint in models:  # a directory without its weight files fails here, not after the run dir exists
        if footprint.weights is not None:
            _check_weight_files(footprint)


def _check_weight_files(footprint: ModelFootprint) -> None:
    try:
        check_weight_files(footprint.weights)
    except ConfigError as exc:
        key = "model.init_from" if footprint.key == "model" else footprint.key  # the key naming the directory
        raise ConfigError(exc.message, key=key, file=exc.context.get("file"), hint=exc.hint) from None


def check_model_fits_for_inference(model: ModelConfig, device, *, key: str, what: str) -> None:
    """Refuse a model to be loaded for inference (``generate``) whose weights cannot fit."""
    footprint = ModelFootprint(key, what, num_params(model), FROZEN_BYTES_PER_PARAM)
    check_training_state_fits(footprint.bytes, device, ranks_sharing=1, what=footprint.describe(), key=key)
