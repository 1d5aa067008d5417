"""``model.arch: gelu_lm``, a model family that only the tests register: its row and all of its code.

It shows that a family is a row (core/model_families.py): registered by ``register()`` (the
test's entry script, tests/families/gelu_lm_train.py, or ``LOCKSTEP_REGISTER=tests.families.gelu_lm:register``),
it trains, resumes, replays, shards, samples and round-trips through a Hugging Face-style
directory with nothing outside this module naming it.

Its blocks differ from Qwen's on purpose: pre-LayerNorm (with bias) multi-head attention with
biased projections and a GELU MLP (``fc_in``, ``fc_out``); positions are learned absolute
embeddings (``wpe``), not RoPE. The blocks form two stacks, ``front`` (``model.gelu_lm.front_layers``
blocks) and ``back`` (the rest of ``model.num_layers``), each its own nn.ModuleList in the plan.
The forward emits an auxiliary loss, ``hidden_square``: ``aux_weight`` times the mean square of the
residual stream before the final norm, per input token; and one metric per stack, the mean L2
norm of the residual stream after it (``front_norm``, ``back_norm``).

Its Hugging Face layout is its own (``architectures: ["GeluLMForCausalLM"]``, ``model_type:
gelu_lm``; names under ``transformer.``): no transformers class reads it, the round trip is ours.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from core.config import Config, ModelConfig
from core.exceptions import ConfigError
from core.model_families import ModelFamily, register_family, unregister_family
from core.model_plan import ModelParallelPlan, Stack
from models.attention import AttentionMask, attend, attend_cached, build_attention_mask, cache_mask
from models.forward import INPUT_TOKEN, AuxLoss, ModelMetric, ModelOutput
from models.generation.kv_cache import KVCache
from models.generation.protocol import GenerationSpec
from models import init
from models.generation_copy import generation_copy as generic_generation_copy
from models.hf_config import FieldReader, with_section
from models.numerics import Numerics
from models.rename_weights import RenameWeights
from models.weight_adapter import Slot

NAME = "gelu_lm"
"""The model.arch value, and the model.<name> section's key."""
HF_ARCHITECTURE = "GeluLMForCausalLM"
"""config.json's ``architectures`` class of an export."""


@dataclass(frozen=True)
class GeluLMSettings:
    """The ``model.gelu_lm`` section."""

    front_layers: int = 1
    """Blocks in the first stack (``front``); the other model.num_layers - front_layers form ``back``."""
    aux_weight: float = 0.01
    """Weight of the auxiliary loss: the residual stream's mean square per input token."""
    layer_norm_eps: float = 1e-5
    """Epsilon of every LayerNorm."""


def validate(config: Config) -> None:
    """The family's checks of a loaded config (torch-free apart from this module's own imports)."""
    model = config.model
    settings = getattr(model, NAME)
    if not 1 <= settings.front_layers < model.num_layers:
        raise ConfigError(f"model.gelu_lm.front_layers must be in [1, model.num_layers), got {settings.front_layers} "
                          f"with model.num_layers={model.num_layers}", key="model.gelu_lm.front_layers",
                          hint="leave at least one block to each of the two stacks")
    if not (math.isfinite(settings.aux_weight) and settings.aux_weight >= 0):
        raise ConfigError(f"model.gelu_lm.aux_weight must be a finite number >= 0, got {settings.aux_weight}",
                          key="model.gelu_lm.aux_weight")
    if model.num_kv_heads != model.num_heads:
        raise ConfigError(f"gelu_lm has one key/value head per query head: model.num_kv_heads={model.num_kv_heads} "
                          f"must equal model.num_heads={model.num_heads}", key="model.num_kv_heads")
    if model.max_position_embeddings < config.data.seq_len:
        raise ConfigError(f"gelu_lm learns one embedding per position: model.max_position_embeddings="
                          f"{model.max_position_embeddings} is below data.seq_len={config.data.seq_len}",
                          key="model.max_position_embeddings", hint="raise it to data.seq_len or more")


