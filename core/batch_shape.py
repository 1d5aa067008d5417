"""The constraints between the global batch, the micro-batch, the data streams and the ranks,
checked together so that a config that breaks several hears of all of them at once.

``python train.py --nproc N`` asks them with ``world_size=N`` before it starts a rank
(training.command_line.check_before_ranks); every rank asks them again with the world size its
launcher gave it (torchrun, Slurm), and ``core.config.validate`` without a world size asks the
one that holds on any number of ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.exceptions import ConfigError

if TYPE_CHECKING:
    from core.config import Config

_MOST_RANKS_SUGGESTED = 4096
"""The largest world size a combined error suggests (a config's streams bound it long before)."""


def batch_shape_violations(config: Config, world_size: int | None = None) -> list[ConfigError]:
    """Every violated constraint, in the order a reader fixes them; with ``world_size`` None,
    only those that hold on any number of ranks."""
    t, d, p = config.train, config.data, config.parallel
    if p.tp < 1 or p.ep < 1:  # core.config.validate refuses them, after these checks
        world_size = None
    found = []
    if world_size is not None and world_size % p.tp:
        found.append(ConfigError(f"world size {world_size} is not divisible by parallel.tp={p.tp}", key="parallel.tp"))
    ranks_apart = p.dp_replicate * p.tp * p.ep  # expert parallelism splits the data-parallel ranks
    if world_size is not None and p.ep > 1 and p.dp_replicate >= 1 and world_size % ranks_apart:
        found.append(ConfigError(
            f"world size {world_size} is not divisible by parallel.dp_replicate x parallel.tp x parallel.ep = "
            f"{p.dp_replicate} x {p.tp} x {p.ep}",
            key="parallel.ep",
            hint=f"use a world size that is a multiple of {ranks_apart}, or another parallel.ep",
        ))
    dp = world_size // p.tp if world_size is not None and not world_size % p.tp else None
    if dp is not None and t.global_batch_size % (t.micro_batch_size * dp):
        found.append(ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size={t.micro_batch_size} x data-parallel ranks={dp}",
            key="train.global_batch_size",
            hint=(f"use a global batch that is a multiple of {t.micro_batch_size * dp}, "
                  "or change train.micro_batch_size"),
        ))
    if t.global_batch_size % d.num_streams:
        found.append(ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by data.num_streams={d.num_streams}",
            key="train.global_batch_size",
            hint=(f"every stream contributes the same number of sequences to a global batch: use a global "
                  f"batch that is a multiple of {d.num_streams}, or (a new run: the stream count is part of "
                  f"the data order) a data.num_streams that divides {t.global_batch_size}"),
        ))
    if dp is not None and d.num_streams % dp:
        found.append(ConfigError(
            f"data.num_streams={d.num_streams} is not divisible by data-parallel ranks={dp}",
            key="data.num_streams",
            hint="use a world size that divides data.num_streams",
        ))
    if world_size is not None and p.strategy == "none" and world_size > 1:
        found.append(ConfigError(f"parallel.strategy=none cannot run on {world_size} ranks", key="parallel.strategy",
                                 hint="use ddp or fsdp for several ranks"))
    return found


def check_batch_shape(config: Config, world_size: int | None = None) -> None:
    """Raise the one violated constraint as it is, or one ConfigError that lists them all
    (one line: each with its own fix in parentheses, and the world sizes the config fits)."""
    found = batch_shape_violations(config, world_size)
    if len(found) == 1:
        raise found[0]
    if not found:
        return
    items = "; ".join(f"({i}) {error.message}" + (f" ({error.hint})" if error.hint else "")
                      for i, error in enumerate(found, 1))
    keys = ", ".join(dict.fromkeys(str(error.context.get("key")) for error in found))
    on = f" on {world_size} ranks" if world_size is not None else ""
    raise ConfigError(f"{len(found)} batch constraints fail{on}: {items}", key=keys, hint=_fitting_world_sizes(config))


def _fitting_world_sizes(config: Config) -> str | None:
    """'world sizes this config fits: 1, 2, 4' (its first few), or None when none would fix it."""
    if batch_shape_violations(config):  # broken on any number of ranks
        return None
    limit = min(config.data.num_streams * config.parallel.tp, _MOST_RANKS_SUGGESTED)
    fits = [n for n in range(1, limit + 1) if not batch_shape_violations(config, n)]
    return f"world sizes this config fits: {', '.join(map(str, fits[:8]))}" if fits else None
