"""POST /v1/completions: prompts (text, token ids, or a list of either) times n, streamed or whole, with echo and
logprobs (OpenAI's completions logprobs block; with echo, the prompt's own tokens scored by `jaxkv.score` on the
engine thread, as evaluation harnesses ask), echo-only scoring with max_tokens 0."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxkv.engine import Event
from jaxkv.server import intake, protocol, sequences, sse
from jaxkv.server.sequences import Choice
from jaxkv.server.protocol import ApiError
from jaxkv.server.state import ServerState
from jaxkv.server.text import TextStream, added_tokens, prompt_text


async def completions(request: Request) -> Response:
    state, req = await intake.accept(request, "completions", protocol.completion_request)
    s = req.sampling
    prompts, budgets, echoed, prompt_part, next_tops = await _prepare(request, state, req)
    cid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
    choice_json = _choice_writer(s, echoed, prompt_part, token_ids=s.return_token_ids or state.tokenizer is None)

    def answer(out, choices):
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": state.model_name,
                             "choices": out, "usage": sequences.usage(prompts, choices)})

    if s.max_tokens == 0:  # echo only: score the prompt, generate nothing
        choices = [Choice(index=i, prompt=prompts[i // s.n], text=TextStream(state.tokenizer), stop_ids=set(),
                          finish_reason="length") for i in range(len(prompts) * s.n)]
        return answer([choice_json(c, echoed[c.index // s.n], 0, True) for c in choices], choices)
    if next_tops is not None:  # the one greedy token, read off the scoring pass: no engine sequence
        choices = _scored_choices(state, s, prompts, budgets, next_tops)
        return answer([choice_json(c, echoed[c.index // s.n] + c.text.text, 0, True) for c in choices], choices)
    choices, queue = await sequences.start(request, state, s, prompts, budgets, s.stop)

    if not s.stream:
        if not await sequences.collect(request, state, choices, queue):
            return Response(status_code=499)  # nobody is listening
        sequences.server_error(choices)
        return answer([choice_json(c, (echoed[c.index // s.n] if echoed else "") + c.text.text, 0, True)
                       for c in choices], choices)

    head = {"id": cid, "object": "text_completion", "created": created, "model": state.model_name}
    opening = [{"index": c.index, "text": echoed[c.index // s.n], "logprobs": prompt_part[c.index // s.n]
                if prompt_part else None, "finish_reason": None} for c in choices] if echoed else []
    return sse.response(sse.event_stream(request, state, choices, queue, head, opening,
                                         lambda c, text, first: choice_json(c, text, first, False),
                                         prompts if s.include_usage else None))


# Engine arguments that do not change which token greedy decoding picks first, at the values that change nothing.
# A request with any other argument (or another value) is decoded by the engine, never answered by the scoring pass.
_FIRST_TOKEN_NEUTRAL = {"repetition_penalty": (None, 1.0), "presence_penalty": (None, 0.0),
                        "frequency_penalty": (None, 0.0), "logit_bias": (None, {}), "min_tokens": (None, 0),
                        "bad_words": (None, []), "bad_words_ids": (None, []), "constraint": (None,)}
_SAMPLING_ARGUMENTS = {"prompt", "max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop_tokens",
                       "logprobs"}


def _answered_by_scoring(req: protocol.CompletionRequest, call: dict) -> bool:
    """Whether the prompt scoring that echo + logprobs runs also gives the whole answer: one greedy token (what
    lm-evaluation-harness's log-likelihood requests ask, and drop). Greedy decoding's first token is the argmax
    of the logits after the prompt, which the scoring pass computes (with the same weights and cache dtype; equal
    to the engine's to float rounding), so no engine sequence, prefill or decode is needed. Sampled requests are
    decoded by the engine (its per-request key decides the draw), as are streams and anything that changes the
    first token beyond the argmax (`_FIRST_TOKEN_NEUTRAL`). Stop strings and stop ids apply to the token as they
    would to the engine's (`sequences.take_event`)."""
    s = req.sampling
    if not (req.echo and s.logprobs is not None and s.max_tokens == 1 and s.temperature == 0 and not s.stream):
        return False
    extra = set(call) - _SAMPLING_ARGUMENTS
    return all(name in _FIRST_TOKEN_NEUTRAL and call[name] in _FIRST_TOKEN_NEUTRAL[name] for name in extra)


def _scored_choices(state: ServerState, s: protocol.Sampling, prompts, budgets, next_tops) -> list[Choice]:
    """The choices of a request `_answered_by_scoring`: each prompt's greedy token (the best of its `next_tops`,
    ties to the lower id as greedy decoding breaks them) as the engine's one event would report it."""
    _, stop_ids = intake.engine_calls(s, prompts, budgets, state)  # the stop ids, checked as for the engine
    choices = []
    for i in range(len(prompts) * s.n):
        tops = next_tops[i // s.n]
        token, logprob = tops[0]
        c = Choice(index=i, prompt=prompts[i // s.n], text=TextStream(state.tokenizer, s.stop), stop_ids=stop_ids)
        sequences.take_event(c, Event(id=-1, tokens=[token], logprobs=[logprob], finished=True,
                                      finish_reason="stop" if token in stop_ids else "length",
                                      top_logprobs=[tops[:s.logprobs]] if s.logprobs else None))
        choices.append(c)
    return choices


async def _prepare(request: Request, state: ServerState, req: protocol.CompletionRequest):
    """A completion request checked against the model and the server's capacity -> (each prompt's ids, each one's
    token budget, the echoed prompts' text or None, the prompts' own logprobs blocks or None, and for a request
    `_answered_by_scoring` each prompt's next-token top logprobs, else None)."""
    s = req.sampling
    if s.stop and state.tokenizer is None:
        raise ApiError("stop strings need a model with a tokenizer: pass stop token ids", param="stop")
    if state.tokenizer is None and (req.echo or s.logprobs is not None):
        raise ApiError("echo and logprobs need a model with a tokenizer (they are text)",
                       param="echo" if req.echo else "logprobs")
    # echo only scores each prompt once, whatever n; a request that could never be held is refused before any work
    per_prompt = s.n if s.max_tokens != 0 else 1
    state.worker.check_count(len(req.prompts) * per_prompt, "n" if per_prompt > 1 else "prompt")
    prompts = await intake.prompt_ids(req.prompts, state)
    budgets = [intake.budget(s, p, state, "prompt") for p in prompts]
    echoed = [p if isinstance(p, str) else state.tokenizer.decode(ids, skip_special_tokens=False)
              for p, ids in zip(req.prompts, prompts)] if req.echo else None
    prompt_part = next_tops = None
    if req.echo and s.logprobs is not None:  # the prompt's own log-probabilities, as evaluation harnesses ask
        whole = s.max_tokens == 1 and _answered_by_scoring(req, intake.engine_calls(s, prompts[:1], budgets[:1],
                                                                                    state)[0][0])
        async with sequences.admitted(request, state.worker.hold(len(prompts), wait=not s.stream)):
            # held against the server's capacity as engine sequences are (a stream's 429, a whole answer's queue);
            # one prompt at a time: each runs a program compiled at start (`worker.warm_up_scoring`: one per length
            # bucket, batch 1), and the engine steps between them, so running streams go on
            scored = [await _prompt_logprobs(state, p, s.logprobs, given, next_token=whole)
                      for p, given in zip(prompts, req.prompts)]
        prompt_part = [part for part, _ in scored]
        next_tops = [tops for _, tops in scored] if whole else None
    return prompts, budgets, echoed, prompt_part, next_tops


def _choice_writer(s: protocol.Sampling, echoed, prompt_part, *, token_ids: bool):
    """-> choice_json(choice, text, first, whole): a choice's JSON for its tokens first.. with `text`, in a whole
    answer (`whole`) or a stream's chunk (whose logprobs offsets go on where the last chunk's ended)."""

    def choice_json(c: Choice, text: str, first: int, whole: bool) -> dict:
        p = c.index // s.n
        logprobs = None
        if s.logprobs is not None:
            head = None
            if whole and prompt_part is not None:
                head = json.loads(json.dumps(prompt_part[p]))  # a copy: n choices share the prompt's part
            # Offsets count from the start of the answer's text (after the echoed prompt), in a stream too: each
            # chunk goes on where the last one ended, as the whole answer's offsets do.
            offset = (len(echoed[p]) if echoed else 0) + (0 if whole else c.text_offset)
            logprobs = _completion_logprobs(c.text.decoded, first, c.tokens[first:], c.logprobs[first:],
                                            c.tops[first:], offset, head)
            if not whole:
                c.text_offset += sum(len(piece) for piece in logprobs["tokens"])
        out = {"index": c.index, "text": text, "logprobs": logprobs,
               "finish_reason": c.finish_reason if c.finish_reason != "error" else None}
        if token_ids:
            out["token_ids"] = c.tokens[first:]
        return out

    return choice_json


async def _prompt_logprobs(state: ServerState, p: list[int], k: int, given, *, next_token: bool = False):
    """A prompt's completions-style logprobs block (its first token has none), computed on the engine thread ->
    (the block, with `next_token` the top max(k, 1) (id, logprob) of the token after the prompt, best first, else
    None). `given`: the prompt as given; a text prompt's tokens are read as its echo shows it, the text as given: a
    token the tokenizer added (a BOS) is "" at offset 0 (`text.added_tokens`); an id prompt's echo is its ids
    decoded with their special tokens, and so are its tokens.

    `next_token` scores one placeholder token after the prompt, in the same pass: its position's logits are those
    after the whole prompt (its own logprob is dropped). The continuation stays within the buckets compiled at
    start: a prompt that may make a token has at most max_len - 1 tokens."""
    from jaxkv.score import score

    tail = [0] if next_token else []
    r = None
    if len(p) > 1 or next_token:
        r = (await state.worker.call(lambda: score(state.model, [p[:1]], [p[1:] + tail], top_logprobs=max(k, 1))))[0]
    tops = r.top_logprobs[-1] if next_token else None

    def listing():  # off the event loop: a long prompt's listing is many decodes
        decoded = prompt_text(state.tokenizer, p, added_tokens(state.tokenizer, given, p) if isinstance(given, str)
                              else None)
        first = decoded.pieces[0]
        part = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
        if len(p) > 1:
            top = [t[:k] for t in r.top_logprobs[:len(p) - 1]] if k else []
            part = _completion_logprobs(decoded, 1, p[1:], list(r)[:len(p) - 1], top, len(first), part)
        return part

    return await asyncio.to_thread(listing), tops


def _completion_logprobs(decoded, first, tokens, logprobs, tops, offset, prompt_part=None) -> dict:
    """OpenAI's completions logprobs block for `tokens`, tokens first.. of `decoded` (a `text.Detokenizer`):
    tokens, token_logprobs, top_logprobs ({text: logprob}, the chosen token always among them), text_offset
    (from `offset`, appended to `prompt_part` when given).

    Each token's text is what it adds to the returned text, so text_offset is the character offset of that text in
    the returned text (the echoed prompt's included) and the texts join to it. A token inside a multi-byte
    character is "" at the offset where the character will start, and the token completing it carries the whole
    character (vLLM's convention); a special token the text skips, a BOS the tokenizer added to a text prompt, are
    "". The stop token that ended the text is listed with its own text at the text's end (it is no part of it)."""
    out = prompt_part if prompt_part is not None else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                       "text_offset": []}
    for j, token in enumerate(tokens):
        piece, _ = decoded.entry(first + j, token)
        top = {}
        if tops:
            for (_, lp), (text, _) in zip(tops[j], decoded.alternatives(first + j, [i for i, _ in tops[j]])):
                top.setdefault(text, lp)
        top.setdefault(piece, logprobs[j])
        out["tokens"].append(piece)
        out["token_logprobs"].append(logprobs[j])
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(piece)
    return out
