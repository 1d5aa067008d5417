"""The Jinja2 environment chat templates run in: Hugging Face's sandbox, with budgets and a fixed clock.

A chat template is code from a model directory. Jinja2's sandbox already blocks attribute
escapes and caps ``range()`` at 100,000 items; what it does not bound is how long a render
runs (nested loops) or how large the values it builds grow (``'x' * 10**10``, a string
doubled in a loop, ``'x'.center(10**10)``). Here every render has

- a **time budget** (``max_seconds``): checked at every iteration of every ``{% for %}`` loop
  (the compiled template calls a check as the first statement of each loop body) and at every
  call, filter and arithmetic operator, so no loop nest runs unchecked; only a single C-level
  operation on a value inside the size budget (a sort, a join) runs between two checks;
- a **size budget** (``max_chars``): binary operators, ``~`` concatenation, method calls and
  filters refuse a result longer than the budget, and so does the rendered text; integer
  arithmetic is capped at the same number of bits, so ``7 ** 100000000`` is refused instead of
  computed, and so are widths and precisions past the budget in ``%`` and ``format`` strings.
  Whatever turns a value into text is refused *before* it runs when the text would pass the
  budget (data/chat_sizes.py measures a value without rendering it, so a list of 1000
  references to one 16 MB string is 16 GB of text, not 1000 items): ``{{ }}`` output, ``~``,
  the filters ``tojson`` (with its ``indent``), ``string``, ``pprint``, ``join``, ``replace``,
  ``format``, ``indent``, ``wordwrap``, ``center``, ``sum`` and those that stringify their value
  (``upper``, ``escape``, ...), the methods ``str.replace``, ``join``, ``expandtabs``,
  ``translate``, ``format`` (field by field) and ``%``, and the text of a macro, ``set`` or
  ``filter`` block. A filter that returns an iterator (``map``, ``select``, ...) yields items
  only while their total size stays within the budget, so ``list`` or ``join`` of it cannot
  collect more.

Exceeding either raises ``TemplateBudgetError`` naming the template and the limit.

``strftime_now(format)`` reads a fixed instant (``data.template_clock``), never the wall
clock, so a resumed or replayed run renders the same text; a template that calls it without a
clock configured is refused when it is compiled.
"""

from __future__ import annotations

import json
import re
import threading
import time
from functools import update_wrapper
from datetime import datetime
from typing import Any, Callable, Iterable, Iterator, Optional

from core.exceptions import ConfigError
from data.chat_sizes import Sizer, TooLarge, field_size, format_spec_sizes, percent_size

MAX_SECONDS = 10.0
"""Default time budget of one render (a real template renders a conversation in well under 1 ms)."""
MAX_CHARS = 16 * 2 ** 20
"""Default size budget: characters of any value a render builds, and of the rendered text."""

PADDING = frozenset(["center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap",
                     "generate_lorem_ipsum", "batch", "slice"])
"""Methods, filters and globals whose integer arguments are output widths or counts, checked
before the call (``generate_lorem_ipsum`` is Jinja2's ``lipsum``)."""

WIDTHS = re.compile(r"%[-+ #0*]*(\d+)|%[-+ #0*]*\d*\.(\d+)|\{[^{}]*:[^{}\d]*(\d+)")
"""The widths and precisions of ``%`` and ``str.format`` format strings."""

STRINGIFYING = frozenset(["string", "pprint", "center", "upper", "lower", "capitalize", "title", "trim",
                          "striptags", "truncate", "wordcount", "urlize", "urlencode", "escape", "e",
                          "forceescape", "safe", "wordwrap", "indent", "replace"])
"""Filters that turn their value into text first (``str()`` of a list included)."""

OUTPUT_FACTOR = 4
"""``{{ }}`` may write this many budgets' worth of text in one render: a character of the rendered
text passes through one ``{{ }}`` per macro or block it is written in, and real templates nest
them a level or two."""

CLOCK_FUNCTIONS = ("strftime_now",)
"""Template functions that read the time: they read the fixed ``data.template_clock``."""

TICK = "lockstep_budget_tick"
"""The global each loop iteration calls (through the sandbox's ``call``, which checks the time)."""


class TemplateBudgetError(Exception):
    """A render ran past its time budget or built a value past its size budget."""


