"""The OpenAI request bodies `jaxkv serve` accepts, checked field by field, and its errors.

Every body is checked here, before anything reaches the engine: a field of the wrong type or out of range, an
unknown field, or a parameter jaxkv does not implement is an `ApiError` (status 400, OpenAI's error shape, the
field named in "param"), never a 500 and never a silently ignored setting. Parameters OpenAI defines that change
the output but are not implemented (suffix, best_of > n) are accepted only at their
neutral value; presence_penalty, frequency_penalty and logit_bias are honoured (`jaxkv.decoding.processing`).
`user`, `store`, `metadata`, `service_tier` and `parallel_tool_calls` do not change the output and are accepted
and ignored.

Structured output (`structured.py`): response_format (json_object, json_schema) on both endpoints, vLLM's
structured_outputs (json, regex, choice, grammar), and chat's tools with tool_choice.

Extensions beside OpenAI's fields, as vLLM and sglang name them: top_k, min_p, repetition_penalty, min_tokens,
stop_token_ids, ignore_eos, return_token_ids (each choice, or streamed chunk, also carries "token_ids": its new
token ids; always on for a model without a tokenizer, which has no text); chat: add_generation_prompt,
chat_template_kwargs. `stop` may hold strings or token ids.
"""

from __future__ import annotations

import dataclasses
import json
import math

MAX_N = 64  # samples per prompt (each takes an engine slot)
MAX_STOP = 16  # stop strings per request
MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs; the engine reports at most this many alternatives
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries (`jaxkv.decoding.processing.MAX_LOGIT_BIAS`)
MAX_STOP_IDS = 32  # stop token ids per sequence, the model's end-of-sequence ids included (jaxkv.engine.STOP_SLOTS)
INT32_MAX = 2**31 - 1  # the largest top_k the sampler holds
# chat_template_kwargs may not set what the request sets itself (the template's own arguments)
TEMPLATE_ARGUMENTS = ("messages", "add_generation_prompt", "tools", "documents")


class ApiError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type or {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")  # a 4xx is the client's, as OpenAI

    def body(self) -> dict:
        # a message quoting the client's text may hold a lone surrogate (a JSON \ud800 escape): escaped, so it encodes
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        return {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class Sampling:
    """What one request asks of the engine, per prompt (shared by its n samples)."""

    max_tokens: int | None  # None: as many as fit (chat's default)
    temperature: float
    top_p: float | None
    top_k: int | None
    min_p: float | None
    n: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None  # None: no log-probabilities; k: k alternatives per token (0: only the chosen token's)
    stream: bool
    include_usage: bool
    return_token_ids: bool  # also send each choice's new token ids ("token_ids"; always, for a model without text)
    repetition_penalty: float = 1.0  # the penalties as `jaxkv.generate` takes them (neutral by default)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None  # {token id: bias}, ids checked against the vocabulary by `intake.engine_calls`
    min_tokens: int = 0
    constraint: object = None  # a `jaxkv.constraints` constraint (response_format, structured_outputs, tools)


@dataclasses.dataclass
class CompletionRequest:
    model: str
    prompts: list  # each a str or a list of token ids
    echo: bool
    sampling: Sampling


@dataclasses.dataclass
class ChatRequest:
    model: str
    messages: list[dict]
    add_generation_prompt: bool
    template_kwargs: dict
    sampling: Sampling
    tool_calls: object = None  # `structured.ToolCalls`: how the output becomes tool calls; None: plain text


# --- field checks ---------------------------------------------------------------------------------------------


def _type_name(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)


def _show(value) -> str:
    """A client's value for an error message: its repr, cut short (a 4,000-digit integer is not repeated back)."""
    if isinstance(value, int) and abs(value) >= 10**40:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(body, name, default=None, lo=None, hi=None, *, nullable=True):
    value = body.get(name, default)
    if value is None and nullable:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():  # 16.0 from a client that writes every number as float
            value = int(value)
        else:
            raise ApiError(f"'{name}' must be an integer, got {_type_name(value)} {_show(value)}", param=name)
    if lo is not None and value < lo or hi is not None and value > hi:
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise ApiError(f"'{name}' must be {bounds}, got {_show(value)}", param=name)
    return value


def _float(body, name, default, lo, hi, *, lo_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float)
                                                                         and not math.isfinite(value)):
        raise ApiError(f"'{name}' must be a number, got {_type_name(value)} {_show(value)}", param=name)
    # compared as given: an integer too large for a float (JSON allows 1 followed by 400 zeros) is out of range
    if value < lo or value > hi or (lo_open and value == lo):
        raise ApiError(f"'{name}' must be {'>' if lo_open else '>='} {lo} and <= {hi}, got {_show(value)}",
                       param=name)
    return float(value)


def _bool(body, name, default=False):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"'{name}' must be a boolean, got {_type_name(value)} {_show(value)}", param=name)
    return value


