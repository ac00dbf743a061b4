"""The `calculator` tool: arithmetic on numbers, evaluated from the expression's `ast` (never `eval`).

Owns `Calculator`. + - * / // % ** and parentheses on ints and floats; exponents and results are
bounded so `9**9**9` is refused instead of hanging. Imports only the standard library.
"""

from __future__ import annotations

import ast
import operator

from megarl.agent.tools.base import TOOLS, Tool

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


@TOOLS.register("calculator")
class Calculator(Tool):
    """Evaluate an arithmetic expression; errors (1/0, bad syntax) raise and become error observations."""

    default_schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }

    def __init__(self, schema=None, *, max_exponent: int = 100, max_chars: int = 200):
        super().__init__(schema)
        self.max_exponent = max_exponent
        self.max_chars = max_chars

    def execute(self, state, arguments: dict) -> str:
        expression = str(arguments["expression"])
        if len(expression) > self.max_chars:
            raise ValueError(f"expression longer than {self.max_chars} characters")
        value = self._eval(ast.parse(expression, mode="eval").body)
        return str(int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 1e15 else value)

    def _eval(self, node: ast.AST):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.max_exponent:
                raise ValueError(f"exponent {right} is larger than {self.max_exponent}")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        raise ValueError(f"unsupported expression: {ast.unparse(node)!r} (numbers and + - * / // % ** only)")
