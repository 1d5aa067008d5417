"""Every violated constraint of a config at once: the checks run one after another, each on a view
of the config that refuses the values of a section another check already found wrong.

``core.config.validate`` hands its checks to ``check_each``: core's field checks of each section
first, then the cross-section checks (core/config_checks.py, the registered ones, the model
family's, the objective kind's). A check raises a ConfigError (or several, as ``ConfigErrors``);
each is kept and the next check runs. A check that reads a value of a section named by an error
already kept (the section that holds the error's key: ``train`` for ``train.lr``,
``model.lora`` for ``model.lora.rank``, ``data`` for ``data.sources[0].path``) stops there and
reports nothing, so a check never runs on a value known to be wrong and no violation is reported
twice. One violation is raised as it is, so its line reads as it always did; several are raised
as one ``ConfigErrors``, one line each.

A check of several constraints collects what it finds and raises it together (``raise_together``).
It reads any other section before it finds anything, or leaves the constraints on it to checks of
their own: a read refused after a find would end the check and lose the find. Checks of their own
run through ``check_independent`` where none needs another to pass (each sees only the sections
found wrong before them, so one's violation stops none of the others), through ``check_each`` where
a later one judges a value an earlier one vouches for. Such a group, called inside a check, ends as
one check: it raises what its checks found, or stops at a wrong section where one of them did, so
the code after it runs only once they all passed.

A check reads the config through attributes (``config.parallel.tp``); a section it gets is a view
too (isinstance sees its class, ``==`` compares the section), and lists, tuples and plain values
are the config's own. A view is no dataclass instance: a check that needs one
(``dataclasses.replace``) belongs where the model or the run is built, not in the loader.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional, Sequence

from core.exceptions import ConfigError


class ConfigErrors(ConfigError):
    """Several violated constraints of one config, each a ConfigError of its own (``errors``, in the
    order the checks ran). Printed as a header line and one indented line per violation: its
    message, its key and its hint. ``context`` and ``hint`` are the first violation's, the one a
    loader that stops at the first would have raised."""

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        self.errors = tuple(errors)
        lines = "".join(f"\n  {_line(error)}" for error in self.errors)
        first = self.errors[0]
        super().__init__(f"{len(self.errors)} violated constraints, one a line:{lines}", hint=first.hint,
                         **first.context)

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


def _line(error: ConfigError) -> str:
    """An error's line without its kind (``config error: ``)."""
    return str(error).removeprefix(f"{error.kind}: ")


