"""What the server says about itself: GET /health (503 once the engine failed) and GET /metrics (Prometheus text,
or JSON with ?format=json or Accept: application/json): the engine's gauges and counters, HTTP requests by
endpoint and responses by status, disconnects, time to the first token."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from jaxkv.server.state import ServerState


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.jaxkv
    if state.worker.failed:
        return JSONResponse({"status": "failed", "error": state.worker.failed}, status_code=503)
    return JSONResponse({"status": "ok"})


_GAUGES = {  # metrics name -> (worker snapshot key, help)
    "jaxkv_sequences_running": ("sequences_running", "Sequences prefilling or decoding in the engine."),
    "jaxkv_sequences_waiting": ("sequences_waiting", "Sequences queued for a cache row (the queue)."),
    "jaxkv_sequences_held": ("sequences_held", "Sequences submitted and not yet answered, and prompts being scored "
                                               "(the 429 limit counts these)."),
    "jaxkv_sequences_queued": ("sequences_queued", "Sequences of non-streaming requests waiting for room beyond "
                                                   "those (--max-queued bounds them)."),
    "jaxkv_slots_total": ("slots_total", "Decode slots of the engine."),
    "jaxkv_slots_free": ("slots_free", "Decode slots no sequence holds."),
    "jaxkv_pages_total": ("pages_total", "KV-cache pages in the pool."),
    "jaxkv_pages_free": ("pages_free", "Pages nothing holds."),
    "jaxkv_pages_held": ("pages_held", "Pages some running sequence holds (0 when idle)."),
    "jaxkv_pages_cached": ("pages_cached", "Pages the prefix cache keeps for later prompts (reclaimable)."),
    "jaxkv_slot_occupancy": ("slot_occupancy", "Decoding slots per decode step run, over all slots."),
    "jaxkv_spec_acceptance_rate": ("spec_acceptance_rate", "Speculative decoding: proposed tokens kept, over "
                                                           "proposed tokens verified (0 without speculation)."),
    "jaxkv_spec_tokens_per_target_forward": ("tokens_per_target_forward", "Speculative decoding: tokens per "
                                             "decoding sequence per forward pass of the model (0 without it)."),
}
_COUNTERS = {
    "jaxkv_sequences_total": ("sequences_submitted", "Sequences submitted to the engine (prompts x n)."),
    "jaxkv_generation_tokens_total": ("generated_tokens", "Tokens the engine generated."),
    "jaxkv_prompt_tokens_total": ("prefill_tokens", "Prompt tokens prefilled (not counting prefix-cache hits)."),
    "jaxkv_prefix_cache_hit_tokens_total": ("prefix_hit_tokens", "Prompt tokens taken from the prefix cache."),
    "jaxkv_decode_steps_total": ("decode_steps", "Decode steps that ran."),
    "jaxkv_spec_proposed_tokens_total": ("spec_proposed", "Speculative decoding: proposed tokens verified."),
    "jaxkv_spec_accepted_tokens_total": ("spec_accepted", "Speculative decoding: proposed tokens kept."),
    "jaxkv_spec_verifies_total": ("spec_verifies", "Speculative decoding: forward passes that verified "
                                                   "proposals."),
    "jaxkv_spec_target_forwards_total": ("target_forwards", "Speculative decoding: decode forward passes of the "
                                                            "model (verifies and plain steps)."),
}


def _metrics_json(state: ServerState) -> dict:
    m = dict(state.worker.metrics)
    http = state.http
    m["requests"] = {k: http[k] for k in ("completions", "chat_completions")}
    m["responses"] = {k[len("status_"):]: v for k, v in http.items() if k.startswith("status_")}
    m["disconnects"] = http["disconnects"]
    m["time_to_first_token_seconds"] = {"sum": http["ttft_s"], "count": http["ttft_count"]}
    return m


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.jaxkv
    m = _metrics_json(state)
    if request.query_params.get("format") == "json" or "application/json" in request.headers.get("accept", ""):
        return JSONResponse(m)
    lines = []

    def metric(name, kind, help_, samples):
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{labels} {value}" for labels, value in samples)

    metric("jaxkv_requests_total", "counter", "HTTP requests received, by endpoint.",
           [(f'{{endpoint="{k}"}}', v) for k, v in m["requests"].items()])
    metric("jaxkv_responses_total", "counter", "HTTP responses sent, by status.",
           [(f'{{status="{k}"}}', v) for k, v in sorted(m["responses"].items())])
    metric("jaxkv_client_disconnects_total", "counter", "Requests cancelled before their end: the client left "
           "(or the server stopped before they could finish).",
           [("", m["disconnects"])])
    metric("jaxkv_sequences_finished_total", "counter", "Sequences finished, by finish reason (stop: a stop token "
           "or a stop string; cancelled: the client left, or the server stopped).",
           [(f'{{reason="{k}"}}', v) for k, v in sorted(m["finished"].items())])
    for name, (key, help_) in _COUNTERS.items():
        metric(name, "counter", help_, [("", m[key])])
    for name, (key, help_) in _GAUGES.items():
        metric(name, "gauge", help_, [("", m[key])])
    ttft = m["time_to_first_token_seconds"]
    metric("jaxkv_time_to_first_token_seconds", "summary", "Streamed requests: seconds to the first token.",
           [("_sum", ttft["sum"]), ("_count", ttft["count"])])
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")
