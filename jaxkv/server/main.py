"""`jaxkv serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

  jaxkv serve [--model PATH|tiny | --preset NAME] [--host 127.0.0.1] [--port 8000] [--slots N] [--max-len N]
              [--cache-dtype D] [--page-size P] [--api-key KEY] [--served-model-name NAME] [--dtype D]
              [--num-pages N] [--max-waiting N] [--max-queued N] [--generation-config auto|ignore]
              [--no-prefix-cache] [--steps-per-dispatch K]
              [--prefill-chunk C] [--tensor-parallel-size N] [--shutdown-timeout S] [--log-level L]

Needs the serve extra (`pip install "jaxkv[serve]"`: Starlette and uvicorn). Order of work, so that mistakes
cost nothing: flags are checked and the port is bound before JAX is imported (a taken port or a bad flag is one
line on stderr and status 2, in a fraction of a second); then the model is loaded, the engine built and its
programs compiled by one warm-up request, and only then are connections accepted, so no client waits on a
compile. `--port 0` takes a free port; the "listening on" line on stdout names it.

SIGINT or SIGTERM stops accepting connections, lets in-flight requests finish for up to --shutdown-timeout
seconds, then cancels every sequence still running or queued (their slots and pages freed): each response ends as
it should (a stream's choices get a last chunk with finish_reason "cancelled", then [DONE]; a whole answer is
sent with what was made); a client that has not read its response CANCEL_GRACE seconds later is cut off. Then it
stops the engine thread and exits with status 0. A second SIGINT exits at once.

`--tensor-parallel-size N` splits the weights (Megatron-style: heads and FFN widths) and the page pools (over KV
heads, the prefix cache's too) across the first N devices, as `jaxkv.Engine(mesh=...)` does on a ("data",
"model") mesh of 1 x N.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from jaxkv import checks
from jaxkv.checks import add_weight_flags, check_weight_flags, weights_of
from jaxkv.cache import planner as memory

EXIT_USAGE = 2
CANCEL_GRACE = 5.0  # seconds responses have to end themselves after the shutdown timeout cancelled their sequences


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(f"{message} (see jaxkv serve --help)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="jaxkv serve", description="An OpenAI-compatible HTTP server (completions, chat completions) "
                                                "over jaxkv's continuous-batching engine.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port, printed at start)")
    p.add_argument("--api-key", default=os.environ.get("JAXKV_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $JAXKV_API_KEY, else none)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may take to finish after SIGINT/SIGTERM before being cancelled")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs every request)")
    add_engine_options(p)
    return p


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The model and engine flags `jaxkv serve` and `jaxkv run-batch` share (what `build` reads)."""
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="checkpoint directory (Hugging Face or jaxkv) or 'tiny' "
                                                      "(the default)")
    source.add_argument("--preset", default=None, help="a config preset with random weights and no tokenizer "
                                                       "(token-id prompts only; for load tests), e.g. small")
    p.add_argument("--slots", type=int, default=8, help="sequences decoded together (the engine's batch)")
    p.add_argument("--max-len", type=int, default=None,
                   help="the most tokens one sequence may use, prompt included (default: the model's max "
                        "positions, at most 2048)")
    p.add_argument("--cache-dtype", choices=memory.CACHE_DTYPES, default=None, help="KV-cache dtype (default: "
                                                                                    "the model's)")
    p.add_argument("--page-size", type=int, default=memory.DEFAULT_PAGE_SIZE, help="token slots per cache page")
    p.add_argument("--num-pages", type=int, default=None,
                   help="pages in the pool (default: every slot at max-len, plus a quarter for cached prefixes)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="weights dtype")
    add_weight_flags(p)
    p.add_argument("--served-model-name", default=None, help="the model's name in /v1/models (default: the "
                                                             "checkpoint directory's name, or tiny / the preset)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="sequences that may wait in the engine for a slot; beyond slots + staging rows + this, "
                        "non-streaming requests wait in the server's queue (--max-queued) and streams get 429")
    p.add_argument("--max-queued", type=int, default=1024,
                   help="sequences of non-streaming requests that may wait for room beyond those (first in, first "
                        "out; their prompts are at most this x max-len token ids of memory); beyond, 429")
    p.add_argument("--generation-config", choices=["auto", "ignore"], default="auto",
                   help="auto: sampling fields a request leaves unset default to the checkpoint's "
                        "generation_config.json (transformers' meaning: do_sample false is greedy); ignore: OpenAI's "
                        "defaults (temperature 1, no filters)")
    p.add_argument("--no-prefix-cache", action="store_true", help="do not keep prompt pages for later requests")
    p.add_argument("--host-cache-gib", type=float, default=0.0, metavar="G",
                   help="host memory (GiB) for prompt pages evicted from the device pool: a later request with that "
                        "prefix copies them back instead of recomputing them (default 0: evicted pages are dropped)")
    p.add_argument("--steps-per-dispatch", type=int, default=8, help="decode steps per engine dispatch")
    p.add_argument("--prefill-chunk", type=int, default=128, help="prompt tokens per prefill chunk")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices the weights and KV cache are split over (heads and FFN widths)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engines side by side, each with its own slots, pages and prefix cache (and its own "
                        "--tensor-parallel-size devices); a request goes to the one holding its longest cached "
                        "prefix, else the least loaded (--slots and --num-pages are per engine)")
    spec = p.add_argument_group("speculative decoding", "a proposer guesses each sequence's next tokens and one "
                                "forward pass verifies them; outputs are distributed exactly as without it")
    spec.add_argument("--speculative-method", choices=["ngram", "draft", "mtp"], default=None,
                      help="ngram: prompt lookup (the sequence's own earlier text proposes); draft: a smaller model "
                           "with the same vocabulary (--draft-model); mtp: the checkpoint's own multi-token-"
                           "prediction module (DeepSeek-V3's, num_nextn_predict_layers > 0)")
    spec.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                      help="tokens proposed per verify (1-16)")
    spec.add_argument("--draft-model", default=None, metavar="PATH",
                      help="the draft model's checkpoint directory, or 'tiny' (--speculative-method draft)")


