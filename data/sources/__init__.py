"""Streaming sources: Parquet, JSONL, indexed or plain JSONL.zst, and text files."""

from data.sources.base import RawRecord, ShardFormat, StreamingSource, Unit
from data.sources.source import Source, open_sources

__all__ = ["RawRecord", "ShardFormat", "Source", "StreamingSource", "Unit", "open_sources"]
