"""FastAPI routes whose request handler is lean, for the shape of the step routes.

FastAPI's own handler spends ~0.4 ms of CPU on a request here before the
endpoint runs (measured on `POST /v1/conversations/{cid}/messages` with the
step stubbed out: 0.9 ms per request through the whole app, 0.3 ms with this
handler): it solves the dependencies generically, checks the content type
through `email`, and looks up its telemetry. A step's own work in upstream
mode is ~2 ms, all under the process's one GIL, so on the step routes that
overhead was a sixth of what one process can serve.

`LeanRoute` is an `APIRoute` (FastAPI's extension point: `route_class`, or
`lean_post`) whose `get_route_handler` resolves the parameters directly when
the route has the shape the step routes have: string path parameters, at most
one JSON body validated by FastAPI's own field validator, the `Request`, and
dependencies that take only the `Request`; and an endpoint that returns a
Response, or plain JSON values (no response model). Any other route gets
FastAPI's handler. Matching, the methods, the OpenAPI schema and the error
answers stay FastAPI's: a body that is not JSON, not UTF-8, missing, or
invalid raises the exception FastAPI raises, with the same errors
(tests/api/test_lean_route.py sends the same requests to both handlers and
compares the answers).
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Callable, Optional

import fastapi.routing
from fastapi.dependencies.models import Dependant
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from session_runtime.api.content_type import is_json


class LeanRoute(APIRoute):
    """An APIRoute served by a LeanHandler where its shape allows (module docstring)."""

    def get_route_handler(self) -> Callable:
        route = self
        # An included router's route is served under its inclusion's context (FastAPI 0.165: its prefix
        # and the router's dependencies folded into the dependant): read the shape from that.
        context_var = getattr(fastapi.routing, "_effective_route_context_var", None)
        context = context_var.get() if context_var is not None else None
        if context is not None and getattr(context, "original_route", None) is self:
            route = context
        try:
            return LeanHandler.of(route).handle
        except ValueError:
            return super().get_route_handler()

    @property
    def lean(self) -> bool:
        """Whether this route is served by a LeanHandler (the tests' check)."""
        try:
            LeanHandler.of(self)
        except ValueError:
            return False
        return True


def lean_post(router, path: str, **kwargs) -> Callable[[Callable], Callable]:
    """`@router.post(path, ...)` as a LeanRoute (on an app, or a router of another route class)."""
    def register(endpoint: Callable) -> Callable:
        target = getattr(router, "router", router)  # a FastAPI app's own router
        target.add_api_route(path, endpoint, methods=["POST"], route_class_override=LeanRoute, **kwargs)
        return endpoint
    return register


class LeanHandler:
    """Calls one endpoint with the parameters a request gives it (module docstring)."""

    @classmethod
    def of(cls, route) -> "LeanHandler":
        """For an APIRoute (or its inclusion context). Raises ValueError for a shape it does not serve."""
        if route.response_field is not None or getattr(route, "_embed_body_fields", False):
            raise ValueError(f"route {route.path}: a response model, or an embedded body; "
                             "serve it with FastAPI's own handler")
        return cls(route.dependant, route.path, route.status_code)

    def __init__(self, dependant: Dependant, path: str, status_code: Optional[int] = None):
        self.endpoint = _checked(dependant, path)
        self.status_code = status_code or 200
        self.body = dependant.body_params[0] if dependant.body_params else None  # FastAPI's field: its validator
        self.request_name = dependant.request_param_name
        self.dependencies = [(d.name, d.call) for d in dependant.dependencies]

    async def handle(self, request: Request) -> Response:
        kwargs: dict[str, Any] = dict(request.path_params)
        if self.request_name is not None:
            kwargs[self.request_name] = request
        for name, call in self.dependencies:
            kwargs[name] = await call(request)
        if self.body is not None:
            kwargs[self.body.name] = self._body(await request.body(), request.headers.get("content-type"))
        result = await self.endpoint(**kwargs)
        if isinstance(result, Response):
            return result
        return JSONResponse(jsonable_encoder(result), status_code=self.status_code)  # as FastAPI writes it

    def _body(self, raw: bytes, content_type: Optional[str]) -> BaseModel:
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
