"""Trains jaxkv's bundled default model, the one `jaxkv.load("tiny")` returns, and saves it into jaxkv/tiny/.

Why a trained model at all: a random model's greedy output is noise, so it can only show that cached decoding
equals recompute. A small model that has actually learned English shows, at a glance, that the whole path
(tokenizer, prefill, KV cache, decode loop, sampling) produces sensible text, and lets examples run with no
download.

What it is:
  * Data: text that ships with every Python: the documentation topics of `pydoc_data.topics` (the text behind
    `help("if")` and friends, ~460 KB of English technical prose). A fixed 5% of the topics, chosen by a seeded
    shuffle of the sorted names, is held out for evaluation (`split_topics`; tests/test_tiny_model.py uses it).
    The text differs a little between Python versions, so the held-out loss is only comparable on one version.
  * Tokenizer: byte level, a `tokenizers.Tokenizer` whose ids 0..255 are the raw bytes (so any UTF-8 text
    round-trips exactly), plus one special end-of-text token, id 256, that separates documents and is the
    config's eos id.
  * Model: a Llama-style decoder (RoPE, RMSNorm, SwiGLU, GQA with 4 query / 2 KV heads), ~3M parameters, float32
    (~12 MB on disk), so it exercises the main path of the library.
  * Training: AdamW with linear warmup and cosine decay, gradient clipping, random fixed-length windows of the
    concatenated training text, a fixed seed. The defaults reproduce the shipped model (held-out loss 1.03
    nats/byte) in about 15 minutes on 2 idle CPU cores, longer on a busy machine.

Run from the repository root (the output directory must not exist or be empty; delete jaxkv/tiny/ to retrain):

    python scripts/train_tiny.py
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxkv

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

EOT = 256  # the end-of-text token: separates documents; generation stops on it
EOT_TEXT = "<|endoftext|>"
VOCAB_SIZE = 257  # 256 bytes + EOT
SPLIT_SEED = 0  # fixed on its own (not --seed): the held-out topics must not move when the training seed does
HELDOUT_FRACTION = 0.05
UNIFORM_BASELINE = math.log(256)  # nats/byte of a model that knows nothing: 5.545

# Llama-style: RoPE, RMSNorm, SwiGLU (ffn ~ 8/3 d, rounded to a multiple of 64), GQA 4 query / 2 KV heads.
# max_positions costs nothing with RoPE; quality beyond the training window (SEQ_LEN) is not trained, though.
CONFIG = jaxkv.Config(vocab_size=VOCAB_SIZE, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=704,
                      max_positions=2048, eos_ids=(EOT,))

# Defaults that reproduce the shipped model.
# On 2 CPU cores compute runs out long before text does, so the steps are small (2,048 bytes) and many: 800 of
# them see the training text ~3.7 times. SEQ_LEN is the context trained (and evaluated) on.
STEPS = 800
SEED = 0
BATCH = 8
SEQ_LEN = 256
PEAK_LR = 3e-3
WARMUP = 60
DEFAULT_OUT = REPO_ROOT / "jaxkv" / "tiny"


# --- tokenizer ------------------------------------------------------------------------------------------------


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character map, the alphabet of the `tokenizers` ByteLevel pre-tokenizer.

    ByteLevel turns each UTF-8 byte into one of these 256 characters; giving character `chars[b]` the id b makes
    the token ids exactly the raw bytes.
    """
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = [], 0
    for b in range(256):
        if b in kept:
            chars.append(chr(b))
        else:  # control bytes, space, and a few others move to unused code points above 255
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def byte_tokenizer():
    """A `tokenizers.Tokenizer`: id b < 256 is byte b, id 256 is the special end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_chars()
    assert set(chars) == set(pre_tokenizers.ByteLevel.alphabet())
    # BPE with no merges: every byte character stays its own token.
    tokenizer = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(chars)}, merges=[]))
    # No regex split: the byte mapping does not care about word boundaries, and no prefix space is invented.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOT_TEXT])
    assert tokenizer.token_to_id(EOT_TEXT) == EOT
    return tokenizer


# --- data -----------------------------------------------------------------------------------------------------


def split_topics(seed: int = SPLIT_SEED) -> tuple[list[str], list[str]]:
    """(training topic names, held-out topic names) of `pydoc_data.topics`, both sorted; deterministic."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    order = np.random.default_rng(seed).permutation(len(names))
    n_held = max(1, math.ceil(HELDOUT_FRACTION * len(names)))
    held = sorted(names[i] for i in order[:n_held])
    train = sorted(names[i] for i in order[n_held:])
    return train, held


def token_stream(tokenizer, names: list[str]) -> np.ndarray:
    """int32 ids of the named topics, each followed by EOT: one long stream to cut windows from."""
    from pydoc_data.topics import topics

    ids = []
    for name in names:
        ids.extend(tokenizer.encode(topics[name]).ids)
        ids.append(EOT)
    return np.asarray(ids, np.int32)


def heldout_stream(tokenizer=None) -> np.ndarray:
    """The held-out topics as one stream: the text training never sees (tests/test_tiny_model.py evaluates it)."""
    return token_stream(tokenizer or byte_tokenizer(), split_topics()[1])


def windows(stream: np.ndarray, length: int, count: int | None = None) -> np.ndarray:
    """int32[n, length + 1]: consecutive non-overlapping windows (inputs are [:, :-1], targets [:, 1:])."""
    n = (len(stream) - 1) // length
    if count is not None:
        n = min(n, count)
    starts = np.arange(n) * length
    return stream[starts[:, None] + np.arange(length + 1)]


