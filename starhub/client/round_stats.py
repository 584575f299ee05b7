"""Per-request round accounting shared by everything that decodes with drafts: the star
target and the edge drafter count rounds, histograms and clipped output the same way."""

from __future__ import annotations

from collections.abc import Iterable


def count_round(stats, accepted: int, nodes: int) -> None:
    """One verified round on ``stats`` (any object with ``rounds``, ``tree_nodes``,
    ``accept_len_hist`` and ``accepted_at_depth``): ``accepted`` draft tokens of ``nodes``."""
    stats.rounds += 1
    stats.tree_nodes += nodes
    key = str(accepted + 1)
    stats.accept_len_hist[key] = stats.accept_len_hist.get(key, 0) + 1
    while len(stats.accepted_at_depth) < accepted:
        stats.accepted_at_depth.append(0)
    for k in range(accepted):
        stats.accepted_at_depth[k] += 1


def mean_accept_len(stats) -> float:
    """Committed tokens per round, bonus included, from ``accept_len_hist``."""
    if not stats.rounds:
        return 0.0
    return sum(int(k) * v for k, v in stats.accept_len_hist.items()) / stats.rounds


def pooled_accept_len(stats: Iterable[dict]) -> float:
    """τ over many requests (their ``stats`` as written to JSON): committed tokens per
    verified round. A request that ran plain adds no rounds, so it does not pull τ down."""
    rounds = tokens = 0
    for s in stats:
        rounds += s.get("rounds", 0)
        tokens += sum(int(k) * v for k, v in s.get("accept_len_hist", {}).items())
    return tokens / rounds if rounds else 0.0


def clip_output(tokens: list[int], room: int, eos: Iterable[int]) -> list[int]:
    """At most ``room`` tokens, cut after the first end-of-sequence token."""
    tokens = tokens[: max(room, 0)]
    for i, tok in enumerate(tokens):
        if tok in eos:
            return tokens[: i + 1]
    return tokens