def check(args):
    checks.check_int("--port", args.port, 0, 65535)
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty")
    check_engine_options(args)


def check_engine_options(args):
    """`add_engine_options`'s flags checked without JAX; ValueError."""
    check_weight_flags(args)
    for name in ("slots", "page_size", "max_waiting", "steps_per_dispatch", "prefill_chunk", "tensor_parallel_size",
                 "data_parallel_size"):
        checks.check_int(f"--{name.replace('_', '-')}", getattr(args, name), 1 if name != "max_waiting" else 0)
    checks.check_int("--max-queued", args.max_queued, 0)
    if not 0 <= args.host_cache_gib < float("inf"):
        raise ValueError(f"--host-cache-gib must be a finite number >= 0, got {args.host_cache_gib}")
    if args.host_cache_gib and args.no_prefix_cache:
        raise ValueError("--host-cache-gib holds the prefix cache's evicted pages: not with --no-prefix-cache")
    if args.max_len is not None:
        checks.check_int("--max-len", args.max_len, 2)
    if args.num_pages is not None:
        checks.check_int("--num-pages", args.num_pages, 1)
    checks.check_int("--num-speculative-tokens", args.num_speculative_tokens, 1, 16)
    if (args.speculative_method == "draft") != (args.draft_model is not None):
        raise ValueError("--draft-model goes with --speculative-method draft, and it needs one")
    if args.draft_model not in (None, "tiny") and not os.path.isdir(args.draft_model):
        raise ValueError(f"--draft-model {args.draft_model}: no such directory (a checkpoint directory or 'tiny')")
    if args.preset is not None:
        from jaxkv.config import PRESETS

        if args.preset not in PRESETS:
            raise ValueError(f"unknown preset {args.preset!r}; choose from {sorted(PRESETS)}")
    for module in ("starlette", "uvicorn"):
        try:
            __import__(module)
        except ImportError:
            raise ValueError(f"jaxkv serve needs {module}: pip install \"jaxkv[serve]\"") from None


def _listen(host: str, port: int) -> socket.socket:
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(2048)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


MALLOC_ARENAS = 2  # glibc malloc arenas for a server process (`_limit_malloc_arenas`)