@dataclass(frozen=True)
class GeluDims:
    """The resolved shape of one gelu_lm model."""

    vocab_size: int
    """Token ids 0..vocab_size-1."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Hidden width of the GELU MLP."""
    front_layers: int
    """Blocks of the ``front`` stack."""
    back_layers: int
    """Blocks of the ``back`` stack."""
    num_heads: int
    """Attention heads (each its own key and value head)."""
    max_positions: int
    """Rows of the learned position embedding."""
    tie_embeddings: bool
    """The output head shares the token embedding."""
    norm_eps: float
    """Epsilon of every LayerNorm."""
    init_std: float
    """Standard deviation of the normal init of linear and embedding weights."""
    aux_weight: float
    """The auxiliary loss's weight."""

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def num_layers(self) -> int:
        """Blocks of both stacks."""
        return self.front_layers + self.back_layers

    @classmethod
    def of(cls, config: ModelConfig) -> "GeluDims":
        """``config``'s shape; ConfigError naming the key where it cannot be built."""
        settings = getattr(config, NAME, GeluLMSettings())
        if config.hidden_size % config.num_heads:
            raise ConfigError(f"model.hidden_size={config.hidden_size} is not divisible by model.num_heads="
                              f"{config.num_heads}", key="model.num_heads")
        if config.head_dim not in (None, config.hidden_size // config.num_heads):
            raise ConfigError(f"gelu_lm's head width is hidden_size // num_heads, got model.head_dim={config.head_dim}",
                              key="model.head_dim", hint="leave model.head_dim unset")
        if not 1 <= settings.front_layers < config.num_layers:
            raise ConfigError(f"model.gelu_lm.front_layers={settings.front_layers} leaves a stack empty "
                              f"(model.num_layers={config.num_layers})", key="model.gelu_lm.front_layers")
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size, front_layers=settings.front_layers,
                   back_layers=config.num_layers - settings.front_layers, num_heads=config.num_heads,
                   max_positions=config.max_position_embeddings, tie_embeddings=config.tie_embeddings,
                   norm_eps=settings.layer_norm_eps, init_std=config.init_std, aux_weight=settings.aux_weight)


# ------------------------------------------------------------------------------------------ model


class SelfAttention(nn.Module):
    """Multi-head causal self-attention with biased q, k, v and output projections."""

    def __init__(self, dims: GeluDims, *, numerics: Numerics) -> None:
        super().__init__()
        self.head_dim = dims.head_dim
        self.numerics = numerics
        width = dims.hidden_size
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v, each (B, T, heads, head_dim); heads from the widths: under TP a rank holds heads / tp."""
        batch, seq_len, _ = x.shape
        return tuple(p(x).view(batch, seq_len, -1, self.head_dim) for p in (self.query, self.key, self.value))

    def forward(self, x: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self._project(x))  # (B, heads, T, head_dim)
        out = attend(q, k, v, mask, backends=self.numerics.sdpa_backends_on(q.device))
        return self.out(out.transpose(1, 2).reshape(batch, seq_len, -1))  # (B, T, heads * head_dim) -> (B, T, d)

    def forward_cached(self, x: torch.Tensor, cache: KVCache, layer: int, position_ids: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        """Write this chunk's keys and values into ``cache`` at ``position_ids``, attend over the cache."""
        batch, seq_len, _ = x.shape
        q, k, v = self._project(x)
        cache.write(layer, position_ids, k, v)
        k_all, v_all = cache.read(layer)  # (B, heads, slots, head_dim)
        out = attend_cached(q.transpose(1, 2), k_all, v_all, mask, kernel=self.numerics.cached_attention(k_all.dtype))
        return self.out(out.transpose(1, 2).reshape(batch, seq_len, -1))