def raise_together(errors: Sequence[ConfigError]) -> None:
    """Nothing for no error, the error itself for one, one ConfigErrors for several."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


def check_each(config: Any, checks: Iterable[Optional[Callable[[Any], None]]]) -> None:
    """Run every check (None: none there) on ``config``, each on a view that refuses the sections the
    checks before it found wrong, and raise what they found together (``raise_together``). Called
    with a view (inside a check), its checks start from what that view's collection found, and the
    call ends as a check does (``_finish``)."""
    collection, view_for = _start(config)
    for check in checks:
        collection.run(check, view_for(collection))
    _finish(config, collection.errors, stopped=collection.stopped)


def check_independent(config: Any, checks: Iterable[Optional[Callable[[Any], None]]]) -> None:
    """Run checks that do not depend on one another (None: none there): each sees the sections found
    wrong before them, not those the others find, so a violation one finds stops none of the others;
    what they find is raised together in their order (``raise_together``). Called with a view, the
    call ends as a check does (``_finish``)."""
    collection, view_for = _start(config)
    found: list[ConfigError] = []
    stopped = False
    for check in checks:
        apart = collection.fork()
        apart.run(check, view_for(apart))
        found.extend(apart.errors)
        stopped = stopped or apart.stopped
    _finish(config, found, stopped=stopped)


def _start(config: Any) -> tuple[_Collection, Callable[[_Collection], _SectionView]]:
    """A collection for a group of checks (a view's: one that starts from what its collection found)
    and the view of ``config`` a check of the group reads through a given collection."""
    if isinstance(config, _SectionView):
        section, path, collection = config._section, config._path, config._collection.fork()
    else:
        section, path, collection = config, "", _Collection(config)
    return collection, lambda reading: _SectionView(section, path, reading)


def _finish(config: Any, errors: Sequence[ConfigError], *, stopped: bool) -> None:
    """Raise a group's errors together. A group run inside a check (``config`` a view) also stops
    that check where one of its own checks stopped at a wrong section: the code after the call runs
    only when every check of the group passed, as it would after checks that raise."""
    raise_together(errors)
    if stopped and isinstance(config, _SectionView):
        raise _ReadsWrongSection(f"a check of {config._path or 'the config'} read a section found wrong")


class _ReadsWrongSection(Exception):
    """A check read a value of a section an earlier check found wrong: the check stops, unreported."""


class _Collection:
    """The errors found so far and the sections they name."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.errors: list[ConfigError] = []
        self.wrong: set[str] = set()
        """Sections (dotted paths of the config's dataclasses; "" the whole config) holding an error's key."""
        self.stopped = False
        """Whether a check stopped at a wrong section."""

    def run(self, check: Optional[Callable[[Any], None]], view: _SectionView) -> None:
        """``check(view)``: what it raises is kept; a read of a wrong section ends it, unreported."""
        if check is None:
            return
        try:
            check(view)
        except _ReadsWrongSection:
            self.stopped = True
        except ConfigError as found:
            self.add([found])

    def fork(self) -> _Collection:
        """A collection of no errors yet that refuses the sections this one refuses now."""
        other = _Collection(self.config)
        other.wrong = set(self.wrong)
        return other

    def add(self, errors: Iterable[ConfigError]) -> None:
        for error in errors:
            if isinstance(error, ConfigErrors):
                self.add(error.errors)
                continue
            self.errors.append(error)
            keys = str(error.context.get("key", "")).split(",")
            self.wrong.update(section_of(self.config, key.strip()) for key in keys)

    def refuses(self, path: str, *, within: bool = False) -> bool:
        """Whether ``path`` is a wrong section (``within``: or holds one)."""
        if "" in self.wrong or path in self.wrong:
            return True
        return within and any(wrong.startswith(f"{path}.") for wrong in self.wrong)


def section_of(config: Any, key: str) -> str:
    """The section that holds ``key``: the longest run of its dotted parts that names dataclasses
    of ``config`` (``train`` for train.lr, ``parallel`` for parallel, ``data`` for data.sources[1].path,
    "" for a key that names none)."""
    node, parts = config, []
    for part in key.split("."):
        value = getattr(node, part, None) if part.isidentifier() else None
        if not _is_section(value):
            break
        node = value
        parts.append(part)
    return ".".join(parts)


def _is_section(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


class _SectionView:
    """A section of the config as a check reads it: its sections as views, its values as they are,
    unless an earlier error named this section (then the check stops: ``_ReadsWrongSection``)."""

    __slots__ = ("_section", "_path", "_collection")

    def __init__(self, section: Any, path: str, collection: _Collection) -> None:
        self._section, self._path, self._collection = section, path, collection

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._section, name)
        if _is_section(value):
            return _SectionView(value, f"{self._path}.{name}".lstrip("."), self._collection)
        if self._collection.refuses(self._path):
            raise _ReadsWrongSection(f"{self._path}.{name}")
        return value

    def __eq__(self, other: object) -> bool:
        if self._collection.refuses(self._path, within=True):
            raise _ReadsWrongSection(self._path)
        return self._section == (other._section if isinstance(other, _SectionView) else other)

    def __hash__(self) -> int:
        return hash(self._section)

    @property
    def __class__(self) -> type:  # isinstance(view, ModelConfig) holds as for the section itself
        return type(self._section)

    def __repr__(self) -> str:
        return f"view of {self._section!r}"
