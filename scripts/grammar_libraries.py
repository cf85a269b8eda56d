"""Compare the grammar libraries for jaxkv's constrained decoding: llguidance, xgrammar, outlines-core (issue 30).

Not part of jaxkv and never imported by the test suite. It assumes the three libraries are installed, in a venv
of their own (xgrammar pulls torch and transformers, which jaxkv's install must not):

    python -m venv /work/venv-grammar && . /work/venv-grammar/bin/activate
    pip install llguidance xgrammar outlines-core tokenizers numpy jsonschema
    python scripts/grammar_libraries.py                 # all three vocabularies, all three libraries
    python scripts/grammar_libraries.py --vocab tiny --libs llguidance --repeats 2   # a quick look

Tokenizers: the bundled model's jaxkv/tiny/tokenizer.json (257 tokens: the 256 bytes and <|endoftext|>), and two
byte-level BPE tokenizers trained here with the `tokenizers` library to 32,000 and 150,000 tokens (one special
token, <|endoftext|>, the eos) on the UTF-8 .py/.txt/.rst files of this Python's standard library plus numpy's
.py/.pyi sources (the standard library alone stops at about 141k merges). They are cached in --cache
(default /tmp/jaxkv-grammar-tokenizers) and reused.

Each (library, vocabulary) pair runs in a fresh subprocess (so xgrammar's torch import and one library's caches
touch no other), single-threaded where the library has a knob (xgrammar's compiler max_threads=1,
RAYON_NUM_THREADS=1, OMP_NUM_THREADS=1). What it prints:

1. import: seconds to import the library (and whether that imported torch); setup: seconds to build the library's vocabulary object from a `tokenizers.Tokenizer`;
2. compile: seconds to compile three grammars: a nested JSON schema (objects, arrays with minItems/maxItems,
   enums, numbers, strings with pattern, optional and required fields), a regex, a choice of five strings;
3. mask: per token of a valid output (the schema's instance in compact JSON, the regex's and choice's strings,
   tokenized with the tokenizer, then eos), walked --repeats times with a fresh matcher from the compiled grammar:
   the time to fill the packed int32 bitmask [1, ceil(V / 32)] in place (median, p99, max, in microseconds, over
   all steps of all walks; "first" is the first step of the first walk) and the time to advance the state; it also
   checks that the next token is always allowed and eos is allowed at the end, and counts the allowed tokens;
4. coverage (tiny vocabulary): per JSON-schema feature, a valid and an invalid instance (the `jsonschema` package
   checks both first): "enforced" (valid accepted, invalid refused), "ignored" (both accepted), "WRONG" (valid
   refused), or "error: ..." (the compile refused it, with the start of its message);
5. whitespace: which of compact / one-space / two-space / indented / 50-space JSON each library accepts with its
   default options, its compact option and its at-most-one-space option;
6. formats: whether regex, choice, Lark and GBNF/EBNF grammars compile.

--json PATH also writes every figure (and each step's allowed-token count) as JSON.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import time

LIBS = ("llguidance", "xgrammar", "outlines-core")
EOS = "<|endoftext|>"
HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "..", "jaxkv", "tiny", "tokenizer.json")

# -- the grammars and their valid outputs --------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z0-9._]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"],
                    "additionalProperties": False,
                },
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "history": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                    "action": {"enum": ["login", "logout", "purchase"]},
                    "amount": {"type": "number"},
                },
                "required": ["date", "action"],
                "additionalProperties": False,
            },
            "minItems": 0,
            "maxItems": 3,
        },
        "active": {"type": "boolean"},
        "nickname": {"type": ["string", "null"]},
    },
    "required": ["id", "name", "role", "tags", "address"],
    "additionalProperties": False,
}
INSTANCE = {
    "id": 1234,
    "name": "Ada Lovelace",
    "email": "ada@example.org",
    "role": "admin",
    "score": 97.5,
    "tags": ["math", "engines"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001",
                "geo": {"lat": 51.5074, "lon": -0.1278}},
    "history": [{"date": "1843-07-10", "action": "purchase", "amount": 12.5},
                {"date": "1843-09-01", "action": "login"}],
    "active": True,
    "nickname": None,
}
REGEX = r"\+?[0-9]{1,3} \(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?"
REGEX_TEXT = "+1 (555) 123-4567 ext. 89"
CHOICES = ["positive", "negative", "neutral", "mixed feelings", "not applicable"]
CHOICE_TEXT = "mixed feelings"
LARK = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/\n'
GBNF = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"\n'


def compact(x) -> str:
    return json.dumps(x, separators=(",", ":"))


# JSON-schema features: (name, schema, valid instance, invalid instance: invalid only through the feature)
_P = "properties"
FEATURES = [
    ("nested objects", {"type": "object", _P: {"a": {"type": "object", _P: {"b": {"type": "integer"}},
                                                      "required": ["b"]}}, "required": ["a"]},
     {"a": {"b": 1}}, {"a": {"b": "x"}}),
    ("required", {"type": "object", _P: {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
     {"a": 1, "b": 2}, {"a": 1}),
    ("optional omitted", {"type": "object", _P: {"a": {"type": "integer"}, "b": {"type": "integer"}},
                          "required": ["a"], "additionalProperties": False},
     {"a": 1}, {"b": 2}),
    ("additionalProperties false", {"type": "object", _P: {"a": {"type": "integer"}}, "required": ["a"],
                                    "additionalProperties": False},
     {"a": 1}, {"a": 1, "z": 2}),
    ("additionalProperties schema", {"type": "object", "additionalProperties": {"type": "integer"}},
     {"x": 1, "y": 2}, {"x": "s"}),
    ("enum", {"enum": ["red", "green", 3]}, "green", "blue"),
    ("const", {"const": "fixed"}, "fixed", "other"),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "s"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, "s", None),
    ("allOf", {"allOf": [{"type": "object", _P: {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", _P: {"a": {"type": "integer", "minimum": 0}}}]},
     {"a": 1}, {"a": "x"}),
    ("$ref/$defs", {"$defs": {"pt": {"type": "object", _P: {"x": {"type": "integer"}}, "required": ["x"],
                                     "additionalProperties": False}},
                    "type": "array", "items": {"$ref": "#/$defs/pt"}},
     [{"x": 1}], [{"y": 1}]),
    ("recursive $ref", {"$defs": {"node": {"type": "object", _P: {"v": {"type": "integer"},
                                                                   "kids": {"type": "array",
                                                                            "items": {"$ref": "#/$defs/node"}}},
                                           "required": ["v"], "additionalProperties": False}},
                        "$ref": "#/$defs/node"},
     {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}, {"v": 1, "kids": [{"w": 2}]}),
    ("type list [string, null]", {"type": ["string", "null"]}, None, 1),
    ("pattern", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "ABC-12", "abc-12"),
    ("format date", {"type": "string", "format": "date"}, "2024-02-29", "yesterday"),
    ("format email", {"type": "string", "format": "email"}, "a.b@example.com", "not an email"),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcdef"),
    ("minimum/maximum (integer)", {"type": "integer", "minimum": 10, "maximum": 99}, 42, 123),
    ("exclusiveMinimum (number)", {"type": "number", "exclusiveMinimum": 0}, 0.5, -1.5),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, 15, 7),
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
     [1, 2], [1, 2, 3]),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
     ["a", 1], [1, "a"]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    ("minProperties/maxProperties", {"type": "object", "additionalProperties": {"type": "integer"},
                                     "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2}),
    ("if/then/else", {"type": "object", _P: {"k": {"type": "string"}, "v": {}}, "required": ["k", "v"],
                      "if": {_P: {"k": {"const": "n"}}}, "then": {_P: {"v": {"type": "integer"}}},
                      "else": {_P: {"v": {"type": "string"}}}},
     {"k": "n", "v": 1}, {"k": "n", "v": "x"}),
    ("not", {"not": {"type": "string"}}, 1, "s"),
]
BAD_INPUTS = [  # each must be refused at compile time, with a message
    ("schema: unknown type", "json", {"type": "integr"}),
    ("regex: unbalanced (", "regex", "(ab"),
]

WS_SCHEMA = {"type": "object", _P: {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}},
             "required": ["a", "b"], "additionalProperties": False}
WS_VALUE = {"a": 1, "b": [1, 2]}
WS_TEXTS = {
    "compact": compact(WS_VALUE),
    "one space": json.dumps(WS_VALUE),
    "two spaces": '{"a":  1,"b":[1,2]}',
    "indent=2": json.dumps(WS_VALUE, indent=2),
    "50 spaces": "{" + " " * 50 + compact(WS_VALUE)[1:],
}

# -- tokenizers ------------------------------------------------------------------------------------------------------


def corpus_files() -> list[str]:
    import sysconfig

    import numpy

    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(f for ext in ("py", "txt", "rst") for f in glob.glob(f"{stdlib}/**/*.{ext}", recursive=True)
                   if "site-packages" not in f and os.path.isfile(f))
    np_dir = os.path.dirname(numpy.__file__)
    files += sorted(f for ext in ("py", "pyi") for f in glob.glob(f"{np_dir}/**/*.{ext}", recursive=True)
                    if os.path.isfile(f))
    return files


def train_tokenizer(vocab_size: int, path: str) -> str:
    """A byte-level BPE tokenizer of vocab_size tokens; <|endoftext|> (special, the eos) is id 0."""
    if os.path.exists(path):
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        for f in corpus_files():
            try:
                with open(f, encoding="utf-8") as fh:
                    yield fh.read()
            except (UnicodeDecodeError, OSError):
                pass

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=0)
    t0 = time.perf_counter()
    tok.train_from_iterator(texts(), trainer)
    print(f"# trained {path}: {tok.get_vocab_size()} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tok.save(path)
    return path


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level vocabulary shows -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tok) -> tuple[list[bytes | None], int]:
    """Each id's bytes (None for special tokens) and the eos id, from a byte-level `tokenizers.Tokenizer`."""
    dec = byte_decoder()
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    vocab = tok.get_vocab(with_added_tokens=True)
    out: list[bytes | None] = [None] * (max(vocab.values()) + 1)
    for s, i in vocab.items():
        out[i] = None if s in special else bytes(dec[c] for c in s)
    return out, vocab[EOS]


