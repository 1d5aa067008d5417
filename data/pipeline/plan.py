"""Everything static about one rank's pipeline, built once from the config.

The threaded ``DataPipeline`` and the single-threaded reference loop (``serial.py``) are
both built on a plan, so they read, transform and pack with the very same components.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import DataConfig
from core.exceptions import ConfigError, DataError
from data.pipeline.batching import BatchAssembler
from data.chat_template import ChatTemplate, check_template
from data.pipeline.packing import StreamPacker, WholeDocPacker
from data.pipeline.reading import StreamReader
from data.pipeline.augment import AugmentStage
from data.pipeline.stages import DecodeStage, Stage, TokenizeStage
from data.record_kinds import EncoderSetup, RecordEncoder, RecordKind, declared_fields, record_kind, record_kinds
from data.sharding import Mixture, StreamAssignment, owned_streams
from data.sources.source import Source, open_sources
from data.state import STATE_VERSION, StreamState
from data.tokenizers import Tokenizer, build_tokenizer

SPLITS = ("train", "eval")


@dataclass
class DataPlan:
    config: DataConfig
    seed: int
    split: str
    owned: list[int]
    rows_per_stream: int
    sources: list[Source]
    tokenizer: Tokenizer
    stages: list[Stage]
    assignments: list[StreamAssignment]
    mixture: Mixture
    compat: dict
    kinds: list[RecordKind]
    """The record kind of each source (data/record_kinds.py)."""

    @property
    def seq_len(self) -> int:
        return self.config.seq_len

    def fresh_state(self) -> StreamState:
        return StreamState.start(len(self.sources))

    def reader(self, stream: int, state: StreamState) -> StreamReader:
        return StreamReader(stream, state, sources=self.sources, assignments=self.assignments,
                            mixture=self.mixture)

    @property
    def whole_documents(self) -> bool:
        """Rows of whole documents, padded (chat data), instead of documents cut across rows."""
        return packing_mode(self.config, self.kinds) == "whole"

    def packer(self, stream: int, state: StreamState) -> StreamPacker | WholeDocPacker:
        if self.whole_documents:
            return WholeDocPacker(stream, state, seq_len=self.seq_len, eos_id=self.tokenizer.eos_id,
                                  pad_id=getattr(self.tokenizer, "pad_id", self.tokenizer.eos_id),
                                  source_names=[s.name for s in self.sources],
                                  skip_bad=self.config.on_bad_record == "skip", overlong=self.config.overlong,
                                  state_every=self.rows_per_stream,
                                  one_per_row=any(kind.one_per_row for kind in self.kinds),
                                  fields=declared_fields(self.kinds))
        return StreamPacker(stream, state, seq_len=self.seq_len, eos_id=self.tokenizer.eos_id,
                            source_names=[s.name for s in self.sources],
                            skip_bad=self.config.on_bad_record == "skip",
                            state_every=self.rows_per_stream)

    def assembler(self) -> BatchAssembler:
        return BatchAssembler(self.owned, self.rows_per_stream, self.compat, declared_fields(self.kinds))

    def start_step(self, states: dict[int, StreamState]) -> int:
        """The global batch the states end after; refuses states that disagree."""
        steps = {s: st.sequences / self.rows_per_stream for s, st in states.items()}
        values = set(steps.values())
        if len(values) != 1 or not float(next(iter(values))).is_integer():
            raise DataError(
                f"stream states end at different batches ({steps})",
                hint="the state was saved with another train.global_batch_size, or is damaged",
            )
        return int(next(iter(values)))


def make_plan(config: DataConfig, *, seed: int, global_batch_size: int, rank: int,
              world_size: int, split: str = "train", record_fields: tuple[str, ...] = ()) -> DataPlan:
    """``record_fields``: optional record fields the objective reads beside the tokens
    (core.objective_kinds.record_fields; ``margin``: each preference pair's margin)."""
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
    offered = {name: kind.name for kind in record_kinds().values() for name in kind.record_fields}
    unknown = set(record_fields) - set(offered)
    if unknown:
        only = ", ".join(f"{name!r} of {kind} records" for name, kind in offered.items())
        raise ConfigError(f"the data pipeline carries no record field {sorted(unknown)[0]!r} (only {only})",
                          key="objective.kind")
    if global_batch_size % config.num_streams:
        raise ConfigError(
            f"global batch size {global_batch_size} is not divisible by data.num_streams={config.num_streams}",
            key="train.global_batch_size",
        )
    owned = owned_streams(config.num_streams, rank, world_size)
    if split == "eval":
        if config.eval_source is None:
            raise ConfigError("split='eval' needs data.eval_source", key="data.eval_source",
                              hint="set data.eval_source or disable evaluation (train.eval_interval=0)")
        sources = open_sources((config.eval_source,), label="data.eval_source")
    else:
        sources = open_sources(config.sources, label="data.sources")
    tokenizer = build_tokenizer(config.tokenizer)
    records = [s.config.record for s in sources]
    kinds = [record_kind(name) for name in records]
    template, encoders = record_encoders(config, kinds, tokenizer, record_fields)
    stages: list[Stage] = [DecodeStage([s.config.text_column for s in sources], [e is not None for e in encoders]),
                           TokenizeStage(tokenizer, encoders)]
    if AugmentStage.enabled(config.augment) and split == "train":
        stages.append(AugmentStage(config.augment, seed=seed, tokenizer=tokenizer))
    shuffle = config.shuffle_shards and split == "train"
    assignments = [
        StreamAssignment(src.units(), seed=seed, source_index=i, num_streams=config.num_streams,
                         shuffle=shuffle)
        for i, src in enumerate(sources)
    ]
    compat = {
        "version": STATE_VERSION,
        "split": split,
        "seed": seed,
        "num_streams": config.num_streams,
        "seq_len": config.seq_len,
        "tokenizer": tokenizer.fingerprint,
        "sources": [s.describe() for s in sources],
    }
    if template is not None:  # what decides the tokens and masks of records rendered with the template
        compat["chat"] = {"records": records, "loss_on": config.loss_on, "overlong": config.overlong,
                          "template": template.fingerprint}
    elif any(e is not None for e in encoders):  # structured records of kinds without a template
        compat["records"] = records
    if packing_mode(config, kinds) == "whole":
        compat["packing"] = "whole"
    if record_fields:  # read from the records beside the tokens
        compat["record_fields"] = sorted(record_fields)
    return DataPlan(
        config=config, seed=seed, split=split, owned=owned,
        rows_per_stream=global_batch_size // config.num_streams, sources=sources,
        tokenizer=tokenizer, stages=stages, assignments=assignments,
        mixture=Mixture([s.weight for s in sources], seed=seed), compat=compat, kinds=kinds,
    )


def packing_mode(config: DataConfig, kinds: list[RecordKind]) -> str:
    """``data.packing``, with ``auto`` resolved: whole documents when any source's kind needs them."""
    if config.packing != "auto":
        return config.packing
    return "whole" if any(kind.whole_documents for kind in kinds) else "split"


def _check_packing(config: DataConfig, kinds: list[RecordKind]) -> None:
    if config.packing == "split" and any(kind.whole_documents for kind in kinds):
        raise ConfigError(
            "chat and prompt_completion records need data.packing=whole (or auto)", key="data.packing",
            hint="a conversation cut across rows would lose its prompt",
        )


def record_encoders(config: DataConfig, kinds: list[RecordKind], tokenizer: Tokenizer,
                    record_fields: tuple[str, ...] = ()) -> tuple[ChatTemplate | None, list[RecordEncoder | None]]:
    """The chat template (None when no source's kind renders with it; checked once) and one encoder
    per source (None for text sources)."""
    if not any(kind.whole_documents for kind in kinds):
        return None, [None] * len(kinds)
    _check_packing(config, kinds)
    template = None
    if any(kind.uses_template for kind in kinds):
        template = ChatTemplate.for_tokenizer(config.tokenizer, config.chat_template, clock=config.template_clock,
                                              thinking=config.template_thinking)
        check_template(template, tokenizer)
    setup = EncoderSetup(template, tokenizer, config.loss_on, frozenset(record_fields), config.images)
    return template, [kind.encoder(setup) if kind.encoder is not None else None for kind in kinds]


def check_chat_config(config: DataConfig) -> None:
    """The checks of ``record_encoders`` without opening any source: for train.py to run them
    before any process group or run dir exists (ConfigError, exit 2)."""
    sources = list(config.sources) + ([config.eval_source] if config.eval_source else [])
    kinds = [record_kind(s.record) for s in sources]
    _check_packing(config, kinds)
    template = None
    if any(kind.uses_template for kind in kinds):
        template = ChatTemplate.for_tokenizer(config.tokenizer, config.chat_template, clock=config.template_clock,
                                              thinking=config.template_thinking)
        check_template(template, build_tokenizer(config.tokenizer))
    if any(kind.encoder is not None for kind in kinds):  # an encoder refuses what it cannot encode with (vision tokens)
        setup = EncoderSetup(template, build_tokenizer(config.tokenizer), config.loss_on, images=config.images)
        for kind in kinds:
            if kind.encoder is not None:
                kind.encoder(setup)
