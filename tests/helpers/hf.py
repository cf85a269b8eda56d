"""The transformers parity harness: tiny random Hugging Face models (CPU, float32, eager attention, seeded) built,
saved and compared with what jaxkv loads from them, and the prompts every family is compared on.

transformers runs with eos disabled (so it never stops or suppresses a token early); jaxkv runs with stop_tokens=[].
torch and transformers are imported if installed: each test file that needs them still calls pytest.importorskip
for them first, so without them it is skipped, not failed (importing this module alone never skips anything).
"""

import jax
import numpy as np

import jaxkv
from jaxkv.config import MoeConfig

from helpers.tolerances import atol, threshold

try:
    import torch
    import transformers
except ImportError:  # the test files importorskip them before calling anything here
    torch = transformers = None

VOCAB = 160
PAD, EOS, BOS = 0, 1, 2
NEW_TOKENS = 32
BEAM_NEW = 12  # beam search against transformers: new tokens per hypothesis
ATOL = atol("transformers logits")
# A greedy step whose two best logits are closer than this could flip on float noise alone (both implementations
# are right then): `assert_clear_margins` checks reference outputs against it.
MIN_MARGIN = threshold("greedy margin")
TIE_GAP = threshold("moe tie gap")
# Lengths 12 + 32 new tokens, and a ragged batch of three: every sequence outgrows Mistral's window of 8.
SINGLE = [[17, 3, 99, 41, 8, 150, 23, 64, 5, 77, 120, 31]]
RAGGED = [[44, 9, 130, 2, 61], [7, 88, 19, 140, 33, 52, 101, 4, 66, 29, 150, 11, 93],
          [12, 5, 70, 143, 38, 26, 9, 81, 57]]


def greedy_cases(single, ragged):
    """The greedy parity cases: (the prompts transformers runs, the batch jaxkv runs). jaxkv runs the single prompt as
    a batch of 4 copies of it (no row padded) and the ragged prompts as they are (left-padded, in a padded batch of
    4): both cases run one compiled decode loop, each compared with transformers' own run of its prompts."""
    return [(single, single * 4), (ragged, ragged)]


def per_row(expected, batch):
    """transformers' rows, one for each row of `batch` (which repeats its prompts in order)."""
    return [expected[b % len(expected)] for b in range(len(batch))]


LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.25, rms_norm_eps=1e-6,
                  pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)

# DeepSeek's multi-head latent attention, every layer dense (first_k_dense_replace = layers): the DeepSeek parity
# tests and the paged latent attention's beam search against transformers build from it.
MLA_LIKE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=6, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=256, initializer_range=0.1,
                rms_norm_eps=1e-6, first_k_dense_replace=2, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
# DeepSeek-V2/V3 with experts: 3 layers, layer 0 dense, layers 1-2 MoE (DEEPSEEK_MOE_LAYERS). The DeepSeek MoE parity
# tests and the FP8 checkpoint tests build from it.
DEEPSEEK_MOE_LIKE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                         qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, max_position_embeddings=256,
                         initializer_range=0.25, rms_norm_eps=1e-6, first_k_dense_replace=1, pad_token_id=PAD,
                         eos_token_id=EOS, bos_token_id=BOS)
DEEPSEEK_MOE_LAYERS = (1, 2)


def build_hf(config_class: str, kwargs: dict, seed: int = 0):
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**kwargs)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    # generate() fills unset options from the model's own generation config, so eos must be cleared there too:
    # otherwise min_new_tokens suppresses eos (id 1), which these random models do pick as their argmax.
    hf.generation_config.eos_token_id = None
    return hf


def build_deepseek_moe_hf(config_class: str, fields: dict, seed: int = 0):
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**fields)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # never stop early (as build_hf)
    if config_class == "DeepseekV3Config":
        with torch.no_grad():  # transformers initializes it to zero, which would hide a bias left out
            for i in DEEPSEEK_MOE_LAYERS:
                bias = hf.model.layers[i].mlp.gate.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape) * 0.1)
    return hf


def hf_logits(hf, tokens) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(tokens))).logits.numpy()


def hf_greedy(hf, prompts, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy generation of `new_tokens` tokens per prompt, left-padded by hand (no tokenizer)."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p)
        mask[b, T - len(p):] = 1
    # No eos (see build_hf): never stop and never suppress a token (min_new_tokens then has nothing to act on).
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                           eos_token_id=None, bos_token_id=None, pad_token_id=PAD)
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert out.shape == (len(prompts), T + new_tokens)
    return out[:, T:].tolist()


