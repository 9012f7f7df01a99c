"""`/v1/responses`: OpenAI Responses, served by the local engine as steps
(api/step_input.py; api/protocol_routes.py has what the protocol routes share).

`POST /v1/responses` answers plain or streamed (`stream: true`: Responses'
events, api/responses_stream.py), with ids on the response and every item
(api/responses_output.py). A request is parsed and checked as the other
protocol routes check theirs (`step_input`), then:

- `store: false`: a stateless client's request (Codex CLI's), answered as a
  step of the conversation its history continues, as every stateless
  request is (session inference, with
  `prompt_cache_key` as the session key; stateless.py); `reasoning.context`
  (`all_turns`: keep, `current_turn`: drop) sets the turn's policy. Call ids
  are the conversation's own, so the history sent back matches the stored one. Reasoning items come back with `encrypted_content` when
  `include` asks for `reasoning.encrypted_content`; sent back in `input`,
  they are decrypted (the server's own only: any other token is 400).
- `store: true` (the default, as on OpenAI): the response IS a conversation of
  the runtime, created with the caller's tenant under the response's id (it
  counts toward the tenant's conversations); api/responses_store.py maps
  each response id to its conversation and where in it the response ended.
- `previous_response_id`: continues that response's conversation with only
  the new input (a user message, or function_call_output items answering its
  calls), the runtime's "only new input" shape, so the step prefills only
  that. The conversation keeps its system prompt: `instructions` on a
  follow-up must be the same or left out (OpenAI does not carry instructions
  over; here the cache starts with them, so other instructions are 400).
  Only the conversation's latest response can be continued: a fork from an
  older one is 409 previous_response_not_latest naming the latest. A
  follow-up with `store: false` is 400 (the stored conversation would move on
  without a response to continue from). Unknown, deleted or another tenant's:
  404 previous_response_not_found. One response per conversation at a time
  (409 conversation_locked).

`GET /v1/responses/{id}` returns a stored response as it was answered;
`DELETE /v1/responses/{id}` forgets it, and deleting the last stored response
of a conversation deletes the conversation (its turns and KV chain). A
conversation stepped through another route (the chat route with its id, the
session API) is no longer continued from its earlier responses (409).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from pathlib import Path
from typing import Callable, Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from session_runtime.api.auth import current_caller
from session_runtime.api.lean_route import LeanRoute
from session_runtime.api.openai_compat import chat_usage, served_name, tool_calls
from session_runtime.api.protocol_routes import read_body, step_input
from session_runtime.api.proxy_routes import validation_error
from session_runtime.api.responses_errors import (
    PreviousResponseNotFound, PreviousResponseNotLatest, ResponseInProgress, ResponseNotFound,
)
from session_runtime.api.responses_input import ENCRYPTED, decrypt_reasoning, only_new_input
from session_runtime.api.responses_output import OutputIds, finished, output_items, shell
from session_runtime.api.responses_store import ResponseStore, StoredResponse
from session_runtime.api.responses_stream import ResponseEvents
from session_runtime.api.settings import Caller
from session_runtime.api.step_input import CONVERSATION_HEADER, FINISH, Stateless, StepAnswers
from session_runtime.api.streaming import cancellable
from session_runtime.errors import ConversationNotFound, InvalidRequest
from session_runtime.policies import ReasoningPolicy
from session_runtime.protocols import get_protocol

PATH = "/v1/responses"
PROTOCOL = "openai-responses"


class _Responses:
    """The route's state: the response table (opened at the first request, in
    the runtime's data folder) and the conversations a response is being
    answered on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._store: Optional[ResponseStore] = None
        self._busy: set[str] = set()

    def store(self, runtime) -> ResponseStore:
        with self._lock:
            if self._store is None:
                data_dir = runtime.config.data_dir
                self._store = ResponseStore(Path(data_dir) / "responses.sqlite3" if data_dir else None)
            return self._store

    def claim(self, cid: str) -> Callable[[], None]:
        """Mark the conversation busy until the returned release is called (once
        the answer is sent). Raises ResponseInProgress while another holds it."""
        with self._lock:
            if cid in self._busy:
                raise ResponseInProgress("a response on the conversation of this previous_response_id is still "
                                         "in progress; send this request once it has completed")
            self._busy.add(cid)
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                with self._lock:
                    self._busy.discard(cid)

        return release


