"""The calculator tool of the embedded agent tasks: integer arithmetic on a string expression.

One function, used by both sides of the tool: ``python -m data prepare`` writes the tool's
results into the tool-use transcripts (SFT), and the built-in ``calculator`` environment of
``training/rollout/`` answers a model's call with it during rollouts. The same call therefore
gets the same text in the data and in an episode.

The call a model makes (Qwen's format, ``<tool_call>`` around one JSON object)::

    {"name": "calculator", "arguments": {"expression": "4821 * 37"}}

An expression is integers, ``+ - * //``, unary minus and parentheses (read with ``ast``, never
``eval``), at most ``MAX_CHARS`` characters and ``MAX_DIGITS`` digits in any intermediate
value. The result is the decimal integer (``178377``). What the calculator cannot compute is
not an exception: the result is a line starting ``error:`` that says why, which the
environment hands back to the model as the tool's observation.
"""

from __future__ import annotations

import ast

NAME = "calculator"
MAX_CHARS = 64
MAX_DIGITS = 24

SPEC = {
    "type": "function",
    "function": {
        "name": NAME,
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
"""The tool's JSON-schema function spec, as a record's ``tools`` list holds it. It has no
descriptions: the template lists it in every prompt, and a tiny model learns faster on short ones."""

_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.FloorDiv: lambda a, b: a // b}


class _Refused(ValueError):
    pass


def calculate(expression: object) -> str:
    """The calculator's answer to ``expression``: a decimal integer, or ``error: <why>``."""
    if not isinstance(expression, str):
        return f"error: expression must be a string, got {type(expression).__name__}"
    if len(expression) > MAX_CHARS:
        return f"error: expression longer than {MAX_CHARS} characters"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return str(_value(tree.body))
    except SyntaxError:
        return "error: not an arithmetic expression"
    except _Refused as e:
        return f"error: {e}"


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(node.operand)
        value = -operand if isinstance(node.op, ast.USub) else operand
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.FloorDiv) and right == 0:
            raise _Refused("division by zero")
        value = _OPERATORS[type(node.op)](left, right)
    else:
        raise _Refused("only integers, + - * // and parentheses are allowed")
    if len(str(abs(value))) > MAX_DIGITS:
        raise _Refused(f"a value has more than {MAX_DIGITS} digits")
    return value
