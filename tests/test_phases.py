"""A session's phases (``targets.phase``): the diagram in docs/architecture.md is the code's
arrows, and the changes a real batcher and a real edge verifier log follow them."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import torch

from targets.phase import ARROWS, NEXT, Phase, PhaseLog, diagram, reachable
from tests.test_edge import PROMPTS, VerifierThread, _edge, _reference
from tests.test_serve_gate import eagle3_hub, plain_pair_then_alone

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def logged_changes(records, noun: str) -> dict[int, list[tuple[str, str]]]:
    """Each session's logged phase changes (``PhaseLog``), in order."""
    seen: dict[int, list[tuple[str, str]]] = {}
    for record in records:
        change = re.search(noun + r" (\d+): (\w+) -> (\w+)", record.getMessage())
        if change:
            seen.setdefault(int(change.group(1)), []).append((change.group(2), change.group(3)))
    return seen


def test_the_state_diagram_in_the_docs_is_the_codes_arrows():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert f"```mermaid\n{diagram()}```" in text, "docs/architecture.md: paste diagram()"
    drawn = re.findall(r"^    (\S+) --> (\S+?)(?::|$)", diagram(), re.M)
    assert len(drawn) == len(ARROWS) == len(set(drawn)), "each arrow drawn once"
    named = {p for arrow in drawn for p in arrow} - {"[*]"}
    assert named == {p.name for p in Phase}
    assert NEXT[None] == {Phase.PREFILLING}
    assert all(Phase.DONE in reachable(p, 99) for p in Phase if p is not Phase.DONE)
    assert not NEXT[Phase.DONE]


def test_a_change_no_arrow_makes_is_logged_as_a_bug(caplog):
    phases = PhaseLog(logging.getLogger("starhub.test"), "t")
    with caplog.at_level(logging.DEBUG, logger="starhub.test"):
        for phase in (Phase.PREFILLING, Phase.WAITING, Phase.TREE, Phase.WAITING):
            phases.note(1, phase)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        phases.note(1, Phase.PREFILLING)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["t: session 1 went from WAITING to PREFILLING, which the state "
                      "diagram has no path for in 1 arrows (targets.phase.ARROWS)"]


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
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    seen: dict[int, list[str]] = {}
    for rid, changes in logged_changes(caplog.records, "request").items():
        for before, after in changes:
            assert before == "NEW" or Phase[after] in reachable(Phase[before], 2), \
                (before, after)
            seen.setdefault(rid, []).append(after)
    long_phases = seen[1]
    assert long_phases[0] == "PREFILLING" and long_phases[-1] == "DONE"
    assert {"ALONE", "AHEAD"} <= set(long_phases), long_phases
    assert seen[2][-1] == "DONE"


def test_an_edge_verifiers_sessions_follow_the_diagram_through_its_four_phases(tiny_model,
                                                                               caplog):
    """Two drafters decode through a real verifier: each session it logs is PREFILLING from
    its OPEN, then WAITING and TREE in turn (a round each), and DONE once its drafter
    closes it; every change is one arrow of the diagram (the verifier logs each as it
    happens)."""
    model, tokenizer = tiny_model
    verifier = VerifierThread(model, tokenizer, ttl_s=30.0)
    try:
        with caplog.at_level(logging.DEBUG, logger="starhub.verifier"):
            for i in range(2):
                edge = _edge(model, verifier.address, name=f"d{i}")
                tokens, _ = edge.generate(PROMPTS[i], max_new_tokens=16)
                edge.close()
                assert tokens == _reference(model, PROMPTS[i], 16)
            deadline = time.monotonic() + 10
            while sum(after == "DONE" for changes in logged_changes(caplog.records, "session")
                      .values() for _, after in changes) < 2:
                assert time.monotonic() < deadline, "the closed sessions never reached DONE"
                time.sleep(0.05)
    finally:
        verifier.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    sessions = logged_changes(caplog.records, "session")
    assert len(sessions) == 2
    for changes in sessions.values():
        phases = [after for _, after in changes]
        assert changes[0] == ("NEW", "PREFILLING") and phases[1] == "WAITING", changes
        assert phases[-1] == "DONE" and phases.count("TREE") >= 2, changes
        assert set(phases) == {"PREFILLING", "WAITING", "TREE", "DONE"}, changes
        assert all(Phase[after] in NEXT[Phase[before]] for before, after in changes[1:]), \
            changes


def test_a_phase_log_forgets_a_session_once_it_is_done(caplog):
    phases = PhaseLog(logging.getLogger("starhub.test"), "t")
    with caplog.at_level(logging.DEBUG, logger="starhub.test"):
        for phase in (Phase.PREFILLING, Phase.WAITING, Phase.WAITING, Phase.TREE, Phase.DONE):
            phases.note(7, phase)
        phases.note(8, Phase.DONE)  # never seen: nothing to say
    assert phases.seen == {}
    assert [r.getMessage() for r in caplog.records] == [
        "t: session 7: NEW -> PREFILLING", "t: session 7: PREFILLING -> WAITING",
        "t: session 7: WAITING -> TREE", "t: session 7: TREE -> DONE"]
