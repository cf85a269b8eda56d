"""`jaxkv memory`: a model's KV-cache bytes per token and per sequence for each cache dtype, what `generate`
allocates, what prefix sharing saves, and how many sequences fit beside the weights, as a table, --json or a
--plot; read from a checkpoint's config (never its weights), a config.json, or a shape given by hand.

JAX-free: `jaxkv.memory` does the arithmetic, and the configs are read without touching a weight.
"""

from __future__ import annotations

import json
import pathlib

from jaxkv.cache import planner as memory
from jaxkv.checks import WEIGHT_MODES
from jaxkv.cli.arguments import non_negative_float, positive_float, positive_int
from jaxkv.config import DTYPES, Config


def add_parser(commands):
    """The `memory` subcommand and its flags, on the top-level parser's subparsers."""
    mem = commands.add_parser("memory", help="KV-cache bytes of a model, and how many sequences fit in memory")
    source = mem.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="PATH",
                        help="checkpoint directory (Hugging Face or jaxkv) or 'tiny'; only its config is read, never "
                             "the weights (default: 'tiny', as jaxkv generate, unless --config or --layers ... "
                             "describe the model)")
    source.add_argument("--config", metavar="FILE", help="a Hugging Face config.json (or a jaxkv_config.json) file")
    mem.add_argument("--layers", metavar="L", type=positive_int, help="describe the model by hand: L layers ...")
    mem.add_argument("--kv-heads", metavar="K", type=positive_int, help="... K key/value heads ...")
    mem.add_argument("--head-dim", metavar="H", type=positive_int, help="... of H dims each")
    mem.add_argument("--dtype", choices=DTYPES, default=None,
                     help="model dtype (weights; the cache dtype the model uses by default); default: the config's, "
                          "float16 with --layers")
    mem.add_argument("--window", metavar="W", type=positive_int, default=None,
                     help="sliding window W: the cache keeps at most W tokens (default: the config's, if any)")
    mem.add_argument("--tokens", metavar="N", type=positive_int, default=2048,
                     help="tokens per sequence (default 2048)")
    mem.add_argument("--n", metavar="N", type=positive_int, default=None,
                     help="samples per prompt: also print the bytes with prefix sharing (a paged cache: the "
                          "prompt's pages shared by its N samples) and without; --tokens is then the prompt")
    mem.add_argument("--new-tokens", metavar="T", type=positive_int, default=None,
                     help="tokens each sample generates (with --n; default 0 new: the prompt alone)")
    mem.add_argument("--page-size", metavar="P", type=positive_int, default=memory.DEFAULT_PAGE_SIZE,
                     help=f"slots per page of the paged cache (with --n; default {memory.DEFAULT_PAGE_SIZE})")
    mem.add_argument("--batch", metavar="B", type=positive_int, default=1,
                     help="sequences cached together (default 1)")
    mem.add_argument("--cache-dtype", choices=memory.CACHE_DTYPES, default=None,
                     help="one cache dtype (default: a row for each)")
    mem.add_argument("--hbm-gib", metavar="G", type=positive_float, default=None,
                     help="device memory in GiB: also print how many --tokens sequences fit beside the weights")
    mem.add_argument("--weights", choices=WEIGHT_MODES, default=None,
                     help="weight-only quantization (as jaxkv generate/serve --weights; int4 in groups of 64): "
                          "print the weights' bytes in the --dtype float form and quantized, and use the latter "
                          "with --hbm-gib (needs a config: --model or --config)")
    mem.add_argument("--weights-gib", metavar="W", type=non_negative_float, default=None,
                     help="weights' size in GiB (default: parameter count x dtype bytes; needed with --layers)")
    mem.add_argument("--plot", metavar="FILE.png", default=None, help="draw cache size versus tokens to FILE.png")
    mem.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _read_config_file(path: pathlib.Path) -> Config:
    """A jaxkv_config.json (it has a format_version) or a Hugging Face config.json, without touching weights."""
    from jaxkv.checkpoint import config_from_dict
    from jaxkv.checkpoint_hf import config_from_hf

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory (pass it with --model)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if isinstance(data, dict) and "format_version" in data:
        return config_from_dict(data, source=str(path))
    config = config_from_hf(data, source=str(path))
    # config_from_hf says float32 because load_hf takes the dtype from the weights; without reading them, the
    # dtype the checkpoint declares ("torch_dtype", or "dtype" in newer transformers) is the best estimate.
    declared = next((data[f] for f in ("torch_dtype", "dtype") if data.get(f) in DTYPES), None)
    return config if declared is None else config.replace(dtype=declared)