def _limit_malloc_arenas() -> None:
    """Caps glibc's malloc arenas at MALLOC_ARENAS unless the environment sets MALLOC_ARENA_MAX (then that holds).

    Why: glibc gives each thread that allocates concurrently an arena of its own, up to 8 per core, and memory
    freed in one is reused only by the threads on it. A server's threads (the event loop, the engine thread,
    asyncio.to_thread's tokenizer pool, XLA's) allocate and free host buffers of many sizes, and its resident
    memory crept up ~1 MiB a minute under scripts/soak_serve.py (+5.6% in 30 minutes; the Python heap, by
    tracemalloc, flat); with 2 arenas it stayed level (docs/design/server.md, "Soak"). A no-op off glibc. Must run
    before the threads start, so before JAX is imported."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(ctypes.c_int(-8), ctypes.c_int(MALLOC_ARENAS))  # -8: M_ARENA_MAX in glibc's malloc.h
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator's own behaviour stands
        pass


def build(args, warm: bool = True):
    """The model, engine and app state for checked `args` (imports JAX) -> (state, engine). `warm`: compile every
    program before returning (the server: no client waits on a compile); a batch job compiles what it uses."""
    _limit_malloc_arenas()
    import jaxkv
    from jaxkv.chat_template import ChatTemplate
    from jaxkv.engine import data_shards
    from jaxkv.server.state import ServerState
    from jaxkv.server.tokenization import read_tokenizer_info
    from jaxkv.server.worker import EngineWorker, warm_up_scoring

    model, directory, name = _model(args)
    if args.speculative_method == "mtp" and model.mtp is None:  # (the engine would refuse it too, after the pool)
        raise ValueError(f"--speculative-method mtp: {name} has no multi-token-prediction layers (a checkpoint "
                         "with num_nextn_predict_layers > 0 and their tensors); use ngram, or draft with "
                         "--draft-model")
    config = model.config
    mesh = _mesh(args, config)
    max_len = min(config.max_positions, 2048) if args.max_len is None else args.max_len
    if max_len > config.max_positions:
        raise ValueError(f"--max-len {max_len} exceeds the model's max positions ({config.max_positions})")
    lookahead = 0 if args.speculative_method is None else args.num_speculative_tokens  # a verify's extra slots
    per_sequence = -(-(max_len + lookahead) // args.page_size)
    num_pages = args.num_pages or args.slots * per_sequence + max(per_sequence, args.slots * per_sequence // 4)
    prefix_cache = None
    if not args.no_prefix_cache:
        page_bytes = memory.pool_bytes(config, num_pages=1, page_size=args.page_size, cache_dtype=args.cache_dtype)
        host_pages = int(args.host_cache_gib * memory.GIB // page_bytes)
        if args.host_cache_gib and not host_pages:
            raise ValueError(f"--host-cache-gib {args.host_cache_gib} holds no page of {page_bytes:,} bytes")
        meshes = [mesh] if mesh is None or args.data_parallel_size == 1 else data_shards(mesh)
        prefix_cache = [jaxkv.PrefixCache(model, num_pages=num_pages, page_size=args.page_size,
                                          cache_dtype=args.cache_dtype, mesh=m, host_pages=host_pages)
                        for m in meshes]
        prefix_cache = prefix_cache[0] if len(prefix_cache) == 1 else prefix_cache
    engine = jaxkv.Engine(model, slots=args.slots, max_len=max_len, page_size=args.page_size,
                          cache_dtype=args.cache_dtype, prefix_cache=prefix_cache,
                          num_pages=None if prefix_cache is not None else num_pages,
                          steps_per_dispatch=args.steps_per_dispatch, prefill_chunk=args.prefill_chunk,
                          mesh=mesh, speculative=_speculation(args))
    scoring = None
    if warm and model.tokenizer is not None:  # echo + logprobs scores prompts (`jaxkv.score`): its programs too
        scoring = _started(warm_up_scoring, model, max_len)
    if warm:
        engine.warm_up()  # compiles every engine program (each decode width) before the first client
    if scoring is not None:
        scoring()
    worker = EngineWorker(engine, max_waiting=args.max_waiting, max_queued=args.max_queued)
    aliases = {args.model} if args.model else set()
    template = ChatTemplate.from_directory(directory)
    state = ServerState(model=model, worker=worker, model_name=args.served_model_name or name, aliases=aliases,
                        max_len=max_len, chat_template=template, api_key=args.api_key,
                        tokenizer_info=read_tokenizer_info(directory, model.tokenizer, config.eos_ids, template),
                        sampling_defaults=_sampling_defaults(args, model))
    return state, engine


def _sampling_defaults(args, model) -> dict | None:
    """The request fields the checkpoint's generation_config.json sets (`--generation-config auto`), as a request
    would send them (None: none, or `ignore`)."""
    if args.generation_config != "auto" or model.sampling_defaults is None:
        return None
    from jaxkv.server import protocol

    out = model.sampling_defaults.arguments()
    try:  # the defaults fill a request's unset fields, so they are held to the request ranges: checked once, here
        protocol.completion_request({"model": "m", "prompt": "x", **out})
    except protocol.ApiError as e:
        raise ValueError(f"the checkpoint's generation_config.json sets a value requests cannot carry: {e.message} "
                         "(serve with --generation-config ignore, or fix the file)") from None
    return out


def _speculation(args):
    """The `jaxkv.Speculation` of --speculative-method (a draft model loaded as --model is, with --dtype) or None."""
    import jaxkv

    if args.speculative_method is None:
        return None
    draft = None if args.draft_model is None else jaxkv.load(args.draft_model, dtype=args.dtype)
    return jaxkv.Speculation(args.speculative_method, args.num_speculative_tokens, draft=draft)


def _model(args):
    """The model to serve -> (model, its checkpoint directory or None, its default served name): --preset's random
    weights, else --model's checkpoint (tiny by default)."""
    import jaxkv
    from jaxkv import checkpoint

    if args.preset is not None:
        from jaxkv.config import PRESETS

        config = PRESETS[args.preset]
        if args.dtype is not None:
            import dataclasses

            config = dataclasses.replace(config, dtype=args.dtype)
        from jaxkv.model import quantize_weights

        return quantize_weights(jaxkv.Model.random(config), weights_of(args)), None, args.preset
    source = args.model or "tiny"
    model = jaxkv.load(source, dtype=args.dtype, weights=weights_of(args))
    directory = checkpoint.TINY_DIR if source == "tiny" else source
    return model, directory, "tiny" if source == "tiny" else os.path.basename(os.path.normpath(source))


