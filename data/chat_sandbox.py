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
  filters refuse a result (or, where it can be known beforehand, an argument) longer than the
  budget, and so does the rendered text; integer arithmetic is capped at the same number of
  bits, so ``7 ** 100000000`` is refused instead of computed, and so are widths past the
  budget in ``%`` and ``format`` strings.

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
from datetime import datetime
from typing import Any, Callable, Optional

from core.exceptions import ConfigError

MAX_SECONDS = 10.0
"""Default time budget of one render (a real template renders a conversation in well under 1 ms)."""
MAX_CHARS = 16 * 2 ** 20
"""Default size budget: characters of any value a render builds, and of the rendered text."""

PADDING = frozenset(["center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap",
                     "generate_lorem_ipsum"])
"""Methods, filters and globals whose integer arguments are output widths or counts, checked
before the call (``generate_lorem_ipsum`` is Jinja2's ``lipsum``)."""

WIDTHS = re.compile(r"%[-+ #0*]*(\d+)|\{[^{}]*:[^{}\d]*(\d+)")
"""The widths of ``%`` and ``str.format`` format strings."""

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

    def start(self) -> None:
        self._clock.deadline = time.monotonic() + self.max_seconds

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
                width = int(match.group(1) or match.group(2))
                if width > self.max_chars:
                    self.refuse_size(width)

    def check_binop(self, operator: str, left: Any, right: Any) -> None:
        """Refuse a product, power or format whose result would be past the budget, before computing it."""
        if operator == "%":
            self.check_format(left)
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
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BudgetedCodeGenerator(CodeGenerator):
        """``a ~ b`` compiles to a join whose result the budget checks."""

        def visit_Concat(self, node, frame) -> None:
            self.write("environment.budget.check_size(")
            super().visit_Concat(node, frame)
            self.write(")")

    class BudgetedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BudgetedCodeGenerator
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def call_binop(self, context, operator, left, right):
            budget = self.budget
            if operator == "+":  # the templates' everyday string concatenation: checked inline
                result = left + right
                if type(result) is str:
                    if len(result) > budget.max_chars:
                        budget.refuse_size(len(result))
                    return result
                return budget.check_size(result)
            budget.check_time()
            budget.check_binop(operator, left, right)
            return budget.check_size(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja2's signature)
            __self.budget.check_time()
            __self.budget.check_arguments(getattr(__obj, "__name__", ""), args, kwargs)
            __self.budget.check_format(_format_string(__obj))
            return __self.budget.check_size(super().call(__context, __obj, *args, **kwargs))

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        if clock is None:  # compile() refuses such templates; a defensive second line
            raise TemplateBudgetError("strftime_now needs data.template_clock")
        return clock.strftime(fmt)

    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.budget = budget
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
    from functools import update_wrapper

    def wrapper(*args, **kwargs):
        budget.check_time()
        budget.check_arguments(name, args, kwargs)
        if name == "format" and args:  # value|format(...) is value % (...)
            budget.check_format(args[0])
        return budget.check_size(function(*args, **kwargs))

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
