"""`jaxkv serve` as clients see it: the real server process on a free port, called with the official `openai`
package and with raw HTTP, its answers checked against `jaxkv.generate` / `jaxkv.score` run here.

One server serves the whole file (starting it compiles the engine): a copy of the bundled model with a chat template
added, 4 slots, max_len 256, an API key, room for 36 sequences. Its tests run in one xdist worker (the group), in
file order; the last one stops it with SIGTERM.
"""

import asyncio
import json
import re
import signal
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv

from helpers.server import TEMPLATE, chat_model_dir, start_server

openai = pytest.importorskip("openai")  # in the test extra; the import guard only names what is missing

pytestmark = pytest.mark.xdist_group("server")

KEY = "test-key"
SLOTS, MAX_LEN, MAX_WAITING = 4, 256, 24
CAPACITY = SLOTS + 2 * 4 + MAX_WAITING  # slots + staging rows (2 x prefill_rows) + the waiting queue
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chat_model_dir(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(model_dir, serve_compile_cache):
    proc, url = start_server(["--model", str(model_dir), "--slots", str(SLOTS), "--max-len", str(MAX_LEN),
                              "--api-key", KEY, "--max-waiting", str(MAX_WAITING), "--served-model-name", "tiny-chat"],
                             env=serve_compile_cache)  # (tests/server/conftest.py: shared with test_soak.py's)
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def url(server):
    return server[1]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(model_dir):
    return jaxkv.load(str(model_dir))


def metrics(url) -> dict:
    return httpx.get(url + "/metrics?format=json", timeout=30).json()


def wait_idle(url, timeout=30.0) -> dict:
    """The metrics once no sequence is held (every request answered or cancelled)."""
    deadline = time.time() + timeout
    while True:
        m = metrics(url)
        if m["sequences_held"] == 0 and m["sequences_running"] == 0 or time.time() > deadline:
            return m
        time.sleep(0.05)


PROMPT = "The quick brown fox"


def test_models_health_and_metrics_format(url, client):
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"
    with pytest.raises(openai.NotFoundError, match="The model 'gpt-4' does not exist") as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.code == "model_not_found"
    assert httpx.get(url + "/v1/models/tiny-chat").status_code == 401  # no bearer token
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    text = httpx.get(url + "/metrics").text  # Prometheus text by default
    for name in ("jaxkv_requests_total", "jaxkv_slots_free", "jaxkv_pages_held", "jaxkv_sequences_waiting",
                 "jaxkv_generation_tokens_total"):
        assert re.search(rf"^{name}(\{{[^}}]*\}})? \d", text, re.M), name
    assert re.search(rf"^jaxkv_slots_total {SLOTS}$", text, re.M)


def test_greedy_completion_equals_generate(client, model):
    expected = jaxkv.generate(model, [PROMPT], max_new_tokens=24)
    out = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.choices[0].text == expected.text[0]
    assert out.choices[0].finish_reason == ("stop" if expected.finish_reasons[0] == "stop" else "length")
    ids = model.tokenizer.encode(PROMPT).ids
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(expected.tokens[0]) == 24
    # the same prompt as token ids gives the same text
    by_ids = client.completions.create(model="tiny-chat", prompt=ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == expected.text[0]


def test_stream_equals_non_stream_and_ends_with_done(url, client):
    whole = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=40, temperature=0)
    chunks = list(client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 40 and not chunks[-1].choices
    # raw: server-sent events, each "data: {json}", the last "data: [DONE]"
    with httpx.stream("POST", url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny-chat", "prompt": PROMPT, "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])


def test_n_samples_are_seeded_per_choice(client, model):
    out = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=16, temperature=1.0, n=3, seed=7)
    again = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=16, temperature=1.0, n=3, seed=7)
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # three draws of 16 tokens at temperature 1 are not all equal
    for i, text in enumerate(texts):  # choice i draws what generate(seed=seed + i) draws
        assert text == jaxkv.generate(model, [PROMPT], max_new_tokens=16, temperature=1.0, seed=7 + i,
                                      sampling="checkpoint").text[0]  # its generation_config.json: top_p 0.9


