"""Qwen2 / Qwen2.5 / Qwen3 decoder-only language model, one config-driven family.

The families differ in two switches (see ``QwenDims``): Qwen2 puts a bias on the q/k/v
projections; Qwen3 has none but RMS-normalizes q and k over head_dim before RoPE, and sets
head_dim independently of hidden_size. Everything else is shared: pre-norm blocks,
grouped-query attention, rotate-half RoPE, a SiLU-gated MLP, tied or untied embeddings.

Module and parameter names follow the Hugging Face checkpoints with the leading
``model.`` removed, so checkpoint I/O is a key rename (models/hf_weights.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from core.config import ModelConfig
from core.exceptions import ConfigError
from core.model_families import model_family
from core.model_plan import ModelParallelPlan
from core.registration import import_attr
from models.generation.kv_cache import KVCache
from models.generation.protocol import GenerationSpec
from models.numerics import Numerics
from models import batch_invariant, init
from models.attention import AttentionMask, attend, attend_cached, build_attention_mask, cache_mask
from models.qwen.dims import QwenDims, resolve_dims
from models.qwen.rope import RotaryTable, apply_rope


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension, normalized in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if batch_invariant.active():  # Numerics.batch_invariant: the mean square by a fixed tree
            return batch_invariant.rms_norm(x, self.weight, self.eps)
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the weight, as the checkpoints were trained: under bf16 the
        # product is then rounded the same way it was during pretraining.
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class QwenMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, dims: QwenDims) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dims.hidden_size, dims.intermediate_size, bias=False)
        self.up_proj = nn.Linear(dims.hidden_size, dims.intermediate_size, bias=False)
        self.down_proj = nn.Linear(dims.intermediate_size, dims.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QwenAttention(nn.Module):
    """Grouped-query self-attention with RoPE (and q/k RMSNorm for Qwen3)."""

    def __init__(self, dims: QwenDims, *, numerics: Numerics) -> None:
        super().__init__()
        self.head_dim = dims.head_dim
        self.numerics = numerics
        self.q_proj = nn.Linear(dims.hidden_size, dims.q_width, bias=dims.qkv_bias)
        self.k_proj = nn.Linear(dims.hidden_size, dims.kv_width, bias=dims.qkv_bias)
        self.v_proj = nn.Linear(dims.hidden_size, dims.kv_width, bias=dims.qkv_bias)
        self.o_proj = nn.Linear(dims.q_width, dims.hidden_size, bias=False)
        if dims.qk_norm:
            self.q_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps)
            self.k_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None

    def forward(self, x: torch.Tensor, rope: RotaryTable, mask: AttentionMask) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q, k, v = self._project(x, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, head_dim)
        out = attend(q, k, v, mask, backends=self.numerics.sdpa_backends_on(q.device))  # (B, n_head, T, head_dim)
        out = out.transpose(1, 2).reshape(batch, seq_len, -1)  # (B, T, n_head * head_dim)
        return self.o_proj(out)

    def forward_cached(
        self, x: torch.Tensor, rope: RotaryTable, cache: KVCache, layer: int, position_ids: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Generation: write this chunk's keys/values into ``cache``, then attend over the cache.

        ``position_ids`` (B, T) are the tokens' positions and cache slots; ``mask`` is
        ``cache_mask(position_ids, cache.slots)``.
        """
        batch, seq_len, _ = x.shape
        q, k, v = self._project(x, rope)
        cache.write(layer, position_ids, k, v)
        k_all, v_all = cache.read(layer)  # (B, n_kv_head, slots, head_dim)
        kernel = self.numerics.cached_attention(k_all.dtype)
        out = attend_cached(q.transpose(1, 2), k_all, v_all, mask, kernel=kernel)  # (B, n_head, T, head_dim)
        out = out.transpose(1, 2).reshape(batch, seq_len, -1)  # (B, T, n_head * head_dim)
        return self.o_proj(out)

    def _project(self, x: torch.Tensor, rope: RotaryTable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, T, n_head, head_dim), k and v (B, T, n_kv_head, head_dim), normed and rotated."""
        batch, seq_len, _ = x.shape
        # Head counts come from the projection widths (-1), not from num_heads: under tensor
        # parallelism each rank's q/k/v_proj output holds only its heads / tp heads.
        q = self.q_proj(x).view(batch, seq_len, -1, self.head_dim)  # (B, T, n_head, head_dim)
        k = self.k_proj(x).view(batch, seq_len, -1, self.head_dim)  # (B, T, n_kv_head, head_dim)
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim)  # (B, T, n_kv_head, head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, over head_dim, before RoPE
        q, k = apply_rope(q, rope.cos, rope.sin), apply_rope(k, rope.cos, rope.sin)
        return q, k, v


class QwenBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    Callable on its own as ``block(hidden, rope, mask)`` so that FSDP, activation
    checkpointing and torch.compile can wrap each block. ``rope`` is the batch's
    ``RotaryTable`` (fp32 cos/sin, built once per forward by ``QwenForCausalLM.rotary_table``).
    """

    def __init__(self, dims: QwenDims, *, numerics: Numerics) -> None:
        super().__init__()
        self.numerics = numerics
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.self_attn = QwenAttention(dims, numerics=numerics)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.mlp = QwenMLP(dims)

    def forward(self, hidden: torch.Tensor, rope: RotaryTable, mask: AttentionMask) -> torch.Tensor:
        # The kernels' context is entered here too, not only by the model: an activation-checkpointed
        # block recomputes this forward in the backward, outside the model's.
        with self.numerics.kernels():
            hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, mask)
            return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_cached(
        self, hidden: torch.Tensor, rope: RotaryTable, cache: KVCache, layer: int, position_ids: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """``forward`` for generation: attention reads and extends ``cache`` (layer ``layer``)."""
        with self.numerics.kernels():
            attn = self.self_attn.forward_cached(self.input_layernorm(hidden), rope, cache, layer, position_ids, mask)
            hidden = hidden + attn
            return hidden + self.mlp(self.post_attention_layernorm(hidden))


class QwenForCausalLM(nn.Module):
    """Token ids -> next-token logits (B, T, vocab) in the compute dtype.

    Parameters are created by the constructor but hold meaningless values until
    ``init_weights(generator)`` or a checkpoint load fills them; ``models.build`` does one
    of the two.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.dims = dims = resolve_dims(config)
        self.numerics = Numerics.for_model(config)  # a run's own: use_numerics
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(
            QwenBlock(dims, numerics=self.numerics) for _ in range(dims.num_layers)
        )
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.lm_head = nn.Linear(dims.hidden_size, dims.vocab_size, bias=False)
        self.tie_weights()

    @property
    def parallel_plan(self) -> ModelParallelPlan:
        """The module names distributed/ shards, checkpoints and compiles: the plan the family's row
        declares (``ModelFamily.parallel_plan``, models/qwen/plan.py) for these dimensions."""
        return import_attr(model_family(self.config.arch).parallel_plan)(self.dims)

    def tie_weights(self) -> None:
        """Make lm_head share embed_tokens' weight when tied.

        ``to_empty`` from the meta device gives every parameter new storage and so breaks the
        tie; ``init_weights`` and ``empty_model`` call this again afterwards.
        """
        if self.dims.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def attention_mask(self, document_ids: torch.Tensor | None, seq_len: int, device: torch.device,
                       positions: torch.Tensor | None = None) -> AttentionMask:
        """The mask every block receives for this batch (built once per forward); the exact kernel's
        layout reads the positions too."""
        kernel = self.numerics.attention_kernel(device, seq_len)
        return build_attention_mask(document_ids, kernel, seq_len=seq_len, device=device, positions=positions)

    def model_positions(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, media: Any) -> torch.Tensor:
        """The positions RoPE reads: the batch's own (B, T) position_ids, or 0..T-1 (1, T) where
        it has none. Qwen reads no media; a family with M-RoPE builds its (3, B, T) here."""
        if position_ids is None:
            return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)  # (1, T)
        return position_ids

    def rotary_table(self, position_ids: torch.Tensor) -> RotaryTable:
        """The RoPE angles every block receives for this batch (built once per forward)."""
        return RotaryTable.build(position_ids, self.dims.head_dim, self.dims.rope_theta)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        head: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        cache: KVCache | None = None,
        media: Any = None,
    ) -> Any:
        """input_ids (B, T) -> logits (B, T, vocab). Run it through ``models.forward.model_forward``.

        The result alone, never a ``ModelOutput``: this family adds no auxiliary losses and no metrics.

        position_ids (B, T) restart at 0 for each packed document (default: 0..T-1);
        document_ids (B, T) confine attention to each document (default: one document).
        ``head(hidden, output_weight)``, if given, replaces the output projection: it gets the
        final normalized hidden states (B, T, hidden) and lm_head's weight (vocab, hidden),
        and its result is returned (a fused loss, training/linear_cross_entropy.py). It runs
        inside this forward, where wrappers such as FSDP have the weight unsharded.

        With a ``cache`` (generation, ``_forward_cached``): the logits (B, vocab) of each row's
        last token, position_ids required, no document_ids and no head. ``media`` must be None:
        this family reads tokens only.
        """
        if media is not None:
            raise ConfigError(
                f"model.arch {self.config.arch} reads token ids only, but the batch carries media "
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
        mask = self.attention_mask(document_ids, seq_len, input_ids.device, position_ids)
        rope = self.rotary_table(position_ids)
        hidden = self.embed_tokens(input_ids)  # (B, T, hidden)
        for block in self.layers:
            hidden = block(hidden, rope, mask)
        with self.numerics.kernels():
            hidden = self.norm(hidden)
            if head is not None:
                return head(hidden, self.lm_head.weight)
            return self.lm_head(hidden)  # (B, T, vocab)

    def _forward_cached(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Generation step: input_ids (B, T) at position_ids (B, T) -> logits (B, vocab) of each row's last token.

        Each token's keys/values are written into cache slot ``position`` of its row, and it
        attends to slots 0..position of that row (earlier chunks' tokens included), so a
        prompt can be fed in chunks and then one token at a time. Rows are independent:
        each has its own positions. Call on a plain (unwrapped) model, under no_grad;
        ``models.generation.sampler`` drives it.
        """
        if input_ids.shape != position_ids.shape:
            raise ValueError(f"position_ids must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(position_ids.shape)}")
        mask = cache_mask(position_ids, cache.slots)  # (B, 1, T, slots)
        rope = self.rotary_table(position_ids)
        hidden = self.embed_tokens(input_ids)  # (B, T, hidden)
        for layer, block in enumerate(self.layers):
            hidden = block.forward_cached(hidden, rope, cache, layer, position_ids, mask)
        with self.numerics.kernels():
            return self.lm_head(self.norm(hidden[:, -1]))  # (B, vocab)

    def use_numerics(self, numerics: Numerics) -> None:
        """Run every forward under ``numerics``: the run's, built once (training/determinism.py), which
        the sampler's copy of this model carries too (models/numerics.py)."""
        self.numerics = numerics
        for block in self.layers:
            block.numerics = numerics
            block.self_attn.numerics = numerics

    def generation_spec(self) -> GenerationSpec:
        """The vocabulary and the KV cache's shape, on the model's device and dtype (the ``GenerationModel``
        protocol, models/generation/protocol.py)."""
        weight = self.embed_tokens.weight
        return GenerationSpec(vocab_size=self.dims.vocab_size, num_layers=self.dims.num_layers,
                              num_kv_heads=self.dims.num_kv_heads, head_dim=self.dims.head_dim,
                              device=weight.device, dtype=weight.dtype)

    def init_weights(self, generator: torch.Generator) -> None:
        """Re-initialize every parameter from ``generator`` (a CPU generator): linear and embedding
        weights ~ N(0, init_std), biases 0, norm weights 1, drawn on the CPU in fp32 in registration
        order (models/init.py), so equal generators give bit-identical models on any device and on
        FSDP2-sharded (DTensor) parameters, each rank keeping its shard of the same full draw."""
        init.init_weights(self, generator, std=self.dims.init_std, norms=(RMSNorm,))


def empty_model(
    config: ModelConfig, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> QwenForCausalLM:
    """A model with storage allocated on ``device`` but undefined values (built on the meta device first,
    models/init.py, so that no time is spent on an init that is about to be overwritten)."""
    return init.empty_model(lambda: QwenForCausalLM(config), device=device, dtype=dtype)