def random_windows(stream: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """int32[batch, length + 1] windows at uniformly random offsets: every offset is a training example."""
    starts = rng.integers(0, len(stream) - length, size=batch)
    return stream[starts[:, None] + np.arange(length + 1)]


# --- training -------------------------------------------------------------------------------------------------


def loss_fn(params, tokens, config):
    """Mean next-byte cross-entropy in nats over tokens int32[B, T + 1]."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    logits, _ = jaxkv.Decoder(config).apply({"params": params}, inputs, positions, None)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_optimizer(steps: int, peak_lr: float, warmup: int) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup, steps, end_value=0.1 * peak_lr)
    # Decay matrices only: shrinking the norm scales toward 0 fights the normalisation they exist to undo.
    decay_mask = lambda params: jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(1.0),  # a bad random window early on must not throw the weights far away
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask),
    )


def make_train_step(config, optimizer):
    # The state (params, optimizer moments) is donated: XLA updates it in place instead of keeping two copies.
    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, tokens):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, config)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return train_step


def evaluate(params, config, batches: np.ndarray, batch_size: int = 16) -> float:
    """Mean loss (nats/byte) over windows int32[n, T + 1], every window weighted equally."""
    eval_loss = jax.jit(functools.partial(loss_fn, config=config))
    losses = [float(eval_loss(params, batches[i:i + batch_size])) * len(batches[i:i + batch_size])
              for i in range(0, len(batches), batch_size)]
    return sum(losses) / len(batches)


def train(steps: int, seed: int, tokenizer) -> tuple[jaxkv.Model, dict]:
    train_names, held_names = split_topics()
    train_ids, held_ids = token_stream(tokenizer, train_names), token_stream(tokenizer, held_names)
    print(f"data: {len(train_names)} training topics ({len(train_ids):,} bytes), "
          f"{len(held_names)} held out ({len(held_ids):,} bytes): {', '.join(held_names)}")
    print(f"model: {CONFIG.param_count():,} parameters; {steps} steps of {BATCH} x {SEQ_LEN} bytes "
          f"({steps * BATCH * SEQ_LEN / len(train_ids):.1f} epochs)")

    model = jaxkv.Model.random(CONFIG, seed=seed)
    # Short smoke-test runs (--steps 50) still need some cosine phase after the warmup.
    optimizer = make_optimizer(steps, PEAK_LR, min(WARMUP, max(1, steps // 10)))
    state = (model.params, optimizer.init(model.params))
    train_step = make_train_step(CONFIG, optimizer)
    rng = np.random.default_rng(seed)

    # Wall time depends on what else the machine runs; process CPU time (all threads) shows the work itself.
    start, cpu_start = time.perf_counter(), time.process_time()
    recent = []
    log_every = max(1, min(100, steps // 20))
    for step in range(1, steps + 1):
        state, loss = train_step(state, random_windows(train_ids, rng, BATCH, SEQ_LEN))
        recent.append(loss)
        if step % log_every == 0 or step == steps:
            mean = float(np.mean([float(x) for x in recent]))  # float() waits for the step: honest timing
            recent = []
            elapsed = time.perf_counter() - start
            print(f"step {step:5d}  train loss {mean:.3f}  {step / elapsed:.2f} steps/s  "
                  f"{step * BATCH * SEQ_LEN / elapsed:,.0f} bytes/s  elapsed {elapsed:.0f} s  "
                  f"cpu {time.process_time() - cpu_start:.0f} s", flush=True)
    train_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start

    params = state[0]
    held = evaluate(params, CONFIG, windows(held_ids, SEQ_LEN))
    # The same number of training windows, same cutting: how much of the gap is generalisation.
    trained = evaluate(params, CONFIG, windows(train_ids, SEQ_LEN, count=len(windows(held_ids, SEQ_LEN))))
    stats = {"train_s": train_s, "cpu_s": cpu_s, "train_loss": trained, "heldout_loss": held}
    return jaxkv.Model(CONFIG, params, tokenizer), stats


def greedy_sample(model: jaxkv.Model, prompt: str, new_bytes: int = 200) -> str:
    ids = model.tokenizer.encode(prompt).ids
    out = jaxkv.generate(model, [ids], max_new_tokens=new_bytes).tokens[0]
    return model.tokenizer.decode(ids + out)


def check_round_trip(tokenizer):
    text = "naïve café — 日本 <tab>\t\x00 end"
    ids = tokenizer.encode(text).ids
    assert ids == list(text.encode("utf-8")), "byte ids must be the UTF-8 bytes"
    assert tokenizer.decode(ids) == text, "encode/decode must round-trip"
    assert tokenizer.encode(EOT_TEXT).ids == [EOT]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"init and batch-sampling seed (default {SEED})")
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                        help="output directory; must not exist or be empty (default: jaxkv/tiny in this checkout)")
    args = parser.parse_args(argv)
    # Fail now, not after the training: jaxkv.save refuses a non-empty directory.
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} exists and is not empty; delete it to retrain")

    tokenizer = byte_tokenizer()
    check_round_trip(tokenizer)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {jax.device_count()} device(s)")
    model, stats = train(args.steps, args.seed, tokenizer)
    jaxkv.save(model, args.out)

    print(f"trained in {stats['train_s']:.0f} s ({stats['train_s'] / 60:.1f} min) wall, "
          f"{stats['cpu_s']:.0f} s CPU")
    print(f"loss (nats/byte): train {stats['train_loss']:.3f}  held-out {stats['heldout_loss']:.3f}  "
          f"uniform-byte baseline ln(256) = {UNIFORM_BASELINE:.3f}")
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"saved {args.out} ({size / 1e6:.1f} MB)")
    print(f"greedy sample: {greedy_sample(jaxkv.load(args.out), 'The KV cache')!r}")


if __name__ == "__main__":
    main()