def test_logprobs_match_the_model(client, model):
    out = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    ids = model.tokenizer.encode(PROMPT).ids
    generated = jaxkv.generate(model, [PROMPT], max_new_tokens=8).tokens[0]
    score = jaxkv.score(model, [ids], [generated], top_logprobs=3)[0]
    np.testing.assert_allclose(lp.token_logprobs, list(score), atol=1e-4)
    assert "".join(lp.tokens) == out.choices[0].text
    for top, chosen in zip(lp.top_logprobs, lp.token_logprobs):
        assert 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(max(top.values()))
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the chosen token is the best
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))


def test_streamed_logprobs_equal_the_whole_answers(client):
    """Chunk by chunk, the logprobs lists add up to the non-streamed ones, text offsets included (they count from
    the start of the answer, not of each chunk), with and without the prompt echoed in front."""
    for echo in (False, True):
        kwargs = dict(model="tiny-chat", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2, echo=echo)
        whole = client.completions.create(**kwargs).choices[0]
        parts = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        text = ""
        for chunk in client.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                text += choice.text
                for key in parts:
                    parts[key] += getattr(choice.logprobs, key) if choice.logprobs else []
        assert text == whole.text
        assert parts["tokens"] == whole.logprobs.tokens and len(parts["tokens"]) >= 12
        assert parts["text_offset"] == whole.logprobs.text_offset
        np.testing.assert_allclose(parts["token_logprobs"][echo:], whole.logprobs.token_logprobs[echo:], atol=1e-5)
        tops = whole.logprobs.top_logprobs
        assert [sorted(t) for t in parts["top_logprobs"][echo:]] == [sorted(t) for t in tops[echo:]]


def test_echo_scores_the_prompt(url, model):
    """What evaluation harnesses send: echo, logprobs, max_tokens 0 -> the prompt's own log-probabilities."""
    r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"model": "tiny-chat", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1,
                         "temperature": 0}).json()
    choice = r["choices"][0]
    assert choice["text"] == PROMPT
    ids = model.tokenizer.encode(PROMPT).ids
    logits = jaxkv.model.logits(model, np.asarray([ids]))[0]  # a plain forward over the whole prompt, no cache
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    expected = [logp[j, ids[j + 1]] for j in range(len(ids) - 1)]
    assert choice["logprobs"]["token_logprobs"][0] is None
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:], expected, atol=1e-4)
    assert "".join(choice["logprobs"]["tokens"]) == PROMPT
    best = [max(t.values()) for t in choice["logprobs"]["top_logprobs"][1:]]
    np.testing.assert_allclose(best, logp[:-1].max(-1), atol=1e-4)
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}


def test_stop_strings_and_stop_ids(client, model):
    full = jaxkv.generate(model, [PROMPT], max_new_tokens=40).text[0]
    stop = full[5:7]  # two characters the greedy text contains; the output ends before their first occurrence
    out = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    assert out.choices[0].text == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    ids = jaxkv.generate(model, [PROMPT], max_new_tokens=40).tokens[0]
    assert out.usage.completion_tokens == min(k for k in range(1, 41)
                                              if stop in model.tokenizer.decode(ids[:k], skip_special_tokens=True))
    streamed = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=40, temperature=0,
                                         stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[:full.index(stop)]
    # a stop token id: ends at that token, whose text is not part of the output
    stop_id = ids[3]
    out = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=40, temperature=0,
                                    stop=[stop_id])  # a list of ints: token ids
    assert out.choices[0].finish_reason == "stop"
    k = ids.index(stop_id)
    assert out.choices[0].text == model.tokenizer.decode(ids[:k], skip_special_tokens=True)
    assert out.usage.completion_tokens == k + 1