# -- one library -----------------------------------------------------------------------------------------------------


class Adapter:
    """compile(kind, spec, ws) -> compiled; matcher(compiled) -> m; fill(m, mask); advance(m, t) -> bool;
    accepts(compiled, ids) -> bool (all consumed and the grammar can end there)."""


class LLGuidance(Adapter):
    def __init__(self, tok, eos):
        import llguidance
        import llguidance.numpy  # noqa: F401

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tok.to_str(), eos_token=eos)

    WS = {"default": {}, "compact": {"whitespace_flexible": False},
          "one space": {"whitespace_flexible": False, "whitespace_pattern": "[ ]?"}}

    def compile(self, kind, spec, ws="compact"):
        M = self.llg.LLMatcher
        if kind == "json":
            g = M.grammar_from_json_schema(spec, defaults=self.WS[ws])
        elif kind == "regex":
            g = M.grammar_from_regex(spec)
        elif kind == "choice":
            g = self.llg.grammar_from("choice", spec)
        elif kind == "lark":
            g = M.grammar_from_lark(spec)
        elif kind == "gbnf":
            g = self.llg.grammar_from("gbnf", spec)
        m = M(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, mask):
        self.llg.numpy.fill_next_token_bitmask(m, mask, 0)

    def advance(self, m, t):
        return m.consume_token(t)

    def accepts(self, compiled, ids):
        m = compiled.deep_copy()
        return all(m.consume_token(t) for t in ids) and m.is_accepting()


