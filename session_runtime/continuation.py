"""How a stateless chat client continues a stored conversation (Chat
Completions with `conversation_id`), without ever losing what is stored.

A request continues the conversation in one of two shapes:

- the full history as a client echoes it: the stored system prompt, the stored
  messages (reasoning may be left out: clients drop it between turns), then the
  new input;
- only the new input: no system and no earlier message, just the new user
  message or the answers to the pending tool calls.

Any other history is a conflict (409) that names the first message where it
differs, unless the client asks to replace the conversation (`replace`). The
check and the step run under the conversation's lock (`Runtime.chat_step`), so
a history that was right when checked is still the stored one at the commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from session_runtime.conversation import Conversation
from session_runtime.errors import HistoryConflict, InvalidRequest
from session_runtime.importer import check_unicode, client_messages, text_content
from session_runtime.templates.base import Message, Template


@dataclass(frozen=True)
class ChatInput:
    """A chat request's messages, split where the runtime reads them."""

    system: Optional[str]  # the system (or developer) message's text; None when absent or empty
    system_given: bool  # the request's first message was a system message
    tools: Optional[list[dict]]  # None: the request sent no `tools`
    history: list[dict]  # the client's messages before the new input, system excluded
    new: list[dict]  # the new input: the last user message, or the trailing tool results

    @property
    def offset(self) -> int:
        """Index of `history[0]` in the request's `messages`."""
        return 1 if self.system_given else 0

    @property
    def only_new(self) -> bool:
        return not self.system_given and not self.history

    @property
    def user_content(self) -> Optional[str]:
        """The new user message's text; None when the new input is tool results."""
        return text_content(self.new[0].get("content")) if self.new[0].get("role") == "user" else None

    def tool_results(self) -> list[dict]:
        return [{"tool_call_id": str(m.get("tool_call_id", "")), "content": text_content(m.get("content"))}
                for m in self.new]


def split(messages: Sequence[dict], tools: Optional[Sequence[dict]]) -> ChatInput:
    """Split an OpenAI `messages` list. Raises InvalidRequest when it holds no new
    input (the last message is neither a user message nor a tool result), or
    text that is not valid Unicode."""
    for i, m in enumerate(messages):
        check_unicode(m, f"messages[{i}]")
    rest = list(messages)
    system, given = None, False
    if rest and isinstance(rest[0], dict) and rest[0].get("role") in ("system", "developer"):
        system, given = text_content(rest.pop(0).get("content"), "messages[0].content") or None, True
    new = _tail(rest)
    return ChatInput(system, given, None if tools is None else list(tools), rest[: len(rest) - len(new)], new)


def _tail(messages: list[dict]) -> list[dict]:
    """The new input: the last user message, or the trailing tool results."""
    if not messages:
        raise InvalidRequest("messages must hold a user message")
    last = messages[-1]
    role = last.get("role") if isinstance(last, dict) else None
    if role == "user":
        return messages[-1:]
    if role == "tool":
        i = len(messages)
        while i > 0 and isinstance(messages[i - 1], dict) and messages[i - 1].get("role") == "tool":
            i -= 1
        return messages[i:]
    raise InvalidRequest("the last message must be a user message or tool results")


def check(conv: Conversation, tpl: Template, request: ChatInput) -> None:
    """Raise HistoryConflict unless `request` continues `conv` in one of the two
    shapes; InvalidRequest for a history that cannot be read. Changes nothing."""
    if request.tools is not None and request.tools != conv.tools:
        raise HistoryConflict(f"tools differ from those of conversation {conv.id!r} ({len(conv.tools)} stored, "
                              f"{len(request.tools)} sent): {_how(conv.id)}", param="tools")
    if request.only_new:
        return
    if request.system != conv.system:
        if request.system is None:
            said = f"the request has no system prompt, and conversation {conv.id!r} has one"
        elif conv.system is None:
            said = f"the request has a system prompt, and conversation {conv.id!r} has none"
        else:
            said = f"the request's system prompt differs from that of conversation {conv.id!r}"
        raise HistoryConflict(f"messages[0]: {said}: {_how(conv.id)}", param="messages")
    at = first_difference(conv.trace_messages(), client_messages(tpl, request.history, with_ids=False))
    if at is not None:
        index, why = at
        raise HistoryConflict(f"messages[{request.offset + index}] {why} conversation {conv.id!r}: {_how(conv.id)}",
                              param="messages")


def _how(cid: str) -> str:
    return (f"send its whole stored history (GET /v1/conversations/{cid}) then the new messages, only the new "
            "messages, or \"replace\": true to replace the conversation")


def first_difference(stored: Sequence[Message], sent: Sequence[Message]) -> Optional[tuple[int, str]]:
    """(index in `sent`, how it differs) of the first message where the client's
    history and the stored one part, or None when they say the same. Reasoning
    is not compared (clients may drop it); tool results answering one step may
    come in any order."""
    a, b = _results_by_id(stored), _results_by_id(sent)
    for (_, mine), (i, theirs) in zip(a, b):
        if not same_message(mine, theirs):
            return i, f"({theirs.role}) differs from the stored {mine.role} message of"
    if len(b) > len(a):
        return b[len(a)][0], f"({b[len(a)][1].role}) is past the {len(a)} stored messages of"
    if len(a) > len(b):
        return len(sent), f"is the new input, where the stored history goes on with a {a[len(b)][1].role} message, in"
    return None


def same_message(a: Message, b: Message) -> bool:
    return ((a.role, a.content.strip(), a.tool_call_id) == (b.role, b.content.strip(), b.tool_call_id)
            and [(c.id, c.name, c.arguments) for c in a.tool_calls] == [(c.id, c.name, c.arguments)
                                                                       for c in b.tool_calls])


def _results_by_id(messages: Sequence[Message]) -> list[tuple[int, Message]]:
    """(index, message) pairs; tool results that answer one step together are
    sorted by call id, so the order a client sends them in does not count."""
    out: list[tuple[int, Message]] = []
    run: list[tuple[int, Message]] = []
    for pair in [*enumerate(messages), None]:
        if pair is not None and pair[1].role == "tool":
            run.append(pair)
            continue
        out += sorted(run, key=lambda p: p[1].tool_call_id)
        run = []
        if pair is not None:
            out.append(pair)
    return out
