"""The checks of a loaded config: core's own, of the run's sections, and the registry of those the
layers above register for the sections they read.

core.config.validate runs ``check_run_sections`` (the fields of run, train, data, checkpoint and
runtime, then the batch shape), then every registered check in the order of registration
(training/registry.py registers distributed/config_checks.py's parallelism checks,
training/optimizers/config_checks.py's and models/config_checks.py's), then the model family's and
the objective kind's own, then ``check_eval_generate`` and ``check_model_shape``, and reports every
violated constraint at once: each check runs on its own, and one that reads a section an earlier
one found wrong stops unreported (core/config_errors.py). A check is registered by import path (``module:function``), so
registering imports nothing; each is imported when a config is first validated, and imports no torch.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Callable

from core.batch_shape import check_batch_shape
from core.config_errors import check_each, raise_together
from core.exceptions import ConfigError
from core.model_families import model_family
from core.record_kinds import one_per_row
from core.registration import ensure_registered, import_attr

if TYPE_CHECKING:
    from core.config import Config

_CHECKS: dict[str, str] = {}


def register_check(name: str, path: str) -> None:
    """Add the check ``path`` (``module:function`` taking a loaded Config, raising ConfigError, or
    ConfigErrors for several: core/config_errors.py) under ``name``. The same path again does nothing; another path under a registered name is refused."""
    known = _CHECKS.get(name)
    if known is not None and known != path:
        raise ConfigError(f"config check {name!r} is registered twice, as {known!r} and {path!r}",
                          hint="give the new check a name of its own")
    _CHECKS[name] = path


def registered_checks() -> tuple[Callable[[Any], None], ...]:
    """The registered checks, imported, in the order of registration."""
    ensure_registered()
    return tuple(import_attr(path) for path in _CHECKS.values())


def check_run_sections(config: Config, world_size: int | None = None) -> None:
    """run.*, train.*, data.*, checkpoint.*, runtime.* field by field (every violated one), then the
    batch shape if the sections it reads hold (core/config_errors.py)."""
    check_each(config, (check_fields, lambda view: check_batch_shape(view, world_size)))


def check_fields(config: Config) -> None:
    """The fields of run, train, data, checkpoint and runtime, each on its own: every violated one at
    once (one ConfigError as it is, several as ConfigErrors)."""
    d, t = config.data, config.train
    found = [*_caught(validate_run_name, config.run.name), *_number_errors(config)]
    for key, value in (("train.max_steps", t.max_steps), ("train.global_batch_size", t.global_batch_size),
                       ("train.micro_batch_size", t.micro_batch_size), ("data.seq_len", d.seq_len),
                       ("data.num_streams", d.num_streams), ("data.max_in_flight", d.max_in_flight)):
        if value <= 0:
            found.append(ConfigError(f"{key} must be > 0, got {value}", key=key))
    if d.workers < 0:
        found.append(ConfigError("data.workers must be >= 0", key="data.workers"))
    if t.loss_chunk_tokens < 0:
        found.append(ConfigError("train.loss_chunk_tokens must be >= 0 (0: full logits)", key="train.loss_chunk_tokens"))
    for i, source in enumerate(d.sources):
        if not source.path:
            found.append(ConfigError(f"data.sources[{i}].path is empty", key=f"data.sources[{i}].path"))
        if not math.isfinite(source.weight) or source.weight <= 0:
            found.append(ConfigError(
                f"data.sources[{i}].weight must be a finite number > 0, got {source.weight}",
                key=f"data.sources[{i}].weight",
            ))
    if config.checkpoint.interval < 0 or config.checkpoint.keep < 0:
        found.append(ConfigError("checkpoint.interval and checkpoint.keep must be >= 0", key="checkpoint"))
    raise_together(found)


def check_eval_generate(config: Config) -> None:
    """train.eval_generate.* (docs/post_training.md, held-out generation): a prompt source and sane
    sizes, every violated one at once."""
    e, key = config.train.eval_generate, "train.eval_generate"
    if e.source is None:
        return
    found = []
    if not one_per_row(e.source.record, key=f"{key}.source.record"):
        found.append(ConfigError(
            f"{key}.source must hold prompt records (one a row), got record: {e.source.record}",
            key=f"{key}.source.record",
            hint='records {"prompt": ..., "answer": ...}; e.g. datasets/tasks/rl/eval with record: prompt'))
    checks = (
        ("prompts", e.prompts >= 1, ">= 1"),
        ("max_new_tokens", e.max_new_tokens >= 1, ">= 1"),
        ("samples", e.samples >= 0, ">= 0 (0: greedy only)"),
        ("temperature", math.isfinite(e.temperature) and e.temperature > 0, "> 0"),
    )
    for name, ok, expected in checks:
        if not ok:
            found.append(ConfigError(f"{key}.{name} must be {expected}, got {getattr(e, name)!r}", key=f"{key}.{name}"))
    raise_together(found)


def check_model_shape(config: Config) -> None:
    """The model's shape, as its family resolves it to count its parameters (``ModelFamily.num_params``:
    models.qwen.dims' rules for the Qwen rows), so a shape the family cannot build is refused before a
    rank starts. Asked last, so a violation the family's own checks name reads as theirs; not with
    model.init_from, whose config.json gives the shape (checked where it is read)."""
    model = config.model
    counter = model_family(model.arch).num_params
    if model.init_from is None and counter:
        import_attr(counter)(model)


def _caught(check: Callable[..., None], *args: Any) -> list[ConfigError]:
    """The ConfigError ``check(*args)`` raises, as a list (empty: it passed)."""
    try:
        check(*args)
    except ConfigError as error:
        return [error]
    return []


RUN_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def validate_run_name(name: str) -> None:
    """run.name becomes a directory name under run.root and the start of ``--resume ID``:
    1-64 characters of ``[A-Za-z0-9._-]`` starting with a letter or digit (no separators,
    no ``..`` component, nothing that reads as an option)."""
    if not isinstance(name, str) or RUN_NAME_PATTERN.fullmatch(name) is None:
        raise ConfigError(
            f"run.name={name!r} is not a valid run name",
            key="run.name",
            hint="use 1-64 characters of letters, digits, '.', '_' and '-', starting with a letter or digit",
        )


def _number_errors(config: Config) -> list[ConfigError]:
    """Values whose wrong sign or non-finite value would only fail (or silently misbehave) later."""
    t, found = config.train, []
    if not math.isfinite(t.lr) or t.lr < 0:
        found.append(ConfigError(f"train.lr must be a finite number >= 0, got {t.lr}", key="train.lr"))
    if t.warmup_steps < 0:
        found.append(ConfigError(f"train.warmup_steps must be >= 0, got {t.warmup_steps}", key="train.warmup_steps"))
    if not math.isfinite(t.min_lr_ratio) or not 0 <= t.min_lr_ratio <= 1:
        found.append(ConfigError(f"train.min_lr_ratio must lie in [0, 1], got {t.min_lr_ratio}",
                                 key="train.min_lr_ratio"))
    if config.runtime.gc_interval < 0:
        found.append(ConfigError(
            f"runtime.gc_interval must be >= 0, got {config.runtime.gc_interval}",
            key="runtime.gc_interval",
            hint="0 leaves Python's automatic garbage collection on",
        ))
    return found