class GeluMLP(nn.Module):
    """fc_out(gelu(fc_in(x))), both biased."""

    def __init__(self, dims: GeluDims) -> None:
        super().__init__()
        self.fc_in = nn.Linear(dims.hidden_size, dims.intermediate_size)
        self.fc_out = nn.Linear(dims.intermediate_size, dims.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class GeluBlock(nn.Module):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x)); callable alone as ``block(hidden, mask)`` (FSDP, AC, compile)."""

    def __init__(self, dims: GeluDims, *, numerics: Numerics) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dims.hidden_size, eps=dims.norm_eps)
        self.attn = SelfAttention(dims, numerics=numerics)
        self.ln_2 = nn.LayerNorm(dims.hidden_size, eps=dims.norm_eps)
        self.mlp = GeluMLP(dims)

    def forward(self, hidden: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), mask)
        return hidden + self.mlp(self.ln_2(hidden))

    def forward_cached(self, hidden: torch.Tensor, cache: KVCache, layer: int, position_ids: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn.forward_cached(self.ln_1(hidden), cache, layer, position_ids, mask)
        return hidden + self.mlp(self.ln_2(hidden))


class GeluLM(nn.Module):
    """Token ids -> next-token logits through the ``front`` then the ``back`` stack.

    Parameters hold meaningless values until ``init_weights(generator)`` or a load fills them.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.dims = dims = GeluDims.of(config)
        self.numerics = Numerics.for_model(config)
        self.wte = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.wpe = nn.Embedding(dims.max_positions, dims.hidden_size)
        self.front = nn.ModuleList(GeluBlock(dims, numerics=self.numerics) for _ in range(dims.front_layers))
        self.back = nn.ModuleList(GeluBlock(dims, numerics=self.numerics) for _ in range(dims.back_layers))
        self.ln_f = nn.LayerNorm(dims.hidden_size, eps=dims.norm_eps)
        self.lm_head = nn.Linear(dims.hidden_size, dims.vocab_size, bias=False)
        self.tie_weights()

    @property
    def parallel_plan(self) -> ModelParallelPlan:
        return parallel_plan(self.dims)

    def tie_weights(self) -> None:
        """lm_head shares wte's weight when tied (again after ``to_empty``, which breaks the tie)."""
        if self.dims.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def blocks(self) -> tuple[GeluBlock, ...]:
        """Every block in the order the forward runs them; a block's index is its cache layer."""
        return (*self.front, *self.back)

    def model_positions(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, media: Any) -> torch.Tensor:
        """The rows of ``wpe`` each token reads: the batch's (B, T) positions, or 0..T-1 (1, T)."""
        if position_ids is None:
            return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return position_ids

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, head: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
                cache: KVCache | None = None, media: Any = None) -> ModelOutput | torch.Tensor:
        """A ``ModelOutput`` (logits, or ``head(final hidden, lm_head.weight)``) with the auxiliary loss and
        the per-stack metrics; with a ``cache``, each row's last-token logits (B, vocab) alone."""
        if media is not None:
            raise ConfigError(f"model.arch {NAME} reads token ids only, but the batch carries media "
                              f"({type(media).__name__})", key="model.arch")
        if cache is not None:
            if position_ids is None or document_ids is not None or head is not None:
                raise ValueError("a cached forward takes position_ids, and neither document_ids nor a head")
            return self._forward_cached(input_ids, position_ids, cache)
        seq_len = input_ids.shape[1]
        kernel = self.numerics.attention_kernel(input_ids.device, seq_len)
        mask = build_attention_mask(document_ids, kernel, seq_len=seq_len, device=input_ids.device)
        hidden = self.wte(input_ids) + self.wpe(self.model_positions(input_ids, position_ids, media))  # (B, T, d)
        tokens, wide = float(input_ids.numel()), torch.promote_types(hidden.dtype, torch.float32)  # sums in fp32 or wider
        metrics = {}
        for name, stack in (("front", self.front), ("back", self.back)):
            for block in stack:
                hidden = block(hidden, mask)
            metrics[f"{name}_norm"] = ModelMetric(hidden.detach().to(wide).norm(dim=-1).sum(), tokens)
        square = hidden.to(wide).pow(2).mean(-1).sum()  # over this forward's input tokens
        aux = {"hidden_square": AuxLoss(square, per=INPUT_TOKEN, weight=self.dims.aux_weight)}
        hidden = self.ln_f(hidden)
        if head is not None:
            return ModelOutput(head=head(hidden, self.lm_head.weight), aux_losses=aux, metrics=metrics)
        return ModelOutput(logits=self.lm_head(hidden), aux_losses=aux, metrics=metrics)

    def _forward_cached(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Generation: (B, T) ids at (B, T) positions -> (B, vocab) logits of each row's last token."""
        mask = cache_mask(position_ids, cache.slots)  # (B, 1, T, slots)
        hidden = self.wte(input_ids) + self.wpe(position_ids)
        for layer, block in enumerate(self.blocks()):
            hidden = block.forward_cached(hidden, cache, layer, position_ids, mask)
        return self.lm_head(self.ln_f(hidden[:, -1]))

    def use_numerics(self, numerics: Numerics) -> None:
        """Run every forward under the run's ``numerics`` (models/numerics.py)."""
        self.numerics = numerics
        for block in self.blocks():
            block.attn.numerics = numerics

    def generation_spec(self) -> GenerationSpec:
        weight = self.wte.weight
        return GenerationSpec(vocab_size=self.dims.vocab_size, num_layers=self.dims.num_layers,
                              num_kv_heads=self.dims.num_heads, head_dim=self.dims.head_dim,
                              device=weight.device, dtype=weight.dtype)

    def init_weights(self, generator: torch.Generator) -> None:
        """Every parameter from ``generator`` (CPU), drawn in fp32 in registration order and copied to the
        parameter's device and dtype (its shard, for a DTensor; models/init.py): LayerNorm weights 1,
        biases 0, the rest N(0, init_std). Equal generators give equal models on any device and sharding."""
        init.init_weights(self, generator, std=self.dims.init_std, norms=(nn.LayerNorm,))


def empty_model(config: ModelConfig, *, device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32) -> GeluLM:
    """``ModelFamily.build``: the model with storage on ``device`` and undefined values (models/init.py)."""
    return init.empty_model(lambda: GeluLM(config), device=device, dtype=dtype)


def parallel_plan(dims: GeluDims) -> ModelParallelPlan:
    """Two stacks of the same block: q, k, v and fc_in colwise (whole heads), out and fc_out rowwise."""
    block = dict(colwise=("attn.query", "attn.key", "attn.value", "mlp.fc_in"), rowwise=("attn.out", "mlp.fc_out"),
                 head_projections=("attn.query", "attn.key", "attn.value"), head_dim=dims.head_dim)
    return ModelParallelPlan(stacks=(Stack("front", **block), Stack("back", **block)), embedding="wte",
                             output="lm_head", root_modules=("wpe", "ln_f"))


# ------------------------------------------------------------------------------------------ counts


def num_params(config: ModelConfig, *, non_embedding: bool = False) -> int:
    """Parameters (a tied head counted once); ``non_embedding`` leaves out wte, wpe and the head."""
    dims = GeluDims.of(config)
    d, inner = dims.hidden_size, dims.intermediate_size
    block = 4 * (d * d + d) + (d * inner + inner) + (inner * d + d) + 4 * d
    body = dims.num_layers * block + 2 * d  # + ln_f
    embeddings = (dims.vocab_size + dims.max_positions) * d
    head = 0 if dims.tie_embeddings else dims.vocab_size * d
    return body if non_embedding else body + embeddings + head


def flops_per_token(config: ModelConfig, seq_len: int, *, include_embedding_head: bool) -> int:
    """6 FLOPs per matmul weight per token, plus the attention's 12 * layers * width * seq_len."""
    dims = GeluDims.of(config)
    matmuls = dims.num_layers * (4 * dims.hidden_size**2 + 2 * dims.hidden_size * dims.intermediate_size)
    if include_embedding_head:
        matmuls += dims.hidden_size * dims.vocab_size
    return 6 * matmuls + 12 * dims.num_layers * dims.hidden_size * seq_len


def block_linears(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """{name in a block: (rows, columns)} of every linear's weight."""
    dims = GeluDims.of(config)
    d, inner = dims.hidden_size, dims.intermediate_size
    return {"attn.query": (d, d), "attn.key": (d, d), "attn.value": (d, d), "attn.out": (d, d),
            "mlp.fc_in": (inner, d), "mlp.fc_out": (d, inner)}


# ------------------------------------------------------------------------------------------ Hugging Face


_TOP = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
        "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias", "lm_head.weight": "lm_head.weight"}
_BLOCK = {"ln_1": "ln_1", "attn.query": "attn.q", "attn.key": "attn.k", "attn.value": "attn.v",
          "attn.out": "attn.c_proj", "ln_2": "ln_2", "mlp.fc_in": "mlp.c_fc", "mlp.fc_out": "mlp.c_proj"}
_OURS = re.compile(r"(front|back)\.(\d+)\.(.+)\.(weight|bias)")
_THEIRS = re.compile(r"transformer\.(front|back)\.h\.(\d+)\.(.+)\.(weight|bias)")


class GeluWeights(RenameWeights):
    """Our keys <-> the export's: a rename (``front.0.attn.query.weight`` is ``transformer.front.h.0.attn.q.weight``).

    The adapter sees no config, so the export keeps the two stacks apart in its names."""

    def from_hf(self, hf_key: str) -> Slot | None:
        ours = {v: k for k, v in _TOP.items()}.get(hf_key)
        if ours is not None:
            return Slot(ours)
        match = _THEIRS.fullmatch(hf_key)
        module = {v: k for k, v in _BLOCK.items()}.get(match.group(3)) if match else None
        return None if module is None else Slot(f"{match.group(1)}.{match.group(2)}.{module}.{match.group(4)}")

    def to_hf(self, key: str, slots: int | None = None) -> tuple[str, ...]:
        if key in _TOP:
            return (_TOP[key],)
        match = _OURS.fullmatch(key)
        if match is None or match.group(3) not in _BLOCK:
            raise ConfigError(f"gelu_lm has no Hugging Face name for tensor {key!r}", key=key,
                              hint="export a plain gelu_lm model (adapters merged)")
        return (f"transformer.{match.group(1)}.h.{match.group(2)}.{_BLOCK[match.group(3)]}.{match.group(4)}",)


WEIGHTS = GeluWeights()
"""The row's weight adapter."""


def config_to_hf(config: ModelConfig, dims: GeluDims, dtype_name: str) -> dict[str, Any]:
    """The export's config.json."""
    return {"architectures": [HF_ARCHITECTURE], "model_type": NAME, "vocab_size": dims.vocab_size,
            "n_embd": dims.hidden_size, "n_inner": dims.intermediate_size, "n_layer": dims.num_layers,
            "n_front_layer": dims.front_layers, "n_head": dims.num_heads, "n_positions": dims.max_positions,
            "activation_function": "gelu", "layer_norm_epsilon": dims.norm_eps,
            "tie_word_embeddings": dims.tie_embeddings, "initializer_range": dims.init_std, "dtype": dtype_name}


def config_from_hf(reader: FieldReader, family: ModelFamily, base: ModelConfig) -> ModelConfig:
    """``base`` with the shape of an export's config.json (the model.gelu_lm section's front_layers and
    layer_norm_eps included); its other keys (aux_weight, the kernels, init_std) stay ``base``'s."""
    layers, front = reader.integer("n_layer"), reader.integer("n_front_layer")
    if front >= layers:
        raise reader.error("n_front_layer", f"n_front_layer={front} leaves no block to the second stack "
                           f"(n_layer={layers})")
    heads, width = reader.integer("n_head"), reader.integer("n_embd")
    if width % heads:
        raise reader.error("n_head", f"n_embd={width} is not divisible by n_head={heads}")
    if reader.get("activation_function", "gelu") != "gelu":
        raise reader.error("activation_function", f"activation {reader.get('activation_function')!r} is not "
                           "supported", hint="only gelu is implemented")
    base = with_section(base, NAME)
    settings = dataclasses.replace(getattr(base, NAME), front_layers=front,
                                   layer_norm_eps=reader.number("layer_norm_epsilon", 1e-5))
    return dataclasses.replace(
        base, arch=family.name, vocab_size=reader.integer("vocab_size"), hidden_size=width,
        intermediate_size=reader.integer("n_inner"), num_layers=layers, num_heads=heads, num_kv_heads=heads,
        head_dim=None, max_position_embeddings=reader.integer("n_positions"),
        tie_embeddings=reader.flag("tie_word_embeddings", True), **{NAME: settings})



# ------------------------------------------------------------------------------------------ generation


def generation_copy(model: nn.Module, state: Mapping[str, torch.Tensor], *, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> GeluLM:
    """A plain local GeluLM with ``model``'s full weights (``state``: its canonical state, DTensor shards
    allowed: gathering is a collective, call on every rank), by the generic copy (models/generation_copy.py);
    ``model`` itself where it is plain and already on ``device`` in ``dtype``. A model with LoRA adapters
    is refused (export it merged)."""
    return generic_generation_copy(model, state, model_class=GeluLM, build=empty_model, device=device, dtype=dtype,
                                   fold_lora=False)


# ------------------------------------------------------------------------------------------ the row

_HERE = "tests.families.gelu_lm"

GELU_LM = ModelFamily(
    name=NAME,
    summary="test family: LayerNorm + GELU MLP, learned positions, two stacks",
    settings=GeluLMSettings,
    hf_architectures=(HF_ARCHITECTURE,),
    hf_model_type=NAME,
    build=f"{_HERE}:empty_model",
    weights=f"{_HERE}:WEIGHTS",
    config_from_hf=f"{_HERE}:config_from_hf",
    config_to_hf=f"{_HERE}:config_to_hf",
    parallel_plan=f"{_HERE}:parallel_plan",
    num_params=f"{_HERE}:num_params",
    flops_per_token=f"{_HERE}:flops_per_token",
    block_linears=f"{_HERE}:block_linears",
    generation_copy=f"{_HERE}:generation_copy",
    lora_targets=("query", "key", "value", "out", "fc_in", "fc_out"),
    validate=validate,
)


def register() -> None:
    """Register the row (``LOCKSTEP_REGISTER=tests.families.gelu_lm:register``, or a test's own call)."""
    register_family(GELU_LM)


def unregister() -> None:
    """Remove the row again (a test that registered it in its own process, once done)."""
    unregister_family(NAME)
