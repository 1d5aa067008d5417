"""``python -m data prepare``: turn a corpus into shards the pipeline reads fast and resumes cheaply.

Default: the running Python's standard library ``.py`` files (sorted by path), split by a
hash of each path into a held-out eval shard (~2%) and two training halves, one written as
multi-frame ``.jsonl.zst`` with a frame index and one as Parquet with small row groups, so
the tiny config exercises a weighted mixture of both formats. With ``--input``, any source
the pipeline can read (files, directories, globs) is re-sharded into indexed ``.jsonl.zst``.

Idempotent: the output directory keeps a manifest of what it was built from and is left
alone when that has not changed; otherwise it is rebuilt in a temporary directory and moved
into place, so an interrupted run never leaves a half-written dataset.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from core.config import SourceConfig
from core.exceptions import DataError
from data.pipeline.items import Chunk, Doc
from data.pipeline.stages import DecodeStage
from data.sources.discover import expand
from data.sources.source import open_sources
from data.sources.zstd import write_indexed_jsonl_zst
from data.state import Position

MANIFEST = "manifest.json"
COMPLETE = ".complete"
"""Written last; the Makefile's stamp that the dataset is there."""
MANIFEST_VERSION = 1
DEFAULT_OUT = Path("datasets/stdlib")


@dataclass(frozen=True)
class Document:
    name: str
    """Where it came from (relative path, or shard:record)."""
    text: str


