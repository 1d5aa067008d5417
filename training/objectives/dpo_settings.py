"""``objective.kind=dpo``: its settings (``objective.dpo``), checks and capabilities.

Everything the config loader needs to know about DPO and its preference losses lives here and
reaches core.config through ``KIND`` (registered by training/registry.py); the method itself is
dpo.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from core.config import Config
from core.config_errors import check_independent, raise_together
from core.exceptions import ConfigError
from core.objective_kinds import ObjectiveCapabilities, ObjectiveKind
from data.preference import PAIR_ROLE
from data.record_kinds import record_kind


@dataclass(frozen=True)
class DPOSettings:
    loss: Literal["sigmoid", "ipo", "simpo", "orpo"] = "sigmoid"
    """sigmoid (DPO), ipo, simpo (reference-free, length-normalized) or orpo (reference-free, odds ratio + NLL)."""
    beta: float = 0.1
    """Inverse temperature of the implicit reward (sigmoid, simpo) or IPO's tau; > 0."""
    label_smoothing: float = 0.0
    """sigmoid: assumed probability that a preference label is flipped (conservative DPO), in [0, 0.5)."""
    gamma: float = 0.5
    """simpo: target reward margin (the loss is -log sigmoid(beta * (mean logp_c - mean logp_r) - gamma))."""
    lam: float = 0.1
    """orpo: weight of the odds-ratio term added to the chosen completion's mean NLL."""
    ipo_length_normalized: bool = True
    """ipo: divide each log-prob by its completion's token count before the squared loss."""
    reference: str = "init"
    """Frozen reference of sigmoid/ipo: init, adapter_off (the LoRA policy with its adapters off: no second model), a Hugging Face directory, or run:RUN_ID[@STEP]."""
    cache_reference: bool = False
    """Store each pair's reference log-probs once (with a fingerprint) and reuse them instead of running the reference."""
    cache_dir: Optional[str] = None
    """Where the reference cache lives; None: <run.root>/reference_cache/<first 16 hex of its fingerprint>, shared by the runs under run.root with the same reference, tokenizer, template and sequence length. A directory whose fingerprint differs is refused."""
    nll_coef: float = 0.0
    """sigmoid/ipo/simpo: weight of the chosen response's mean per-token NLL added to each pair's loss (RPO); >= 0."""


def validate(config: Config) -> None:
    """objective.dpo.* (docs/post_training.md, DPO): constants, reference and preference sources, every
    violated one (core/config_errors.py)."""
    check_independent(config, (_check_constants, _check_adapter_off_reference, _check_cache_reference,
                               _check_sources))


def _check_constants(config: Config) -> None:
    o, key = config.objective.dpo, "objective.dpo"
    checks = (
        ("beta", math.isfinite(o.beta) and o.beta > 0, "> 0"),
        ("label_smoothing", 0 <= o.label_smoothing < 0.5, "in [0, 0.5)"),
        ("gamma", math.isfinite(o.gamma), "finite"),
        ("lam", math.isfinite(o.lam) and o.lam >= 0, ">= 0"),
        ("nll_coef", math.isfinite(o.nll_coef) and o.nll_coef >= 0, ">= 0"),
    )
    found = [ConfigError(f"{key}.{name} must be {expected}, got {getattr(o, name)!r}", key=f"{key}.{name}")
             for name, ok, expected in checks if not ok]
    if math.isfinite(o.nll_coef) and o.nll_coef > 0 and o.loss == "orpo":
        found.append(ConfigError(f"{key}.nll_coef: orpo's loss already holds the chosen response's NLL",
                                 key=f"{key}.nll_coef",
                                 hint="leave nll_coef at 0 with orpo (its lam weighs the other term)"))
    raise_together(found)


def _check_adapter_off_reference(config: Config) -> None:
    """reference=adapter_off: adapters to switch off, and none of the base's modules trained."""
    o, key = config.objective.dpo, "objective.dpo"
    if o.reference != "adapter_off":
        return
    rank, modules_to_save, found = config.model.lora.rank, config.model.lora.modules_to_save, []
    if rank <= 0:
        found.append(ConfigError(f"{key}.reference=adapter_off needs LoRA adapters (model.lora.rank > 0)",
                                 key=f"{key}.reference", hint="use reference: init, or set model.lora.rank"))
    if modules_to_save:
        found.append(ConfigError(
            f"{key}.reference=adapter_off with model.lora.modules_to_save {list(modules_to_save)}: "
            "switching the adapters off would keep those modules' trained weights, so the reference would not be the base",
            key=f"{key}.reference", hint="use reference: init (a frozen copy of the whole starting model), "
            "or train adapters only (model.lora.modules_to_save: [])"))
    raise_together(found)


def _check_cache_reference(config: Config) -> None:
    o, key = config.objective.dpo, "objective.dpo"
    if o.cache_reference and o.loss in ("simpo", "orpo"):
        raise ConfigError(f"{key}.cache_reference: {o.loss} is reference-free, there is nothing to cache",
                          key=f"{key}.cache_reference")


def _check_sources(config: Config) -> None:
    sources = list(config.data.sources) + ([config.data.eval_source] if config.data.eval_source else [])
    if not config.data.sources or any(not record_kind(s.record).declares(PAIR_ROLE.name) for s in sources):
        raise ConfigError("objective.kind=dpo needs preference sources only (data.sources[i].record: preference)",
                          key="data.sources", hint='records {"prompt", "chosen", "rejected"}; e.g. datasets/tasks/pref')


KIND = ObjectiveKind(
    name="dpo",
    summary="preference optimization on chosen/rejected pairs; its loss, objective.dpo.loss, is sigmoid, ipo, simpo or orpo",
    objective="training.objectives.dpo:DPOObjective",
    # A pair's two completions are scored by log-probs over full logits (no fused head), and a
    # step's tokens are a batch of pairs; the policy answers through the chat template.
    capabilities=ObjectiveCapabilities(chat_model=True),
    settings=DPOSettings,
    validate=validate,
    hashed_only_when_set=("nll_coef",),
    hash_default_section=True,
    # A preference loss is not an objective of its own.
    kind_hints=tuple((loss, f"{loss} is a preference loss of DPO: objective.kind=dpo objective.dpo.loss={loss}")
                     for loss in ("orpo", "simpo", "ipo")),
)
