"""What a STATS_REPORT carries: a hub's, a verifier's, or one peer's own numbers.

Each report is a msgspec Struct tagged by ``role``, so a ``StatsReport`` decodes into
exactly one of them or is refused. Lists, maps and names are bounded: a hostile server
cannot make a client hold more than a few megabytes for one report.

Fields a server leaves out for a peer without a card (``starhub.server.isolation``) are
optional and absent from ``msgspec.to_builtins``, so the plain-dict form of a report (what
the benchmark writes and ``starhub status --json`` prints) has the keys the untyped body
had, plus its ``role`` (a verifier's always said so; a hub's and a peer's now do too).

The hub checks its report against these types as it builds it (``msgspec.convert``), so a
field that outgrows them fails on the server, not on every reader.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

MAX_ENTRIES = 4096
"""Per-target, per-peer and per-session entries in one report; servers send at most this."""
MAX_KEYS = 2048
"""Keys of a histogram or a count by label (error codes, drafting choices)."""

Name = Annotated[str, Meta(max_length=4096)]
Key = Annotated[str, Meta(max_length=64)]
Counts = Annotated[dict[Key, int], Meta(max_length=MAX_KEYS)]
"""A count by label or a histogram keyed by its bin (as a string)."""
Floats = Annotated[list[float], Meta(max_length=MAX_KEYS)]
IntOrAuto = int | Annotated[str, Meta(max_length=16)]
"""A setting the hub may choose itself (``auto``): the tree depth, ``max_targets``."""


class Entry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True,
            gc=False):
    """A nested part of a report."""


class Report(msgspec.Struct, tag_field="role", forbid_unknown_fields=True, kw_only=True,
             omit_defaults=True, gc=False):
    """A STATS_REPORT body. ``aggregates_only``: per-peer parts were left out."""

    aggregates_only: bool = False


class PeerEntry(Entry):
    """One target's share of a hub's work; the hub's metrics keep one per target and add to it."""

    name: Name = ""
    rounds: int = 0
    queue_s: float = 0.0
    draft_s: float = 0.0
    commits: int = 0
    tokens: int = 0
    first: float = 0.0
    last: float = 0.0


class PeerReport(Report, tag="peer"):
    """The answer to ``StatsQuery(peer=True)``: the sender's own totals (None: the hub
    has none for it yet)."""

    peer: PeerEntry | None = None


PeerRow = tuple[Name, int, float, float, int, int, float, float]
"""A peer's totals in ``PeerEntry`` order, as ``counters.peers`` lists them."""


class Counters(Entry):
    """A hub's raw totals and clock (``HubMetrics.counters``); ``starhub.hub.metrics.derive``
    turns two readings into a window's metrics. ``peers`` only for a peer with a card."""

    rounds: int
    draft_s: float
    draft_layers: int
    wait_s: float
    idle_s: float
    sched_s: float
    idle_gaps: int
    iterations: float
    return_s: float
    returns: int
    commits: int
    committed_tokens: int
    proposed_nodes: int
    plain_rounds: int
    plain_tokens: int
    batches: int
    batched: float
    batch_s: float
    predraft_hits: int
    predraft_misses: int
    predraft_s: float
    critical_draft_s: float
    lookup_rounds: int
    lookup_tokens: int
    now: float
    t0: float
    t1: float
    accept_len_hist: Counts
    accepted_at_depth: Counts
    choices: Counts
    peers: Annotated[list[PeerRow], Meta(max_length=MAX_ENTRIES)] | None = None


class HubSplit(Entry):
    draft: float
    idle: float
    sched: float
    queue_s_per_round: float


class Typical(Entry):
    """The control plane's typical target at its best fixed shape."""

    S_ms: float
    Z_ms: float
    tau: float
    step_ms: float
    depth: int


class TargetEntry(Entry):
    """One admitted target, as the control plane models it."""

    name: Name
    sessions: int
    step_ms: float
    standalone_tok_s: float | None
    predicted_tok_s: float | None
    t_c_ms: float
    verify_ms_fit: Floats
    verify_samples: int
    shared_cores: bool = False
    """The target computes on the hub's cores and times its step alone."""
    kept_share: float = 1.0
    """The share of its chosen trees' nodes that each round's floor kept."""


