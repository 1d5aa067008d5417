"""Low-rank adapters (LoRA) on a frozen base model, laid out as PEFT lays them out.

A targeted linear ``W`` becomes ``LoRALinear``::

    y = base_layer(x) + lora_B(lora_A(dropout(x))) * alpha / rank      # A: (rank, in), B: (out, rank)

with the same operations in the same order as PEFT's LoRA layer, so logits through
``peft`` + ``transformers`` equal ours. ``B`` starts at zero, so step 0 computes the base
model exactly.

Names. The wrapper keeps the original linear as ``base_layer`` (as PEFT does in memory),
so a base weight is ``layers.0.self_attn.q_proj.base_layer.weight`` while wrapped and the
adapters are ``layers.0.self_attn.q_proj.lora_A.weight`` / ``.lora_B.weight``. The
*canonical* name of a parameter drops ``.base_layer``: it is the plain model's name, and
our names are Hugging Face's without the leading ``model.``. A PEFT adapter file's key is
``base_model.model.`` + the Hugging Face name (``base_model.model.model.layers.0...``).

Mixtures of experts. The experts a model's plan declares (``Stack.experts``) hold their weights
stacked on dim 0, not as linears: a target naming one of their weights is a ConfigError even where a
dense block has a linear of that name. An experts module that declares ``wants_adapters`` (its
family's key, ``adapter_key``: ``model.qwen3_moe.lora_experts``) is given per-expert adapters by
``apply_lora`` through its own ``add_adapters`` (its ``lora_A`` and ``lora_B`` parameters, keyed init
as here, no dropout), switched off by ``adapters_disabled`` (its ``adapter_disabled``) and folded by
``merge_lora`` (its ``merge_adapters``); PEFT has no form for them, so the adapter export and
``model.lora.init_from`` refuse such a model (``adapted_experts``). Adapters on the attention of a
mixture are the plain case.

Vision towers. A vision-language model names its tower (``vision_tower``) and how it trains
(``tower_training``, its family's ``model.<arch>.tower``): ``lora`` wraps every linear of the tower's
blocks whatever the targets name, ``full`` and ``frozen`` wrap none of them (``full`` trains every
tower parameter beside the adapters, as ``modules_to_save`` would; ``frozen`` keeps them frozen), and
unset the targets wrap the tower's block linears whose names they list, as any other's.

Keyed init. Each ``lora_A`` is drawn from a CPU generator seeded by
``core.seeding.derive_seed(seed, "lora:<canonical name>")``, uniform in
+-1/sqrt(in_features) (PEFT's kaiming-uniform with a=sqrt(5)), in fp32 on the CPU, then
copied to the parameter's device and dtype. An adapter therefore does not depend on which
other adapters exist, the order they were created in, the device, the world size or the
strategy. ``apply_lora`` runs on the plain model, before ``distributed.parallelize``.

Dropout (``model.lora.dropout`` > 0). Masks never come from torch's global RNG: before
each micro-batch's forward the loop calls ``set_dropout_key(model, seed=, step=, rank=,
micro_batch=)``, and each adapter draws its mask from a generator seeded by
``(seed, "lora_dropout:<canonical name>:<micro_batch>", step, rank)``. The mask is thus a
pure function of where it is used: kill/resume and replay give the same masks without
any saved RNG state, and activation checkpointing's recomputation redraws the same mask.
``rank`` is the data-parallel rank (tensor-parallel ranks of one replica must share the
key: their colwise inputs are replicated). Masks depend on the data-parallel layout, so
with dropout an elastic resume matches batches but not losses bit for bit. The dropout
draw runs outside torch.compile (a graph break per adapter), so prefer dropout 0 with
``parallel.compile``.

Tensor parallelism. ``ColwiseParallel`` / ``RowwiseParallel`` accept only ``nn.Linear``;
a wrapped projection is sharded through its parts (``tp_plan``): colwise shards
``base_layer`` and ``lora_B`` on the output features and keeps ``lora_A`` replicated;
rowwise shards ``base_layer`` and ``lora_A`` on the input features (their partial sums
are all-reduced) and keeps ``lora_B`` replicated. Every adapter gradient is then complete
on every rank.

Adapters off. Inside ``with adapters_disabled(model):`` every ``LoRALinear`` returns its
``base_layer``'s output alone (no dropout draw, no update, no cast): the wrapped model then
computes the frozen base bit for bit, with no second copy of it (DPO's ``reference:
adapter_off``). The switch is a plain attribute of each wrapper, so it reaches them through
DDP, FSDP2 (which shards in place), tensor parallelism and checkpoint wrappers, and per-block
``torch.compile`` guards on it: the first forward in the other state compiles a second graph,
and neither graph is ever used for the other state. Activation checkpointing recomputes a
block in backward, after the ``with`` block has ended, so a forward that records a graph must
have its backward inside the ``with`` too; a forward under ``torch.no_grad()`` (the DPO
reference) saves nothing and is never recomputed. ``modules_to_save`` are not restored: they
stay as trained (PEFT would use its kept original copies).

Batch-invariant numerics (``determinism.batch_invariant``). The wrapper's three matmuls are plain
``F.linear`` calls, which the block's kernels context (``Numerics.kernels``) sends to the invariant
``linear`` of models/batch_invariant.py, as it sends the base model's. The sampler's generation copy
then keeps the adapters unmerged (``Numerics.merges_adapters``, models/generation_copy.py): a merged
weight ``W + scaling * B @ A`` computes other bits than ``base(x) + scaling * B(A(x))``. A dropout on
the adapters is refused in that mode (models/config_checks.py).

Base identity. ``base_identity`` is the sha256 over every non-adapter parameter, keyed by
canonical name in sorted order, each contributing its name, dtype, shape and raw bytes (an
NF4 weight: its packed tensors). Compute it on the plain model before training (a
``modules_to_save`` parameter counts with its value at that time).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from core.config import LoRAConfig, ModelConfig
from core.exceptions import ConfigError
from core.seeding import derive_seed
from core.model_families import model_family
from models.hf_weights import load_pretrained, weight_adapter
from models.nf4 import NF4Linear, is_nf4, nf4_bytes

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
ADAPTER_PARTS = ("lora_A", "lora_B")


class LoRALinear(nn.Module):
    """A frozen linear (``base_layer``) plus a trainable low-rank update."""

    def __init__(self, base_layer: nn.Module, *, rank: int, alpha: float, dropout: float, name: str) -> None:
        super().__init__()
        weight = base_layer.weight
        self.base_layer = base_layer
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.name = name
        """Canonical module name (the plain model's), the key of init and dropout randomness."""
        adapter_dtype = torch.float32 if is_nf4(weight) else weight.dtype
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=weight.device, dtype=adapter_dtype)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=weight.device, dtype=adapter_dtype)
        self.rank, self.alpha, self.dropout = rank, alpha, dropout
        self.scaling = alpha / rank
        self._dropout_key: int | None = None
        self.adapter_disabled = False
        """True inside ``adapters_disabled``: the forward is the base layer's alone."""

    @torch.no_grad()
    def reset_adapters(self, seed: int) -> None:
        """A from the keyed generator (uniform +-1/sqrt(in)), B zeros: the update starts at 0."""
        generator = torch.Generator(device="cpu")
        generator.manual_seed(derive_seed(seed, f"lora:{self.name}.lora_A.weight"))
        bound = 1.0 / math.sqrt(self.in_features)
        full = torch.empty(self.lora_A.weight.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
        self.lora_A.weight.copy_(full)
        self.lora_B.weight.zero_()

    def set_dropout_key(self, seed: int, step: int, rank: int, micro_batch: int) -> None:
        """Key the dropout mask of the next forward (and of its recomputation)."""
        self._dropout_key = derive_seed(seed, f"lora_dropout:{self.name}:{micro_batch}", step, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.adapter_disabled:  # a module attribute: compiled graphs guard on it
            return result
        if self.dropout != 0.0 and self.training:  # tested here, so dropout 0 costs compile no graph break
            x = self._dropout(x)
        if x.dtype != self.lora_A.weight.dtype and not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.lora_A.weight.dtype)  # (autocast casts by itself, and a copy here would be saved)
        update = self.lora_B(self.lora_A(x))
        return (result + update * self.scaling).to(result.dtype)

    @torch.compiler.disable
    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self._dropout_key is None:
            raise RuntimeError(
                f"{self.name}: model.lora.dropout > 0 needs models.lora.set_dropout_key before each training forward"
            )
        generator = torch.Generator(device=x.device)
        generator.manual_seed(self._dropout_key)
        keep = torch.rand(x.shape, generator=generator, device=x.device) >= self.dropout
        return x * keep.to(x.dtype) / (1.0 - self.dropout)

    def delta_weight(self) -> torch.Tensor:
        """scaling * B @ A in fp32: what merging adds to the base weight."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def tp_plan(self, style: str) -> dict[str, str]:
        """How tensor parallelism shards this wrapper's parts (relative paths -> 'colwise'/'rowwise').

        ``style`` is the plain linear's style. Parts not listed stay replicated.
        """
        if style == "colwise":
            return {"base_layer": "colwise", "lora_B": "colwise"}
        if style == "rowwise":
            return {"base_layer": "rowwise", "lora_A": "rowwise"}
        raise ValueError(f"unknown tensor-parallel style {style!r} (colwise or rowwise)")

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, dropout={self.dropout}"


# --------------------------------------------------------------------------- names


def canonical_name(name: str) -> str:
    """The plain model's name of a parameter or module (drops ``.base_layer``)."""
    return name.replace(".base_layer.", ".").removesuffix(".base_layer")


def is_adapter_name(name: str) -> bool:
    return any(f".{part}." in f".{name}." for part in ADAPTER_PARTS)


def peft_key(model: nn.Module, name: str) -> str:
    """Our canonical parameter name -> its key in a PEFT adapter file: the Hugging Face name the
    model family's weight adapter gives it, under PEFT's prefix."""
    (hf_key,) = weight_adapter(model.config).to_hf(canonical_name(name))
    return PEFT_PREFIX + hf_key


def _ordered_targets(model: nn.Module, found: set[str]) -> list[str]:
    """``found`` in the order of the model family's LoRA targets, other names after them, sorted."""
    targets = model_family(model.config.arch).lora_targets
    return [n for n in targets if n in found] + sorted(found - set(targets))


def lora_modules(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def target_names(model: nn.Module) -> list[str]:
    """The module names ``model.lora.targets`` may use: linear layers inside the blocks."""
    return _ordered_targets(model, {name.rsplit(".", 1)[-1] for name, m in _block_linears(model)})


def _block_linears(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """(name, module) of every base linear (plain, NF4 or already wrapped) in the blocks of the
    stacks the model's parallel plan lists (core/model_plan.py)."""
    plan = model.parallel_plan
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not plan.in_blocks(name) or leaf in ADAPTER_PARTS or leaf == "base_layer":
            continue
        if isinstance(module, (nn.Linear, NF4Linear, LoRALinear)):
            yield name, module


def _experts_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every block's experts the model's plan declares (a dense block of a mixture's
    stack has no experts module)."""
    for stack in model.parallel_plan.stacks:
        for index, block in enumerate(model.get_submodule(stack.path) if stack.experts is not None else ()):
            try:
                experts = block.get_submodule(stack.experts.path)
            except AttributeError:
                continue
            yield f"{stack.path}.{index}.{stack.experts.path}", experts


def _expert_weight_names(model: nn.Module) -> set[str]:
    """The parameter names (last part) of the stacked expert weights the model's plan declares."""
    return {name for _, experts in _experts_modules(model) for name, _ in experts.named_parameters(recurse=False)}


def adapted_experts(model: nn.Module) -> list[nn.Module]:
    """The experts modules that carry adapters (``add_adapters``, module docstring)."""
    return [m for m in model.modules() if hasattr(m, "merge_adapters") and "lora_A" in m._modules]


def _refuse_adapted_experts(model: nn.Module, what: str) -> None:
    """A ConfigError where ``model``'s experts carry adapters, which ``what`` (a PEFT form) cannot hold."""
    adapted = adapted_experts(model)
    if adapted:
        key = getattr(adapted[0], "adapter_key", "model.lora.targets")
        raise ConfigError(
            f"{what}: this model's experts carry adapters ({key}), stacked one per expert on separate gate and up "
            f"weights, which PEFT has no form for (docs/models.md, Qwen3-MoE)", key=key,
            hint="export the adapters merged into the model (python -m training export --merge), or leave the key unset")


# --------------------------------------------------------------------------- apply


def apply_lora(model: nn.Module, config: LoRAConfig, *, seed: int) -> list[str]:
    """Wrap every targeted linear, freeze all but adapters and ``modules_to_save``; in place.

    Returns the names of the trainable parameters (adapters, then extra modules). Call on
    the plain model with its base weights loaded, before parallelize. May be called again
    with other targets (already wrapped layers are refused).
    """
    if config.rank <= 0:
        raise ConfigError(f"model.lora.rank must be > 0 to apply adapters, got {config.rank}", key="model.lora.rank")
    valid = target_names(model)
    unknown = [t for t in config.targets if t not in valid]
    stacked = [t for t in config.targets if t in _expert_weight_names(model)]  # even where a dense block has the name
    if stacked:
        raise ConfigError(
            f"model.lora.targets names {stacked[0]!r}, which in this model's mixture-of-experts blocks is a "
            f"stacked expert weight (one slice per expert), not a linear layer: the experts take adapters by their "
            f"family's key (docs/models.md, Qwen3-MoE)",
            key="model.lora.targets",
            hint=f"adapt the attention and dense layers only; valid names for this model: {', '.join(valid)}",
        )
    if unknown or not config.targets:
        raise ConfigError(
            f"model.lora.targets {list(config.targets)} "
            + (f"names {unknown[0]!r}, which matches no linear layer" if unknown else "is empty"),
            key="model.lora.targets",
            hint=f"valid names for this model: {', '.join(valid)}",
        )
    tower, training = _tower(model)
    for name, module in list(_block_linears(model)):
        if not _wrapped(name, config.targets, tower, training):
            continue
        if isinstance(module, LoRALinear):
            raise ValueError(f"{name} already has adapters; apply_lora wraps each linear once")
        wrapper = LoRALinear(module, rank=config.rank, alpha=config.alpha, dropout=config.dropout, name=name)
        wrapper.reset_adapters(seed)
        parent, leaf = name.rsplit(".", 1)
        setattr(model.get_submodule(parent), leaf, wrapper)
    for name, experts in list(_experts_modules(model)):
        if getattr(experts, "wants_adapters", False):
            experts.add_adapters(rank=config.rank, alpha=config.alpha, dropout=config.dropout, seed=seed, name=name)
    extra = [*_modules_to_save(model, config.modules_to_save), *([tower] if training == "full" else [])]
    trainable = []
    for name, param in model.named_parameters():
        train = is_adapter_name(name) or any(name.startswith(f"{m}.") for m in extra)
        param.requires_grad_(train)
        if train:
            trainable.append(name)
    return sorted(trainable, key=lambda n: not is_adapter_name(n))


def _tower(model: nn.Module) -> tuple[str | None, str | None]:
    """A vision-language model's tower (its module name, ``vision_tower``) and how it trains
    (``tower_training``: full, frozen, lora, None: as the language model); (None, None) without a tower."""
    tower = getattr(model, "vision_tower", None)
    return (tower, model.tower_training) if tower else (None, None)


def _wrapped(name: str, targets: tuple[str, ...], tower: str | None, training: str | None) -> bool:
    """Whether ``apply_lora`` wraps the block linear ``name``: a linear of the vision tower as the tower trains
    (lora: every one; full, frozen: none; None: as the others), any other when ``targets`` name it."""
    if tower is not None and training is not None and name.startswith(f"{tower}."):
        return training == "lora"
    return name.rsplit(".", 1)[-1] in targets


def _modules_to_save(model: nn.Module, names: tuple[str, ...]) -> list[str]:
    """Full module names of ``modules_to_save`` (each entry: a module name or its last part)."""
    candidates = [n for n, m in model.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
    chosen = []
    for entry in names:
        matched = [n for n in candidates if n == entry or n.endswith(f".{entry}")]
        if not matched or any(is_adapter_name(n) for n in matched):
            leaves = sorted({n.rsplit(".", 1)[-1] for n in candidates if not is_adapter_name(n)})
            raise ConfigError(
                f"model.lora.modules_to_save names {entry!r}, which matches no module with parameters",
                key="model.lora.modules_to_save",
                hint=f"valid names: {', '.join(leaves)}",
            )
        chosen.extend(matched)
    return chosen


def set_dropout_key(model: nn.Module, *, seed: int, step: int, rank: int, micro_batch: int) -> None:
    """Key every adapter's dropout for the next forward (see the module docstring)."""
    for module in lora_modules(model):
        module.set_dropout_key(seed, step, rank, micro_batch)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` (plain or wrapped by any strategy) as its frozen base: every adapter off.

    The base output is bit-identical to the unwrapped base model's (see the module
    docstring for compile and activation checkpointing). ``modules_to_save`` keep their
    trained weights. A model without adapters is a ValueError; a nested use restores the
    outer state.
    """
    wrapped = [*lora_modules(model), *adapted_experts(model)]
    if not wrapped:
        raise ValueError("adapters_disabled needs a model with LoRA adapters (apply_lora first)")
    before = [module.adapter_disabled for module in wrapped]
    for module in wrapped:
        module.adapter_disabled = True
    try:
        yield
    finally:
        for module, state in zip(wrapped, before):
            module.adapter_disabled = state


def add_adapters(
    model: nn.Module, config: ModelConfig, *, seed: int, load_init: bool = True, base_dtype: torch.dtype | None = None
) -> dict[str, str]:
    """A run's LoRA model from its plain model (base weights loaded), in place; the base's identity.

    In this order: the identity of the base (``{"path": model.init_from or "init:seed",
    "sha256": base_identity}``, computed once, before anything trains; equal to
    ``base_identity`` of the init_from directory), ``apply_lora``, the adapters of
    ``model.lora.init_from`` (unless ``load_init`` is false: a checkpoint overwrites them
    anyway), then the NF4 base (``model.quantize_base``). Call before parallelize.
    """
    identity = {"path": config.init_from or "init:seed", "sha256": base_identity(model)}
    apply_lora(model, config.lora, seed=seed)
    if load_init and config.lora.init_from is not None:
        load_peft_adapter(model, config.lora.init_from)
    if config.quantize_base == "nf4":
        from models.nf4 import quantize_base

        quantize_base(model)
    elif base_dtype is not None:
        store_base_as(model, base_dtype)
    return identity


@torch.no_grad()
def store_base_as(model: nn.Module, dtype: torch.dtype) -> None:
    """Keep every wrapped linear's frozen ``base_layer`` (weight and bias) in ``dtype``.

    Under ``parallel.precision=bf16`` the loop calls this with bf16: a frozen base weight is
    only ever read by a matmul, which bf16 autocast or FSDP's bf16 policy feeds the weight
    rounded to bf16 anyway, by the same round-to-nearest-even. Storing it rounded gives
    bit-identical forwards and gradients and halves the base's bytes; it also drops the
    per-step fp32 -> bf16 copy of every base weight. Norms, embeddings and the head keep
    their dtype (they are not read only by a matmul). Call after ``base_identity``.
    """
    for module in lora_modules(model):
        for name, param in module.base_layer.named_parameters(recurse=False):
            if param.requires_grad:
                raise ValueError(f"{module.name}.base_layer.{name} is trainable: only a frozen base can be stored as {dtype}")
            param.data = param.data.to(dtype)


# --------------------------------------------------------------------------- merge


@torch.no_grad()
def merge_lora(model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """A plain model with every update folded into its base weight (NF4 bases dequantized).

    The result has the plain model's parameter names and no adapters (so
    ``models.save_pretrained`` writes a Hugging Face directory). ``inplace=False`` leaves
    ``model`` as it is and works on a copy.
    """
    merged = model if inplace else copy.deepcopy(model)
    for name, module in list(merged.named_modules()):
        if not isinstance(module, LoRALinear):
            continue
        base = module.base_layer
        weight = base.dequantized_weight() if isinstance(base, NF4Linear) else base.weight
        plain = nn.Linear(module.in_features, module.out_features, bias=base.bias is not None,
                          device=weight.device, dtype=weight.dtype)
        plain.weight.copy_((weight.float() + module.delta_weight()).to(weight.dtype))
        if base.bias is not None:
            plain.bias.copy_(base.bias)
        parent, leaf = name.rsplit(".", 1)
        setattr(merged.get_submodule(parent), leaf, plain)
    for experts in adapted_experts(merged):
        experts.merge_adapters()
    for param in merged.parameters():
        param.requires_grad_(True)
    if hasattr(merged, "config"):
        merged.config = dataclasses.replace(merged.config, lora=LoRAConfig(), quantize_base="none")
    return merged


# --------------------------------------------------------------------------- PEFT I/O


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT key -> tensor of every adapter and every other trainable (modules_to_save) parameter."""
    _refuse_adapted_experts(model, "a PEFT adapter export")
    out = {}
    for name, param in model.named_parameters():
        if is_adapter_name(name) or param.requires_grad:
            if hasattr(param, "full_tensor"):
                raise ValueError(f"{name} is a sharded DTensor; gather the adapters before exporting them")
            out[peft_key(model, name)] = param.detach()
    return out


def peft_adapter_config(model: nn.Module, base_model_name_or_path: str | None) -> dict:
    """adapter_config.json for ``model``'s adapters (one rank/alpha/dropout for all)."""
    wrapped = lora_modules(model)
    if not wrapped:
        raise ValueError("the model has no LoRA adapters (apply_lora first)")
    settings = {(m.rank, m.alpha, m.dropout) for m in wrapped}
    if len(settings) != 1:
        raise ValueError(f"adapters differ in (rank, alpha, dropout): {sorted(settings)}; PEFT needs one setting")
    rank, alpha, dropout = settings.pop()
    leaves = {m.name.rsplit(".", 1)[-1] for m in wrapped}
    extra = sorted({canonical_name(n).rsplit(".", 1)[0].rsplit(".", 1)[-1] for n in _extra_names(model)})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": _ordered_targets(model, leaves),
        "modules_to_save": extra or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
    }


def _extra_names(model: nn.Module) -> list[str]:
    """Trainable parameters that are not adapters: those of modules_to_save."""
    return [n for n, p in model.named_parameters() if p.requires_grad and not is_adapter_name(n)]


def save_peft_adapter(model: nn.Module, directory: str | Path, base_model_name_or_path: str | None) -> None:
    """Write adapter_model.safetensors + adapter_config.json that ``peft.PeftModel.from_pretrained`` loads."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to("cpu").contiguous() for k, v in adapter_state_dict(model).items()}
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_adapter_config(model, base_model_name_or_path)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def load_peft_adapter(model: nn.Module, directory: str | Path) -> None:
    """Fill ``model``'s adapters (and modules_to_save) from a PEFT adapter directory.

    The model must already carry adapters of the same rank and alpha (apply_lora with the
    run's config). A tensor with no place, a missing one or a shape that does not fit is a
    ConfigError under ``model.lora.init_from`` naming the key and both shapes.
    """
    directory = Path(directory)
    wrapped = lora_modules(model)
    if not wrapped:
        raise ValueError("load_peft_adapter needs a model with adapters (apply_lora first)")
    _refuse_adapted_experts(model, "model.lora.init_from (a PEFT adapter directory)")
    check_peft_adapter(directory, rank=wrapped[0].rank, alpha=wrapped[0].alpha)
    weights_file = directory / ADAPTER_WEIGHTS
    trained = {n: p for n, p in model.named_parameters() if is_adapter_name(n) or p.requires_grad}
    expected = {peft_key(model, n): p for n, p in trained.items()}
    ours = {peft_key(model, n): canonical_name(n) for n in trained}
    filled = set()
    with safe_open(str(weights_file), framework="pt", device="cpu") as reader:
        for key in reader.keys():
            name = _strip_adapter_name(key)  # a PEFT key, as in ``expected``
            if name not in expected:
                raise ConfigError(
                    f"{weights_file.name} holds {key!r}, which this model has no adapter or trainable module for",
                    key="model.lora.init_from",
                    file=str(weights_file),
                    hint="model.lora.targets / modules_to_save must match the adapter's target_modules / modules_to_save",
                )
            tensor, param = reader.get_tensor(key), expected[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ConfigError(
                    f"{key!r} in {weights_file.name} has shape {list(tensor.shape)}, this model's "
                    f"{ours[name]} has {list(param.shape)}",
                    key="model.lora.init_from",
                    file=str(weights_file),
                    hint="the adapter was trained on a different base model or rank",
                )
            param.copy_(tensor)
            filled.add(name)
    missing = sorted(set(expected) - filled)
    if missing:
        raise ConfigError(
            f"{weights_file.name} lacks {missing[0]!r}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""),
            key="model.lora.init_from",
            file=str(weights_file),
            hint="model.lora.targets / modules_to_save must match the adapter's target_modules / modules_to_save",
        )


def _strip_adapter_name(key: str) -> str:
    """Files written by some PEFT versions keep the adapter name (``lora_A.default.weight``)."""
    for part in ADAPTER_PARTS:
        key = key.replace(f".{part}.default.", f".{part}.")
    return key


def check_peft_adapter(directory: str | Path, *, rank: int, alpha: float) -> None:
    """What can be checked of a PEFT adapter directory without a model (before the run dir
    exists): both files are there and its config is a plain LoRA of this ``rank`` and ``alpha``.
    A ConfigError under ``model.lora.init_from`` otherwise."""
    directory = Path(directory)
    config_file, weights_file = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    for file in (config_file, weights_file):
        if not file.is_file():
            raise ConfigError(
                f"{directory} is not a PEFT adapter directory: {file.name} is missing",
                key="model.lora.init_from",
                file=str(file),
                hint="point model.lora.init_from at a directory written by peft's save_pretrained or our export",
            )
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{config_file} is not valid JSON: {exc}", key="model.lora.init_from", file=str(config_file))
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_file} is not a JSON object", key="model.lora.init_from", file=str(config_file))
    ours = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_dora": False, "use_rslora": False}
    fields = {"r": "model.lora.rank", "lora_alpha": "model.lora.alpha"}
    for field, value in ours.items():
        theirs = raw.get(field, False if field.startswith("use_") else None)
        if theirs != value:
            raise ConfigError(
                f"{config_file.name} has {field}={theirs!r}, this run has {value!r}",
                key=fields.get(field, "model.lora.init_from"),
                file=str(config_file),
                hint=f"set {fields[field]} to {theirs!r}" if field in fields else "only plain LoRA adapters load",
            )


# --------------------------------------------------------------------------- identity


def base_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor of every non-adapter parameter (NF4 weights: their packed parts)."""
    out = {}
    for name, param in model.named_parameters():
        if is_adapter_name(name):
            continue
        if hasattr(param, "full_tensor") and not is_nf4(param):
            raise ValueError(f"{name} is a sharded DTensor; compute the base identity on the plain model")
        if is_nf4(param):
            for part, tensor in nf4_bytes(param):
                out[f"{canonical_name(name)}:nf4.{part}"] = tensor
        else:
            out[canonical_name(name)] = param.detach()
    return out


def base_identity(source: nn.Module | str | Path) -> str:
    """sha256 of a base model's weights: a model, or a Hugging Face directory (loaded in fp32)."""
    model = load_pretrained(source) if isinstance(source, (str, Path)) else source
    digest = hashlib.sha256()
    for name, tensor in sorted(base_tensors(model).items()):
        data = tensor.detach().to("cpu")
        digest.update(f"{name}|{str(data.dtype).removeprefix('torch.')}|{list(data.shape)}\n".encode())
        flat = data.reshape(-1).clone(memory_format=torch.contiguous_format)  # also drops odd strides of size-1 dims
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
