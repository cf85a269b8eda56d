"""GET /v1/models and /v1/models/{model}: the one served model, by its name or an alias."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxkv.server import intake
from jaxkv.server.state import ServerState


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "jaxkv",
            "max_model_len": state.max_len}


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.jaxkv
    intake.authorize(request, state)
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def model(request: Request) -> Response:
    """OpenAI's "retrieve model" (`client.models.retrieve(name)`): the served model by its name or an alias, else
    404 model_not_found."""
    state: ServerState = request.app.state.jaxkv
    intake.authorize(request, state)
    intake.check_model(request.path_params["model"], state)
    return JSONResponse(_model_card(state))
