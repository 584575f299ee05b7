"""A serving request's phases: the diagram in docs/architecture.md names exactly the
batcher's phases, and the changes a real batcher logs follow the diagram's arrows."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from targets.batcher import Phase
from tests.test_serve_gate import eagle3_hub, plain_pair_then_alone

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def diagram() -> dict[str, set[str]]:
    """The arrows of the serving request's state diagram: phase -> phases it goes to."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    block = re.search(r"```mermaid\nstateDiagram-v2\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no state diagram"
    arrows: dict[str, set[str]] = {}
    for line in block.group(1).splitlines():
        found = re.match(r"\s*(\S+) --> (\S+?)(:|$)", line)
        if found:
            arrows.setdefault(found.group(1), set()).add(found.group(2))
    return arrows


def reachable(arrows: dict[str, set[str]], start: str, most: int = 99) -> set[str]:
    """The phases ``start`` leads to in at most ``most`` arrows."""
    seen, frontier = set(), {start}
    for _ in range(most):
        frontier = {nxt for p in frontier for nxt in arrows.get(p, ())} - seen
        seen |= frontier
    return seen


def test_the_state_diagram_names_the_batchers_phases():
    arrows = diagram()
    named = set(arrows) | {p for targets in arrows.values() for p in targets}
    assert named - {"[*]"} == {p.name for p in Phase}
    assert arrows["[*]"] == {Phase.PREFILLING.name}
    assert all(Phase.DONE.name in reachable(arrows, p.name) for p in Phase)


def test_a_requests_logged_phases_follow_the_diagram(tiny_model, tiny_dir, caplog):
    """Two requests begin plain (the gate finds the hub too slow for a batch of two); once
    the short one ends, the long one opens its hub session mid-stream, decodes ahead until
    its first tree and verifies trees. Every change the batcher logs is an arrow of the
    diagram, or two: it logs a turn at a time, and a turn may read a reply (a tree comes)
    and then verify it (a COMMIT leaves)."""
    model, tokenizer = tiny_model
    with caplog.at_level(logging.DEBUG, logger="starhub.target"), eagle3_hub(tiny_dir) as hub:
        got, stats, _ = plain_pair_then_alone(model, tokenizer, hub.address)
    assert stats.rounds > 0, "the long request verified hub trees"
    ref = model.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=40, do_sample=False)
    assert got == ref[0, 5:].tolist()
    arrows = diagram()
    seen: dict[int, list[str]] = {}
    for record in caplog.records:
        change = re.search(r"request (\d+): (\w+) -> (\w+)", record.getMessage())
        if change:
            rid, before, after = int(change.group(1)), change.group(2), change.group(3)
            assert before == "NEW" or after in reachable(arrows, before, 2), (before, after)
            seen.setdefault(rid, []).append(after)
    long_phases = seen[1]
    assert long_phases[0] == "PREFILLING" and long_phases[-1] == "DONE"
    assert {"ALONE", "AHEAD"} <= set(long_phases), long_phases
    assert seen[2][-1] == "DONE"