class ControlReport(Entry):
    """The control plane's state (``starhub.control.plane``); ``targets`` only for a peer
    with a card."""

    depth: IntOrAuto
    max_targets: IntOrAuto
    admitted: int
    rejections: int
    rejected_waiting: int
    n_max: int | None
    n_full: int
    typical: Typical
    draft_ms_fit: Floats
    overhead_ms: float
    hub_load_ms: float
    acceptance_by_depth: Floats
    unwanted: int = 0
    """Targets asked to move to another hub of their pool (``Controller.review``)."""
    targets: Annotated[list[TargetEntry], Meta(max_length=MAX_ENTRIES)] | None = None


MAX_DRAFTER_EVENTS = 16
"""Drafter losses a hub's report lists (the most recent); ``restarts`` counts them all."""


class DrafterEvent(Entry):
    """One loss of a hub's drafting process (``starhub.hub.supervision``): when (Unix
    time), why, how many sessions it ended, and how long the restart took (0: not back)."""

    at: float
    reason: Annotated[str, Meta(max_length=512)]
    sessions: int
    restart_s: float = 0.0


class DrafterHealth(Entry):
    """Whether a hub's drafter can serve: ``process`` says it drafts in a process of its own
    (``pid``), which the hub watches and restarts; ``healthy`` is false while it restarts
    (admission is closed then); ``restarts`` and ``sessions_ended`` count every loss."""

    process: bool
    healthy: bool
    pid: int
    restarts: int
    sessions_ended: int
    events: Annotated[list[DrafterEvent], Meta(max_length=MAX_DRAFTER_EVENTS)]


class HubReport(Report, tag="hub"):
    """A hub's STATS: the metrics of docs/architecture.md over its active window
    (``metrics.derive``), its sessions and settings, the control plane, and on request the
    raw ``counters``."""

    # metrics.derive
    wall_s: float
    rounds: int
    commits: int
    tokens: int
    plain_rounds: int
    plain_tokens: int
    choices: Counts
    system_tok_s: float
    per_target_tok_s: float
    t_s_ms: float
    t_draft_ms: float
    t_wait_ms: float
    t_idle_ms: float
    t_idle_gap_ms: float
    t_sched_ms: float
    z_ms: float
    r_q: float
    r_p: float
    load: float
    hub_split: HubSplit
    mean_accept_len: float
    accept_rate_by_depth: Floats
    accept_len_hist: Counts
    proposed_nodes_mean: float
    batch_mean: float
    draft_ms_per_batch: float
    draft_ms_per_session: float
    critical_draft_ms: float
    predraft_hits: int
    predraft_hit_rate: float
    predraft_load: float
    lookup_round_share: float
    lookup_token_share: float
    # sessions
    active_sessions: int
    peers: int
    sessions_opened: int
    sessions_expired: int
    errors: Counts
    # settings and admission
    drafter: Name
    depth: IntOrAuto
    topk: int
    max_nodes: int
    queue: int
    threads: int
    max_targets: IntOrAuto
    admitted: int
    n_max: int | None
    n_full: int
    cached_tokens: int
    rejections: int
    control: ControlReport
    drafting: DrafterHealth
    counters: Counters | None = None


class SessionEntry(Entry):
    """One edge session, as the verifier's scheduler sees it."""

    alpha: float
    goodput: float
    nodes: int
    rounds: int
    late: int


class SchedulerReport(Entry):
    """The verifier's scheduler (``targets.schedule``); ``sessions`` (by tag) only for a
    peer with a card."""

    policy: Name
    budget: int
    max_batch: int
    time_model_ms: Floats
    time_model_mape: float | None
    sessions: Annotated[dict[Key, SessionEntry], Meta(max_length=MAX_ENTRIES)] | None = None


class VerifierReport(Report, tag="verifier"):
    """An edge verifier's STATS (``targets.verifier``)."""

    schedule: Name
    budget: int
    max_batch: int
    sessions: int
    drafters: int
    cached_tokens: int
    steps: int
    rounds: int
    committed: int
    accepted: int
    opened: int
    closed: int
    expired: int
    wall_s: float
    verify_s: float
    gather_s: float
    prefill_s: float
    mean_batch: float
    verify_ms_per_step: float
    fed_per_step: float
    batch_hist: Counts
    slo_rounds: int
    slo_late: int
    errors: Counts
    threads: int
    step_ms: float
    scheduler: SchedulerReport


StatsBody = HubReport | VerifierReport | PeerReport
