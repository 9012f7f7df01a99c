"""Trace readers, one module per format, all producing `replay.trace.Trace`:

    jsonl      our JSONL (examples/TRACE_FORMAT.md)
    atif       Harbor's Agent Trajectory Interchange Format (trajectory.json)
    openai     OpenAI chat messages: a list, {messages, tools}, or JSONL
    anthropic  Anthropic Messages: {system, tools, messages} or a list, thinking blocks

Each module has `read(text, source) -> Trace` and is imported when its format
is read. `detect` picks the format from the content; `load` reads a file.
"""

from __future__ import annotations

import glob
import importlib
import json
from pathlib import Path
from typing import Iterable

from session_runtime.replay.trace import Trace, TraceError

FORMATS = ("atif", "openai", "anthropic", "jsonl")
TRACE_SUFFIXES = (".json", ".jsonl")

# Content blocks only Anthropic messages have; fields of OpenAI messages our JSONL rejects.
_ANTHROPIC_BLOCKS = frozenset({"thinking", "redacted_thinking", "tool_use", "tool_result"})
_OPENAI_FIELDS = frozenset({"refusal", "annotations", "audio", "function_call"})


def read(text: str, source: str, fmt: str = "auto") -> Trace:
    """Parse `text` as `fmt` (or the detected format). Raises TraceError, ValueError (unknown format)."""
    if fmt == "auto":
        fmt = detect(text)
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; one of {', '.join(FORMATS)} or auto")
    return importlib.import_module(f"{__name__}.{fmt}").read(text, source)


def load(path: str | Path, fmt: str = "auto") -> Trace:
    """Read and validate one trace file. Raises TraceError, OSError, ValueError."""
    path = Path(path)
    return read(path.read_text(encoding="utf-8"), str(path), fmt)


def detect(text: str) -> str:
    """The format of a trace file's content. Raises TraceError when no format fits."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return _detect_lines(text)
    if isinstance(data, dict):
        if "steps" in data:
            return "atif"
        if "role" in data or data.get("type") == "conversation":  # a one-line JSONL trace
            return _detect_messages([data], jsonl=True)
        if isinstance(data.get("messages"), list):
            if "system" in data:  # OpenAI puts the system prompt in messages, Anthropic beside them
                return "anthropic"
            if any(isinstance(t, dict) and "input_schema" in t for t in data.get("tools") or []):
                return "anthropic"
            return _detect_messages(data["messages"])
    if isinstance(data, list):
        return _detect_messages(data)
    raise TraceError(0, "cannot tell the trace format (expected an ATIF trajectory, a list of messages, an "
                        "object with messages, or JSONL); give --format")


def _detect_lines(text: str) -> str:
    records = []
    for raw in text.splitlines():
        if raw.strip():
            try:
                records.append(json.loads(raw))
            except json.JSONDecodeError:
                return "jsonl"  # the JSONL reader names the bad line
    return _detect_messages(records, jsonl=True)


def _detect_messages(messages: list, jsonl: bool = False) -> str:
    """anthropic when a content block only Anthropic has appears. A JSON file is
    otherwise openai; a JSONL file is openai when a role, a content list or a
    field our JSONL rejects appears, else our JSONL (whose messages OpenAI's
    reader would read the same way)."""
    dicts = [m for m in messages if isinstance(m, dict)]
    for m in dicts:
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") in _ANTHROPIC_BLOCKS
                                             for b in content):
            return "anthropic"
    if not jsonl:
        return "openai"
    if any(m.get("type") == "conversation" for m in dicts):
        return "jsonl"
    openai = any(m.get("role") in ("system", "developer", "function") or isinstance(m.get("content"), list)
                 or _OPENAI_FIELDS & set(m) or ("name" in m and m.get("role") != "tool") for m in dicts)
    return "openai" if openai else "jsonl"


def collect_paths(paths: Iterable[str]) -> list[Path]:
    """Files named by `paths`: a file is itself; a folder gives every .json/.jsonl
    file directly in it, sorted; anything else is a glob (`**` recursive),
    sorted. Each file once, in order. Raises ValueError when a path names nothing."""
    out: list[Path] = []
    for text in paths:
        p = Path(text)
        if p.is_file():
            found = [p]
        elif p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in TRACE_SUFFIXES)
            if not found:
                raise ValueError(f"{text}: no .json or .jsonl file in this folder")
        else:
            found = sorted(Path(f) for f in glob.glob(text, recursive=True) if Path(f).is_file())
            if not found:
                raise ValueError(f"{text}: no such file, folder or matching file")
        out += [f for f in found if f not in out]
    return out