def _model_config(model: str) -> Config:
    from jaxkv.checkpoint import CONFIG_FILE, TINY_DIR
    from jaxkv.checkpoint_hf import CONFIG_FILE as HF_CONFIG_FILE

    directory = TINY_DIR if model == "tiny" else pathlib.Path(model)
    if not directory.exists():
        raise FileNotFoundError(f"{directory}: no such directory (pass a checkpoint directory or 'tiny')")
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory (pass a config.json file with --config)")
    for name in (CONFIG_FILE, HF_CONFIG_FILE):
        if (directory / name).is_file():
            return _read_config_file(directory / name)
    raise FileNotFoundError(f"{directory}: has neither {CONFIG_FILE} (jaxkv) nor {HF_CONFIG_FILE} (Hugging Face)")


def _memory_model(args) -> Config | memory.CacheGeometry:
    """The model to plan for, from --model, --config, or the shape flags, with --dtype and --window applied."""
    shape_flags = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    given = [flag for flag, value in shape_flags.items() if value is not None]
    if args.model is not None or args.config is not None:
        if given:
            raise ValueError(f"{given[0]} describes a model by hand; it cannot be combined with --model or --config")
        config = _model_config(args.model) if args.model is not None else _read_config_file(pathlib.Path(args.config))
        changes = {"dtype": args.dtype, "sliding_window": args.window}
        return config.replace(**{k: v for k, v in changes.items() if v is not None})
    if not given:  # no model named: the bundled one, as `jaxkv generate` takes
        args.model = "tiny"
        return _memory_model(args)
    missing = [flag for flag, value in shape_flags.items() if value is None]
    if missing:
        raise ValueError(f"a model described by hand needs --layers, --kv-heads and --head-dim; missing "
                         f"{', '.join(missing)}")
    return memory.CacheGeometry(args.layers, args.kv_heads, args.head_dim, args.dtype or "float16", args.window)


def run(args) -> dict:
    """The plan for the flags' model -> the result (what --json prints); draws --plot."""
    model = _memory_model(args)
    geometry = memory.CacheGeometry.of(model)
    if args.weights_gib is not None and args.hbm_gib is None:
        raise ValueError("--weights-gib is only used with --hbm-gib")
    if args.weights is not None and not isinstance(model, Config):
        raise ValueError("--weights needs a config to count parameters from (--model or --config)")
    if args.weights is not None and args.weights_gib is not None:
        raise ValueError("--weights counts the quantized weights; --weights-gib gives their size by hand: not both")
    hbm, weights = _device_budget(args, model)
    if args.new_tokens is not None and args.n is None:
        raise ValueError("--new-tokens is only used with --n")
    _check_positions(args, model)
    rows = [_row(args, model, geometry, cache_dtype, hbm, weights)
            for cache_dtype in ([args.cache_dtype] if args.cache_dtype else memory.CACHE_DTYPES)]
    result = {
        "model": args.model or args.config,  # None: described by hand
        "n_layers": geometry.n_layers, "n_kv_heads": geometry.n_kv_heads, "head_dim": geometry.head_dim,
        "mla": None if not isinstance(model, Config) or model.mla is None else {
            "kv_lora_rank": model.mla.kv_lora_rank, "qk_rope_head_dim": model.mla.qk_rope_head_dim,
            "n_heads": model.n_heads, "qk_head_dim": model.mla.qk_head_dim, "v_head_dim": model.mla.v_head_dim,
            # DeepSeek-V3.2: one indexer key per token and layer beside the row
            "index_head_dim": None if model.mla.indexer is None else model.mla.indexer.head_dim},
        "dtype": geometry.dtype, "sliding_window": geometry.sliding_window,
        "linear_layers": None if not isinstance(model, Config) or model.linear_attention is None
        else len(model.linear_layers),
        "state_bytes_per_sequence": geometry.state_bytes,
        # None unless some layer slides (a hybrid model's layer types name no window)
        "local_layers": None if geometry.layer_windows is None or all(w is None for w in geometry.layer_windows)
        else sum(w is not None for w in geometry.layer_windows),
        "param_count": model.param_count() if isinstance(model, Config) else None,
        "tokens": args.tokens, "batch": args.batch, "slots": memory.cache_slots(geometry, args.tokens),
        "padded_batch": memory.next_pow2(args.batch),
        "n": args.n, "new_tokens": args.new_tokens, "page_size": args.page_size if args.n is not None else None,
        "hbm_bytes": hbm, "weights_bytes": weights, "weights_fit": None if hbm is None else weights <= hbm,
        # --weights: the float weights' bytes and the quantized ones' (memory.weight_bytes)
        "weights": args.weights,
        "float_weights_bytes": None if args.weights is None else memory.weight_bytes(model),
        "quantized_weights_bytes": None if args.weights is None else memory.weight_bytes(model, weights=args.weights),
        "rows": rows,
    }
    if args.plot is not None:
        _plot_memory(geometry, [row["cache_dtype"] for row in rows], result, args.plot)
        result["plot"] = args.plot
    return result


