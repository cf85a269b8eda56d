"""No recompilation per prompt length or per sampling setting."""

import jax
import numpy as np
import pytest

import jaxkv
from helpers.compiles import count_compiles
from helpers.models import model_for


def test_counter_sees_a_compile():
    """The counter itself must work, or the bounds below prove nothing."""
    with count_compiles() as c:
        jax.jit(lambda x: x * 3 + 1)(np.arange(7))
    assert c["n"] >= 1


def test_fifty_prompt_lengths_compile_a_handful_of_times():
    model = model_for("mqa")
    lengths = np.unique(np.linspace(1, 500, 50).astype(int))
    rng = np.random.default_rng(0)
    with count_compiles() as c:
        for n in lengths:
            jaxkv.generate(model, [rng.integers(1, 97, n).tolist()], max_new_tokens=2, stop_tokens=[])
    # Six buckets (16, 32, ..., 512): at most one prefill and one decode-loop shape each, plus one scalar helper.
    assert c["n"] <= 13, c["n"]


def test_sampling_settings_and_seeds_never_recompile():
    model = model_for("mqa")
    prompts = [[1, 2, 3], [4, 5]]
    jaxkv.generate(model, prompts, max_new_tokens=4, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=1)
    with count_compiles() as c:
        for i, (t, k, p, m) in enumerate([(0.0, None, None, None), (1.3, 3, None, None), (0.5, None, 0.5, None),
                                          (2.0, 50, 0.95, 0.1), (1.0, 1, 1.0, 0.0)]):
            jaxkv.generate(model, prompts, max_new_tokens=4, temperature=t, top_k=k, top_p=p, min_p=m, seed=i,
                           stop_tokens=[3, 7, 11])
    assert c["n"] == 0


@pytest.mark.parametrize("n_stop", [0, 1, 5])
def test_stop_token_count_does_not_recompile(n_stop):
    model = model_for("mqa")
    jaxkv.generate(model, [[1, 2]], max_new_tokens=3, stop_tokens=[1])
    with count_compiles() as c:
        jaxkv.generate(model, [[1, 2]], max_new_tokens=3, stop_tokens=list(range(n_stop)))
    assert c["n"] == 0