def hf_greedy_cases(hf) -> dict[int, list[list[int]]]:
    """transformers' greedy tokens for SINGLE and for RAGGED (batched), keyed by prompt count (`greedy_cases`)."""
    return {len(prompts): hf_greedy(hf, prompts) for prompts, _ in greedy_cases(SINGLE, RAGGED)}


def saved_and_loaded(build, cases):
    """`loaded(name, tmp_path_factory)` -> (HF model, jaxkv model loaded from its save_pretrained directory, that
    directory) for `build(*cases[name])`, built once per run and process (shared by a test module's tests)."""
    built = {}

    def loaded(name, tmp_path_factory):
        if name not in built:
            hf = build(*cases[name])
            directory = tmp_path_factory.mktemp(name)
            hf.save_pretrained(directory, safe_serialization=True)
            built[name] = hf, jaxkv.load(directory), directory
        return built[name]

    return loaded


def assert_clear_margins(hf, prompts, generated, name, min_margin):
    """Every greedy choice of the reference beats the runner-up by `min_margin` (transformers' own full forward
    over prompt + tokens so far), and the output is varied: token equality is then meaningful, not luck."""
    for p, row in zip(prompts, generated):
        assert len(set(row)) >= 8, f"{name}: HF output too repetitive to test anything: {row}"
        logits = hf_logits(hf, [p + row[:-1]])[0, len(p) - 1:]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        assert (logits.argmax(-1) == row).all()
        margin = (top2[:, 1] - top2[:, 0]).min()
        assert margin > min_margin, f"{name}: a near-tie ({margin:.2e}) in the reference output; change the seed"


def hf_greedy_uncached(hf, prompt, steps):
    """transformers' greedy continuation of one prompt (argmax of the full forward pass, no cache)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(prompt):].tolist()


def hf_beam_search(hf, prompts, stops, *, num_beams, length_penalty, early_stopping, num_return_sequences):
    """transformers' hypotheses per prompt: [(new tokens up to and including a stop token, score or None)]."""
    T = max(map(len, prompts))
    ids = torch.full((len(prompts), T), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding, as transformers wants for decoder-only models
        ids[b, T - len(p):], mask[b, T - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, num_beams=num_beams, do_sample=False,
                          length_penalty=length_penalty, early_stopping=early_stopping,
                          num_return_sequences=num_return_sequences, max_new_tokens=BEAM_NEW, output_scores=True,
                          return_dict_in_generate=True, eos_token_id=stops, pad_token_id=PAD)
    seqs = out.sequences[:, T:].tolist()
    scores = getattr(out, "sequences_scores", None)  # greedy search (one beam) reports none
    result = []
    for i in range(len(prompts)):
        hyps = []
        for j in range(num_return_sequences):
            row = seqs[i * num_return_sequences + j]
            end = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))  # padding follows a stop
            hyps.append((row[:end], None if scores is None else float(scores[i * num_return_sequences + j])))
        result.append(hyps)
    return result