def _neutral(body, name, neutral, what):
    """An OpenAI parameter jaxkv does not implement: accepted only at the value that changes nothing."""
    value = body.get(name)
    if value is None or value == neutral or (isinstance(neutral, (list, dict)) and value in ([], {})):
        return
    raise ApiError(f"'{name}' is not supported by jaxkv serve ({what}); leave it unset", param=name,
                   code="unsupported_parameter")


def _logit_bias(body) -> dict | None:
    """OpenAI's logit_bias: an object {token id (a JSON key: a string of digits): bias in [-100, 100]}."""
    value = body.get("logit_bias")
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise ApiError(f"'logit_bias' must be an object {{token id: bias}}, got {_type_name(value)}", param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise ApiError(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens, got {len(value)}", param="logit_bias")
    out = {}
    for key in value:
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise ApiError(f"'logit_bias' keys must be token ids, got {_show(key)}", param="logit_bias")
        bias = value[key]
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ApiError(f"'logit_bias' values must be numbers in [-100, 100], got {_show(bias)} for token {key}",
                           param="logit_bias")
        out[int(key)] = float(bias)
    return out


def _structured(body, *, chat: bool):
    """response_format, structured_outputs and tools (`structured.constraint`) -> (constraint, tool calls)."""
    from jaxkv.server import structured

    try:
        return structured.constraint(body, chat=chat)
    except structured.FieldError as e:
        raise ApiError(str(e), param=e.param, code=e.code) from None


def _token_ids(value, name) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(f"'{name}' must be a list of integer token ids", param=name)
    return value


def _check_fields(body, allowed: set[str], ignored: set[str]):
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {_type_name(body)}")
    unknown = sorted(set(body) - allowed - ignored)
    if unknown:
        raise ApiError(f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0],
                       code="unknown_parameter")


_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids",
           "ignore_eos", "stream", "stream_options", "frequency_penalty", "presence_penalty", "logit_bias",
           "return_token_ids", "min_tokens", "structured_outputs",
           # transformers' names that harnesses forward with their generation settings (lm-evaluation-harness):
           # honoured where jaxkv does the same thing, else refused as any unsupported value is
           "max_new_tokens", "do_sample", "num_beams", "repetition_penalty"}
_IGNORED = {"user", "store", "metadata", "service_tier", "parallel_tool_calls"}


def _model(body) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("'model' is required: a model name from GET /v1/models", param="model")
    return model