class XGrammar(Adapter):
    def __init__(self, tok, eos):
        import xgrammar as xgr

        self.xgr = xgr
        tb, self.eos = token_bytes(tok)
        # special tokens as empty strings: xgrammar then treats them as special (never inside the grammar's text)
        info = xgr.TokenizerInfo([b if b is not None else b"" for b in tb], xgr.VocabType.RAW,
                                 vocab_size=len(tb), stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    WS = {"default": {}, "compact": {"any_whitespace": False, "separators": (",", ":")},
          "one space": {"any_whitespace": True, "max_whitespace_cnt": 1}}

    def compile(self, kind, spec, ws="compact"):
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(json.dumps(spec), **self.WS[ws])
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        if kind == "lark":
            return c.compile_lark(spec)
        if kind == "gbnf":
            return c.compile_grammar(spec)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, mask):
        m.fill_next_token_bitmask(mask, 0)

    def advance(self, m, t):
        return m.accept_token(t)

    def accepts(self, compiled, ids):
        m = self.xgr.GrammarMatcher(compiled)
        return all(m.accept_token(t) for t in ids) and m.is_completed()


class OutlinesCore(Adapter):
    def __init__(self, tok, eos):
        import re

        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.re, self.build = oc, re, build_regex_from_schema
        tb, _ = token_bytes(tok)
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(tb):
            if b is not None:
                by_bytes.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(eos, by_bytes)

    WS = {"default": None, "compact": "", "one space": "[ ]?"}

    def compile(self, kind, spec, ws="compact"):
        if kind == "json":
            regex = self.build(json.dumps(spec), self.WS[ws])
        elif kind == "regex":
            regex = spec
        elif kind == "choice":
            regex = "|".join(self.re.escape(s) for s in spec)
        else:
            raise ValueError(f"outlines-core takes regular languages only: no {kind} grammar")
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled, max_rollback=32)

    def fill(self, m, mask):
        m.write_mask_into(mask.ctypes.data, mask.size, 4)

    def advance(self, m, t):
        try:
            m.advance(t, return_tokens=False)
            return True
        except Exception:
            return False

    def accepts(self, compiled, ids):
        g = self.oc.Guide(compiled, max_rollback=32)
        for t in ids:
            if t not in g.get_tokens():
                return False
            g.advance(t, return_tokens=False)
        return g.is_finished()


