"""The augment stage: per-document seeded augmentation of token ids (off by default).

Kept apart from stages.py so worker processes, which import that module, never import
torch (``core.seeding`` does).
"""

from __future__ import annotations

import numpy as np

from core.config import AugmentConfig
from core.exceptions import ConfigError
from data import rng
from data.pipeline.items import Chunk, Doc
from data.pipeline.stages import each_doc
from data.tokenizers import ByteTokenizer, Tokenizer


class AugmentStage:
    """Per-document seeded augmentation of the token ids.

    Document ``c`` of stream ``s`` draws values hashed from ``(seed, s, c)``, so a resumed
    or re-sharded stream augments every document exactly as before.

    - ``span_drop``: delete one random span of 1..max_fraction*n tokens;
    - ``case_flip``: swap the case of ASCII letters in one such span (byte tokenizer only).
    """

    name = "augment"
    heavy = False  # a few numpy operations per document
    holds_gil = True

    def __init__(self, config: AugmentConfig, *, seed: int, tokenizer: Tokenizer) -> None:
        if config.kind == "case_flip" and not isinstance(tokenizer, ByteTokenizer):
            raise ConfigError("data.augment.kind=case_flip needs data.tokenizer=byte",
                              key="data.augment.kind", hint="use span_drop with other tokenizers")
        if not 0.0 <= config.probability <= 1.0 or not 0.0 < config.max_fraction <= 1.0:
            raise ConfigError("data.augment.probability must be in [0, 1] and max_fraction in (0, 1]",
                              key="data.augment")
        self.config = config
        self.seed = seed

    @staticmethod
    def enabled(config: AugmentConfig) -> bool:
        return config.kind != "none" and config.probability > 0

    def process(self, chunk: Chunk) -> Chunk:
        return each_doc(self.name, chunk, lambda doc: self._augment(chunk.stream, doc))

    def _augment(self, stream: int, doc: Doc) -> np.ndarray:
        tokens: np.ndarray = doc.payload

        def draw(k: int) -> float:  # hashed draws: no generator whose algorithm could change
            return rng.uniform(self.seed, "augment", stream, doc.counter, k)

        if len(tokens) < 2 or draw(0) >= self.config.probability:
            return tokens
        longest = max(1, int(len(tokens) * self.config.max_fraction))
        length = 1 + int(draw(1) * longest)
        start = int(draw(2) * (len(tokens) - length + 1))
        if self.config.kind == "span_drop":
            return np.concatenate([tokens[:start], tokens[start + length:]])
        out = tokens.copy()
        span = out[start:start + length]
        letters = ((span >= 65) & (span <= 90)) | ((span >= 97) & (span <= 122))
        span[letters] ^= 0x20  # ASCII case bit
        return out