def assert_no_near_ties(logits, moe: MoeConfig, bias):
    """Every token's expert choice is decided by a margin > the MoE tie gap (helpers.tolerances): the weights and
    hidden states are continuous random draws, so two router scores tie with probability zero, and this checks it
    for every token (the gap between the A-th and (A+1)-th choice scores, and between the topk_group-th and next
    group scores), so an expert-id comparison can only fail on a real routing difference. Where a tie did occur,
    jax.lax.top_k would pick the lower expert id and torch.topk makes no promise."""
    X, A, G = moe.n_routed_experts, moe.experts_per_token, moe.n_group
    # topk_softmax / topk_sigmoid rank the logits themselves
    scores = {"softmax": lambda: jax.nn.softmax(logits, -1), "sigmoid": lambda: jax.nn.sigmoid(logits),
              "topk_softmax": lambda: logits, "topk_sigmoid": lambda: logits}[moe.scoring]()
    choice = np.asarray(scores + (0 if bias is None else bias))
    if moe.topk_method != "greedy":
        grouped = np.sort(choice.reshape(len(choice), G, X // G), axis=-1)[..., ::-1]
        group_scores = grouped[..., :2].sum(-1) if moe.topk_method == "noaux_tc" else grouped[..., 0]
        ranked = np.sort(group_scores, axis=-1)[:, ::-1]
        if moe.topk_group < G:
            assert np.min(ranked[:, moe.topk_group - 1] - ranked[:, moe.topk_group]) > TIE_GAP
        # only the chosen groups' experts compete
        keep = group_scores >= ranked[:, moe.topk_group - 1:moe.topk_group]
        choice = np.where(np.repeat(keep, X // G, axis=1), choice, -np.inf)
    ranked = np.sort(choice, axis=-1)[:, ::-1]
    if A < X:
        assert np.min(ranked[:, A - 1] - ranked[:, A]) > TIE_GAP


# --- test bodies several families' files run on their own `pair` fixtures (name, HF model, jaxkv model, dir) ---


def check_logits_match(pair):
    """The whole-sequence logits of a random batch of 2 x 24 tokens equal transformers' (float32)."""
    name, hf, model, _ = pair
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
    np.testing.assert_allclose(jaxkv.logits(model, tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0, err_msg=name)


def check_greedy_generation_is_token_identical(pair):
    """The single prompt and the ragged batch (`greedy_cases`), each against transformers' greedy tokens."""
    name, hf, model, _ = pair
    for prompts, batch in greedy_cases(SINGLE, RAGGED):
        got = jaxkv.generate(model, batch, max_new_tokens=NEW_TOKENS, stop_tokens=[]).tokens
        for b, row in enumerate(per_row(hf_greedy(hf, prompts), batch)):
            # A model stuck on one token would make equality meaningless.
            assert len(set(row)) >= 8, f"{name}: HF output too repetitive to test anything: {row}"
            assert got[b] == row, f"{name}, {len(prompts)} prompt(s), row {b}"


def check_speculative_greedy(model, expected, name="", prompts=RAGGED):
    """The ragged batch (`prompts`) with speculation (issue 29) gives transformers' greedy tokens (`expected`, per row): the
    model drafting for itself (every proposal its own argmax, so nearly every verify keeps all k and emits k + 1
    tokens from the (k + 1)-wide pass's logits at every position), verifying every pass."""
    spec = jaxkv.Speculation("draft", 3, draft=model, adaptive=False)
    got = jaxkv.generate(model, prompts, max_new_tokens=NEW_TOKENS, stop_tokens=[], speculative=spec)
    assert got.tokens == expected, name
    assert got.stats["spec_acceptance_rate"] > 0.8 and got.stats["target_forwards"] < NEW_TOKENS // 2, name


def check_mtp_speculation(model, where, prompts=None, plain=None, decode_widths=None):
    """Speculation("mtp") with the model's MTP module proposing ("contiguous", "paged" or "engine"): greedy tokens
    equal plain decoding's, with verifies run. `prompts` (default: two of the ragged prompts) and `plain`: their
    16 plain greedy tokens where the caller has them already (transformers'); by default a plain jaxkv run.
    `decode_widths`: the engine's (default: its own, 1 and 2); [2] compiles one speculative decode dispatch
    instead of two (tests/engine cover the widths)."""
    prompts = [RAGGED[0], RAGGED[2]] if prompts is None else prompts
    if plain is None:
        plain = jaxkv.generate(model, prompts, max_new_tokens=16, stop_tokens=[]).tokens
    spec = jaxkv.Speculation("mtp", num_tokens=2, adaptive=False)
    if where == "engine":
        engine = jaxkv.Engine(model, slots=2, max_len=64, page_size=4, speculative=spec, decode_widths=decode_widths)
        tokens = [r.tokens for r in engine.generate(prompts, max_new_tokens=16, stop_tokens=[])]
        verifies = engine.stats["spec_verifies"]
    else:
        out = jaxkv.generate(model, prompts, max_new_tokens=16, stop_tokens=[], speculative=spec,
                             page_size=4 if where == "paged" else None)
        tokens, verifies = out.tokens, out.stats["spec_verifies"]
    assert verifies > 0 and tokens == plain


# --- the parity checks every MoE family's test runs (Qwen3-MoE, Mixtral): each test file keeps thin tests of these
# names, so a family's parity reads in its own file and the bodies are written once.


def check_moe_greedy_generation(model, greedy):
    """The single prompt and the ragged batch (`greedy_cases`), each against transformers' greedy tokens."""
    for prompts, batch in greedy_cases(SINGLE, RAGGED):
        got = jaxkv.generate(model, batch, max_new_tokens=NEW_TOKENS, stop_tokens=[]).tokens
        for b, row in enumerate(per_row(greedy[len(prompts)], batch)):
            assert len(set(row)) >= 8, f"HF output too repetitive to test anything: {row}"
            assert got[b] == row, f"{len(prompts)} prompt(s), row {b}"


def check_moe_parallel_greedy_samples(model, greedy):
    """n=2 samples of each ragged prompt (prefilled once, forked; page size 5 divides no prompt length): each is
    transformers' greedy continuation."""
    expected = greedy[len(RAGGED)]
    got = jaxkv.generate(model, RAGGED, max_new_tokens=NEW_TOKENS, stop_tokens=[], n=2, page_size=5).tokens
    assert got == [row for row in expected for _ in range(2)]


def check_moe_engine(model, greedy, decode_widths=None):
    """The engine's requests (2 slots for 3 prompts, prefill chunks of 8), greedy: transformers' tokens.
    `decode_widths`: the engine's (default: its own, 1 and 2); [2] compiles one decode dispatch instead of two (the
    last request then decodes beside an idle slot)."""
    engine = jaxkv.Engine(model, slots=2, max_len=64, page_size=8, prefill_chunk=8, decode_widths=decode_widths)
    results = engine.generate(RAGGED, max_new_tokens=NEW_TOKENS, stop_tokens=[])
    assert [r.tokens for r in results] == greedy[len(RAGGED)]


def check_moe_beam_search(hf, model, greedy):
    """Three beams, three hypotheses, stop ids reached at different steps: transformers' tokens and scores."""
    check_beam_search(hf, model, SINGLE + RAGGED, sorted({greedy[1][0][3], greedy[len(RAGGED)][0][6]}))


def check_beam_search(hf, model, prompts, stops, num_pages=None):
    """Three beams and three hypotheses per prompt, ending at `stops`: transformers' tokens and scores (1e-4).
    `num_pages`: the page pool (default the plan's, which depends on the prompt lengths): one pool size for calls
    with prompts of different lengths compiles the search once."""
    want = hf_beam_search(hf, prompts, stops, num_beams=3, length_penalty=1.0, early_stopping=True,
                          num_return_sequences=3)
    got = jaxkv.beam_search(model, prompts, num_beams=3, max_new_tokens=BEAM_NEW, length_penalty=1.0,
                            early_stopping=True, num_return_sequences=3, stop_tokens=stops, num_pages=num_pages)
    assert got.tokens == [[tokens for tokens, _ in hyps] for hyps in want]
    for hyps, want_hyps in zip(got, want):
        for h, (_, score) in zip(hyps, want_hyps):
            assert abs(h.score - score) < 1e-4


def check_moe_routing(hf, model, moe_layers, router=lambda layer: layer.mlp.gate,
                      routed=lambda out: (out[0], out[2])):
    """Every token is routed to the same experts as transformers' router picks, with no near tie between the A-th
    and (A+1)-th choice. `router(decoder layer)` is the router module (default a `*TopKRouter` at mlp.gate);
    `routed(its output)` -> (logits, expert ids) (default: the (logits, weights, ids) such a router returns)."""
    import torch

    from jaxkv.model import Decoder

    tokens = np.array(SINGLE + [list(reversed(SINGLE[0]))])  # [2, 12]
    captured, hooks = {}, []
    for i in moe_layers:
        def hook(module, args, out, i=i):
            captured[i] = tuple(np.asarray(x.detach().numpy()) for x in routed(out))
        hooks.append(router(hf.model.layers[i]).register_forward_hook(hook))
    try:
        with torch.no_grad():
            hf(torch.tensor(tokens))
    finally:
        for h in hooks:
            h.remove()
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    forward = jax.jit(lambda params, t, p: Decoder(model.config).apply({"params": params}, t, p, None,
                                                                       mutable=["intermediates"]))
    _, state = forward(model.params, tokens.astype(np.int32), positions)
    A = model.config.moe.experts_per_token
    for i in moe_layers:
        logits, ids = captured[i]
        assert_no_near_ties(logits, model.config.moe, None)
        ours = np.asarray(state["intermediates"][f"layer_{i}"]["mlp"]["expert_ids"][0]).reshape(-1, A)
        # transformers' order within a token is unspecified: compare as sets
        np.testing.assert_array_equal(np.sort(ours, -1), np.sort(ids, -1), err_msg=f"layer {i}")
        assert len({tuple(sorted(row)) for row in ours}) > 2  # different tokens pick different experts


def check_moe_path(path, hf, model, greedy, name, routing, beams=None, decode_widths=None):
    """One of the decoding paths every MoE family's test checks against transformers ("greedy", "n=2", "engine",
    "beams", "routing", "speculative"); `routing` runs the family's routing check, `beams` replaces the default
    beam check, `decode_widths` goes to the engine (`check_moe_engine`)."""
    {"greedy": lambda: check_moe_greedy_generation(model, greedy),
     "n=2": lambda: check_moe_parallel_greedy_samples(model, greedy),
     "engine": lambda: check_moe_engine(model, greedy, decode_widths),
     "beams": beams or (lambda: check_moe_beam_search(hf, model, greedy)),
     "routing": routing,
     "speculative": lambda: check_speculative_greedy(model, greedy[len(RAGGED)], name)}[path]()
