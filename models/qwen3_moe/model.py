"""Qwen3-MoE decoder-only language model: Qwen3's blocks with mixture-of-experts MLPs.

Attention, RMSNorm, RoPE and the dense MLP are Qwen's own modules (models/qwen/model.py, rope.py);
the mixture of experts is models/qwen3_moe/moe.py. Module and parameter names follow the Hugging
Face checkpoints with the leading ``model.`` removed, except that each block's experts are stacked:
``layers.N.mlp.experts.gate_proj`` (E, inner, hidden) holds the checkpoint's
``model.layers.N.mlp.experts.<e>.gate_proj.weight`` for every expert e (models/qwen3_moe/weights.py).

The forward returns a ``ModelOutput`` (models/forward.py) with, beside the logits:

- ``aux_losses["load_balance"]``: the load-balancing loss (``moe.load_balance``, transformers' formula
  over all sparse layers) as a ``PooledProductLoss`` of this forward's tokens per expert and router
  probability sums per sparse layer, which training/step.py forms over the global batch's counts,
  with weight ``router_aux_loss_coef`` (left out where the coefficient is 0);
- ``metrics["layer<i>_load_min"]`` and ``["layer<i>_load_max"]`` for each sparse layer i: the fewest
  and the most tokens an expert received, over the mean tokens per expert (N * top_k / E), so 1.0 is
  a perfectly even load; summed over micro-batches and ranks as sums and counts;
- with auxiliary-loss-free balancing (``model.qwen3_moe.bias_update_rate > 0``),
  ``metrics["layer<i>_bias_min"]`` and ``["layer<i>_bias_max"]``: the range of the router bias this
  forward chose with (a mean over the step's forwards of the one value).

Routing replay (``model.qwen3_moe.routing_replay``): ``generation_spec()`` declares ``routing`` (the
sparse layers, top_k), so the sampler's cache records every token's experts per sparse layer
(``_forward_cached`` writes them where the cache has a routing record, models/generation/
routing_record.py); a training forward handed that record as ``media[ROUTING]`` ((B, T, sparse
layers, top_k) integers, -1 where a token has none) routes each recorded token to its recorded experts
(``moe.Router``) and reports ``metrics["routing_replay_mismatch"]``: the recorded tokens whose own
top-k differs from the recorded one in at least one sparse layer, over the recorded tokens.

Auxiliary-loss-free balancing: a forward that records gradients adds each sparse layer's tokens per
expert to the step's counts (the model's own forward, not a block's: an activation-checkpointed
block's recomputation adds nothing); ``after_update(sum_over_replicas)``, which the training loop
calls after each optimizer update, sums them over the data-parallel replicas and moves every
router's bias by ``moe.bias_step``. Integer counts summed over micro-batches and ranks: the bias
does not depend on how the step's batch is split.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from core.config import ModelConfig
from core.exceptions import ConfigError
from core.model_families import model_family
from core.model_plan import ModelParallelPlan
from core.registration import import_attr
from models import init
from models.attention import AttentionMask, build_attention_mask, cache_mask
from models.forward import ModelMetric, ModelOutput
from models.generation.kv_cache import KVCache
from models.generation.protocol import GenerationSpec
from models.numerics import Numerics
from models.qwen.model import QwenAttention, QwenMLP, RMSNorm
from models.qwen.rope import RotaryTable
from models.qwen3_moe.dims import MoeDims, resolve_moe_dims
from models.qwen3_moe.family import settings_of
from models.qwen3_moe.moe import BIAS, Router, SparseMoe, bias_step, load_balance
from models.routing_replay import ROUTING


class Qwen3MoeBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)), the MLP a mixture of experts or dense.

    Callable alone as ``block(hidden, rope, mask, replay=None) -> (hidden, router probability sums (E,)
    or None, tokens per expert (E,) or None, replay mismatches (B, T) bool or None)`` (FSDP, activation
    checkpointing and compile wrap each block); ``replay`` (B, T, top_k) int64 the recorded experts
    (routing replay, module docstring)."""

    def __init__(self, dims: MoeDims, layer: int, *, numerics: Numerics) -> None:
        super().__init__()
        self.numerics = numerics
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.self_attn = QwenAttention(dims, numerics=numerics)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.mlp = SparseMoe(dims) if dims.sparse[layer] else QwenMLP(dims)

    def forward(self, hidden: torch.Tensor, rope: RotaryTable, mask: AttentionMask,
                replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                                            torch.Tensor | None]:
        with self.numerics.kernels():  # here too: activation checkpointing recomputes the block alone
            hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, mask)
            if not isinstance(self.mlp, SparseMoe):
                return hidden + self.mlp(self.post_attention_layernorm(hidden)), None, None, None
            moe = self.mlp(self.post_attention_layernorm(hidden), replay, routed=True)
            return hidden + moe.hidden, moe.prob_sum, moe.counts, moe.mismatched

    def forward_cached(self, hidden: torch.Tensor, rope: RotaryTable, cache: KVCache, layer: int,
                       position_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward`` for generation: attention reads and extends ``cache`` (layer ``layer``); the hidden
        states and, in a mixture-of-experts layer, each token's experts (B, T, top_k)."""
        with self.numerics.kernels():
            hidden = hidden + self.self_attn.forward_cached(self.input_layernorm(hidden), rope, cache, layer,
                                                            position_ids, mask)
            normed = self.post_attention_layernorm(hidden)
            if not isinstance(self.mlp, SparseMoe):
                return hidden + self.mlp(normed), None
            moe = self.mlp(normed, routed=True)
            return hidden + moe.hidden, moe.experts


class Qwen3MoeForCausalLM(nn.Module):
    """Token ids -> a ``ModelOutput``: next-token logits (B, T, vocab) with the router's loss and metrics.

    Parameters hold meaningless values until ``init_weights(generator)`` or a checkpoint load fills
    them; ``models.build`` does one of the two."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.dims = dims = resolve_moe_dims(config)
        self.numerics = Numerics.for_model(config)  # a run's own: use_numerics
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(Qwen3MoeBlock(dims, layer, numerics=self.numerics)
                                    for layer in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.lm_head = nn.Linear(dims.hidden_size, dims.vocab_size, bias=False)
        self.tie_weights()
        self.step_counts: torch.Tensor | None = None  # (sparse layers, E) int64: this step's tokens per expert

    def routers_with_bias(self) -> list[tuple[int, nn.Module]]:
        """(layer, router) of each sparse layer whose router carries a balancing bias, in layer order."""
        found = []
        for name, module in self.named_modules():  # names survive the wrappers around a block
            if isinstance(module, Router) and getattr(module, BIAS, None) is not None:
                found.append((int(name.split(".")[1]), module))  # layers.<i>. ...
        return found

    @torch.no_grad()
    def after_update(self, sum_over_replicas: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After an optimizer update (the training loop's hook): the step's tokens per expert, summed over
        the data-parallel replicas by ``sum_over_replicas``, move each router's balancing bias
        (``moe.bias_step``); nothing without auxiliary-loss-free balancing or without a recorded forward."""
        counts, self.step_counts = self.step_counts, None
        if counts is None:
            return
        counts = sum_over_replicas(counts)
        for row, (_, router) in enumerate(self.routers_with_bias()):
            bias = getattr(router, BIAS)
            bias.copy_(bias_step(bias.to(torch.float32), counts[row].to(bias.device), self.dims.bias_update_rate))

    @property
    def parallel_plan(self) -> ModelParallelPlan:
        """The plan the family's row declares for these dimensions (models/qwen3_moe/plan.py)."""
        return import_attr(model_family(self.config.arch).parallel_plan)(self.dims)

    def tie_weights(self) -> None:
        """lm_head shares embed_tokens' weight when tied (again after ``to_empty``, which breaks the tie)."""
        if self.dims.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def model_positions(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, media: Any) -> torch.Tensor:
        """The positions RoPE reads: the batch's (B, T) position_ids, or 0..T-1 (1, T)."""
        if position_ids is None:
            return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)  # (1, T)
        return position_ids

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        head: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        cache: KVCache | None = None,
        media: Any = None,
    ) -> ModelOutput | torch.Tensor:
        """input_ids (B, T) -> a ``ModelOutput`` (module docstring); run it through ``models.forward.model_forward``.

        The logits, or ``head(final normed hidden (B, T, d), lm_head.weight)`` where a head is given.
        With a ``cache`` (generation): each row's last-token logits (B, vocab) alone, position_ids
        required, no document_ids and no head. ``media`` is None, or holds the recorded routing alone
        (``ROUTING``, under ``model.qwen3_moe.routing_replay``): this family reads tokens only."""
        replay = self._replayed_routing(media, input_ids)
        if media is not None and replay is None:
            raise ConfigError(f"model.arch {self.config.arch} reads token ids only, but the batch carries media "
                              f"({type(media).__name__})", key="model.arch",
                              hint="train a family that reads media on this data, or leave the media out of its records")
        if cache is not None:
            if position_ids is None or document_ids is not None or head is not None:
                raise ValueError("a cached forward takes position_ids, and neither document_ids nor a head")
            return self._forward_cached(input_ids, position_ids, cache)
        batch, seq_len = input_ids.shape
        for name, ids in (("position_ids", position_ids), ("document_ids", document_ids)):
            if ids is not None and (ids.dim() != 2 or ids.shape[1] != seq_len or ids.shape[0] not in (1, batch)):
                raise ValueError(f"{name} must be (B, T)={batch, seq_len}, got {tuple(ids.shape)}")
        position_ids = self.model_positions(input_ids, position_ids, media)
        kernel = self.numerics.attention_kernel(input_ids.device, seq_len)
        mask = build_attention_mask(document_ids, kernel, seq_len=seq_len, device=input_ids.device,
                                    positions=position_ids)  # the exact kernel's layout reads them
        rope = RotaryTable.build(position_ids, self.dims.head_dim, self.dims.rope_theta)
        hidden = self.embed_tokens(input_ids)  # (B, T, hidden)
        tokens = input_ids.numel()
        prob_sums, counts, metrics, mismatched = [], [], {}, []
        mean_load = tokens * self.dims.top_k / self.dims.num_experts  # tokens per expert under an even load
        for layer, block in enumerate(self.layers):
            if replay is None or not self.dims.sparse[layer]:
                hidden, prob_sum, count, _ = block(hidden, rope, mask)
            else:  # this sparse layer's recorded experts (B, T, k)
                hidden, prob_sum, count, differs = block(hidden, rope, mask, replay[:, :, len(prob_sums)])
                mismatched.append(differs)
            if prob_sum is not None:
                prob_sums.append(prob_sum)
                counts.append(count)
                metrics[f"layer{layer}_load_min"] = ModelMetric(count.min().to(torch.float32), mean_load)
                metrics[f"layer{layer}_load_max"] = ModelMetric(count.max().to(torch.float32), mean_load)
        if replay is not None:  # a token differs where any sparse layer's own top-k differs
            recorded = (replay[:, :, 0, 0] >= 0).sum().to(torch.float32)
            differs = torch.stack(mismatched).any(dim=0).sum().to(torch.float32)
            metrics["routing_replay_mismatch"] = ModelMetric(differs, recorded)
        for layer, router in self.routers_with_bias():
            bias = getattr(router, BIAS).detach().to(torch.float32)
            metrics[f"layer{layer}_bias_min"] = ModelMetric(bias.min(), 1.0)
            metrics[f"layer{layer}_bias_max"] = ModelMetric(bias.max(), 1.0)
        if self.dims.bias_update_rate > 0 and torch.is_grad_enabled():  # a training forward: the step's counts
            stacked = torch.stack([c.to(torch.int64) for c in counts])  # (sparse layers, E)
            self.step_counts = stacked if self.step_counts is None else self.step_counts + stacked
        aux = {}
        if self.dims.router_aux_loss_coef > 0:  # the step pools the counts over the global batch first
            aux["load_balance"] = load_balance(prob_sums, counts, tokens, weight=self.dims.router_aux_loss_coef)
        with self.numerics.kernels():
            hidden = self.norm(hidden)
            if head is not None:
                return ModelOutput(head=head(hidden, self.lm_head.weight), aux_losses=aux, metrics=metrics)
            return ModelOutput(logits=self.lm_head(hidden), aux_losses=aux, metrics=metrics)

    def _forward_cached(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Generation: (B, T) ids at (B, T) positions (each token's cache slot) -> (B, vocab) logits of each
        row's last token; rows are independent (models/qwen/model.py's ``_forward_cached``)."""
        if input_ids.shape != position_ids.shape:
            raise ValueError(f"position_ids must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(position_ids.shape)}")
        mask = cache_mask(position_ids, cache.slots)  # (B, 1, T, slots)
        rope = RotaryTable.build(position_ids, self.dims.head_dim, self.dims.rope_theta)
        hidden = self.embed_tokens(input_ids)  # (B, T, hidden)
        record = getattr(cache, "record_routing", None)  # a routing record's cache (models/generation/routing_record.py)
        sparse = 0
        for layer, block in enumerate(self.layers):
            hidden, experts = block.forward_cached(hidden, rope, cache, layer, position_ids, mask)
            if experts is not None:
                if record is not None:
                    record(sparse, position_ids, experts)
                sparse += 1
        with self.numerics.kernels():
            return self.lm_head(self.norm(hidden[:, -1]))  # (B, vocab)

    def _replayed_routing(self, media: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The recorded routing ``media`` holds, (B, T, sparse layers, top_k) as int64, checked; None without one."""
        if not isinstance(media, dict) or set(media) != {ROUTING}:
            return None
        replay = media[ROUTING]
        expected = (*input_ids.shape, self.dims.num_sparse_layers, self.dims.top_k)
        if not self.routing_replay or tuple(replay.shape) != expected or replay.is_floating_point():
            raise ConfigError(
                f"model.arch {self.config.arch} was handed a recorded routing of shape {tuple(replay.shape)}, but "
                f"routes {expected} with model.{self.config.arch}.routing_replay={self.routing_replay}",
                key=f"model.{self.config.arch}.routing_replay",
                hint="record the rollouts with the model that trains on them (the same routing_replay and experts)")
        return replay.to(device=input_ids.device, dtype=torch.int64)

    @property
    def routing_replay(self) -> bool:
        """Whether this model records its routing in the sampler and replays a recorded one (model.qwen3_moe.routing_replay)."""
        return settings_of(self.config).routing_replay

    def use_numerics(self, numerics: Numerics) -> None:
        """Run every forward under the run's ``numerics`` (models/numerics.py)."""
        self.numerics = numerics
        for block in self.layers:
            block.numerics = numerics
            block.self_attn.numerics = numerics

    def generation_spec(self) -> GenerationSpec:
        """The vocabulary and the KV cache's shape, on the model's device and dtype."""
        weight = self.embed_tokens.weight
        return GenerationSpec(vocab_size=self.dims.vocab_size, num_layers=self.dims.num_layers,
                              num_kv_heads=self.dims.num_kv_heads, head_dim=self.dims.head_dim,
                              device=weight.device, dtype=weight.dtype,
                              routing=(self.dims.num_sparse_layers, self.dims.top_k) if self.routing_replay else None)

    def init_weights(self, generator: torch.Generator) -> None:
        """Every parameter from ``generator`` (CPU), drawn in fp32 in registration order and copied to the
        parameter's device and dtype (its shard, for a DTensor; models/init.py): norm weights 1, biases 0,
        the rest (embedding, projections, routers, stacked experts) N(0, init_std). Equal generators give
        equal models on any device and sharding."""
        init.init_weights(self, generator, std=self.dims.init_std, norms=(RMSNorm,))


def empty_model(config: ModelConfig, *, device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32) -> Qwen3MoeForCausalLM:
    """``ModelFamily.build``: the model with storage on ``device`` and undefined values (models/init.py)."""
    model = init.empty_model(lambda: Qwen3MoeForCausalLM(config), device=device, dtype=dtype)
    for _, router in model.routers_with_bias():  # the balancing bias starts at 0 and stays fp32 (its steps are small)
        setattr(router, BIAS, torch.zeros_like(getattr(router, BIAS), dtype=torch.float32))
    return model