ADAPTERS = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


def short(e: BaseException) -> str:
    s = " ".join(f"{type(e).__name__}: {e}".split())
    return s[:110] + ("..." if len(s) > 110 else "")


def pct(xs, q):
    import numpy as np

    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def worker(lib: str, tok_path: str, repeats: int, coverage: bool) -> dict:
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    V = tok.get_vocab_size(with_added_tokens=True)
    eos = tok.token_to_id(EOS)
    out: dict = {"lib": lib, "vocab": V}
    t0 = time.perf_counter()
    __import__({"outlines-core": "outlines_core"}.get(lib, lib))
    out["import_s"] = time.perf_counter() - t0
    out["imports_torch"] = "torch" in sys.modules
    t0 = time.perf_counter()
    a = ADAPTERS[lib](tok, eos)
    out["setup_s"] = time.perf_counter() - t0

    cases = [("json", SCHEMA, compact(INSTANCE)), ("regex", REGEX, REGEX_TEXT), ("choice", CHOICES, CHOICE_TEXT)]
    out["grammars"] = {}
    for kind, spec, text in cases:
        r: dict = {}
        out["grammars"][kind] = r
        t0 = time.perf_counter()
        try:
            compiled = a.compile(kind, spec)
        except Exception as e:
            r["error"] = short(e)
            continue
        r["compile_s"] = time.perf_counter() - t0
        ids = tok.encode(text, add_special_tokens=False).ids + [eos]
        r["tokens"] = len(ids)
        mask = np.zeros((1, (V + 31) // 32), dtype=np.int32)
        fill_us, adv_us, bad, allowed = [], [], [], []
        for rep in range(repeats):
            m = a.matcher(compiled)
            for step, t in enumerate(ids):
                mask[:] = 0
                t1 = time.perf_counter()
                a.fill(m, mask)
                t2 = time.perf_counter()
                fill_us.append((t2 - t1) * 1e6)
                bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:V]
                if rep == 0:
                    allowed.append(int(bits.sum()))
                if not bits[t]:
                    bad.append(step)
                if step == len(ids) - 1:
                    break  # eos: allowed is what we check; consuming it is not timed
                t1 = time.perf_counter()
                ok = a.advance(m, t)
                adv_us.append((time.perf_counter() - t1) * 1e6)
                if not ok:
                    bad.append(step)
                    break
        r.update(first_us=fill_us[0], mask_med_us=pct(fill_us, 50), mask_p99_us=pct(fill_us, 99),
                 mask_max_us=max(fill_us), adv_med_us=pct(adv_us, 50), adv_p99_us=pct(adv_us, 99),
                 not_allowed_steps=sorted(set(bad)), allowed_counts=allowed, samples=len(fill_us))

    if coverage:
        import jsonschema

        cov = {}
        for name, schema, good, badv in FEATURES:
            check = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
            assert check.is_valid(good) and not check.is_valid(badv), name
            try:
                c = a.compile("json", schema)
            except Exception as e:
                cov[name] = "error: " + short(e)
                continue
            try:
                g = a.accepts(c, tok.encode(compact(good), add_special_tokens=False).ids)
                b = a.accepts(c, tok.encode(compact(badv), add_special_tokens=False).ids)
            except Exception as e:
                cov[name] = "walk error: " + short(e)
                continue
            cov[name] = "WRONG (valid refused)" if not g else ("ignored" if b else "enforced")
        for name, kind, spec in BAD_INPUTS:
            try:
                a.compile(kind, spec)
                cov[name] = "accepted (no error)"
            except Exception as e:
                cov[name] = "refused: " + short(e)
        out["coverage"] = cov
        ws = {}
        for mode in ("default", "compact", "one space"):
            try:
                c = a.compile("json", WS_SCHEMA, ws=mode)
            except Exception as e:
                ws[mode] = {"error": short(e)}
                continue
            ws[mode] = {k: a.accepts(c, tok.encode(t, add_special_tokens=False).ids) for k, t in WS_TEXTS.items()}
        out["whitespace"] = ws
        fmts = {}
        for kind, spec, text in [("regex", REGEX, REGEX_TEXT), ("choice", CHOICES, CHOICE_TEXT),
                                 ("lark", LARK, "12+(3-4)"), ("gbnf", GBNF, "12+(3-4)")]:
            try:
                c = a.compile(kind, spec)
                fmts[kind] = "yes" if a.accepts(c, tok.encode(text, add_special_tokens=False).ids) else "compiles, refuses"
            except Exception as e:
                fmts[kind] = "no: " + short(e)
        out["formats"] = fmts
    return out


# -- the driver ------------------------------------------------------------------------------------------------------


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    v = {}
    for p in ("llguidance", "xgrammar", "outlines-core", "tokenizers", "numpy", "torch", "transformers"):
        try:
            v[p] = version(p)
        except PackageNotFoundError:
            v[p] = None
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", default="tiny,32000,150000", help="comma list of: tiny, or a vocabulary size to train")
    ap.add_argument("--libs", default=",".join(LIBS))
    ap.add_argument("--repeats", type=int, default=5, help="walks of each output per grammar")
    ap.add_argument("--cache", default="/tmp/jaxkv-grammar-tokenizers")
    ap.add_argument("--timeout", type=int, default=600, help="seconds for one (library, vocabulary) subprocess")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", nargs=4, metavar=("LIB", "TOKENIZER", "REPEATS", "COVERAGE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        lib, path, reps, cov = args.worker
        print(json.dumps(worker(lib, path, int(reps), cov == "1")))
        return 0

    vocabs = [v.strip() for v in args.vocab.split(",") if v.strip()]
    libs = [x.strip() for x in args.libs.split(",") if x.strip()]
    print(f"# {platform.platform()}, python {platform.python_version()}, {os.cpu_count()} cpus visible; "
          f"load average {os.getloadavg()[0]:.2f}; {versions()}")
    paths = {v: (os.path.abspath(TINY) if v == "tiny" else
                 train_tokenizer(int(v), os.path.join(args.cache, f"bytelevel-bpe-{v}.json"))) for v in vocabs}
    env = dict(os.environ, RAYON_NUM_THREADS="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    results = []
    for v in vocabs:
        for lib in libs:
            cov = "1" if v == vocabs[0] else "0"
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", lib, paths[v], str(args.repeats), cov]
            t0 = time.perf_counter()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
                r = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else \
                    {"lib": lib, "error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"rc {p.returncode}"}
            except subprocess.TimeoutExpired:
                r = {"lib": lib, "error": f"over {args.timeout} s"}
            r["vocab_name"], r["wall_s"] = v, time.perf_counter() - t0
            results.append(r)
            print(f"# done {lib} @ {v} in {r['wall_s']:.1f} s", flush=True)

    print("\n## Mask per token (us; packed int32 [1, ceil(V/32)] filled in place) and compile (s)\n")
    print("| vocab | library | import s (torch?) | setup s | grammar | compile s | tokens | first us | median us | p99 us | max us "
          "| advance median/p99 us | next token always allowed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['vocab_name']} | {r['lib']} | | | | error: {r['error']} |")
            continue
        imp = f"{r['import_s']:.2f} ({'torch' if r['imports_torch'] else 'no'})"
        for kind, g in r["grammars"].items():
            if "error" in g:
                print(f"| {r['vocab']} | {r['lib']} | {imp} | {r['setup_s']:.3f} | {kind} | error: {g['error']} |")
                continue
            ok = "yes" if not g["not_allowed_steps"] else f"NO at steps {g['not_allowed_steps'][:5]}"
            print(f"| {r['vocab']} | {r['lib']} | {imp} | {r['setup_s']:.3f} | {kind} | {g['compile_s']:.3f} | {g['tokens']} "
                  f"| {g['first_us']:.0f} | {g['mask_med_us']:.1f} | {g['mask_p99_us']:.1f} | {g['mask_max_us']:.0f} "
                  f"| {g['adv_med_us']:.1f} / {g['adv_p99_us']:.1f} | {ok} |")

    print("\n## Allowed-token counts: steps where each library's count equals llguidance's (first walk)\n")
    by = {(r["vocab_name"], r["lib"]): r for r in results if "error" not in r}
    for v in vocabs:
        base = by.get((v, "llguidance"))
        for lib in libs:
            r = by.get((v, lib))
            if not base or not r or lib == "llguidance":
                continue
            for kind in r["grammars"]:
                a, b = base["grammars"][kind].get("allowed_counts"), r["grammars"][kind].get("allowed_counts")
                if a and b:
                    same = sum(x == y for x, y in zip(a, b))
                    diff = [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y][:3]
                    print(f"- {v} {lib} {kind}: {same}/{len(a)} equal; first differences (step, llg, {lib}): {diff}")

    cov_rows = [r for r in results if "coverage" in r]
    if cov_rows:
        print(f"\n## JSON-schema coverage ({cov_rows[0]['vocab_name']} vocabulary; compact whitespace)\n")
        print("| feature | " + " | ".join(r["lib"] for r in cov_rows) + " |")
        print("|---" * (len(cov_rows) + 1) + "|")
        for name in cov_rows[0]["coverage"]:
            print(f"| {name} | " + " | ".join(r["coverage"].get(name, "") for r in cov_rows) + " |")
        print("\n## Whitespace: accepted texts per option\n")
        print("| library | option | " + " | ".join(WS_TEXTS) + " |")
        print("|---" * (len(WS_TEXTS) + 2) + "|")
        for r in cov_rows:
            for mode, res in r["whitespace"].items():
                cells = [res["error"]] if "error" in res else ["yes" if res[k] else "no" for k in WS_TEXTS]
                print(f"| {r['lib']} | {mode} | " + " | ".join(cells) + " |")
        print("\n## Grammar formats\n")
        print("| library | " + " | ".join(cov_rows[0]["formats"]) + " |")
        print("|---" * (len(cov_rows[0]["formats"]) + 1) + "|")
        for r in cov_rows:
            print(f"| {r['lib']} | " + " | ".join(r["formats"].values()) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