def _check_positions(args, model):
    """A model with a config has max positions: sequences past them are what `jaxkv.generate` refuses (ValueError,
    as `plan_cache` says it), so their bytes are refused here too rather than printed as an allocation. A model
    described by hand has no such bound."""
    if not isinstance(model, Config):
        return
    limit = model.max_positions
    if args.tokens > limit:
        raise ValueError(f"--tokens {args.tokens:,} exceeds the model's max positions ({limit:,}): jaxkv generate "
                         f"refuses max_len={args.tokens} for it")
    if args.n is not None and args.tokens + (args.new_tokens or 0) > limit:
        raise ValueError(f"--tokens {args.tokens:,} + --new-tokens {args.new_tokens:,} = "
                         f"{args.tokens + args.new_tokens:,} positions, beyond the model's max positions ({limit:,}): "
                         f"jaxkv generate refuses such a request")


def _device_budget(args, model) -> tuple[int | None, int | None]:
    """--hbm-gib and the weights' bytes beside it (--weights-gib, else counted from the config) -> (memory bytes,
    weights bytes), (None, None) without --hbm-gib."""
    hbm = weights = None
    if args.hbm_gib is not None:
        if args.weights_gib is not None:
            weights = int(args.weights_gib * memory.GIB)
        elif isinstance(model, Config):
            weights = memory.weight_bytes(model, weights=args.weights)
        else:
            raise ValueError("--hbm-gib with --layers/--kv-heads/--head-dim also needs --weights-gib (there is no "
                             "config to count parameters from)")
        hbm = int(args.hbm_gib * memory.GIB)  # exact: a float times a power of two
    return hbm, weights


def _row(args, model, geometry: memory.CacheGeometry, cache_dtype: str, hbm, weights) -> dict:
    """One cache dtype's row of the table: bytes per token, sequence, batch; allocated; and, as the flags ask,
    the per-head K/V a latent cache saves, the full-length bytes rings save, prefix sharing, sequences that fit."""
    total = memory.kv_cache_bytes(geometry, tokens=args.tokens, batch=args.batch, cache_dtype=cache_dtype)
    row = {
        "cache_dtype": cache_dtype,
        "bytes_per_token": memory.kv_bytes_per_token(geometry, cache_dtype),
        "bytes_per_sequence": memory.kv_cache_bytes(geometry, tokens=args.tokens, cache_dtype=cache_dtype),
        "total_bytes": total,
        "total_gib": total / memory.GIB,
        "allocated_bytes": memory.allocated_bytes(geometry, tokens=args.tokens, batch=args.batch,
                                                  cache_dtype=cache_dtype),
        "sequences_fit": None if hbm is None else memory.sequences_that_fit(
            geometry, tokens=args.tokens, memory_bytes=hbm, weights_bytes=weights, cache_dtype=cache_dtype),
    }
    if isinstance(model, Config) and model.mla is not None:
        # What the latent cache saves: full per-head keys and values for the same tokens.
        per_token = memory.expanded_kv_bytes_per_token(model, cache_dtype)
        row["per_head_kv_bytes_per_token"] = per_token
        row["per_head_kv_total_bytes"] = per_token * args.batch * memory.cache_slots(geometry, args.tokens)
    if geometry.layer_windows is not None and any(w is not None for w in geometry.layer_windows):
        # Per-layer rings (local layers) against a cache that keeps every token on every layer.
        row["full_length_bytes"] = memory.full_length_cache_bytes(
            geometry, tokens=args.tokens, batch=args.batch, cache_dtype=cache_dtype)
    if args.n is not None:
        new = args.new_tokens or 1  # 1: the first new token is sampled from the prompt's logits, never stored
        row["shared_bytes"] = memory.shared_cache_bytes(
            geometry, prompt_tokens=args.tokens, new_tokens=new, n=args.n, page_size=args.page_size,
            batch=args.batch, cache_dtype=cache_dtype)
        row["unshared_bytes"] = memory.kv_cache_bytes(
            geometry, tokens=args.tokens + (args.new_tokens or 0), batch=args.batch * args.n,
            cache_dtype=cache_dtype)
    return row


