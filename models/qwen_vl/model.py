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

Generation (the sampler's cached forward, models/generation/protocol.py): ``prompt_media`` runs the
tower once over a prefill group's images and builds the whole prompts' M-RoPE positions
(``PromptImages``); each prefill chunk then takes its tokens' embeddings, image features and
positions from it by position, and sets each cache row's position offset (transformers'
``rope_deltas``: the last prompt token's M-RoPE position minus its index). Decode steps are text,
at M-RoPE position (slot + the row's offset) on all three axes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

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


@dataclass(frozen=True)
class PromptImages:
    """A prefill group's whole prompts as its chunks' cached forwards read them (``prompt_media``)."""

    positions: torch.Tensor
    """(3, B, T) long: every prompt token's M-RoPE positions (the zero padding after a prompt: text)."""
    is_image: torch.Tensor
    """(B, T) bool: the image placeholders."""
    features: torch.Tensor
    """(B, T, hidden): each placeholder's merged image feature (zeros elsewhere)."""
    deepstack: tuple[torch.Tensor, ...]
    """Per language block k < len, (B, T, hidden): the feature added to its output at the placeholders
    (a tower that returns DeepStack features beside the merged ones); empty otherwise."""
    offsets: torch.Tensor
    """(B,) long: each row's position offset after its prompt (last token's M-RoPE position - its index)."""

    def at(self, values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``values`` ((B, T, ...) per token) at a chunk's (B, t) positions, clamped into the prompts (the
        positions past a prompt compute padding no one reads)."""
        index = position_ids.clamp(max=self.is_image.shape[1] - 1)
        index = index.view(*index.shape, *[1] * (values.dim() - 2)).expand(*index.shape, *values.shape[2:])
        return values.gather(1, index)

    def positions_at(self, position_ids: torch.Tensor) -> torch.Tensor:
        """(3, B, t) M-RoPE positions of a chunk's (B, t) positions (clamped as ``at``)."""
        index = position_ids.clamp(max=self.is_image.shape[1] - 1)
        return self.positions.gather(2, index[None].expand(3, -1, -1))


class QwenVLForConditionalGeneration(nn.Module):
    """Token ids (and images) -> logits (B, T, vocab). Parameters hold meaningless values until
    ``init_weights(generator)`` or a checkpoint load fills them (``models.build`` does one)."""

    resolve_shape: ClassVar[Callable[[ModelConfig], Any]] = staticmethod(resolve_vl_dims)
    """The config's resolved shape (``dims``: ``text`` and ``vision``); a subclass family's own."""
    tower_class: ClassVar[type[nn.Module]] = VisionTower
    """The vision tower, built from ``dims.vision``; a subclass family's own."""
    vision_tower: ClassVar[str] = "visual"
    """The vision tower's module name: what ``tower_training`` applies to (models/lora.py asks it)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.dims = dims = self.resolve_shape(config)
        self.numerics = Numerics.for_model(config)
        self.visual = self.tower_class(dims.vision, numerics=self.numerics)
        if self.tower_training == "frozen":  # no gradient, so no optimizer state; LoRA adds it no adapter
            self.visual.requires_grad_(False)
        self.embed_tokens = nn.Embedding(dims.text.vocab_size, dims.text.hidden_size)
        self.layers = nn.ModuleList(QwenBlock(dims.text, numerics=self.numerics) for _ in range(dims.text.num_layers))
        self.norm = RMSNorm(dims.text.hidden_size, dims.text.rms_norm_eps)
        self.lm_head = nn.Linear(dims.text.hidden_size, dims.text.vocab_size, bias=False)
        self.tie_weights()

    @property
    def tower_training(self) -> Optional[str]:
        """How the vision tower trains: the ``model.<arch>.tower`` key (full, frozen, lora; None: as the language
        model). Frozen is applied here; models/lora.py applies the others under ``model.lora``."""
        section = getattr(self.config, self.config.arch, None)
        return None if section is None else section.tower

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
        with self.numerics.kernels():  # batch_invariant: an image's features whatever else the batch holds
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
        projection. With a ``cache`` (generation): each row's last-token logits (B, vocab); its
        ``media`` is None or what ``prompt_media`` returned for the prefill group.
        """
        if cache is not None:
            if position_ids is None or document_ids is not None or head is not None:
                raise ValueError("a cached forward takes position_ids, and neither document_ids nor a head")
            if media is not None and not isinstance(media, PromptImages):
                raise ConfigError(f"{self.config.arch}'s cached forward reads a prompt's images through "
                                  f"prompt_media, got {type(media).__name__}", key="model.arch",
                                  hint="pass each prompt's media to Sampler.generate(media=...)")
            return self._forward_cached(input_ids, position_ids, cache, media)
        batch, seq_len = input_ids.shape
        for name, ids in (("position_ids", position_ids), ("document_ids", document_ids)):
            if ids is not None and (ids.dim() != 2 or ids.shape[1] != seq_len or ids.shape[0] not in (1, batch)):
                raise ValueError(f"{name} must be (B, T)={batch, seq_len}, got {tuple(ids.shape)}")
        images = self.images(input_ids, media)
        rope = self.rotary_table(self._positions(input_ids, position_ids, images))  # from (3, B, T) positions
        mask = self.attention_mask(document_ids, seq_len, input_ids.device)
        hidden = self.language_blocks(input_ids, images, rope, mask)
        with self.numerics.kernels():  # batch_invariant's norm and head, as the cached forward's
            hidden = self.norm(hidden)
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

    def prompt_media(self, input_ids: torch.Tensor, lengths: torch.Tensor, media: Any) -> PromptImages:
        """A prefill group's whole prompts (B, T) (zero-padded past ``lengths`` (B,)) and their images
        (``media`` as ``Batch.media`` holds them) -> ``PromptImages``: the tower run over each image
        of the group on its own (``_each_image_alone``). DataError naming the row where placeholders and images disagree or a
        prompt ends on an image placeholder (the last prompt token is fed as text)."""
        images = self.images(input_ids, media)
        last = (lengths - 1)[:, None]  # (B, 1)
        ending = (input_ids.gather(1, last)[:, 0] == self.dims.image_token_id).nonzero()
        if len(ending):
            row = int(ending[0, 0])
            raise DataError(f"prompt row {row} ends on an image placeholder; the sampler feeds a prompt's last "
                            "token as text", row=row, hint="end a prompt with text (the assistant header)")
        positions = self._positions(input_ids, None, images)  # (3, B, T)
        is_image = input_ids == self.dims.image_token_id
        features = self.embed_tokens.weight.new_zeros(*input_ids.shape, self.dims.text.hidden_size)
        deepstack: tuple[torch.Tensor, ...] = ()
        if images is not None:
            merged, extra = self._each_image_alone(images)
            if int(is_image.sum()) != merged.shape[0]:
                raise DataError(f"{int(is_image.sum())} image placeholders for {merged.shape[0]} merged features")
            features = features.masked_scatter(is_image[..., None], merged.to(features.dtype))
            deepstack = tuple(torch.zeros_like(features).masked_scatter(is_image[..., None], f.to(features.dtype))
                              for f in extra)
        offsets = positions[0].gather(1, last)[:, 0] - (lengths - 1)
        return PromptImages(positions=positions, is_image=is_image, features=features, deepstack=deepstack,
                            offsets=offsets)

    def _each_image_alone(self, images: ImageBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The tower over each image of a prefill group on its own, in the group's order: (image tokens,
        hidden) merged features and the DeepStack features likewise. An image's features then depend on
        that image alone, never on which prompts share its group (the tower's matmuls round by their
        row count: one call over a group's every image gave a prompt other log-probs beside another
        photograph than alone, 5e-7 apart on a CPU)."""
        merged, extra = [], []
        with self.numerics.kernels():
            for pixels, grid in zip((p for row in images.pixels for p in row), (g for row in images.grids for g in row)):
                out = self.visual(pixels, [grid])
                own, deep = out if isinstance(out, tuple) else (out, ())
                merged.append(own)
                extra.append(deep)
        return torch.cat(merged), tuple(torch.cat(level) for level in zip(*extra))

    def _forward_cached(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                        prompt: PromptImages | None) -> torch.Tensor:
        """Generation: ids (B, T) at positions (B, T), which are also their cache slots -> (B, vocab) logits
        of each row's last token. Text reads M-RoPE position (slot + its row's offset) on all three axes; a
        prefill chunk of ``prompt`` reads its tokens' positions and image features from it, and sets
        its rows' offsets."""
        if input_ids.shape != position_ids.shape:
            raise ValueError(f"position_ids must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(position_ids.shape)}")
        mask = cache_mask(position_ids, cache.slots)  # (B, 1, T, slots)
        hidden = self.embed_tokens(input_ids)
        if prompt is None:
            rope = self.rotary_table((position_ids + cache.offsets()[:, None])[None].expand(3, -1, -1))
            deepstack: list[tuple[torch.Tensor, torch.Tensor]] = []
        else:
            cache.set_offsets(prompt.offsets)
            rope = self.rotary_table(prompt.positions_at(position_ids))
            is_image = prompt.at(prompt.is_image, position_ids)[..., None]  # (B, T, 1)
            hidden = torch.where(is_image, prompt.at(prompt.features, position_ids), hidden)
            deepstack = [(is_image, prompt.at(feature, position_ids)) for feature in prompt.deepstack]
        for layer, block in enumerate(self.layers):
            hidden = block.forward_cached(hidden, rope, cache, layer, position_ids, mask)
            if layer < len(deepstack):
                placed, feature = deepstack[layer]
                hidden = hidden + torch.where(placed, feature, torch.zeros_like(feature))
        with self.numerics.kernels():
            return self.lm_head(self.norm(hidden[:, -1]))  # (B, vocab)

    def use_numerics(self, numerics: Numerics) -> None:
        """Run every forward under ``numerics`` (models/numerics.py): every module of both towers that reads one."""
        for module in self.modules():
            if isinstance(getattr(module, "numerics", None), Numerics):
                module.numerics = numerics

    def generation_spec(self) -> GenerationSpec:
        """The vocabulary, the language model's KV cache shape on the model's device and dtype, and the
        placeholders (image, video) the sampler never draws: only a prompt's media fill them."""
        text, weight = self.dims.text, self.embed_tokens.weight
        return GenerationSpec(vocab_size=text.vocab_size, num_layers=text.num_layers, num_kv_heads=text.num_kv_heads,
                              head_dim=text.head_dim, device=weight.device, dtype=weight.dtype,
                              never_sampled=(self.dims.image_token_id, self.dims.video_token_id))

    def init_weights(self, generator: torch.Generator) -> None:
        """Every parameter from ``generator`` (CPU), drawn in fp32 in registration order and copied to the
        parameter's device and dtype (its shard, for a DTensor; models/init.py): RMSNorm weights 1, biases 0,
        the rest (linears, the patch Conv3d, the embedding) N(0, init_std). Equal generators give equal models."""
        init.init_weights(self, generator, std=self.dims.text.init_std, norms=(RMSNorm,))


def empty_model(config: ModelConfig, *, device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32) -> QwenVLForConditionalGeneration:
    """``ModelFamily.build``: the model with storage on ``device`` and undefined values (models/init.py)."""
    return init.empty_model(lambda: QwenVLForConditionalGeneration(config), device=device, dtype=dtype)
