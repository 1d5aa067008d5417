"""Qwen2.5-VL: token ids and images -> next-token logits (models/qwen_vl/__init__.py).

The language model is Qwen's (models/qwen/model.py: ``QwenBlock``, ``RMSNorm``) with q/k/v bias;
only its positions differ: 3-D M-RoPE (models/qwen_vl/positions.py) instead of 1-D. The vision
tower (models/qwen_vl/vision.py) turns the batch's images into merged features, which replace the
image placeholder tokens' embeddings in order, row by row. Module names follow the Hugging Face
checkpoint (``visual.*``; ``model.`` removed from the language model's), so weight I/O is a rename
(models/qwen_vl/weights.py).

Every forward without a cache runs the vision tower, on a one-image stand-in of zeros where the
batch has no image, and adds 0 x its sum to the residual stream: each rank then runs the same
collectives of a sharded tower whatever its rows hold, and the logits are unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from torch import nn

from core.config import ModelConfig
from core.exceptions import ConfigError, DataError
from core.model_families import model_family
from core.model_plan import ModelParallelPlan
from core.registration import import_attr
from models import init
from models.attention import AttentionMask, build_attention_mask, cache_mask
from models.generation.kv_cache import KVCache
from models.generation.protocol import GenerationSpec
from models.numerics import Numerics
from models.qwen.model import QwenBlock, RMSNorm
from models.qwen.rope import RotaryTable
from models.qwen_vl.dims import resolve_vl_dims
from models.qwen_vl.positions import ImageBatch, image_batch, mrope_positions, mrope_table
from models.qwen_vl.vision import VisionTower


class QwenVLForConditionalGeneration(nn.Module):
    """Token ids (and images) -> logits (B, T, vocab). Parameters hold meaningless values until
    ``init_weights(generator)`` or a checkpoint load fills them (``models.build`` does one)."""

    resolve_shape: ClassVar[Callable[[ModelConfig], Any]] = staticmethod(resolve_vl_dims)
    """The config's resolved shape (``dims``: ``text`` and ``vision``); a subclass family's own."""
    tower_class: ClassVar[type[nn.Module]] = VisionTower
    """The vision tower, built from ``dims.vision``; a subclass family's own."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.dims = dims = self.resolve_shape(config)
        self.numerics = Numerics.for_model(config)
        self.visual = self.tower_class(dims.vision, numerics=self.numerics)
        self.embed_tokens = nn.Embedding(dims.text.vocab_size, dims.text.hidden_size)
        self.layers = nn.ModuleList(QwenBlock(dims.text, numerics=self.numerics) for _ in range(dims.text.num_layers))
        self.norm = RMSNorm(dims.text.hidden_size, dims.text.rms_norm_eps)
        self.lm_head = nn.Linear(dims.text.hidden_size, dims.text.vocab_size, bias=False)
        self.tie_weights()

    @property
    def parallel_plan(self) -> ModelParallelPlan:
        """The plan the family's row declares (models/qwen_vl/plan.py): the vision blocks, then the language model's."""
        return import_attr(model_family(self.config.arch).parallel_plan)(self.dims)

    def tie_weights(self) -> None:
        """lm_head shares embed_tokens' weight when tied (again after ``to_empty``, which breaks the tie)."""
        if self.dims.text.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def images(self, input_ids: torch.Tensor, media: Any) -> ImageBatch | None:
        """The batch's images (models/qwen_vl/positions.py), None without any."""
        return image_batch(media, input_ids.shape[0], self.dims.vision.patch_dim, arch=self.config.arch)

    def model_positions(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, media: Any) -> torch.Tensor:
        """(3, B, T) M-RoPE positions of the tokens (temporal, height, width), from the batch's (B, T)
        positions and its images; DataError naming the row where placeholders and images disagree."""
        return self._positions(input_ids, position_ids, self.images(input_ids, media))

    def _positions(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                   images: ImageBatch | None) -> torch.Tensor:
        return mrope_positions(input_ids, position_ids, images, image_token_id=self.dims.image_token_id,
                               video_token_id=self.dims.video_token_id, merge=self.dims.vision.spatial_merge_size,
                               arch=self.config.arch)

    def rotary_table(self, positions: torch.Tensor) -> RotaryTable:
        """The M-RoPE angles every language block receives (built once per forward)."""
        text = self.dims.text
        return mrope_table(positions, text.head_dim, text.rope_theta, self.dims.mrope_section)

    def attention_mask(self, document_ids: torch.Tensor | None, seq_len: int, device: torch.device) -> AttentionMask:
        """The causal (document) mask every language block receives."""
        kernel = self.numerics.attention_kernel(device, seq_len)
        return build_attention_mask(document_ids, kernel, seq_len=seq_len, device=device)

    def embed(self, input_ids: torch.Tensor, images: ImageBatch | None) -> torch.Tensor:
        """Token embeddings (B, T, hidden) with each image placeholder replaced by its merged feature."""
        hidden = self.embed_tokens(input_ids)
        if images is None:  # the tower still runs: the same collectives on every rank (module docstring)
            vision = self.dims.vision
            side = vision.spatial_merge_size
            stand_in = torch.zeros(side * side, vision.patch_dim, device=hidden.device, dtype=hidden.dtype)
            return hidden + 0.0 * self.visual(stand_in, [(1, side, side)]).sum().to(hidden.dtype)
        pixels, grids = images.flat()
        features = self.visual(pixels, grids).to(hidden.dtype)  # (image tokens, hidden)
        placeholders = input_ids == self.dims.image_token_id
        if int(placeholders.sum()) != features.shape[0]:  # the positions' row-by-row check runs first
            raise DataError(f"{int(placeholders.sum())} image placeholders for {features.shape[0]} merged features")
        return hidden.masked_scatter(placeholders[..., None], features)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        head: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        cache: KVCache | None = None,
        media: Any = None,
    ) -> Any:
        """input_ids (B, T) and media (the images) -> logits (B, T, vocab); run it through ``models.forward.model_forward``.

        ``position_ids`` (B, T) are the batch's 1-D positions (packed documents restart at 0), from
        which and the images the M-RoPE positions are built (``model_positions``); ``document_ids``
        confine attention to each document; ``head(hidden, lm_head.weight)`` replaces the output
        projection. With a ``cache`` (generation of text): each row's last-token logits (B, vocab).
        """
        if cache is not None:
            if position_ids is None or document_ids is not None or head is not None:
                raise ValueError("a cached forward takes position_ids, and neither document_ids nor a head")
            if self.images(input_ids, media) is not None:
                raise ConfigError(f"{self.config.arch}'s cached forward (the sampler) reads text only, but the batch "
                                  "carries images", key="model.arch", hint="generate from text prompts")
            return self._forward_cached(input_ids, position_ids, cache)
        batch, seq_len = input_ids.shape
        for name, ids in (("position_ids", position_ids), ("document_ids", document_ids)):
            if ids is not None and (ids.dim() != 2 or ids.shape[1] != seq_len or ids.shape[0] not in (1, batch)):
                raise ValueError(f"{name} must be (B, T)={batch, seq_len}, got {tuple(ids.shape)}")
        images = self.images(input_ids, media)
        rope = self.rotary_table(self._positions(input_ids, position_ids, images))  # from (3, B, T) positions
        mask = self.attention_mask(document_ids, seq_len, input_ids.device)
        hidden = self.norm(self.language_blocks(input_ids, images, rope, mask))
        if head is not None:
            return head(hidden, self.lm_head.weight)
        return self.lm_head(hidden)  # (B, T, vocab)

    def language_blocks(self, input_ids: torch.Tensor, images: ImageBatch | None, rope: RotaryTable,
                        mask: AttentionMask) -> torch.Tensor:
        """The embeddings (``embed``) through every language block: (B, T, hidden) before the final norm."""
        hidden = self.embed(input_ids, images)  # (B, T, hidden)
        for block in self.layers:
            hidden = block(hidden, rope, mask)
        return hidden

    def _forward_cached(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Generation of text: ids (B, T) at positions (B, T), which are also their cache slots -> (B, vocab)
        logits of each row's last token. A text token's three M-RoPE positions are equal."""
        if input_ids.shape != position_ids.shape:
            raise ValueError(f"position_ids must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(position_ids.shape)}")
        mask = cache_mask(position_ids, cache.slots)  # (B, 1, T, slots)
        rope = self.rotary_table(position_ids[None].expand(3, -1, -1))
        hidden = self.embed_tokens(input_ids)
        for layer, block in enumerate(self.layers):
            hidden = block.forward_cached(hidden, rope, cache, layer, position_ids, mask)
        return self.lm_head(self.norm(hidden[:, -1]))  # (B, vocab)

    def use_numerics(self, numerics: Numerics) -> None:
        """Run every forward under ``numerics`` (models/numerics.py): every module of both towers that reads one."""
        for module in self.modules():
            if isinstance(getattr(module, "numerics", None), Numerics):
                module.numerics = numerics

    def generation_spec(self) -> GenerationSpec:
        """The vocabulary and the language model's KV cache shape, on the model's device and dtype."""
        text, weight = self.dims.text, self.embed_tokens.weight
        return GenerationSpec(vocab_size=text.vocab_size, num_layers=text.num_layers, num_kv_heads=text.num_kv_heads,
                              head_dim=text.head_dim, device=weight.device, dtype=weight.dtype)

    def init_weights(self, generator: torch.Generator) -> None:
        """Every parameter from ``generator`` (CPU), drawn in fp32 in registration order and copied to the
        parameter's device and dtype (its shard, for a DTensor; models/init.py): RMSNorm weights 1, biases 0,
        the rest (linears, the patch Conv3d, the embedding) N(0, init_std). Equal generators give equal models."""
        init.init_weights(self, generator, std=self.dims.text.init_std, norms=(RMSNorm,))


def empty_model(config: ModelConfig, *, device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32) -> QwenVLForConditionalGeneration:
    """``ModelFamily.build``: the model with storage on ``device`` and undefined values (models/init.py)."""
    return init.empty_model(lambda: QwenVLForConditionalGeneration(config), device=device, dtype=dtype)
