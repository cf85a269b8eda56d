"""A checkpoint's recommended sampling: generation_config.json's `do_sample`, `temperature`, `top_k`, `top_p`,
`min_p` and `repetition_penalty`, read as transformers reads them, and turned into `jaxkv.generate`'s arguments.

transformers' meaning, kept here: `do_sample` false (its default) is greedy whatever the temperature (a file with a
temperature but no `do_sample` is greedy in transformers too); sampling applies `top_k` 50 where the file names
none (`GenerationConfig`'s default; vLLM's `--generation-config auto` takes only the fields the file names, so it
samples such a file without a top-k); `repetition_penalty` applies to greedy decoding too. Its eos ids are read by
`io.hf.generation_eos_ids` (they join the config's stop tokens).

Where the defaults apply: `jaxkv.generate(..., sampling="checkpoint")` (`resolve`: each argument given explicitly
overrides the checkpoint's), `jaxkv generate` and `jaxkv serve` (`--generation-config auto`, their default;
`ignore` for jaxkv's own defaults). `jaxkv.save` writes them back as generation_config.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

FILE = "generation_config.json"  # io.hf.GENERATION_CONFIG_FILE
TRANSFORMERS_TOP_K = 50  # GenerationConfig's default top_k: transformers samples with it where the file names none
MODES = ("auto", "ignore")  # --generation-config


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    """A checkpoint's sampling, as generation_config.json states it (None: the file does not name the field)."""

    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_dict(cls, data: dict, *, source: str) -> "SamplingDefaults | None":
        """The sampling fields of a parsed generation_config.json (None when it names none of them). ValueError
        naming the file and field for a value of the wrong type or out of range."""

        def number(name, lo, hi, *, lo_open=False, integer=False):
            value = data.get(name)
            if value is None:
                return None
            ok = isinstance(value, int) if integer else isinstance(value, (int, float))
            if isinstance(value, bool) or not ok or not math.isfinite(value) or value < lo or value > hi or (
                    lo_open and value == lo):
                raise ValueError(f"{source}: {name} must be {'an integer' if integer else 'a number'} in "
                                 f"{'(' if lo_open else '['}{lo}, {hi}], got {value!r}")
            return value if integer else float(value)

        do_sample = data.get("do_sample", False)
        if not isinstance(do_sample, bool):
            raise ValueError(f"{source}: do_sample must be true or false, got {do_sample!r}")
        out = cls(do_sample=do_sample, temperature=number("temperature", 0.0, 100.0),
                  top_k=number("top_k", 0, 2**31 - 1, integer=True), top_p=number("top_p", 0.0, 1.0, lo_open=True),
                  min_p=number("min_p", 0.0, 1.0), repetition_penalty=number("repetition_penalty", 0.0, 100.0,
                                                                             lo_open=True))
        named = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")
        return out if any(name in data for name in named) else None

    def to_dict(self) -> dict:
        """The fields as generation_config.json writes them (unnamed fields left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def arguments(self) -> dict:
        """`jaxkv.generate`'s sampling arguments for these defaults, as transformers applies them."""
        penalty = None if self.repetition_penalty in (None, 1.0) else self.repetition_penalty
        if not self.do_sample or self.temperature == 0:
            return dict(temperature=0.0, top_k=None, top_p=None, min_p=None, repetition_penalty=penalty)
        top_k = TRANSFORMERS_TOP_K if self.top_k is None else self.top_k
        return dict(temperature=1.0 if self.temperature is None else self.temperature,
                    top_k=None if top_k == 0 else top_k, top_p=None if self.top_p in (None, 1.0) else self.top_p,
                    min_p=None if self.min_p in (None, 0.0) else self.min_p, repetition_penalty=penalty)


def read(directory) -> SamplingDefaults | None:
    """The sampling defaults of a checkpoint directory's generation_config.json (None: no file, or it names none).
    ValueError naming the file for one that is not a JSON object or holds a bad value."""
    data = read_file(directory)
    source = str(pathlib.Path(directory) / FILE)
    return None if data is None else SamplingDefaults.from_dict(data, source=source)


def read_file(directory) -> dict | None:
    """The parsed generation_config.json of a checkpoint directory, or None where it has none. ValueError naming
    the file for one that is not a JSON object. (Here rather than in `io.hf`, which reads the file's eos ids and
    imports this module: one home for the file, no import cycle.)"""
    path = pathlib.Path(directory) / FILE
    return json_object(path) if path.is_file() else None


def json_object(path: pathlib.Path) -> dict:
    """A JSON file that must hold an object -> the dict; ValueError naming the file otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def write(defaults: SamplingDefaults | None, directory):
    """Writes generation_config.json into `directory` (nothing for None)."""
    if defaults is not None:
        (pathlib.Path(directory) / FILE).write_text(json.dumps(defaults.to_dict(), indent=2) + "\n")


_FILTERS = ("top_k", "top_p", "min_p")


def resolve(defaults: SamplingDefaults | None, sampling: str | None, given: dict) -> dict:
    """`jaxkv.generate`'s sampling arguments: `given` (temperature, top_k, top_p, min_p, repetition_penalty; None:
    not given) over the checkpoint's (`sampling="checkpoint"`; no defaults: greedy, as transformers' own) or over
    jaxkv's (`sampling=None`: greedy, no filters). A prompt whose temperature ends up 0 (greedy) drops the
    checkpoint's filters (a filter given explicitly with it is still refused by the checks)."""
    if sampling not in (None, "checkpoint"):
        raise ValueError(f"sampling must be None or 'checkpoint', got {sampling!r}")
    base = dict(temperature=0.0, top_k=None, top_p=None, min_p=None, repetition_penalty=None)
    if sampling == "checkpoint" and defaults is not None:
        base = defaults.arguments()
    out = {name: given[name] if given.get(name) is not None else base[name] for name in base}
    temperature = out["temperature"]
    for name in _FILTERS:
        if given.get(name) is not None or base[name] is None:
            continue
        if isinstance(temperature, (list, tuple)):
            out[name] = [None if t == 0 else base[name] for t in temperature]
        elif temperature == 0:
            out[name] = None
    return out