class _Releasing(StreamingResponse):
    """A stream that calls `release` once it is over, however it ended."""

    def __init__(self, content, release: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def build(answers: StepAnswers, validate: Optional[str], runtime) -> APIRouter:
    router = APIRouter(route_class=LeanRoute)  # the step routes' requests read lean (api/lean_route.py)
    adapter = get_protocol(PROTOCOL)
    state = _Responses()

    @router.post(PATH, name=PROTOCOL)
    async def create(request: Request, caller: Caller = Depends(current_caller)):
        """Answer a Responses request (module docstring). Raises InvalidRequest,
        InvalidEncryptedContent, PreviousResponseNotFound (404),
        PreviousResponseNotLatest and ResponseInProgress (409), and the chat
        route's errors; before a stream starts every error is an HTTP error."""
        raw = await read_body(request)
        as_provider = validate == PROTOCOL
        if as_provider:
            refused = validation_error(PROTOCOL, raw)
            if refused is not None:
                return refused
        raw = decrypt_reasoning(raw, request.app.state.secret)
        # As the provider, any of its model names is taken.
        inp = step_input(adapter, PROTOCOL, raw, None)
        assert isinstance(raw, dict)  # step_input refuses any other body
        model_id = served_name(runtime, raw["model"]) if raw.get("model") is not None and not as_provider \
            else runtime.served_names[0]
        store, previous = _flag(raw, "store", True), raw.get("previous_response_id")
        stream = _flag(raw, "stream", False)
        if previous is not None and not isinstance(previous, str):
            raise InvalidRequest("previous_response_id: expected a string", param="previous_response_id")
        if previous is not None and not store:
            raise InvalidRequest("store: false cannot continue a stored response here: the stored conversation "
                                 "would move on with no response to continue it from; leave store out",
                                 param="store")
        include = raw.get("include") if isinstance(raw.get("include"), list) else []
        encrypt = request.app.state.secret.encrypt if ENCRYPTED in include else None
        policy = _reasoning_policy(raw)
        inp = dataclasses.replace(inp, stream=stream, stateless=Stateless(
            PROTOCOL, _cache_key(raw), policy, rules=policy and {"reasoning": {
                "rule": "reasoning.context", "policy": policy.name, "keep_last_k": policy.keep_last_k}}))

        def answer(cancel):
            responses = state.store(runtime)
            ids = OutputIds(own_calls=previous is None and not store)
            base = shell(raw, ids, model_id, inp.temperature, inp.top_p, store)
            body, cid, release = inp, None, lambda: None
            if previous is not None:
                rec = responses.get(previous)
                if rec is None or not caller.may_see(rec.tenant):
                    raise PreviousResponseNotFound(previous)
                cid = rec.conversation_id
                release = state.claim(cid)
            elif store:
                cid = ids.response  # the first response names its conversation
                release = state.claim(cid)
            try:
                if previous is not None:
                    body = dataclasses.replace(inp, conversation_id=cid,
                                               messages=_continuing(runtime, responses, rec, inp.messages))
                elif store:
                    body = dataclasses.replace(inp, conversation_id=cid, create=True)

                def record(response: dict) -> None:
                    if cid is not None:
                        conv = runtime.get(cid)
                        responses.put(StoredResponse(ids.response, cid, conv.tenant, len(conv.trace),
                                                     ids.call_ids(), response))

                render = ResponseEvents(base, ids, encrypt, on_done=record).render if stream else None
                result = answers.answer(body, caller, cancel, render)
            except BaseException:
                release()
                raise

            if isinstance(result, StreamingResponse):  # the step's events in Responses', rendered by ResponseEvents
                return _Releasing(result.body_iterator, release, media_type="text/event-stream",
                                  headers={CONVERSATION_HEADER: result.headers.get(CONVERSATION_HEADER, "")})
            try:
                finish = FINISH.get(result.finish_reason, "stop")
                output = output_items(ids, result.reasoning or "", result.content or "", tool_calls(result),
                                      finish == "length", encrypt)
                response = finished(base, output, finish, chat_usage(result))
                record(response)
                return JSONResponse(response, headers={CONVERSATION_HEADER: result.conversation_id})
            finally:
                release()

        return await cancellable(request, answer)

    @router.get(PATH + "/{rid}")
    def get(rid: str, request: Request, caller: Caller = Depends(current_caller)) -> dict:
        """A stored response as it was answered. Raises ResponseNotFound."""
        return _visible(state.store(request.app.state.runtime), rid, caller).body

    @router.delete(PATH + "/{rid}")
    def delete(rid: str, request: Request, caller: Caller = Depends(current_caller)) -> dict:
        """Forget a stored response; with the last of its conversation's, the
        conversation too (deleted first: a delete that cannot be saved does not
        happen). Raises ResponseNotFound."""
        runtime = request.app.state.runtime
        responses = state.store(runtime)
        rec = _visible(responses, rid, caller)
        if responses.count(rec.conversation_id) == 1:
            with contextlib.suppress(ConversationNotFound):  # deleted through the session API already
                runtime.delete_conversation(rec.conversation_id)
        responses.delete(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}

    return router


def _flag(raw: dict, name: str, default: bool) -> bool:
    value = raw.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name}: expected a boolean", param=name)
    return value