def _mesh(args, config):
    """A ("data", "model") mesh of --data-parallel-size x --tensor-parallel-size over the first devices, or None
    for 1 x 1. A data axis above 1: one engine per data shard (`jaxkv.engine.data_parallel`)."""
    dp, tp = args.data_parallel_size, args.tensor_parallel_size
    if dp * tp <= 1:
        return None
    import jax
    import numpy as np

    from jaxkv import sharding

    if jax.device_count() < dp * tp:
        raise ValueError(f"--data-parallel-size {dp} x --tensor-parallel-size {tp} needs {dp * tp} devices; "
                         f"there are {jax.device_count()}")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:dp * tp]).reshape(dp, tp), ("data", "model"))
    sharding.check_config(config, mesh)  # heads and FFN widths must divide over tp: a clear error, before compute
    return mesh


def _started(fn, *args):
    """fn(*args) started on a thread -> a function that waits for it to end and re-raises what it raised."""
    import threading

    out = {}

    def run():
        try:
            fn(*args)
        except BaseException as e:  # re-raised by the waiter, on the main thread
            out["error"] = e

    thread = threading.Thread(target=run, name=f"jaxkv-{fn.__name__}", daemon=True)
    thread.start()

    def wait():
        thread.join()
        if "error" in out:
            raise out["error"]

    return wait


def _server(app, args, worker):
    import asyncio
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with signal handling that exits 0 after a graceful stop (uvicorn re-raises the
        signal once it has stopped, which makes the exit status that of a killed process), and a shutdown that
        ends what is still running at --shutdown-timeout by cancelling its sequences (each response then ends
        itself: last chunks, [DONE]) rather than uvicorn's cancelling of the tasks, which cuts each open stream
        mid-body; uvicorn's cut stays, CANCEL_GRACE seconds later, for a client that does not read."""

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()  # stopped cleanly: nothing to re-raise

        async def shutdown(self, sockets=None):
            timer = asyncio.get_running_loop().call_later(args.shutdown_timeout, worker.stop)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    config = uvicorn.Config(app, log_level=args.log_level, lifespan="on",
                            timeout_graceful_shutdown=args.shutdown_timeout + CANCEL_GRACE,
                            access_log=args.log_level in ("info", "debug"))
    return Server(config)


def main(argv=None) -> int:
    started = time.perf_counter()
    try:
        args = parser().parse_args(argv)
        check(args)
        sock = _listen(args.host, args.port)
    except ValueError as e:
        print(f"jaxkv serve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        state, engine = build(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"jaxkv serve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    import contextlib

    from jaxkv.server.app import create_app

    host, port = sock.getsockname()[:2]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.worker.start()
        template = "chat template" if state.chat_template is not None else "no chat template"
        split = "" if engine.mesh is None else f"; split over {engine.mesh.devices.size} devices"
        print(f"jaxkv serve: {state.model_name} ({template}; {engine.slots} slots, max_len {state.max_len}, "
              f"{engine.num_pages} pages of {engine.page_size}{split}) ready in "
              f"{time.perf_counter() - started:.1f} s; listening on http://{host}:{port}", flush=True)
        try:
            yield
        finally:
            state.worker.close()
            print("jaxkv serve: stopped", flush=True)

    server = _server(create_app(state, lifespan), args, state.worker)
    server.run(sockets=[sock])
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