def _sampling(body, *, default_max_tokens: int | None, logprobs: int | None, max_tokens_name="max_tokens",
              min_tokens: int = 1) -> Sampling:
    max_tokens = _int(body, max_tokens_name, default_max_tokens, lo=min_tokens)
    if body.get("max_new_tokens") is not None:  # transformers' name for the same budget
        new = _int(body, "max_new_tokens", None, lo=min_tokens)
        if body.get(max_tokens_name) is not None and new != max_tokens:
            raise ApiError(f"'max_new_tokens' ({new}) and '{max_tokens_name}' ({max_tokens}) disagree; send one",
                           param="max_new_tokens")
        max_tokens = new
    top_k = _int(body, "top_k", None, lo=-1, hi=INT32_MAX)
    stop = body.get("stop")
    stop_strings, stop_ids = [], list(_token_ids(body["stop_token_ids"], "stop_token_ids")
                                      if body.get("stop_token_ids") is not None else [])
    if isinstance(stop, str):
        stop_strings = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop_strings = list(stop)
    elif isinstance(stop, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        stop_ids += stop
    elif stop is not None:
        raise ApiError("'stop' must be a string, a list of strings or a list of token ids", param="stop")
    if len(stop_strings) > MAX_STOP or any(not s for s in stop_strings):
        raise ApiError(f"'stop' takes at most {MAX_STOP} non-empty strings", param="stop")
    if len(stop_ids) > MAX_STOP_IDS:
        raise ApiError(f"at most {MAX_STOP_IDS} stop token ids per request, got {len(stop_ids)}",
                       param="stop_token_ids" if body.get("stop_token_ids") else "stop")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise ApiError("'stream_options' must be an object with at most 'include_usage'", param="stream_options")
    stream = _bool(body, "stream")
    if options is not None and not stream:
        raise ApiError("'stream_options' is only allowed with 'stream': true", param="stream_options")
    include_usage = _bool(options or {}, "include_usage")
    penalties = dict(frequency_penalty=_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
                     presence_penalty=_float(body, "presence_penalty", 0.0, -2.0, 2.0),
                     repetition_penalty=_float(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
                     logit_bias=_logit_bias(body), min_tokens=_int(body, "min_tokens", 0, lo=0))
    _int(body, "num_beams", 1, lo=1)
    _neutral(body, "num_beams", 1, "no beam search through the API")
    temperature = _float(body, "temperature", 1.0, 0.0, 2.0)
    if _bool(body, "do_sample", True) is False:  # transformers' greedy switch: greedy whatever the temperature
        temperature = 0.0
    top_p, min_p = _float(body, "top_p", None, 0.0, 1.0, lo_open=True), _float(body, "min_p", None, 0.0, 1.0)
    if temperature == 0:  # greedy: a filter changes nothing (OpenAI and vLLM accept it, and many clients send top_p)
        top_k = top_p = min_p = None
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                    top_k=None if top_k in (None, -1, 0) else top_k, min_p=min_p,
                    n=_int(body, "n", 1, lo=1, hi=MAX_N), seed=_int(body, "seed", None, lo=-MAX_SEED - 1, hi=MAX_SEED),
                    stop=stop_strings, stop_token_ids=stop_ids, ignore_eos=_bool(body, "ignore_eos"),
                    logprobs=logprobs, stream=stream, include_usage=include_usage,
                    return_token_ids=_bool(body, "return_token_ids"), **penalties)


# --- the two endpoints ----------------------------------------------------------------------------------------


def completion_request(body) -> CompletionRequest:
    """A /v1/completions body -> CompletionRequest (ApiError 400 otherwise). `prompt`: a string, a list of token
    ids, or a list of either (one choice group per prompt)."""
    _check_fields(body, _COMMON | {"prompt", "echo", "logprobs", "suffix", "best_of", "response_format"}, _IGNORED)
    model = _model(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or (isinstance(p, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p)) for p in prompt):
        prompts = list(prompt)
    else:
        raise ApiError("'prompt' is required: a string, a list of token ids, or a non-empty list of either",
                       param="prompt")
    if any(len(p) == 0 for p in prompts):
        raise ApiError("'prompt' is empty: a prompt needs at least one token", param="prompt")
    _neutral(body, "suffix", "", "no insertion")
    echo = _bool(body, "echo")
    logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    # max_tokens 0 is only meaningful with echo (score the prompt, generate nothing), as OpenAI allowed it
    sampling = _sampling(body, default_max_tokens=16, logprobs=logprobs, min_tokens=0 if echo else 1)
    best_of = _int(body, "best_of", None, lo=1)
    if best_of is not None and best_of != sampling.n:
        raise ApiError("'best_of' other than n is not supported by jaxkv serve (no server-side ranking)",
                       param="best_of", code="unsupported_parameter")
    if sampling.max_tokens == 0 and sampling.stream:
        raise ApiError("'max_tokens' 0 (echo only) cannot be streamed", param="max_tokens")
    sampling.constraint, _ = _structured(body, chat=False)
    return CompletionRequest(model=model, prompts=prompts, echo=echo, sampling=sampling)


def chat_request(body) -> ChatRequest:
    """A /v1/chat/completions body -> ChatRequest (ApiError 400 otherwise)."""
    _check_fields(body, _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                                   "response_format", "tools", "tool_choice", "add_generation_prompt",
                                   "chat_template_kwargs"}, _IGNORED)
    model = _model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' is required: a non-empty list of {role, content} objects", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ApiError(f"messages[{i}].content must be a string or a list of content parts",
                           param=f"messages[{i}].content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(f"messages[{i}].content: only text parts are supported by jaxkv serve",
                                   param=f"messages[{i}].content", code="unsupported_parameter")
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not want:
        raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sampling = _sampling(body, default_max_tokens=None, logprobs=(top or 0) if want else None, max_tokens_name=name)
    sampling.constraint, tool_calls = _structured(body, chat=True)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    taken = [k for k in TEMPLATE_ARGUMENTS if k in kwargs]
    if taken:
        raise ApiError(f"'chat_template_kwargs' may not set {taken[0]!r}: the request sets it (its own "
                       f"'{taken[0]}' field, or jaxkv serve for tools and documents)", param="chat_template_kwargs")
    if body.get("tools"):  # the template shows the model the tools (checked by `structured.constraint`)
        kwargs = {**kwargs, "tools": body["tools"]}
    return ChatRequest(model=model, messages=template_messages(messages),
                       add_generation_prompt=_bool(body, "add_generation_prompt",
                                                                                    True),
                       template_kwargs=kwargs, sampling=sampling, tool_calls=tool_calls)


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI's messages as chat templates take them: an earlier tool call's `function.arguments`, a JSON string
    on the wire, becomes the object it encodes, since templates write it with `tojson` (transformers documents
    arguments as a dict; vLLM parses them too) and a string would reach the model double-encoded
    (`"arguments": "{\\"city\\": ...}"`), not as the model wrote it. A string that is not a JSON object (not JSON,
    or an array or number, which no call's arguments are) stays the string. The client's messages are not
    changed: a message with calls is copied."""

    def parsed(arguments):
        if not isinstance(arguments, str):
            return arguments
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments

    def call(c):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or "arguments" not in fn:
            return c
        return {**c, "function": {**fn, "arguments": parsed(fn["arguments"])}}

    return [{**m, "tool_calls": [call(c) for c in m["tool_calls"]]} if isinstance(m.get("tool_calls"), list) else m
            for m in messages]


# --- how long a text prompt can be --------------------------------------------------------------------------------

# A normalizer's worst shrink (characters in / characters out); None: no bound (it may delete characters).
# Unicode composition merges at most 4 code points into one (the longest canonical decomposition is 4).
_NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "ByteLevel": 1}
# Pre-tokenizers that keep every character (the others, Whitespace, WhitespaceSplit, BertPreTokenizer,
# CharDelimiterSplit, drop some); Split and Punctuation keep them unless their behavior is "Removed".
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def _shrink(normalizer) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for child in normalizer.get("normalizers") or []:
            f = _shrink(child)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":  # a fixed string replaced by a non-empty one: their length ratio; a regex, or "": unbounded
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content") or ""
        if set(pattern) != {"String"} or not pattern["String"] or not content:
            return None
        return -(-len(pattern["String"]) // len(content))
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_characters(pre_tokenizer) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in pre_tokenizer.get("pretokenizers") or [])
    return kind in _KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def text_char_limit(tokenizer, max_len: int) -> int | None:
    """The most characters a text of at most `max_len` tokens can have under `tokenizer` (a `tokenizers.Tokenizer`),
    so that a longer prompt is refused before any tokenizing; None where the tokenizer gives no such bound.

    Sound when every character of the text reaches some token: then a token covers at most as many characters as
    its own text has UTF-8 bytes (a byte-level piece "Ġthe", a "▁the" or a byte-fallback "<0x41>" each cover
    fewer), times what the normalizer may merge (Unicode composition: 4 code points into one). Tokenizers that
    may drop characters have no bound: a normalizer that strips or deletes (Strip, StripAccents, BertNormalizer,
    Nmt, Precompiled, a regex Replace), a pre-tokenizer that drops whitespace or delimiters, an added token that
    absorbs the spaces around it (lstrip / rstrip), a model that maps a run of unknown characters to one token
    (WordPiece, WordLevel, BPE with fuse_unk and no byte fallback, Unigram without byte fallback)."""
    import json

    try:
        spec = json.loads(tokenizer.to_str())
        vocab = tokenizer.get_vocab(with_added_tokens=True)
    except Exception:  # not a tokenizers.Tokenizer: no bound known
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind == "BPE":
        if model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback"):
            return None
    elif kind != "Unigram" or not model.get("byte_fallback"):
        return None
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_characters(spec.get("pre_tokenizer")) or not vocab:
        return None
    longest = max(len(piece.encode("utf-8", "surrogatepass")) for piece in vocab)
    return max_len * longest * shrink


# --- the tokenizer endpoints (vLLM's /tokenize and /detokenize) -------------------------------------------------


@dataclasses.dataclass
class TokenizeRequest:
    model: str | None
    prompt: str | None  # a text, or None for chat messages
    chat: ChatRequest | None  # the messages, as a chat request takes them (its sampling unused)
    add_special_tokens: bool
    return_token_strs: bool


_CHAT_TOKENIZE = {"messages", "add_generation_prompt", "chat_template_kwargs", "tools"}


def tokenize_request(body) -> TokenizeRequest:
    """A /tokenize body (vLLM's: `prompt`, or chat `messages` with `add_generation_prompt` and
    `chat_template_kwargs`; `add_special_tokens`, default true for a prompt and false for messages, whose template
    writes them; `return_token_strs`) -> TokenizeRequest (ApiError 400 otherwise)."""
    _check_fields(body, {"model", "prompt", "add_special_tokens", "return_token_strs", "continue_final_message",
                         *_CHAT_TOKENIZE}, _IGNORED)
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ApiError("'model' must be a model name from GET /v1/models", param="model")
    if ("prompt" in body) == ("messages" in body):
        raise ApiError("send either 'prompt' (a string) or 'messages' (a chat)", param="prompt")
    if _bool(body, "continue_final_message"):
        raise ApiError("'continue_final_message' is not supported by jaxkv serve", param="continue_final_message",
                       code="unsupported_parameter")
    chat = prompt = None
    if "messages" in body:
        chat = chat_request({"model": model or "-", **{k: body[k] for k in _CHAT_TOKENIZE if k in body}})
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise ApiError(f"'prompt' must be a string, got {_type_name(prompt)}", param="prompt")
        if "add_generation_prompt" in body or "chat_template_kwargs" in body or "tools" in body:
            raise ApiError("'add_generation_prompt', 'chat_template_kwargs' and 'tools' go with 'messages'",
                           param="prompt")
    return TokenizeRequest(model=model, prompt=prompt, chat=chat,
                           add_special_tokens=_bool(body, "add_special_tokens", chat is None),
                           return_token_strs=_bool(body, "return_token_strs"))


def detokenize_request(body) -> tuple[str | None, list[int]]:
    """A /detokenize body ({"tokens": [ids], "model"?}) -> (model or None, the ids) (ApiError 400 otherwise)."""
    _check_fields(body, {"model", "tokens"}, _IGNORED)
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ApiError("'model' must be a model name from GET /v1/models", param="model")
    if "tokens" not in body:
        raise ApiError("'tokens' is required: a list of token ids", param="tokens")
    return model, _token_ids(body["tokens"], "tokens")
