"""`jaxkv serve`: an OpenAI-compatible HTTP server (Starlette, uvicorn) over the continuous-batching engine.

Owns the HTTP side only: `main.py` the command (flags, socket, model and engine built, uvicorn run), `app.py` the
application (routes, error handlers, status counting), one module per endpoint (`completions.py`, `chat.py`,
`models.py`, `metrics.py`: /health and /metrics), what they share (`state.py` the app state, `intake.py` requests
read and checked, `sequences.py` a request's sequences on the engine, `sse.py` streaming), `protocol.py` the
request bodies' checks and OpenAI's error shape, `text.py` tokens to text, `worker.py` the engine thread.
docs/design/server.md ("Package layout") says more.

May import anything in jaxkv below it (the engine, score, the chat template, checks); nothing in jaxkv imports it
but the CLI, by name, for `jaxkv serve`. Starlette and uvicorn are the serve extra: imported only by this package.
"""
