"""A FastAPI route's request handler, lean, for the shape of the step routes.

FastAPI's own handler spends ~0.4 ms of CPU on a request here before the
endpoint runs (measured on `POST /v1/conversations/{cid}/messages` with the
step stubbed out: 0.9 ms per request through the whole app, 0.3 ms with this
handler): it solves the dependencies generically, checks the content type
through `email`, opens two exit stacks and looks up its telemetry. A step's
own work in upstream mode is ~2 ms, all under the process's one GIL, so on the
step routes that overhead was a sixth of a process's throughput.

`make_lean(route)` replaces the route's handler (`route.app`, what Starlette's
`Route.handle` calls) with one that resolves the same parameters directly, for
the shape those routes have: string path parameters, one JSON body validated
by its pydantic model, the `Request`, and dependencies that take only the
`Request`. Any other shape is refused when the app is built. Matching, the
methods and the OpenAPI schema stay FastAPI's, and so do the answers: a body
that is not JSON, missing, or invalid raises the `RequestValidationError`
FastAPI raises, with the same errors (tests/api/test_lean_route.py sends the
same requests to both handlers and compares the responses).
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Callable

from fastapi.dependencies.models import Dependant
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from session_runtime.api.content_type import is_json


def make_lean(route: APIRoute) -> None:
    """Serve `route` with a LeanHandler. Raises ValueError for a shape it does not serve."""
    route.app = LeanHandler(route.dependant, route.path)


class LeanHandler:
    """An ASGI app calling one endpoint (module docstring)."""

    def __init__(self, dependant: Dependant, path: str):
        self.endpoint = _checked(dependant, path)
        self.body = dependant.body_params[0] if dependant.body_params else None  # FastAPI's field: its validator
        self.request_name = dependant.request_param_name
        self.dependencies = [(d.name, d.call) for d in dependant.dependencies]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        kwargs: dict[str, Any] = dict(scope["path_params"])
        if self.request_name is not None:
            kwargs[self.request_name] = request
        for name, call in self.dependencies:
            kwargs[name] = await call(request)
        if self.body is not None:
            kwargs[self.body.name] = self._body(await request.body(), request.headers.get("content-type"))
        response = await self.endpoint(**kwargs)
        if not isinstance(response, Response):
            raise TypeError(f"{self.endpoint.__name__} must return a Response on a lean route")
        await response(scope, receive, send)

    def _body(self, raw: bytes, content_type: str | None) -> BaseModel:
        """The body as FastAPI reads it: JSON when it says it is, else the bytes
        as they came (which the model then refuses); none is a missing field."""
        if not raw:
            raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required",
                                           "input": None}])
        value: Any = raw
        if is_json(content_type):
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos),
                                               "msg": "JSON decode error", "input": {}, "ctx": {"error": exc.msg}}],
                                             body=exc.doc) from exc
            except Exception as exc:  # not UTF-8, say
                raise HTTPException(status_code=400, detail="There was an error parsing the body") from exc
        model, errors = self.body.validate(value, {}, loc=("body",))
        if errors:
            raise RequestValidationError(errors, body=value)
        return model


def _checked(d: Dependant, path: str) -> Callable:
    """The endpoint, when the route has the shape a LeanHandler serves."""
    def refuse(why: str) -> ValueError:
        return ValueError(f"route {path}: {why}; serve it with FastAPI's own handler")

    if not inspect.iscoroutinefunction(d.call):
        raise refuse("the endpoint is not `async def`")
    if d.query_params or d.header_params or d.cookie_params:
        raise refuse("query, header or cookie parameters")
    if any(p.field_info.annotation is not str for p in d.path_params):
        raise refuse("a path parameter that is not a str")
    if len(d.body_params) > 1 or d.body_params and not (
            inspect.isclass(d.body_params[0].field_info.annotation)
            and issubclass(d.body_params[0].field_info.annotation, BaseModel)):
        raise refuse("a body that is not one pydantic model")
    if any(getattr(d, name) is not None for name in (
            "websocket_param_name", "http_connection_param_name", "response_param_name",
            "background_tasks_param_name", "security_scopes_param_name")):
        raise refuse("a parameter other than the Request")
    for sub in d.dependencies:
        if not inspect.iscoroutinefunction(sub.call) or sub.request_param_name is None or (
                sub.path_params or sub.query_params or sub.header_params or sub.cookie_params
                or sub.body_params or sub.dependencies):
            raise refuse(f"the dependency {sub.name} takes more than the Request, or is not `async def`")
    return d.call


def lean_post(router, path: str, **kwargs) -> Callable[[Callable], Callable]:
    """`@router.post(path, ...)`, its route served by a LeanHandler."""
    def register(endpoint: Callable) -> Callable:
        router.post(path, **kwargs)(endpoint)
        make_lean(router.routes[-1])
        return endpoint
    return register
