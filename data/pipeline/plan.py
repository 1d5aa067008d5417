"""Everything static about one rank's pipeline, built once from the config.

The threaded ``DataPipeline`` and the single-threaded reference loop (``serial.py``) are
both built on a plan, so they read, transform and pack with the very same components.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import DataConfig
from core.exceptions import ConfigError, DataError
from data.pipeline.batching import BatchAssembler
from data.chat_template import ChatEncoder, ChatTemplate
from data.preference import MARGIN, PreferenceEncoder
from data.pipeline.packing import StreamPacker, WholeDocPacker
from data.pipeline.reading import StreamReader
from data.pipeline.augment import AugmentStage
from data.pipeline.stages import DecodeStage, Stage, TokenizeStage
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
        return packing_mode(self.config, self.sources) == "whole"

    def packer(self, stream: int, state: StreamState) -> StreamPacker | WholeDocPacker:
        if self.whole_documents:
            return WholeDocPacker(stream, state, seq_len=self.seq_len, eos_id=self.tokenizer.eos_id,
                                  pad_id=getattr(self.tokenizer, "pad_id", self.tokenizer.eos_id),
                                  source_names=[s.name for s in self.sources],
                                  skip_bad=self.config.on_bad_record == "skip", overlong=self.config.overlong,
                                  state_every=self.rows_per_stream,
                                  one_per_row=any(s.config.record == "prompt" for s in self.sources))
        return StreamPacker(stream, state, seq_len=self.seq_len, eos_id=self.tokenizer.eos_id,
                            source_names=[s.name for s in self.sources],
                            skip_bad=self.config.on_bad_record == "skip",
                            state_every=self.rows_per_stream)

    def assembler(self) -> BatchAssembler:
        return BatchAssembler(self.owned, self.rows_per_stream, self.compat)

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
    unknown = set(record_fields) - {MARGIN}
    if unknown:
        raise ConfigError(f"the data pipeline carries no record field {sorted(unknown)[0]!r} (only {MARGIN!r} of "
                          "preference records)", key="objective.kind")
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
    chat = chat_encoders(config, sources, tokenizer, margins=MARGIN in record_fields)
    stages: list[Stage] = [DecodeStage([s.config.text_column for s in sources], records),
                           TokenizeStage(tokenizer, chat)]
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
    if any(c is not None for c in chat):  # what decides the tokens and masks of chat records
        template = next(c for c in chat if c is not None).template
        compat["chat"] = {"records": records, "loss_on": config.loss_on, "overlong": config.overlong,
                          "template": template.fingerprint}
    if packing_mode(config, sources) == "whole":
        compat["packing"] = "whole"
    if record_fields:  # read from the records beside the tokens
        compat["record_fields"] = sorted(record_fields)
    return DataPlan(
        config=config, seed=seed, split=split, owned=owned,
        rows_per_stream=global_batch_size // config.num_streams, sources=sources,
        tokenizer=tokenizer, stages=stages, assignments=assignments,
        mixture=Mixture([s.weight for s in sources], seed=seed), compat=compat,
    )


def packing_mode(config: DataConfig, sources: list[Source]) -> str:
    """``data.packing``, with ``auto`` resolved: whole documents when any source is not text."""
    if config.packing != "auto":
        return config.packing
    return "whole" if any(s.config.record != "text" for s in sources) else "split"


def chat_encoders(config: DataConfig, sources: list[Source], tokenizer: Tokenizer, *,
                  margins: bool = False) -> list[ChatEncoder | None]:
    """One encoder per structured source (None for text sources); checks the template once."""
    if all(s.config.record == "text" for s in sources):
        return [None] * len(sources)
    if packing_mode(config, sources) == "split":
        raise ConfigError(
            "chat and prompt_completion records need data.packing=whole (or auto)", key="data.packing",
            hint="a conversation cut across rows would lose its prompt",
        )
    template = ChatTemplate.for_tokenizer(config.tokenizer, config.chat_template, clock=config.template_clock)
    encoders: list[ChatEncoder | None] = []
    for s in sources:
        if s.config.record == "text":
            encoders.append(None)
            continue
        if s.config.record == "preference":
            encoders.append(PreferenceEncoder(template, tokenizer, margins=margins))
            continue
        encoder = ChatEncoder(template, tokenizer, kind=s.config.record, loss_on=config.loss_on)
        encoders.append(encoder)
    next(e for e in encoders if e is not None).check()
    return encoders


def check_chat_config(config: DataConfig) -> None:
    """The checks of ``chat_encoders`` without opening any source: for train.py to run them
    before any process group or run dir exists (ConfigError, exit 2)."""
    kinds = [s.record for s in config.sources] + ([config.eval_source.record] if config.eval_source else [])
    if all(kind == "text" for kind in kinds):
        return
    if config.packing == "split":
        raise ConfigError("chat and prompt_completion records need data.packing=whole (or auto)",
                          key="data.packing", hint="a conversation cut across rows would lose its prompt")
    template = ChatTemplate.for_tokenizer(config.tokenizer, config.chat_template, clock=config.template_clock)
    kind = next(k for k in kinds if k != "text")
    ChatEncoder(template, build_tokenizer(config.tokenizer), kind=kind, loss_on=config.loss_on).check()
