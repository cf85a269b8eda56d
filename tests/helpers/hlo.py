"""Reading compiled HLO text (`jax.jit(f).lower(...).compile().as_text()`): the ops that copy a whole buffer, and the
collectives a sharded program runs."""

import math
import re


def is_whole_buffer_copy(line: str, buffer_elements: int) -> bool:
    """A `copy` op, or a fusion named for a copy or transpose, producing at least `buffer_elements` elements."""
    m = re.search(r"%(\S+) = \w+\[([\d,]+)\]\S* (\w+)\(", line)
    if not m or not (m.group(3) == "copy" or "copy" in m.group(1) or "transpose" in m.group(1)):
        return False
    return math.prod(int(d) for d in m.group(2).split(",")) >= buffer_elements


def is_copy_of(line: str, shape: str) -> bool:
    """A `copy` op, or a fusion named for a copy or transpose, producing exactly `shape` (e.g. "[1,2,48]")."""
    m = re.search(r"%(\S+) = \w+(\[[\d,]+\])\S* (\w+)\(", line)
    return bool(m) and m.group(2) == shape and (m.group(3) == "copy" or "copy" in m.group(1)
                                                or "transpose" in m.group(1))


def collectives(text: str):
    """(op, element count of its result) of every collective in compiled HLO text."""
    found = []
    for line in text.splitlines():
        m = re.search(r"= \(?(\w+)\[([\d,]*)\][^ ]* (all-reduce|all-gather|all-to-all|collective-permute|"
                      r"reduce-scatter)(-start)?\(", line)
        if m:
            found.append((m.group(3), math.prod(int(d) for d in m.group(2).split(",") if d)))
    return found
