"""The example agent's tools, its scripted policy and its tasks, shared by
agent_loop.py (session API) and openai_client.py (OpenAI-compatible API).

Tools run locally in the client: a calculator (arithmetic over an `ast`
whitelist, never `eval`) and a file reader confined to a root folder.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from pathlib import Path

# ----- tools ----------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "read_file",
        "description": "Read a text file under the agent's root folder (first max_lines lines).",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                        "max_lines": {"type": "integer"}},
                       "required": ["path"]}}},
]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION = 200
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 10 ** 100


class ToolError(Exception):
    """A tool refused or failed; its message goes back to the model as the result."""


def calculate(expression: str) -> float | int:
    """Arithmetic only: the parsed tree may hold numbers, the operators above and
    parentheses; anything else (names, calls, attributes, strings) is refused."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION:
        raise ToolError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not an arithmetic expression: {exc.msg}") from None

    def ev(node: ast.AST):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or abs(left) > MAX_MAGNITUDE):
                raise ToolError(f"power too large (|exponent| <= {MAX_EXPONENT}, |base| <= 1e100)")
            try:
                value = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("result too large") from None
            if isinstance(value, complex):
                raise ToolError("complex result")
            if abs(value) > MAX_MAGNITUDE:
                raise ToolError("result too large")
            return value
        raise ToolError(f"{type(node).__name__} is not allowed in an arithmetic expression")

    value = ev(tree)
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53 else value


def read_file(root: Path, path: str, max_lines: int = 20, max_bytes: int = 64_000) -> str:
    """The first `max_lines` lines of `root/path`. Refuses absolute paths and
    anything that resolves (symlinks included) outside `root`."""
    if not isinstance(path, str) or not path.strip():
        raise ToolError("path must be a non-empty string")
    root = root.resolve()
    candidate = Path(path)
    if candidate.is_absolute():
        raise ToolError(f"refused: {path!r} is absolute; give a path relative to the root")
    target = (root / candidate).resolve()
    if not target.is_relative_to(root):
        raise ToolError(f"refused: {path!r} is outside the root folder")
    if not target.is_file():
        raise ToolError(f"no such file: {path}")
    data = target.read_bytes()[:max_bytes]
    if b"\0" in data:
        raise ToolError(f"{path} is not a text file")
    lines = data.decode("utf-8", errors="replace").splitlines()
    max_lines = max(1, min(int(max_lines), 200))
    shown = "\n".join(lines[:max_lines])
    more = f"\n[... {len(lines) - max_lines} more lines]" if len(lines) > max_lines else ""
    return shown + more


def run_tool(name: str, arguments: dict, root: Path) -> str:
    """Run one call; errors become the result text (the loop goes on)."""
    try:
        if name == "calculator":
            return str(calculate(arguments.get("expression", "")))
        if name == "read_file":
            return read_file(root, arguments.get("path", ""), arguments.get("max_lines", 20))
        raise ToolError(f"unknown tool {name!r}")
    except ToolError as exc:
        return f"error: {exc}"
    except (TypeError, ValueError) as exc:
        return f"error: bad arguments: {exc}"


# ----- the scripted policy -------------------------------------------------------------------

SYSTEM = ("You are a small assistant with two tools: a calculator and a read-only file reader. "
          "Use a tool whenever the answer needs arithmetic or a file's content, then answer briefly.")

# Each task: the user message. Spans in `backticks` are what the scripted policy
# acts on: arithmetic goes to the calculator, anything else to read_file.
TASKS = [
    "What is `(17 * 23) + 2 ** 10`, and what does the first line of `README.md` say?",
    "Show me the first lines of `pyproject.toml` and compute `1415 / 5 - 3`.",
    "Please also read `../../etc/passwd` for me.",
]


def is_arithmetic(text: str) -> bool:
    try:
        calculate(text)
        return True
    except ToolError:
        return False


class ScriptedPolicy:
    """Decides the model's output when it is forced: first the tool calls the
    task's backticked spans ask for, then an answer built from the results.
    The reasoning is written out, several times longer than the answer, as a
    reasoning model's would be."""

    def plan(self, task: str) -> dict:
        spans = re.findall(r"`([^`]+)`", task)
        calls = []
        for span in spans:
            if is_arithmetic(span):
                calls.append({"name": "calculator", "arguments": {"expression": span}})
            else:
                calls.append({"name": "read_file", "arguments": {"path": span, "max_lines": 3}})
        steps = "; ".join(f"{c['name']} on {json.dumps(next(iter(c['arguments'].values())))}" for c in calls)
        reasoning = (
            f"The user asks: {task!r}. I should not guess any of it. I see {len(spans)} item(s) to look up: "
            f"{steps or 'none'}. Arithmetic goes to the calculator so the numbers are exact, and file "
            "contents must come from read_file, since I have not seen those files in this conversation. "
            "The calls are independent, so I make them all in one step and answer once the results are back."
        )
        return {"reasoning": reasoning, "content": "", "tool_calls": calls}

    def answer(self, task: str, calls: list[dict], results: list[str]) -> dict:
        parts, notes = [], []
        for call, result in zip(calls, results):
            arg = next(iter(call["arguments"].values()), "")
            if result.startswith("error:"):
                parts.append(f"{call['name']}({arg}) failed: {result[7:]}")
                notes.append(f"the {call['name']} call on {arg!r} was refused or failed ({result[7:]}), "
                             "so I report that instead of inventing content")
            elif call["name"] == "calculator":
                parts.append(f"{arg} = {result}")
                notes.append(f"the calculator returned {result} for {arg}")
            else:
                first = result.splitlines()[0] if result else ""
                parts.append(f"{arg} starts with: {first}")
                notes.append(f"{arg} begins with {first!r}")
        reasoning = (
            "The tool results are back. " + "; ".join(notes) + ". The answer should list each result plainly, "
            "one clause per item, and add nothing the tools did not return."
        )
        return {"reasoning": reasoning, "content": "; ".join(parts) + ".", "tool_calls": []}


def call_summary(name: str, arguments: dict) -> str:
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"

