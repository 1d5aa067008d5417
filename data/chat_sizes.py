"""How many characters a chat template's value renders to, known before it is rendered.

A value can be small to hold and huge to render: ``[s] * 1000`` is a list of 1000 references
to one string, and nested list literals share their items, so a few kilobytes of structure
can render to gigabytes. ``Sizer`` walks a value once (a shared part is walked once and
counted wherever it occurs) and returns a lower bound of the characters ``str()`` or
``json.dumps`` make of it, stopping with ``TooLarge`` as soon as that passes its limit. It is
a lower bound (escapes and quotes that ``repr`` and JSON add are not all counted), so a value
it lets through renders to at most a few times the limit, and a real one is never refused.

``format_spec_sizes`` and ``percent_size`` read the widths and precisions of ``str.format``
specs and ``%`` format strings, which pad a value to a length of their own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Callable, Iterable

LOG10_2 = 0.30103
"""Decimal digits per bit of an integer (a lower bound of its printed length)."""

_MAX_DEPTH = 200
"""Deeper than this the walk counts nothing more (str() and json.dumps refuse such nesting)."""

_TICK_EVERY = 1 << 14
"""Items walked between two checks of the time budget."""

FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?([a-zA-Z%]?)$")
"""A ``str.format`` spec: width, precision, type."""

PERCENT = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")
"""A ``%`` conversion: mapping key, width, precision, type."""

_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))


class TooLarge(Exception):
    """A value renders to more characters than the limit (``size``: the count when it passed it)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class Sizer:
    """Lower bounds of rendered lengths, each refused (``TooLarge``) once past ``limit``."""

    def __init__(self, limit: int, tick: Callable[[], None]) -> None:
        self.limit = limit
        self._tick = tick  # the time budget's check, called while long containers are walked

    def text(self, value: Any) -> int:
        """``len(str(value))``, at least."""
        return _Walk(self, json=False).size(value, nested=False, depth=0)

    def json(self, value: Any, *, indent: int = 0, item_sep: int = 2, key_sep: int = 2) -> int:
        """``len(json.dumps(value, indent=..., separators=...))``, at least."""
        walk = _Walk(self, json=True, indent=indent, item_sep=item_sep, key_sep=key_sep)
        return walk.size(value, nested=True, depth=0)

    def joined(self, items: list, separator: int) -> int:
        """``len(sep.join(map(str, items)))`` with ``len(sep) == separator``, at least."""
        total = separator * max(len(items) - 1, 0)
        self.check(total)
        for i, item in enumerate(items):
            total += self.text(item)
            self.check(total, i)
        return total

    def check(self, total: int, step: int = 0) -> None:
        if total > self.limit:
            raise TooLarge(total)
        if step and step % _TICK_EVERY == 0:
            self._tick()


