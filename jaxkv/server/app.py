"""The application of `jaxkv serve` (Starlette): its routes, error handlers and status counting; the endpoints
themselves are one module each.

    GET  /health                 200 {"status": "ok"}; 503 while stopping or after an engine failure  (metrics.py)
    GET  /metrics                Prometheus text (JSON with ?format=json or Accept: application/json)  (metrics.py)
    GET  /v1/models              the served model                                                      (models.py)
    POST /v1/completions         prompt (text, token ids, or a list of either), n, stream, logprobs, echo, ...
                                                                                                   (completions.py)
    POST /v1/chat/completions    when the checkpoint has a chat template (else 400)                       (chat.py)
    POST /tokenize, /detokenize, GET /tokenizer_info    vLLM's tokenizer endpoints                (tokenization.py)

A request's sequences (its prompts times n) go to the engine thread together (`worker.EngineWorker`); its
tokens come back as engine events, are turned into text (`text.TextStream`: whole characters, cut at stop
strings) and sent as they come (stream, `sse`) or when all are done. A client that disconnects cancels its
sequences at once (`sequences`): their slots and pages are free by the next engine step. Errors are OpenAI's JSON
shape with the status that says whose fault it was (`protocol.ApiError`); a bug answers 500 with its message,
never a hung connection.
"""

from __future__ import annotations

import sys
import traceback

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxkv.server import chat, completions, metrics, models, tokenization
from jaxkv.server.protocol import ApiError
from jaxkv.server.state import ServerState

__all__ = ["ServerState", "create_app"]

RETRY_AFTER_S = 1  # every 429's Retry-After: room comes back as sequences finish, many per second


def _error_response(request: Request, exc: Exception) -> Response:
    if isinstance(exc, ApiError):
        error = exc
    elif isinstance(exc, HTTPException):
        error = ApiError(exc.detail if isinstance(exc.detail, str) else "HTTP error", status=exc.status_code)
    else:  # a bug: say what it was, as JSON, rather than a bare 500 page
        error = ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500, type="server_error")
    headers = {401: {"WWW-Authenticate": "Bearer"}, 429: {"Retry-After": str(RETRY_AFTER_S)}}.get(error.status)
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class _CountStatus:
    """ASGI middleware counting responses by status (for /metrics), and answering a bug's exception itself: a JSON
    500 (counted), after which the app returns normally, so the server keeps the connection (uvicorn drops a
    keep-alive connection whose app raised, without telling the client). Mid-response there is nothing to answer:
    the exception goes on to the server, which ends the connection."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.state.http[f"status_{message['status']}"] += 1
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception as exc:
            if started:
                raise
            print(f"jaxkv serve: internal error answering {scope.get('method')} {scope.get('path')}:",
                  file=sys.stderr)
            traceback.print_exc()
            await _error_response(None, exc)(scope, receive, counting_send)


def create_app(state: ServerState, lifespan=None) -> Starlette:
    routes = [Route("/health", metrics.health, methods=["GET"]), Route("/metrics", metrics.metrics, methods=["GET"]),
              Route("/v1/models", models.models, methods=["GET"]),
              Route("/v1/models/{model:path}", models.model, methods=["GET"]),  # a name may hold slashes (org/name)
              Route("/v1/completions", completions.completions, methods=["POST"]),
              Route("/v1/chat/completions", chat.chat_completions, methods=["POST"]),
              Route("/tokenize", tokenization.tokenize, methods=["POST"]),
              Route("/detokenize", tokenization.detokenize, methods=["POST"]),
              Route("/tokenizer_info", tokenization.tokenizer_info, methods=["GET"])]
    handlers = {ApiError: _error_response, HTTPException: _error_response, Exception: _error_response}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.jaxkv = state
    app.add_middleware(_CountStatus, state=state)
    return app
