"""The tokenizer endpoints, in vLLM's shapes, for clients that tokenize through the server (lm-evaluation-harness's
`tokenizer_backend=remote`, token-budget checks before a request):

    POST /tokenize        {"prompt": text} or {"messages": [...], "add_generation_prompt"?, "chat_template_kwargs"?},
                          "add_special_tokens"? (default true for a prompt, false for messages: their template
                          writes them), "return_token_strs"?  ->  {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize      {"tokens": [ids]}  ->  {"prompt": text} (special tokens kept, as transformers' decode)
    GET  /tokenizer_info  the checkpoint's tokenizer_config.json (file paths left out, `*_token` entries as their
                          text), with "tokenizer_class", "eos_token" (the model's first end-of-sequence token where the
                          file names none) and "chat_template" (the one chat uses) filled in

A text is tokenized as a completion prompt is (`intake.encode`, off the event loop), messages as chat renders them
(`intake.render_chat`). There is no length limit here (counting a long document is what /tokenize is for); the
body limit bounds the work. `model`, when given, must name the served model (404). With `--api-key` these routes
need it too. A model without a tokenizer answers 400.
"""

from __future__ import annotations

import json
import os

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxkv.server import intake, protocol
from jaxkv.server.protocol import ApiError
from jaxkv.server.state import ServerState

_FILE_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")  # paths on the server's disk


async def _accept(request: Request, endpoint: str, parse=None):
    state: ServerState = request.app.state.jaxkv
    state.http[endpoint] += 1
    intake.authorize(request, state)
    if state.tokenizer is None:
        raise ApiError("this model has no tokenizer: it takes and gives token ids only")
    if parse is None:
        return state, None
    req = await intake.read_body(request, parse)
    model = req.model if isinstance(req, protocol.TokenizeRequest) else req[0]
    if model is not None:
        intake.check_model(model, state)
    return state, req


async def tokenize(request: Request) -> Response:
    state, req = await _accept(request, "tokenize", protocol.tokenize_request)
    if req.chat is not None:
        text = await intake.render_chat(state, req.chat)
    else:
        text = req.prompt
    intake.check_unicode(text, "messages" if req.chat is not None else "prompt")
    ids = (await intake.encode(state, [text], special_tokens=req.add_special_tokens))[0]
    strs = [state.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": state.max_len, "tokens": ids, "token_strs": strs})


async def detokenize(request: Request) -> Response:
    state, (_, ids) = await _accept(request, "detokenize", protocol.detokenize_request)
    vocab = state.model.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": state.tokenizer.decode(ids, skip_special_tokens=False)})


async def tokenizer_info(request: Request) -> Response:
    state, _ = await _accept(request, "tokenizer_info")
    return JSONResponse(state.tokenizer_info or read_tokenizer_info(None, state.tokenizer, state.model.config.eos_ids,
                                                                    state.chat_template))


def read_tokenizer_info(directory, tokenizer, eos_ids, chat_template) -> dict | None:
    """/tokenizer_info's answer for a checkpoint directory (None: a model without a tokenizer). ValueError if its
    tokenizer_config.json is not a JSON object."""
    if tokenizer is None:
        return None
    info = {}
    path = None if directory is None else os.path.join(directory, "tokenizer_config.json")
    if path is not None and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable JSON file ({e})") from None
        if not isinstance(info, dict):
            raise ValueError(f"{path}: not a JSON object")
    info = {k: (v.get("content") if k.endswith("_token") and isinstance(v, dict) else v)
            for k, v in info.items() if k not in _FILE_FIELDS}  # an AddedToken entry as its text, as vLLM does
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    if info.get("eos_token") is None:
        info["eos_token"] = tokenizer.id_to_token(eos_ids[0]) if eos_ids else None
    if chat_template is not None:
        info["chat_template"] = chat_template.source
    else:
        info.pop("chat_template", None)
    return info
