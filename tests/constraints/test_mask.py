"""The device-side mask (`jaxkv.constraints.mask`) against numpy's unpacking of the same words, and a
hand-computed case."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.constraints import mask


def numpy_unpack(bits, vocab_size):
    """bool[B, V]: token i allowed where bit i % 32 of word i // 32 is set (little-endian bytes, LSB first)."""
    return np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size] == 1


def test_unpack_hand_computed():
    # word 0 = 0b101 allows tokens 0 and 2; word 1 = -2**31 (only bit 31) allows token 32 + 31 = 63.
    bits = np.array([[0b101, -(2**31)]], np.int32)
    assert np.flatnonzero(np.asarray(mask.unpack(jnp.asarray(bits), 64))[0]).tolist() == [0, 2, 63]


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 257])
def test_unpack_and_apply_match_numpy(vocab_size):
    rng = np.random.default_rng(vocab_size)
    words = mask.words(vocab_size)
    bits = rng.integers(-(2**31), 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    bits[1] = -1  # an unconstrained row: every token allowed
    want = numpy_unpack(bits, vocab_size)
    assert want[1].all()
    np.testing.assert_array_equal(np.asarray(mask.unpack(jnp.asarray(bits), vocab_size)), want)
    logits = rng.normal(size=(3, vocab_size)).astype(np.float32)
    got = np.asarray(mask.apply(jnp.asarray(logits), jnp.asarray(bits)))
    np.testing.assert_array_equal(got, np.where(want, logits, -np.inf))


def test_one_thread_fills_the_masks_the_pool_fills(monkeypatch):
    """`Rows` fills a step's masks with a plain loop when it has one thread (`matcher.threads`) and through
    llguidance's pool otherwise: the same masks, step after step, for rows in different states (unconstrained,
    two constraints, one row ended early)."""
    pytest.importorskip("llguidance")
    import jaxkv
    from jaxkv.constraints import matcher

    model = jaxkv.load("tiny")
    V, eos = model.config.vocab_size, model.config.eos_ids
    lltok = matcher.lltokenizer(model.tokenizer, V, eos)
    made = [jaxkv.JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
            None, jaxkv.Regex("[a-c]+x"), jaxkv.Regex("[a-c]+x")]
    steps = [[ord(c) for c in t] for t in ('{"a', 'zzzz', 'abcx', 'ab')]  # the bundled tokenizer: byte ids
    masks = {}
    for n in (1, 2):
        monkeypatch.setattr(matcher, "threads", lambda n=n: n)
        rows = matcher.Rows([None if c is None else matcher.compiled(c, lltok) for c in made], rows=4,
                            vocab_size=V, stop_ids=np.array(eos), eos_ids=eos)
        seen = [rows.first()]
        for i in range(4):
            tokens = np.array([s[i] if i < len(s) else 0 for s in steps], np.int32)
            emitted = np.array([True, True, True, i < 2])
            seen.append(rows.advance(tokens, emitted)[0])
        masks[n] = np.stack(seen)
    assert (masks[1] != -1).any()  # constrained rows were masked
    np.testing.assert_array_equal(masks[1], masks[2])