def _plot_memory(geometry: memory.CacheGeometry, cache_dtypes: list[str], result: dict, path: str):
    try:
        from matplotlib.figure import Figure  # not pyplot: no global backend or figure state is touched
    except ImportError:
        raise ValueError("--plot needs matplotlib, which is not installed (pip install matplotlib)") from None
    tokens, batch = result["tokens"], result["batch"]
    xs = sorted({round(tokens ** (i / 199)) for i in range(200)} | {tokens})  # 1..tokens, log-spaced
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    # Dtypes of equal size (bfloat16 and float16; int8 and fp8) draw the same curve: one line, both names.
    same_size: dict[int, list[str]] = {}
    for cache_dtype in cache_dtypes:
        same_size.setdefault(memory.kv_bytes_per_token(geometry, cache_dtype), []).append(cache_dtype)
    for names in same_size.values():
        gib = [memory.kv_cache_bytes(geometry, tokens=t, batch=batch, cache_dtype=names[0]) / memory.GIB for t in xs]
        ax.plot(xs, gib, label=", ".join(names))
    if result["hbm_bytes"] is not None and result["weights_fit"]:
        free = (result["hbm_bytes"] - result["weights_bytes"]) / memory.GIB
        if free > 0:
            ax.axhline(free, color="black", linestyle="--", linewidth=1, label="memory left after weights")
    # Log-log: the dtypes' fixed byte ratios become constant vertical gaps, and a sliding window a flat tail.
    ax.set_xscale("log")
    ax.set_yscale("log")
    window = f", window {geometry.sliding_window}" if geometry.sliding_window else ""
    ax.set(xlabel="tokens per sequence", ylabel=f"KV cache, batch {batch} (GiB)",
           title=f"{geometry.n_layers} layers x {geometry.n_kv_heads} KV heads x {geometry.head_dim} dims{window}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="cache dtype", loc="lower right")
    try:
        fig.savefig(path)
    except (OSError, ValueError) as e:  # a missing directory, an extension matplotlib has no writer for
        raise ValueError(f"--plot {path}: {e}") from None


def _gib(n: int) -> str:
    return f"{n / memory.GIB:,.2f} GiB"


def show(result: dict):
    """The table (and the lines above it that say what it counts)."""
    _print_summary(result)
    _print_table(result)


def _print_summary(result: dict):
    """The lines above the table: the model, the sequences, the memory left for the cache, what the columns mean."""
    window = f", sliding window {result['sliding_window']:,}" if result["sliding_window"] else ""
    local = result["local_layers"]
    if local is not None:
        window = (f" ({local} local layers with a sliding window of {result['sliding_window']:,}, "
                  f"{result['n_layers'] - local} global)") if local else " (every layer global)"
    params = f", {result['param_count']:,} parameters" if result["param_count"] is not None else ""
    name = f"{result['model']}: " if result["model"] is not None else ""
    mla = result["mla"]
    if mla is None:
        print(f"{name}{result['n_layers']} layers x {result['n_kv_heads']} KV heads x "
              f"{result['head_dim']} head dim{window}, {result['dtype']}{params}")
    else:
        print(f"{name}{result['n_layers']} layers, multi-head latent attention: one cached row per token and layer of "
              f"latent {mla['kv_lora_rank']} + rotary key {mla['qk_rope_head_dim']} = {result['head_dim']} values "
              f"(keys only){window}, {result['dtype']}{params}")
        if mla["index_head_dim"] is not None:
            print(f"plus the lightning indexer's key of {mla['index_head_dim']} values per token and layer (DeepSeek "
                  f"Sparse Attention)")
        print(f"per-head K/V: what {mla['n_heads']} heads' full keys ({mla['qk_head_dim']}) and values "
              f"({mla['v_head_dim']}) would take instead")
    if result["linear_layers"]:
        print(f"{result['linear_layers']} of {result['n_layers']} layers are linear attention (Gated DeltaNet): no "
              f"K/V but a fixed state of {result['state_bytes_per_sequence']:,} bytes per sequence (conv windows "
              f"and float32 delta-rule states, never quantized), whatever the length; bytes/token counts the other "
              f"layers' K/V, bytes/sequence and the totals include the state")
    if local:
        print(f"{result['tokens']:,} tokens x batch {result['batch']:,} (per sequence: {result['tokens']:,} cache "
              f"slots on each global layer, {min(result['tokens'], result['sliding_window']):,} in each local "
              f"layer's ring; 'all layers full length': every layer keeping every token)")
    else:
        print(f"{result['tokens']:,} tokens x batch {result['batch']:,} ({result['slots']:,} cache slots per "
              f"sequence)")
    if result.get("weights") is not None:
        fl, qu = result["float_weights_bytes"], result["quantized_weights_bytes"]
        print(f"weights: {fl:,} bytes ({_gib(fl)}) in {result['dtype']}, {qu:,} bytes ({_gib(qu)}) as "
              f"{result['weights']} ({qu / fl:.3f} of it; the scales included, float32)")
    hbm = result["hbm_bytes"]
    if hbm is not None:
        weights = result["weights_bytes"]
        if result["weights_fit"]:
            free = hbm - weights
            print(f"memory {_gib(hbm)} - weights {_gib(weights)} = {_gib(free)} for the cache "
                  f"({hbm:,} - {weights:,} = {free:,} bytes)")
        else:
            print(f"the weights alone ({weights:,} bytes, {_gib(weights)}) do not fit in the memory ({hbm:,} bytes, "
                  f"{_gib(hbm)}): no sequence fits")
    print(f"total: the cache for exactly these sequences; allocated: what jaxkv.generate allocates for them with "
          f"max_len={result['tokens']:,} (batch padded to {result['padded_batch']:,} rows; without max_len the "
          f"capacity is padded to a power of two too: jaxkv.plan_cache)")
    if result["n"] is not None:
        print(f"{result['n']} samples of {result['new_tokens'] or 0:,} new tokens per prompt of {result['tokens']:,}: "
              f"with sharing, the prompt's full pages ({result['page_size']} slots each) are held once and each "
              f"sample holds its own last prompt page and new tokens; without, each sample a private cache")


def _print_table(result: dict):
    """One row per cache dtype, with the columns the flags asked for."""
    mla, local, hbm = result["mla"], result["local_layers"], result["hbm_bytes"]
    headers = ["cache dtype", "bytes/token", "bytes/sequence", "total bytes", "total GiB", "allocated bytes"]
    if result["n"] is not None:
        headers += ["with sharing", "without sharing"]
    if mla is not None:
        headers += ["per-head K/V bytes/token", "per-head K/V total bytes"]
    if local is not None:
        headers.append("all layers full length")
    if hbm is not None:
        headers.append("sequences that fit")
    table = [headers]
    for row in result["rows"]:
        cells = [row["cache_dtype"], f"{row['bytes_per_token']:,}", f"{row['bytes_per_sequence']:,}",
                 f"{row['total_bytes']:,}", f"{row['total_gib']:,.4f}", f"{row['allocated_bytes']:,}"]
        if "shared_bytes" in row:
            cells += [f"{row['shared_bytes']:,}", f"{row['unshared_bytes']:,}"]
        if mla is not None:
            cells += [f"{row['per_head_kv_bytes_per_token']:,}", f"{row['per_head_kv_total_bytes']:,}"]
        if local is not None:
            cells.append(f"{row['full_length_bytes']:,}")
        if hbm is not None:
            cells.append(f"{row['sequences_fit']:,}")
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(headers))]
    print()
    for line in table:  # the dtype column left-aligned, numbers right-aligned
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))
    if "plot" in result:
        print(f"\nplot written to {result['plot']}")