@dataclass
class Layout:
    """How documents are split and grouped into shards."""

    eval_every: int = 50
    """About one document in eval_every goes to the eval split (by a hash of its name)."""
    shard_docs: int = 128
    """Documents per training shard."""
    frame_docs: int = 8
    """Documents per zstd frame or Parquet row group (the unit a resume re-reads)."""
    eval_frame_docs: int = 2
    """Documents per frame of the eval shard (small, so every stream gets a frame)."""
    parquet_half: bool = True
    """Write half of the training documents as Parquet (else all as .jsonl.zst)."""


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's .py files, sorted by relative path (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p for p in root.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    ]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_documents(root: Path, files: list[Path], skipped: list[str]) -> Iterator[Document]:
    for path in files:
        name = path.relative_to(root).as_posix()
        try:
            yield Document(name, path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            skipped.append(name)  # a few test files are deliberately not UTF-8


def source_documents(paths: list[str], fmt: str, text_column: str, text_unit: str) -> Iterator[Document]:
    """Every record of the given paths, read with the pipeline's own sources."""
    configs = tuple(SourceConfig(path=p, format=fmt, text_column=text_column, text_unit=text_unit)
                    for p in paths)
    for source in open_sources(configs, label="--input"):
        decode = DecodeStage([source.config.text_column])
        for unit in source.units():
            for raw in source.read(unit, 0, None):
                doc = Doc(0, 0, unit.shard, raw.record, unit.codec, Position(), Position(), raw.payload)
                decode.process(Chunk(0, 0, [doc]))
                if doc.error:
                    raise DataError(doc.error, file=unit.shard, record=raw.record + 1, hint=doc.hint)  # counted from 1, as lines
                yield Document(f"{unit.shard_id}:{raw.record}", doc.payload)


def input_fingerprint(files: Iterable[Path], layout: Layout) -> str:
    h = hashlib.sha256(json.dumps([MANIFEST_VERSION, layout.eval_every, layout.shard_docs,
                                   layout.frame_docs, layout.eval_frame_docs, layout.parquet_half]).encode())
    for path in files:
        st = path.stat()
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _bucket(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def write_dataset(docs: Iterable[Document], out: Path, layout: Layout) -> dict:
    """Split and write; returns the manifest's 'outputs' part."""
    evals: list[Document] = []
    zst: list[Document] = []
    parquet: list[Document] = []
    for doc in docs:
        b = _bucket(doc.name)
        if layout.eval_every and b % layout.eval_every == 0:
            evals.append(doc)
        elif layout.parquet_half and (b // max(1, layout.eval_every)) % 2:
            parquet.append(doc)
        else:
            zst.append(doc)
    outputs = {
        "train/*.jsonl.zst": _write_zst_shards(zst, out / "train", layout.shard_docs, layout.frame_docs),
        "train/*.parquet": _write_parquet_shards(parquet, out / "train", layout.shard_docs, layout.frame_docs),
        "eval/*.jsonl.zst": _write_zst_shards(evals, out / "eval", len(evals) or 1, layout.eval_frame_docs),
    }
    return {k: v for k, v in outputs.items() if v["documents"]}


def _line(doc: Document) -> bytes:
    return json.dumps({"text": doc.text, "name": doc.name}, ensure_ascii=False).encode()


def _write_zst_shards(docs: list[Document], directory: Path, shard_docs: int, frame_docs: int) -> dict:
    files = []
    for i in range(0, len(docs), shard_docs):
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"shard-{i // shard_docs:05d}.jsonl.zst"
        write_indexed_jsonl_zst(path, (_line(d) for d in docs[i:i + shard_docs]), frame_records=frame_docs)
        files.append(path)
    return _summary(files, len(docs))


def _write_parquet_shards(docs: list[Document], directory: Path, shard_docs: int, row_group_docs: int) -> dict:
    files = []
    for i in range(0, len(docs), shard_docs):
        directory.mkdir(parents=True, exist_ok=True)
        part = docs[i:i + shard_docs]
        table = pa.table({"text": [d.text for d in part], "name": [d.name for d in part]})
        path = directory / f"shard-{i // shard_docs:05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group_docs, compression="zstd")
        files.append(path)
    return _summary(files, len(docs))


def _summary(files: list[Path], documents: int) -> dict:
    return {"shards": len(files), "documents": documents, "bytes": sum(f.stat().st_size for f in files)}


def prepare(out: Path, layout: Layout, *, inputs: list[str], input_format: str, text_column: str,
            text_unit: str, force: bool) -> tuple[dict, bool]:
    """Build (or keep) the dataset at ``out``; returns (manifest, rebuilt)."""
    skipped: list[str] = []
    if inputs:
        files = sorted({f for p in inputs for f in expand(p)[1]})
        docs: Iterable[Document] = source_documents(inputs, input_format, text_column, text_unit)
        origin = {"inputs": inputs, "format": input_format}
        layout = dataclasses.replace(layout, parquet_half=False)  # users' files: one format
    else:
        root, files = stdlib_files()
        docs = stdlib_documents(root, files, skipped)
        origin = {"stdlib": str(root), "python": sys.version.split()[0]}
    fingerprint = input_fingerprint(files, layout)
    manifest_path = out / MANIFEST
    if not force and manifest_path.is_file() and (out / COMPLETE).is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") == fingerprint:
            return manifest, False
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        outputs = write_dataset(docs, tmp, layout)
        manifest = {"version": MANIFEST_VERSION, "fingerprint": fingerprint, "origin": origin,
                    "outputs": outputs, "skipped_not_utf8": skipped}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        (tmp / COMPLETE).touch()
        shutil.rmtree(out, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:  # another prepare finished first: keep its result if it is the same
            if json.loads(manifest_path.read_text()).get("fingerprint") != fingerprint:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest, True


def recommended_data_section(out: Path) -> str:
    """The data: section of a config that trains on this dataset (tiny model settings)."""
    return "\n".join([
        "data:",
        "  sources:",
        f'    - {{path: "{out}/train/*.jsonl.zst", name: stdlib-jsonl, weight: 2.0}}',
        f'    - {{path: "{out}/train/*.parquet", name: stdlib-parquet, weight: 1.0}}',
        f'  eval_source: {{path: "{out}/eval/*.jsonl.zst", name: stdlib-eval}}',
        "  tokenizer: byte",
        "  seq_len: 256",
        "  num_streams: 8",
        "  workers: 2",
    ])