def stop_text(tokenizer, ids, stop, min_tokens):
    """vLLM's rule, as a reference, for greedy tokens `ids`: (the text before the first occurrence of `stop` that
    ends past the text of the first min_tokens tokens, the tokens that made the text up to its end, True), or
    (the whole text, every token, False) without one."""
    decode = lambda k: tokenizer.decode(ids[:k], skip_special_tokens=True)  # noqa: E731
    boundary = len(decode(min_tokens))
    for k in range(min_tokens + 1, len(ids) + 1):
        text = decode(k)
        ends = [p for p in range(len(text)) if text.startswith(stop, p) and p + len(stop) > boundary]
        if ends:
            return text[:ends[0]], k, True
    return decode(len(ids)), len(ids), False


def test_stop_strings_wait_for_min_tokens(client, model, model_dir):
    """Issue 50: with min_tokens m, no stop string ends in the first m tokens' text (vLLM's rule; stop token ids
    already waited): a stop string that appears early and again later stops at the later one, one straddling the
    m-th token stops, and without min_tokens the early one stops. Completions and chat, whole and streamed, n = 2,
    logprobs and usage cut at the stop."""
    from jaxkv.chat_template import ChatTemplate

    tok, new = model.tokenizer, 24
    messages = [{"role": "user", "content": "Hello there"}]
    rendered = ChatTemplate.from_directory(model_dir).render(messages, add_generation_prompt=True)
    prompts = {"completions": PROMPT, "chat": tok.encode(rendered, add_special_tokens=False).ids}
    greedy = {(kind, m): jaxkv.generate(model, [p], max_new_tokens=new, min_tokens=m).tokens[0]
              for kind, p in prompts.items() for m in (0, 5, 8)}
    text = tok.decode(greedy["completions", 0], skip_special_tokens=True)
    early = text[2]  # a character of the first tokens that comes again later
    assert early in text[6:12]
    straddle = text[4:7]  # (one token per character here) tokens 5..7: straddles m = 5, inside the first 8
    cases = [(early, 0), (early, 5), (straddle, 5), (straddle, 8)]
    assert stop_text(tok, greedy["completions", 0], early, 0)[1] <= 5 < stop_text(tok, greedy["completions", 5],
                                                                                   early, 5)[1]
    for stop, m in cases:
        want, used, found = stop_text(tok, greedy["completions", m], stop, m)
        assert found or m == 8
        body = dict(model="tiny-chat", prompt=PROMPT, max_tokens=new, temperature=0, stop=[stop],
                    extra_body={"min_tokens": m})
        out = client.completions.create(**body, n=2, logprobs=1)
        for choice in out.choices:
            assert (choice.text, choice.finish_reason) == (want, "stop" if found else "length"), (stop, m)
            assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == used
        assert out.usage.completion_tokens == 2 * used
        streamed = client.completions.create(**body, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == want
    text = tok.decode(greedy["chat", 0], skip_special_tokens=True)  # (the chat's own stops: "*" repeated, here)
    for stop, m in [(text[0], 0), (text[0], 5), (text[4:7], 5), (text[4:7], 8)]:
        want, used, found = stop_text(tok, greedy["chat", m], stop, m)
        assert found and used > m
        body = dict(model="tiny-chat", messages=messages, max_tokens=new, temperature=0, stop=[stop],
                    extra_body={"min_tokens": m})
        out = client.chat.completions.create(**body)
        assert (out.choices[0].message.content, out.usage.completion_tokens) == (want, used), (stop, m)
        chunks = client.chat.completions.create(**body, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_a_stop_string_counts_as_stop_in_metrics(url, client, model):
    """A sequence ended by a stop string finished with "stop", as its client was told, not "cancelled" (the server
    ends it in the engine when the string appears)."""
    full = jaxkv.generate(model, [PROMPT], max_new_tokens=40).text[0]
    before = wait_idle(url)["finished"]
    out = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=40, temperature=0, stop=[full[5:7]])
    assert out.choices[0].finish_reason == "stop"
    after = wait_idle(url)["finished"]
    assert after.get("stop", 0) == before.get("stop", 0) + 1
    assert after.get("cancelled", 0) == before.get("cancelled", 0)


def test_chat_with_the_template(client, model, model_dir):
    from jaxkv.chat_template import ChatTemplate

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    rendered = ChatTemplate.from_directory(model_dir).render(messages, add_generation_prompt=True)
    ids = model.tokenizer.encode(rendered, add_special_tokens=False).ids
    expected = jaxkv.generate(model, [ids], max_new_tokens=20)
    out = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=20, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text[0]
    assert out.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=20,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text[0]
    with_lp = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=5, temperature=0,
                                             logprobs=True, top_logprobs=2)
    content = with_lp.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5) for c in content)  # greedy
    # max_tokens unset: as many as fit in max_len
    assert client.chat.completions.create(model="tiny-chat", messages=messages, temperature=0,
                                          stop=None).usage.total_tokens <= MAX_LEN
    # the template refuses a role it does not know: 400 with its message
    with pytest.raises(openai.BadRequestError, match="unknown role"):
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "robot", "content": "x"}])


