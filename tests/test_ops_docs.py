"""The dispatch's documentation says what the dispatch does (issue 60): the table of ``docs/performance.md`` and the
list in ``moh_vision/ops/__init__.py``'s docstring name, for each ``kernels.<key>``, exactly the implementations
registered under it and each device's ``auto`` entry as the ops hold it."""
import re
from typing import Dict, Set, Tuple

import pytest

import moh_vision.ops
from helpers import REPO
from moh_vision.ops import OPS, REFERENCE

DEVICES = ("cpu", "cuda")
Facts = Dict[str, Tuple[Set[str], Dict[str, str]]]  # key -> (implementations, device -> auto)


def registered() -> Facts:
    """What the ops hold: per key, ``reference`` and every registered implementation; ``auto`` per device (one value
    for all the key's ops, or the set of values if they disagree)."""
    facts: Facts = {}
    for op in OPS.values():
        impls, auto = facts.setdefault(op.key, ({REFERENCE}, {}))
        impls.update(op.impls)
        for device in DEVICES:
            auto.setdefault(device, set()).add(op.auto.get(device, REFERENCE))
    return {key: (impls, {d: v.pop() if len(v) == 1 else str(sorted(v)) for d, v in auto.items()})
            for key, (impls, auto) in facts.items()}


def _names(text: str) -> Set[str]:
    """The implementation names of a ``;``-separated list: each part's first backticked word."""
    return {re.search(r"`+([\w]+)`+", part).group(1) for part in text.split(";")}


def performance_table(page: str = "") -> Facts:
    page = page or (REPO / "docs" / "performance.md").read_text()
    facts: Facts = {}
    for row in re.finditer(r"^\| [^|]*\(`(\w+)`\) \| ([^|]+) \| `(\w+)` \| `(\w+)` \|$", page, re.M):
        facts[row.group(1)] = (_names(row.group(2)), {"cpu": row.group(3), "cuda": row.group(4)})
    return facts


def docstring_list() -> Facts:
    facts: Facts = {}
    for item in moh_vision.ops.__doc__.split("\n- ")[1:]:
        found = re.match(r"``(\w+)`` \([^)]*\): (.+?)\. ``auto``: ``(\w+)`` on the CPU, ``(\w+)`` on CUDA\.",
                         " ".join(item.split()))
        if found:
            facts[found.group(1)] = (_names(found.group(2)), {"cpu": found.group(3), "cuda": found.group(4)})
    return facts


@pytest.mark.parametrize("source", [performance_table, docstring_list], ids=["docs/performance.md", "ops/__init__"])
def test_the_documented_implementations_and_auto_entries_are_the_registered_ones(source):
    documented, actual = source(), registered()
    assert set(documented) == set(actual), "the documented kernels keys are not the config's"
    for key, (impls, auto) in actual.items():
        assert documented[key][0] == impls, f"kernels.{key}: documented {sorted(documented[key][0])}, registered " \
                                            f"{sorted(impls)}"
        assert documented[key][1] == auto, f"kernels.{key}: documented auto {documented[key][1]}, the ops' {auto}"


def test_a_drifted_entry_is_caught(monkeypatch):
    """The check can fail: the docstring as it read before issue 60 (the depthwise ``auto`` as ``reference``), a list
    that names a removed C++ routing kernel, and the page with the depthwise CPU default changed disagree with the
    ops."""
    doc = moh_vision.ops.__doc__
    drifted = doc.replace("``auto``: ``channels_last`` on the CPU", "``auto``: ``reference`` on the CPU")
    removed = doc.replace("(one Triton kernel each way, CUDA)", "(one Triton kernel each way, CUDA); ``cpp`` (C++)")
    for text in (drifted, removed):
        assert text != doc
        monkeypatch.setattr(moh_vision.ops, "__doc__", text)
        assert docstring_list() != registered()
    page = (REPO / "docs" / "performance.md").read_text()
    assert performance_table(page.replace("| `channels_last` | `reference` |", "| `reference` | `reference` |")) != \
        registered()