class _Walk:
    """One walk over a value; ``memo`` holds the sizes of the containers already walked."""

    def __init__(self, sizer: Sizer, *, json: bool, indent: int = 0, item_sep: int = 2, key_sep: int = 2) -> None:
        self.sizer = sizer
        self.json = json
        self.indent = indent
        self.item_sep = item_sep
        self.key_sep = key_sep
        self.memo: dict[int, int] = {}

    def size(self, value: Any, *, nested: bool, depth: int) -> int:
        kind = type(value)
        if kind is str:  # the common cases first: a render measures every value it writes
            return len(value) + (2 if nested or self.json else 0)  # repr's and JSON's quotes
        if kind is dict or kind is list or kind is tuple:
            return self._memoized(value, value.items() if kind is dict else value, kind is dict, depth)
        if isinstance(value, str):
            return len(value) + (2 if nested or self.json else 0)
        if isinstance(value, (bytes, bytearray)):
            return len(value) + 3
        if value is None or isinstance(value, bool):
            return 4
        if isinstance(value, int):
            return max(1, int(value.bit_length() * LOG10_2))
        if isinstance(value, float):
            return 3
        items = _items(value)
        if items is None:
            return 0
        return self._memoized(value, items, isinstance(value, Mapping), depth)

    def _memoized(self, value: Any, items: Iterable, mapping: bool, depth: int) -> int:
        if depth > _MAX_DEPTH:
            return 0
        key = id(value)
        if key not in self.memo:
            self.memo[key] = self._container(items, mapping, depth)
        return self.memo[key]

    def _container(self, items: Iterable, mapping: bool, depth: int) -> int:
        items = list(items) if not isinstance(items, (list, tuple)) else items
        n, limit, size = len(items), self.sizer.limit, self.size
        total = 2 + self.item_sep * max(n - 1, 0)
        if self.indent and n:
            total += n * (1 + self.indent * (depth + 1)) + 1 + self.indent * depth
        self.sizer.check(total + n)  # every item renders to a character at least
        depth += 1
        for i, item in enumerate(items):
            if mapping:
                k, v = item
                total += size(k if isinstance(k, str) or not self.json else str(k), nested=True, depth=depth)
                total += self.key_sep + size(v, nested=True, depth=depth)
            else:
                total += size(item, nested=True, depth=depth)
            if total > limit or (i and i % _TICK_EVERY == 0):
                self.sizer.check(total, i)
        return total


def _items(value: Any) -> Iterable | None:
    """The parts of a container that renders them all (None for anything else: a range, a
    generator, which str() does not walk and which must not be consumed)."""
    if isinstance(value, Mapping):
        return value.items()
    if isinstance(value, (list, tuple, set, frozenset) + _VIEWS):
        return value
    attrs = _namespace_attrs(value)
    return attrs.items() if attrs is not None else None


def _namespace_attrs(value: Any) -> dict | None:
    """A Jinja2 ``namespace()``'s attributes (its repr shows them all)."""
    from jinja2.utils import Namespace

    if isinstance(value, Namespace):
        return object.__getattribute__(value, "_Namespace__attrs")
    return None


def format_spec_sizes(spec: str) -> tuple[int, int | None, str]:
    """(width, precision or None, type) of a ``str.format`` spec; (0, None, "") if unparsed."""
    match = FORMAT_SPEC.match(spec or "")
    if match is None:
        return 0, None, ""
    width, precision, kind = match.groups()
    return int(width or 0), (int(precision) if precision else None), kind


def field_size(body: int, width: int, precision: int | None, kind: str) -> int:
    """The length of one formatted field: padded to ``width``; a precision is the number of digits
    after the point of a fixed or exponent number, or cuts a string."""
    if precision is not None:
        if kind in "fFeE%" and kind:
            body = max(body, precision)
        elif kind in ("s", "r", "a", ""):
            body = min(body, precision)
    return max(width, body)


def percent_size(fmt: str, args: Any, sizer: Sizer) -> int:
    """``len(fmt % args)``, at least: each conversion's value (``*`` widths and precisions
    read from ``args`` as Python does), padded to its width."""
    values = list(args) if isinstance(args, tuple) else [args]
    mapping = args if isinstance(args, Mapping) else None
    position = 0

    def take() -> Any:
        nonlocal position
        position += 1
        return values[position - 1] if position <= len(values) else None

    total = 0
    for i, match in enumerate(PERCENT.finditer(fmt)):
        key, width, precision, kind = match.groups()
        if kind == "%":
            continue
        width_value = take() if width == "*" else int(width or 0)
        precision_value = take() if precision == "*" else (int(precision) if precision else None)
        value = mapping.get(key) if key is not None and mapping is not None else take()
        body = sizer.text(value) if kind in "sra" else 1
        width_value = abs(width_value) if isinstance(width_value, int) else 0
        precision_value = precision_value if isinstance(precision_value, int) and precision_value >= 0 else None
        total += field_size(body, width_value, precision_value, "" if kind in "sra" else kind)
        sizer.check(total, i + 1)
    return total