def error(url, body=None, *, raw=None, key=KEY, path="/v1/completions"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        r = httpx.post(url + path, content=raw, headers={**headers, "Content-Type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url + path, json=body, headers=headers, timeout=30)
    return r.status_code, r.json()["error"]


def test_bad_requests_get_openai_errors(url):
    ok = {"model": "tiny-chat", "prompt": "x", "max_tokens": 4}
    cases = {
        "malformed JSON": dict(raw=b'{"model": "tiny-chat", "prompt": '),
        "not an object": dict(raw=b"[1, 2]"),
        "wrong type": dict(body={**ok, "max_tokens": "ten"}),
        "wrong type (temperature)": dict(body={**ok, "temperature": "hot"}),
        "negative max_tokens": dict(body={**ok, "max_tokens": -5}),
        "huge max_tokens": dict(body={**ok, "max_tokens": 10**9}),
        "prompt longer than the context": dict(body={**ok, "prompt": "x" * (MAX_LEN + 10)}),
        "token id outside the vocabulary": dict(body={**ok, "prompt": [1, 2, 99999]}),
        "unknown field": dict(body={**ok, "frobnicate": True}),
        "unsupported parameter": dict(body={**ok, "suffix": "x"}),
        "logit_bias outside the vocabulary": dict(body={**ok, "logit_bias": {"99999": 1}}),
        "unsupported best_of": dict(body={**ok, "best_of": 3}),
        "logprobs above 20": dict(body={**ok, "logprobs": 21}),
        "missing prompt": dict(body={"model": "tiny-chat"}),
        "empty prompt": dict(body={**ok, "prompt": ""}),
        "n zero": dict(body={**ok, "n": 0}),
        "chat: no messages": dict(body={"model": "tiny-chat", "messages": []}, path="/v1/chat/completions"),
        "chat: tools": dict(body={"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}],
                                  "tools": [{"type": "function", "function": {"name": "f"}}]},
                            path="/v1/chat/completions"),
    }
    for name, case in cases.items():
        status, err = error(url, **case)
        assert status == 400, (name, status, err)
        assert err["type"] == "invalid_request_error" and err["message"], name
    assert error(url, {**ok, "max_tokens": "ten"})[1]["param"] == "max_tokens"
    assert error(url, {**ok, "model": "gpt-4"})[0] == 404
    assert error(url, ok, key=None)[0] == 401
    assert error(url, ok, key="wrong")[0] == 401
    assert httpx.get(url + "/v1/models").status_code == 401
    status, err = error(url, {**ok, "n": CAPACITY + 1})  # more sequences than the server could ever hold
    assert status == 400 and "at most" in err["message"]
    # a full server: one streaming request holds every sequence it may hold; the next stream is 429 with
    # Retry-After, a whole answer waits for room (issue 30, item 6b) and is answered once the stream is gone
    queued = {}
    with httpx.stream("POST", url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={**ok, "n": CAPACITY, "max_tokens": MAX_LEN - 8, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()  # kept: a dropped httpx line iterator closes the response (a disconnect)
        assert next(lines).startswith("data: {")
        with pytest.raises(openai.RateLimitError) as refused:
            openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0).completions.create(
                model="tiny-chat", prompt="x", max_tokens=4, stream=True)
        assert refused.value.response.headers["retry-after"] == "1"
        waiting = threading.Thread(target=lambda: queued.update(out=openai.OpenAI(
            base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60).completions.create(
            model="tiny-chat", prompt="x", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})))
        waiting.start()
        deadline = time.time() + 30
        while metrics(url)["sequences_queued"] != 1 and time.time() < deadline:
            time.sleep(0.05)
        assert metrics(url)["sequences_queued"] == 1
    waiting.join(60)
    assert queued["out"].usage.completion_tokens == 4
    # none of the above left anything running
    m = wait_idle(url)
    assert m["slots_free"] == SLOTS and m["pages_held"] == 0


def test_the_tokenizer_endpoints_answer_as_lm_evals_remote_tokenizer_reads_them(url, model):
    """lm-eval's `tokenizer_backend=remote` (its RemoteTokenizer): GET /tokenizer_info (eos_token, chat_template),
    POST /tokenize {"prompt", "add_special_tokens": false} -> tokens, POST /detokenize {"tokens"} -> prompt; with the
    API key, as every other route."""
    auth = {"Authorization": f"Bearer {KEY}"}
    info = httpx.get(url + "/tokenizer_info", headers=auth, timeout=30).json()
    assert info["eos_token"] == "<|endoftext|>" and info["chat_template"] == TEMPLATE
    eos = httpx.post(url + "/tokenize", headers=auth, timeout=30,
                     json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"] == list(model.config.eos_ids) and eos["max_model_len"] == MAX_LEN
    ids = httpx.post(url + "/tokenize", headers=auth, timeout=30, json={"prompt": PROMPT}).json()["tokens"]
    assert ids == model.tokenizer.encode(PROMPT).ids
    assert httpx.post(url + "/detokenize", headers=auth, json={"tokens": ids}, timeout=30).json() == {"prompt": PROMPT}
    assert httpx.get(url + "/tokenizer_info", timeout=30).status_code == 401


def test_32_concurrent_streams_equal_their_solo_results(url, client):
    prompts = [f"Request {i}: " + "the cat sat on the mat " * (i % 3) for i in range(32)]  # some share prefixes
    lengths = [8 + (i * 7) % 33 for i in range(32)]
    solo = [client.completions.create(model="tiny-chat", prompt=p, max_tokens=n, temperature=0).choices[0].text
            for p, n in zip(prompts, lengths)]

    async def stream(aclient, prompt, n):
        parts, finish = [], None
        async for chunk in await aclient.completions.create(model="tiny-chat", prompt=prompt, max_tokens=n,
                                                            temperature=0, stream=True):
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def all_streams():
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        async with aclient:
            return await asyncio.gather(*(stream(aclient, p, n) for p, n in zip(prompts, lengths)))

    before = metrics(url)
    results = asyncio.run(all_streams())
    assert [t for t, _ in results] == solo
    assert all(f in ("stop", "length") for _, f in results)
    m = wait_idle(url)
    assert m["slots_free"] == SLOTS and m["pages_held"] == 0 and m["sequences_waiting"] == 0
    assert m["prefix_hit_tokens"] > before["prefix_hit_tokens"]  # the shared prompts were reused


def test_disconnect_mid_stream_frees_the_slot(url):
    before = metrics(url)
    with httpx.stream("POST", url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": "tiny-chat", "prompt": PROMPT, "max_tokens": MAX_LEN - 32, "stream": True,
                            "temperature": 0, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        assert metrics(url)["slots_free"] < SLOTS  # it is decoding
    # the connection is closed: the server cancels the sequence, its slot and pages come back
    m = wait_idle(url)
    assert m["slots_free"] == SLOTS and m["pages_held"] == 0
    assert m["disconnects"] == before["disconnects"] + 1
    assert m["finished"].get("cancelled", 0) == before["finished"].get("cancelled", 0) + 1
    assert m["generated_tokens"] - before["generated_tokens"] < MAX_LEN - 32  # it did not run to the end


# A bounded schema (every string and number bounded), so that the tiny model's output always completes.
ORDER = {"type": "object", "additionalProperties": False, "required": ["item", "count", "tags"],
         "properties": {"item": {"type": "string", "maxLength": 12}, "count": {"type": "integer", "minimum": 1,
                                                                              "maximum": 99},
                        "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["red", "blue"]}},
                        "note": {"type": "string", "pattern": "^[a-z]{1,6}$"}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}}}


def test_structured_logprobs_are_the_models_and_the_stop_token_is_counted(client, model):
    """Issue 50: a constrained answer's logprobs (and top_logprobs) are the model's (jaxkv.logits, before the
    mask; they were 0.0 for every forced token), whole and streamed; the stop token that ends a complete
    constraint is emitted: counted in usage and listed at the text's end, not part of the text."""
    regex = "[A-Z]{2}-[0-9]{3}"
    gen = jaxkv.generate(model, ["Code:"], max_new_tokens=20, constraint=jaxkv.Regex(regex), logprobs=2)
    tokens = gen.tokens[0]
    assert tokens[-1] in model.config.eos_ids and gen.finish_reasons == ["stop"]
    prompt = model.tokenizer.encode("Code:").ids
    logp = np.asarray(jax.nn.log_softmax(jaxkv.logits(model, [prompt + tokens[:-1]])[0], axis=-1))[len(prompt) - 1:]
    want = logp[np.arange(len(tokens)), tokens]
    assert np.any(want < -1e-2)  # some token the model did not find certain: a masked distribution says 0
    body = dict(model="tiny-chat", prompt="Code:", max_tokens=20, temperature=0, logprobs=2,
                extra_body={"structured_outputs": {"regex": regex}})
    out = client.completions.create(**body)
    choice = out.choices[0]
    assert re.fullmatch(regex, choice.text) and choice.finish_reason == "stop"
    assert out.usage.completion_tokens == len(tokens)
    np.testing.assert_allclose(choice.logprobs.token_logprobs, want, atol=1e-4)
    np.testing.assert_allclose([max(t.values()) for t in choice.logprobs.top_logprobs], logp.max(-1), atol=1e-4)
    streamed = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    assert "".join(c.text for c in streamed) == choice.text
    np.testing.assert_allclose([v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs], want,
                               atol=1e-4)


def test_structured_outputs_tools_and_bad_schemas(url, client):
    """response_format json_schema (parsed by the client), json_object, vLLM's structured_outputs, tools with
    tool_choice required or named (tool_calls whose arguments validate); a bad schema or regex, or tool_choice
    auto with a template whose calls cannot be read back, is a 400 in OpenAI's shape; nothing is held after."""
    jsonschema = pytest.importorskip("jsonschema")
    pydantic = pytest.importorskip("pydantic")
    messages = [{"role": "user", "content": "Order something."}]

    class Order(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        item: str = pydantic.Field(max_length=12)
        count: int = pydantic.Field(ge=1, le=99)

    parsed = client.chat.completions.parse(model="tiny-chat", messages=messages, response_format=Order,
                                           max_tokens=120, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Order)
    out = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=160, n=2, temperature=1,
                                         seed=3, response_format={"type": "json_schema", "json_schema": {
                                             "name": "order", "schema": ORDER, "strict": True}})
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), ORDER)
        assert choice.finish_reason == "stop"
    obj = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=160, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason != "stop" or isinstance(json.loads(obj.choices[0].message.content), dict)
    regex = client.completions.create(model="tiny-chat", prompt="Code:", max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", regex.choices[0].text)
    choice = client.completions.create(model="tiny-chat", prompt="Yes or no?", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
             {"type": "function", "function": {"name": "order", "parameters": ORDER}}]
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        called = client.chat.completions.create(model="tiny-chat", messages=messages, tools=tools, temperature=0,
                                                tool_choice=tool_choice, max_tokens=200, parallel_tool_calls=False)
        c = called.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls and c.message.content is None
        for call in c.message.tool_calls:
            schema = WEATHER if call.function.name == "get_weather" else ORDER
            jsonschema.validate(json.loads(call.function.arguments), schema)
        if isinstance(tool_choice, dict):
            assert [call.function.name for call in c.message.tool_calls] == ["get_weather"]
    # streamed: the same calls, in the last chunk
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=messages, tools=tools, temperature=0,
                                                 tool_choice=tool_choice, max_tokens=200, stream=True))
    streamed = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(d.function.name, d.function.arguments) for d in streamed] == [
        (call.function.name, call.function.arguments) for call in c.message.tool_calls]

    bad = {"chat: a bad schema": dict(response_format={"type": "json_schema", "json_schema": {
               "name": "x", "schema": {"type": "integr"}}}),
           "chat: tool_choice auto": dict(tools=tools),
           "chat: two formats": dict(response_format={"type": "json_object"}, tools=tools, tool_choice="required")}
    words = {"chat: a bad schema": "integr", "chat: tool_choice auto": "<tool_call>", "chat: two formats": "one of"}
    for name, extra in bad.items():
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8, **extra)
        assert refused.value.body["type"] == "invalid_request_error" and words[name] in refused.value.message, name
    with pytest.raises(openai.BadRequestError, match="unclosed group") as refused:
        client.completions.create(model="tiny-chat", prompt="x", max_tokens=8,
                                  extra_body={"structured_outputs": {"regex": "(ab"}})
    assert refused.value.body["param"] == "structured_outputs.regex"
    m = wait_idle(url)
    assert m["slots_free"] == SLOTS and m["pages_held"] == 0