def _visible(responses: ResponseStore, rid: str, caller: Caller) -> StoredResponse:
    rec = responses.get(rid)
    if rec is None or not caller.may_see(rec.tenant):  # another tenant's is not the caller's business
        raise ResponseNotFound(rid)
    return rec


def _continuing(runtime, responses: ResponseStore, rec: StoredResponse, messages: list[dict]) -> list[dict]:
    """The new input of a request continuing `rec`, once its conversation is
    found at `rec`'s end. Raises PreviousResponseNotFound (the conversation was
    deleted), PreviousResponseNotLatest (it moved on), InvalidRequest."""
    try:
        conv = runtime.get(rec.conversation_id)
    except ConversationNotFound:
        raise PreviousResponseNotFound(rec.id) from None
    if len(conv.trace) != rec.position:
        latest = responses.latest(rec.conversation_id)
        then = (f"continue from its latest response {latest.id!r}" if latest is not None and latest.id != rec.id
                else "it was stepped through another route")
        raise PreviousResponseNotLatest(
            f"previous_response {rec.id!r} is not the latest response of its conversation: this server continues a "
            f"stored conversation only from its end ({then}); to branch off, send the whole history with "
            "store: false")
    return only_new_input(messages, conv.system, rec.calls)


def _cache_key(raw: dict) -> Optional[str]:
    """`prompt_cache_key`: Codex's session id, the stateless request's session key."""
    key = raw.get("prompt_cache_key")
    if key is not None and not isinstance(key, str):
        raise InvalidRequest("prompt_cache_key: expected a string", param="prompt_cache_key")
    return key or None


_CONTEXTS = {"all_turns": "keep", "current_turn": "drop"}


def _reasoning_policy(raw: dict) -> Optional[ReasoningPolicy]:
    """`reasoning.context`'s policy for the request's turn; None without it (the server's --policy)."""
    reasoning = raw.get("reasoning")
    context = reasoning.get("context") if isinstance(reasoning, dict) else None
    if context is None:
        return None
    if context not in _CONTEXTS:
        raise InvalidRequest(f"reasoning.context: expected one of {', '.join(_CONTEXTS)}, got {context!r}",
                             param="reasoning.context")
    return ReasoningPolicy(_CONTEXTS[context])