def parse_clock(value: Optional[str], *, key: str = "data.template_clock") -> Optional[datetime]:
    """``data.template_clock`` (an ISO 8601 date or date-time) as a datetime; None stays None."""
    if value is None:
        return None
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        raise ConfigError(f"{key} must be an ISO 8601 date or date-time such as 2026-01-01T00:00:00, "
                          f"got {value!r}", key=key) from None


class Budget:
    """The limits of one render, checked by the environment's hooks while the render runs."""

    def __init__(self, origin: str, max_seconds: float, max_chars: int) -> None:
        self.origin = origin
        self.max_seconds = max_seconds
        self.max_chars = max_chars
        self._clock = threading.local()  # the pipeline's worker threads render with one template at once
        self.sizes = Sizer(max_chars, self.check_time)

    def start(self) -> None:
        self._clock.deadline = time.monotonic() + self.max_seconds
        self._clock.output = 0

    def check_time(self) -> None:
        if time.monotonic() > getattr(self._clock, "deadline", float("inf")):
            raise TemplateBudgetError(f"chat template ({self.origin}) ran longer than its time budget of "
                                      f"{self.max_seconds:g} s")

    def check_size(self, value: Any) -> Any:
        if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > self.max_chars:
            self.refuse_size(len(value))
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > self.max_chars:
            self.refuse_size(value.bit_length(), unit="bits")
        return value

    def refuse_size(self, size: int, unit: str = "items") -> None:
        raise TemplateBudgetError(f"chat template ({self.origin}) built a value of {size:,} {unit}, over its "
                                  f"size budget of {self.max_chars:,}")

    def refuse_estimate(self, size: int, what: str) -> None:
        raise TemplateBudgetError(f"chat template ({self.origin}) would build {size:,} characters or more with "
                                  f"{what}, over its size budget of {self.max_chars:,} (refused before building them)")

    def estimate(self, what: str, measure: Callable[..., int], *args: Any, **kwargs: Any) -> int:
        """``measure(*args, **kwargs)``, a size in characters; refused past the budget."""
        try:
            size = measure(*args, **kwargs)
        except TooLarge as exc:
            size = exc.size
        if size > self.max_chars:
            self.refuse_estimate(size, what)
        return size

    def check_output(self, value: Any) -> Any:
        """``{{ value }}``: refuse a value whose text would pass the budget, before str() builds it,
        and output past OUTPUT_FACTOR budgets in all: the text a loop writes inside a macro or a
        ``set`` block piles up in the block's buffer until the block ends."""
        size = len(value) if type(value) is str else self.estimate("{{ }} output", self.sizes.text, value)
        clock = self._clock
        output = clock.output = getattr(clock, "output", 0) + size
        if output > OUTPUT_FACTOR * self.max_chars:
            raise TemplateBudgetError(f"chat template ({self.origin}) wrote {output:,} characters with {{{{ }}}} "
                                      f"(those in macros and blocks included), over {OUTPUT_FACTOR} times its size "
                                      f"budget of {self.max_chars:,}")
        return value

    def check_parts(self, parts: tuple) -> tuple:
        """The operands of ``a ~ b ~ ...``, before they are turned into text and joined."""
        self.estimate("~", lambda: sum(self.sizes.text(part) for part in parts))
        return parts

    def join_pieces(self, pieces: Iterable[str]) -> str:
        """The text of a macro, ``set`` or ``filter`` block: its pieces, joined within the budget."""
        pieces = pieces if isinstance(pieces, list) else list(pieces)
        self.estimate("a block's text", lambda: sum(map(len, pieces)))
        return "".join(pieces)

    def bounded(self, items: Iterator, what: str) -> Iterator:
        """An iterator a filter returned, yielding while its items' total size stays in budget."""
        total = 0
        for i, item in enumerate(items):
            total += self.estimate(what, self.sizes.text, item) + 1
            if total > self.max_chars:
                self.refuse_estimate(total, what)
            if i % 1024 == 0:
                self.check_time()
            yield item

    def check_percent(self, fmt: str, args: Any) -> None:
        self.check_format(fmt)
        self.estimate("% formatting", percent_size, fmt, args, self.sizes)

    def check_field(self, value: Any, spec: str, total: int) -> int:
        """One ``str.format`` field (``spec`` with its nested fields filled in): the text so far."""
        width, precision, kind = format_spec_sizes(spec)
        for number in (width, precision or 0):
            if number > self.max_chars:
                self.refuse_estimate(number, "a format width or precision")
        size = field_size(self.estimate("str.format", self.sizes.text, value), width, precision, kind)
        if total + size > self.max_chars:
            self.refuse_estimate(total + size, "str.format")
        return total + size

    def check_arguments(self, name: str, args: tuple, kwargs: dict) -> None:
        """Widths (``center(n)``, ``indent(n)``) past the budget are refused before the call."""
        if name not in PADDING:
            return
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.max_chars:
                self.refuse_size(abs(value))

    def check_format(self, fmt: Any) -> None:
        """Refuse a format string with a width past the budget (``'%999999999s'``), before formatting."""
        if isinstance(fmt, str):
            for match in WIDTHS.finditer(fmt):
                width = int(next(group for group in match.groups() if group))
                if width > self.max_chars:
                    self.refuse_estimate(width, "a format width or precision")

    def check_filter(self, name: str, function: Callable, args: tuple, kwargs: dict) -> tuple:
        """Refuse a filter call whose result would pass the budget, before it runs; returns the
        arguments, with an iterator the filter would consume collected into a list (within the
        budget) and a value it would turn into text turned into it (measured first)."""
        offset = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0  # context/environment first
        if len(args) <= offset:
            return args
        head, value, rest = args[:offset], args[offset], args[offset + 1:]

        def arg(index: int, key: str, default: Any = None) -> Any:
            return kwargs[key] if key in kwargs else rest[index] if len(rest) > index else default

        what = f"the {name} filter"
        if name in STRINGIFYING and not isinstance(value, str):
            self.estimate(what, self.sizes.text, value)
            if name in ("replace", "indent", "wordwrap"):
                value = str(value)
        if name == "tojson":
            indent, separators = arg(1, "indent"), arg(2, "separators")
            if isinstance(indent, (int, float)) and indent > self.max_chars:
                self.refuse_estimate(int(indent), "tojson's indent")
            indent = len(indent) if isinstance(indent, str) else indent if _integer(indent) and indent > 0 else 0
            item_sep, key_sep = (len(separators[0]), len(separators[1])) if isinstance(separators, (list, tuple)) \
                and len(separators) == 2 else (1 if indent else 2, 2)
            self.estimate(what, self.sizes.json, value, indent=indent, item_sep=item_sep, key_sep=key_sep)
        elif name == "join":
            value = self._collected(value, what)
            items = value
            if arg(1, "attribute") is not None:
                from jinja2.filters import make_attrgetter

                items = list(map(make_attrgetter(head[0].environment, arg(1, "attribute")), value))
            self.estimate(what, self.sizes.joined, items, len(str(arg(0, "d", ""))))
        elif name == "replace":
            self._check_replace(value, arg(0, "old"), arg(1, "new"), arg(2, "count"), what)
        elif name == "format":
            self.check_percent(value, kwargs or rest)
        elif name in ("indent", "wordwrap") and isinstance(value, str):
            self._check_lines(name, value, arg, what)
        elif name == "sum":
            value = self._collected(value, what)
            self._check_sum(value, arg(1, "start", 0), what)
        elif name == "xmlattr" and isinstance(value, dict):
            self.estimate(what, self.sizes.text, value)
        return (*head, value, *rest)

    def _collected(self, value: Any, what: str) -> Any:
        """An iterator as a list, collected while its items stay within the budget; else ``value``."""
        if isinstance(value, Iterator):
            return list(self.bounded(value, what))
        return value

    def _check_replace(self, text: Any, old: Any, new: Any, count: Any, what: str) -> None:
        if not (isinstance(text, (str, bytes)) and type(old) is type(text) and type(new) is type(text)):
            return
        if len(new) <= len(old):
            return
        times = text.count(old) if old else len(text) + 1
        if _integer(count) and count >= 0:
            times = min(times, count)
        self.estimate(what, lambda: len(text) + times * (len(new) - len(old)))

    def _check_lines(self, name: str, text: str, arg: Callable, what: str) -> None:
        """indent: every line but the first (or all) gets the indentation; wordwrap: a wrapstring
        between lines, of which there are at most a line per whitespace character and per width."""
        if name == "indent":
            width = arg(0, "width", 4)
            indentation = len(width) if isinstance(width, str) else width if _integer(width) else 0
            lines = text.count("\n") + (1 if arg(1, "first", False) else 0)
        else:
            width, wrapstring = arg(0, "width", 79), arg(2, "wrapstring")
            indentation = len(wrapstring) if isinstance(wrapstring, str) else 1
            spaces = sum(text.count(c) for c in " \t\n\r\x0b\x0c")
            lines = spaces + (len(text) // width if _integer(width) and width > 0 else 0) + 1
        self.estimate(what, lambda: len(text) + lines * indentation)

    def _check_sum(self, items: Any, start: Any, what: str) -> None:
        """``sum`` of lists or strings concatenates: refuse a result past the budget, and a sum whose
        partial results (each one copied) add up to far more."""
        if not isinstance(items, (list, tuple)) or not isinstance(start, (list, tuple, str)):
            return
        total, copied = len(start), 0
        for i, item in enumerate(items):
            total += len(item) if isinstance(item, (list, tuple, str)) else 0
            copied += total
            if total > self.max_chars or copied > 16 * self.max_chars:
                self.refuse_estimate(max(total, copied), what + " (its partial sums copied)")
            if i % 1024 == 0:
                self.check_time()

    def check_method(self, method: Any, args: tuple, kwargs: dict) -> tuple:
        """Refuse ``str.replace``, ``join``, ``expandtabs`` or ``translate`` past the budget before
        the call; returns the arguments (an iterator given to ``join`` collected into a list)."""
        owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if not isinstance(owner, (str, bytes)):
            return args
        what = f"{type(owner).__name__}.{name}"
        if name == "replace" and len(args) >= 2:
            self._check_replace(owner, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count"), what)
        elif name == "join" and args:
            items = self._collected(args[0], what)
            items = items if isinstance(items, (list, tuple)) else list(items)
            self.estimate(what, lambda: sum(len(i) for i in items if isinstance(i, (str, bytes)))
                          + len(owner) * max(len(items) - 1, 0))
            args = (items, *args[1:])
        elif name == "expandtabs":
            tabsize = args[0] if args else kwargs.get("tabsize", 8)
            if _integer(tabsize):
                self.estimate(what, lambda: len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t")
                              * max(tabsize - 1, 0))
        elif name == "translate" and args and isinstance(args[0], dict):
            longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
            self.estimate(what, lambda: len(owner) * max(longest, 1))
        return args

    def check_binop(self, operator: str, left: Any, right: Any) -> None:
        """Refuse a product, power or format whose result would be past the budget, before computing it."""
        if operator == "%" and isinstance(left, str):
            self.check_percent(left, right)
        sized = (str, bytes, list, tuple)
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, sized) and isinstance(n, int) and len(seq) * max(n, 0) > self.max_chars:
                    self.refuse_size(len(seq) * n)
            if _integer(left) and _integer(right) and left.bit_length() + right.bit_length() > self.max_chars:
                self.refuse_size(left.bit_length() + right.bit_length(), unit="bits")
        if operator == "**" and _integer(left) and _integer(right) and abs(left) > 1:
            if right > 0 and left.bit_length() * right > self.max_chars:
                self.refuse_size(left.bit_length() * right, unit="bits")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def environment(budget: Budget, clock: Optional[datetime], raise_exception: Callable[[str], Any]):
    """A sandboxed Jinja2 environment as Hugging Face configures it, with ``budget``'s hooks."""
    import jinja2
    import jinja2.ext
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter

    class BudgetedCodeGenerator(CodeGenerator):
        """``a ~ b`` compiles to a join of operands the budget measured first, and whose result it checks."""

        def visit_Concat(self, node, frame) -> None:  # Jinja2's, with the two checks around the join
            if frame.eval_ctx.volatile:
                join = "(markup_join if context.eval_ctx.volatile else str_join)"
            elif frame.eval_ctx.autoescape:
                join = "markup_join"
            else:
                join = "str_join"
            self.write(f"environment.budget.check_size({join}(environment.budget.check_parts((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))))")

    class BudgetedFormatter(SandboxedFormatter):
        """``str.format`` that measures each field before formatting it."""

        def __init__(self, env, **kwargs) -> None:
            super().__init__(env, **kwargs)
            self.total = 0

        def convert_field(self, value, conversion):
            if conversion is not None:  # !r, !s, !a
                budget.estimate("str.format", budget.sizes.text, value)
            return super().convert_field(value, conversion)

        def format_field(self, value, format_spec):
            self.total = budget.check_field(value, format_spec, self.total)
            return super().format_field(value, format_spec)

    class BudgetedEscapeFormatter(BudgetedFormatter, SandboxedEscapeFormatter):
        pass

    class BudgetedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BudgetedCodeGenerator
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def call_binop(self, context, operator, left, right):
            if operator == "+":  # the templates' everyday string concatenation: checked inline
                if type(left) is type(right) and type(left) in (str, list, tuple):
                    if len(left) + len(right) > budget.max_chars:
                        budget.refuse_size(len(left) + len(right))
                    return left + right
                return budget.check_size(left + right)
            budget.check_time()
            budget.check_binop(operator, left, right)
            return budget.check_size(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja2's signature)
            budget.check_time()
            budget.check_arguments(getattr(__obj, "__name__", ""), args, kwargs)
            budget.check_format(_format_string(__obj))
            args = budget.check_method(__obj, args, kwargs)
            return budget.check_size(super().call(__context, __obj, *args, **kwargs))

        def wrap_str_format(self, value):  # Jinja2's, with a formatter that measures each field
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            owner, is_format_map = value.__self__, value.__name__ == "format_map"

            def wrapper(*args, **kwargs):
                if is_format_map:
                    if kwargs or len(args) != 1:
                        return wrapped(*args, **kwargs)  # Jinja2's own error
                    args, kwargs = (), args[0]
                formatter = BudgetedEscapeFormatter(self, escape=owner.escape) if hasattr(owner, "__html__") \
                    else BudgetedFormatter(self)
                return type(owner)(formatter.vformat(owner, args, kwargs))

            return update_wrapper(wrapper, value)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        if clock is None:  # compile() refuses such templates; a defensive second line
            raise TemplateBudgetError("strftime_now needs data.template_clock")
        return clock.strftime(fmt)

    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                              finalize=budget.check_output)
    env.budget = budget
    env.concat = budget.join_pieces  # what compiled templates join a macro's or block's pieces with
    env.filters["tojson"] = tojson
    env.filters = {name: _budgeted_filter(name, f, budget) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals[TICK] = budget.check_time
    return env


def _format_string(method: Any) -> Optional[str]:
    """The string of a ``str.format`` / ``format_map`` call (Jinja2 hands it over wrapped), else None."""
    if getattr(method, "__name__", None) not in ("format", "format_map"):
        return None
    owner = getattr(getattr(method, "__wrapped__", method), "__self__", None)
    return owner if isinstance(owner, str) else None


def _budgeted_filter(name: str, function: Callable, budget: Budget) -> Callable:

    def wrapper(*args, **kwargs):
        budget.check_time()
        budget.check_arguments(name, args, kwargs)
        args = budget.check_filter(name, function, args, kwargs)
        result = function(*args, **kwargs)
        if isinstance(result, Iterator):  # map, select, ...: whoever consumes it collects at most the budget
            return budget.bounded(result, f"the {name} filter")
        return budget.check_size(result)

    # update_wrapper also copies jinja_pass_arg: filters that take the context first keep it.
    return update_wrapper(wrapper, function)


def compile_template(env, source: str):
    """(compiled template, whether it reads the clock): every loop body starts with a call of the
    budget's tick, which the sandbox's ``call`` hook checks against the time budget."""
    from jinja2 import nodes

    ast = env.parse(source)
    uses_clock = any(name.name in CLOCK_FUNCTIONS for name in ast.find_all(nodes.Name))
    for loop in ast.find_all(nodes.For):
        tick = nodes.ExprStmt(nodes.Call(nodes.Name(TICK, "load"), [], [], None, None))
        tick.set_lineno(loop.lineno)
        tick.set_environment(env)
        loop.body.insert(0, tick)
    return env.from_string(ast), uses_clock


def render_within(template, budget: Budget, variables: dict) -> str:
    """``template.generate(**variables)`` joined, under ``budget``'s time and size limits."""
    budget.start()
    pieces, size = [], 0
    for piece in template.generate(**variables):
        size += len(piece)
        if size > budget.max_chars:
            budget.refuse_size(size, unit="characters of output")
        pieces.append(piece)
    return "".join(pieces)