def test_a_call_without_parameters_and_json_object_with_a_schema(url, client):
    """Issue 50. A function without parameters (omitted, or {}) is called with arguments "{}", forced, required or
    streamed (before: junk keys until max_tokens, or an array). response_format json_object with a "schema" is
    held to it (before: ignored, any object came back), and json_schema strict: true gives only the keys the
    schema names although it does not say additionalProperties: false."""
    jsonschema = pytest.importorskip("jsonschema")
    messages = [{"role": "user", "content": "What time is it?"}]
    tools = [{"type": "function", "function": {"name": "now"}},
             {"type": "function", "function": {"name": "ping", "parameters": {}}}]
    for tool_choice in [{"type": "function", "function": {"name": name}} for name in ("now", "ping")] + ["required"]:
        for stream in (False, True):
            out = client.chat.completions.create(model="tiny-chat", messages=messages, tools=tools, max_tokens=60,
                                                 temperature=0, tool_choice=tool_choice, stream=stream,
                                                 parallel_tool_calls=False)
            if stream:
                chunks = list(out)
                finish, calls = chunks[-1].choices[0].finish_reason, [
                    d.function for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
            else:
                message = out.choices[0].message
                finish, calls = out.choices[0].finish_reason, [c.function for c in message.tool_calls or []]
            assert finish == "tool_calls" and len(calls) == 1, (tool_choice, stream, finish)
            assert all(c.arguments == "{}" and c.name in ("now", "ping") for c in calls), (tool_choice, calls)

    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["answer"]}
    for response_format in ({"type": "json_object", "schema": schema},
                            {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": schema}}):
        out = client.completions.create(model="tiny-chat", prompt="JSON: ", max_tokens=60, n=4, seed=1,
                                        extra_body={"response_format": response_format})
        for choice in out.choices:
            assert choice.finish_reason == "stop", (response_format, choice.text)
            value = json.loads(choice.text)
            jsonschema.validate(value, schema)
            assert set(value) == {"answer"}, (response_format, choice.text)
    m = wait_idle(url)
    assert m["slots_free"] == SLOTS and m["pages_held"] == 0


def test_sigterm_finishes_in_flight_requests_and_exits_cleanly(server, url):
    """Last in the file: stops the shared server."""
    proc = server[0]
    out = {}

    def request():
        out["r"] = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                              json={"model": "tiny-chat", "prompt": PROMPT, "max_tokens": 120, "temperature": 0,
                                    "ignore_eos": True})

    t = threading.Thread(target=request)
    t.start()
    deadline = time.time() + 30
    while metrics(url)["sequences_running"] == 0 and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    t.join(60)
    assert out["r"].status_code == 200 and out["r"].json()["usage"]["completion_tokens"] == 120
    assert "Traceback" not in proc.stderr.read()
