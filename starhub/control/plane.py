"""The hub's control plane: an online load model, admission (N_max) and tree-shape choice.

StarSD's model (docs/architecture.md, "The analytical model"), generalised to sessions
that differ. Session j drafting a tree of depth d_j with n_j nodes costs the hub
``S_j = draft(d_j, n_j) + overhead`` a round, then waits ``Z_j = t_c + t_v(n_j)`` for its
target, and commits ``E_j(d_j)`` tokens. The hub drafts one request at a time, so a
speculating session completes one round every ``max(S_j + Z_j, sum_k S_k)`` seconds at
best. A plain-decoding session costs the hub
nothing and commits one token every ``t_step``, its target's standalone speed.

That bound holds for sessions alike; sessions whose round trips differ queue behind one
another once the hub's load nears the longest round trip, and then all go at the slowest
one's pace (measured: at 12 emulated targets of mixed acceptance the bound was 4-12%
optimistic). So the tree choice counts each session's round stretched toward the slowest
round trip, by ``(load / slowest)^2`` of the difference (``session_rate``): nothing on a lightly
loaded hub, where a session seldom finds it busy, all of it at the knee, where the rounds
go in step. A deeper tree for one session then pays only if it does not stretch the
others' rounds more than it adds, and the shapes it settles on keep the round trips
alike, where the hub loses no time to the queue.

Admission keeps every admitted target at or above its standalone speed; the tree choice
maximises the hub's total goodput under the same rule, and falls back to plain decoding
where no tree pays. The hub calls this module; it never touches sockets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from starhub.control.estimators import Acceptance, Ema, ProbeBackoff
from starhub.fit import LinearFit
from starhub.options import AUTO, MAX_AUTO_DEPTH
from starhub.wire.reports import MAX_ENTRIES, ControlReport, TargetEntry, Typical

PLAIN_TOKENS = 16
"""Tokens a target decodes on its own per plain round: the round trip is paid once."""
PROBE_DEPTH = 2
"""Probes draft at most this deep: acceptance near the root says whether trees pay, and
a shallow tree costs least when they do not."""
TREE_MARGIN = 1.02
"""A tree must beat plain decoding by this factor: the estimates are noisy, plain is not.
(A serving target's gate, where a wrong "plain" holds a whole batch off trees, keeps trees
within 5% of plain batching: its ``BATCH_MARGIN`` 0.95.)"""
IN_STEP_POWER = 2
"""A session's round is stretched toward the slowest round trip by ``(load /
slowest)^IN_STEP_POWER`` of the difference. Squared: at four emulated targets of mixed
acceptance (load 0.8 of the slowest round trip) sessions already queued 2 ms a round
behind one another, and counting them in step there took ``--depth auto`` from 0.95x to
1.00x the best fixed depth; at a quarter of it (the demo's two targets) it counts 6%."""
MAX_FLOOR = 0.5
"""No floor leaves out a node the head gives even odds, whatever the cost estimates say
(before a target has verified a tree its cost per node is a prior)."""
OVER_S = 10.0
"""A hub asks targets to leave once it has been over its limit this long, and never one it
admitted more recently: N_max moves by a target or so as acceptance is learned, and
admission (each target judged by its own estimates) can take one past the typical
target's N_max."""
CONFIDENCE = 2.0
"""Admission counts acceptance this many standard errors below its estimate: an admitted
target keeps its slot until it leaves, so a lucky streak must not admit one too many."""


@dataclass(frozen=True)
class Choice:
    """One round's plan for a session: a tree of ``depth``/``nodes``, or ``plain`` tokens
    decoded by the target alone."""

    depth: int = 0
    nodes: int = 0
    plain: int = 0
    probe: bool = False
    floor: float = 0.0
    """Nodes of a greedy tree below this draft path probability are left out."""

    @property
    def label(self) -> str:
        return "plain" if self.plain else f"d{self.depth}n{self.nodes}"


@dataclass
class ControlConfig:
    depth: int | str = 5
    """A fixed depth, or ``auto``: chosen per session and round up to MAX_AUTO_DEPTH."""
    topk: int = 4
    max_nodes: int = 10
    max_targets: int | str = 0
    """0 admits everyone, N at most N targets, ``auto`` while nobody falls below standalone."""
    retry_after_s: float = 1.0
    plain_tokens: int = PLAIN_TOKENS
    t_c_prior_s: float = 1e-3
    verify_slope_prior: float = 0.04
    """Verification cost per tree node, as a fraction of a plain step, until measured."""
    prune: bool = True
    """Each tree choice carries a ``floor``: greedy trees leave out the nodes worth less
    than the verify time they cost."""

    @property
    def adaptive(self) -> bool:
        return self.depth == AUTO

    def nodes_for(self, depth: int) -> int:
        return max(1, min(self.max_nodes, self.topk * depth))

    def shapes(self) -> list[tuple[int, int]]:
        depths = range(1, MAX_AUTO_DEPTH + 1) if self.adaptive else [int(self.depth)]
        return [(d, self.nodes_for(d)) for d in depths]


class TargetProfile:
    """What the hub knows of one target process: its plain step, verify curve and link."""

    def __init__(self, name: str, step_s: float, hub: Acceptance, config: ControlConfig):
        self.name = name
        self.step = Ema(step_s if step_s > 0 else None)
        self.t_c = Ema()
        self.config = config
        base = step_s if step_s > 0 else 0.0
        self.verify = LinearFit([base, config.verify_slope_prior * base])
        self.acceptance = Acceptance(parent=hub)
        self.sessions: set[int] = set()
        self.shared_cores = False
        """The target said it computes on the hub's cores: its step is then timed with the
        cores to itself (``starhub.cores``), so the hub's drafting counts against trees."""
        self.kept = Ema(1.0, alpha=0.05)
        """The share of its chosen trees' nodes the floor left, over its sessions."""
        self.joined_at = -math.inf
        """When admission took it (``Controller.join``)."""
        self.probes = ProbeBackoff()
        """Plain rounds between two probes of the target's plain sessions: 2, 4, then 8;
        kept across the target's sessions."""

    def step_s(self) -> float:
        return self.step.get(0.0)

    def report_step(self, step_s: float) -> None:
        """A step time the target measured; 0 means it has none yet."""
        if step_s > 0:
            self.step.update(step_s)

    def verify_s(self, nodes: int) -> float:
        base, slope = self.verify_line()
        return max(base + slope * nodes, 0.0)

    def verify_line(self) -> tuple[float, float]:
        """Verification seconds as ``base + slope·nodes``: the fit, or until the target has
        verified a tree, its plain step scaled by the prior slope."""
        if not self.verify.samples and self.step.value:
            return self.step.value, self.step.value * self.config.verify_slope_prior
        base, slope = self.verify.weights
        return base, slope


@dataclass
class SessionModel:
    target: TargetProfile
    acceptance: Acceptance
    choice: Choice = Choice()
    s: float = 0.0
    """Hub time per round at the current choice (0 when plain)."""
    z: float = 0.0
    e: float = 1.0
    batched: bool = False
    """Its target verifies it in passes shared with other sessions (a serving target): a
    pass's time says little of what one more node of this tree costs, so its trees take
    the floor the target advises (``advised``), priced from its own fit of a pass."""
    advised: float = 0.0
    """The floor the target's latest COMMIT advised (0: none)."""
    kept: Ema = field(default_factory=Ema)
    """The share of a chosen tree's nodes that a floor left in this session's rounds (a
    prompt the head reads with confidence keeps most, a poorly read one few), from its
    target's share: its verify time is priced at that share, as its acceptance is learned
    from the same rounds."""


class Controller:
    """The load model plus the two decisions the hub asks for: admit a target, shape a round."""

    def __init__(self, config: ControlConfig):
        self.config = config
        self.hub_acceptance = Acceptance()
        self.draft = LinearFit([0.0, 1e-3, 0.0])
        """Seconds to draft as ``c0 + c1·depth + c2·nodes``."""
        self.overhead = Ema(0.0, alpha=0.05)
        """Hub time per round outside drafting (codec, event loop, thread hand-off)."""
        self.targets: dict[bytes, TargetProfile] = {}
        self.sessions: dict[int, SessionModel] = {}
        self.rejections = 0
        self.rejected_recently: dict[bytes, float] = {}
        self.hello_step = Ema()
        """Step times of every target that asked, admitted or not: N_max needs one even
        when nobody was admitted."""
        self.unwanted: frozenset[bytes] = frozenset()
        """The targets asked to move to another hub of their pool (``review``)."""
        self._over_since: float | None = None
        """Since when the hub has been over its limit (``review``)."""

    # --- the load model -------------------------------------------------------------

    def observe_draft(self, depth: int, nodes: int, seconds: float) -> None:
        self.draft.update([1.0, depth, nodes], seconds)

    def observe_overhead(self, seconds: float) -> None:
        self.overhead.update(seconds)

    def service_s(self, depth: int, nodes: int) -> float:
        """``S``: the hub's time for one round of this shape."""
        return self.services([(depth, nodes)])[0]

    def services(self, shapes: list[tuple[int, int]]) -> list[float]:
        """``S`` of each shape, the fit's weights read once."""
        c0, c1, c2 = self.draft.weights
        overhead = self.overhead.get(0.0)
        return [max(c0 + c1 * d + c2 * n, 1e-5) + overhead for d, n in shapes]

    def observe_commit(self, tag: int, accepted: int, depth: int, nodes: int,
                       verify_s: float, return_s: float | None, step_s: float,
                       floor: float = 0.0) -> None:
        """A round verified; ``floor``: the target's advice for the next tree (a serving
        target's COMMIT carries it)."""
        sm = self.sessions.get(tag)
        if sm is None:
            return
        sm.advised = floor
        target = sm.target
        target.report_step(step_s)
        if sm.choice.plain == 0 and depth > 0:
            # A tree its floor cut short counts to the depth chosen: E(d) is then what a
            # round of depth d yields with the floor, as the choice needs it.
            floored = sm.choice.floor > 0
            sm.acceptance.observe(max(depth, sm.choice.depth) if floored else depth, accepted)
            if floored and sm.choice.nodes:
                share = min(nodes / sm.choice.nodes, 1.0)
                sm.kept.update(share)
                target.kept.update(share)
            if verify_s > 0:
                target.verify.update([1.0, nodes], verify_s)
        if return_s is not None and verify_s > 0:
            target.t_c.update(max(return_s - verify_s, 0.0))

    # --- admission -------------------------------------------------------------------

    def join(self, identity: bytes, name: str, step_s: float, now: float) -> str | None:
        """Admit a target (None) or say why not. An admitted target keeps its slot until
        ``leave``; admission never drops or slows anyone already admitted."""
        if step_s > 0:
            self.hello_step.update(step_s)
        if identity in self.targets:
            self.targets[identity].report_step(step_s)
            return None
        limit = self.config.max_targets
        candidate = TargetProfile(name, step_s, self.hub_acceptance, self.config)
        reason = None
        if limit == AUTO:
            if not self._fits(candidate):
                reason = "saturated"
        elif limit and len(self.targets) >= int(limit):
            reason = f"at its admission limit of {limit} targets"
        if reason is not None:
            self.rejections += 1
            self.rejected_recently[identity] = now
            if len(self.rejected_recently) > 1024:
                self._forget_rejected(now)
            return reason
        self.rejected_recently.pop(identity, None)
        candidate.joined_at = now
        self.targets[identity] = candidate
        return None

    def leave(self, identity: bytes) -> None:
        target = self.targets.pop(identity, None)
        if target is not None:
            for tag in list(target.sessions):
                self.close(tag)

    def review(self, now: float) -> frozenset[bytes]:
        """Which admitted targets the hub would rather lose (each of their PROPOSEs says
        ``leave``), at ``now``: once it has been over its limit (N_max under
        ``--max-targets auto``, else the number given) for ``OVER_S``, as many as it is
        over, among those admitted at least ``OVER_S`` ago. Those asked already come first
        while they are admitted (one that left counts until its peer grace ends, and a
        newly chosen one would move too); then the ones the hub serves least well: the
        lowest predicted tokens/s per session against their standalone speed (a target
        with no speculating session gains nothing here now), the latest admitted among
        equals. Admission never drops anyone; a target asked to leave moves only to a hub
        of its pool with room, and stays where there is none. Kept in ``unwanted``."""
        limit = self.config.max_targets
        cap = self.n_max() if limit == AUTO else int(limit) if limit else None
        over = len(self.targets) - cap if cap is not None else 0
        if over <= 0:
            self._over_since, self.unwanted = None, frozenset()
            return self.unwanted
        if self._over_since is None:
            self._over_since = now
        if now - self._over_since < OVER_S:
            return self.unwanted
        rates_of = self._rates_now()

        def gain(target: TargetProfile) -> float:
            step, rates = target.step_s(), rates_of(target)
            return sum(rates) / len(rates) * step if rates and step > 0 else 1.0

        order = sorted((identity not in self.unwanted, gain(t), -n, identity)
                       for n, (identity, t) in enumerate(self.targets.items())
                       if identity in self.unwanted or now - t.joined_at >= OVER_S)
        self.unwanted = frozenset(identity for *_, identity in order[:over])
        return self.unwanted

    def _fits(self, new: TargetProfile) -> bool:
        """Whether, with ``new`` speculating at some shape, every speculating session (and
        ``new``) still decodes at least as fast as its target alone, each target's
        acceptance counted CONFIDENCE standard errors below its estimate (``new``'s is the
        hub's curve): N_max's rule, with each target's own estimates, and the doubt a
        decision that cannot be undone calls for."""
        if new.step_s() <= 0:
            return True
        load = self._load()
        for target in self.targets.values():
            if not target.sessions:
                load += self._typical_s(target)
        newcomer, tokens = self._admission_tokens()
        probe = SessionModel(new, Acceptance(parent=new.acceptance))
        for depth, _, s, z, _ in self._rounds(probe, self.config.shapes()):
            e = newcomer[min(depth, MAX_AUTO_DEPTH)]
            if e / max(s + z, load + s) >= 1.0 / new.step_s() \
                    and self._others_keep_up(load + s, newcomer, tokens):
                return True
        return False

    def _typical_s(self, target: TargetProfile) -> float:
        """Hub time of an admitted target between sessions, at its best shape."""
        sm = SessionModel(target, Acceptance(parent=target.acceptance))
        return min((s for _, _, s, _, _ in self._rounds(sm, self.config.shapes())), default=0.0)

    def _admission_tokens(self) -> tuple[list[float], dict[TargetProfile, list[float]]]:
        """``E(d)`` as admission counts it: for a newcomer, the hub's curve; for each
        admitted target, its own estimate shrunk toward the hub's by the share of their
        difference that its sampling noise explains (empirical Bayes). Each is lowered by
        CONFIDENCE standard errors, taken at the typical depth.

        A target's estimate rests on a few hundred rounds at most, and the slowest of a
        dozen identical targets reads about 1.5 standard errors low: judged raw, that one
        would stop admission well below N_max. So targets count as alike (the hub's curve
        for all) unless their estimates differ by more than their noise explains (a
        chi-square test, CONFIDENCE standard deviations over its mean); targets that do
        differ keep their own curves, shrunk by how much of the spread is noise."""
        hub = self.hub_acceptance
        pooled = hub.expected_tokens()
        depth = min(self.typical()[4], MAX_AUTO_DEPTH)
        hub_noise = _sampling_variance(hub, depth)
        rows = []
        for target in self.targets.values():
            own = target.acceptance
            if own.rounds() <= 0:
                continue
            curve = own.expected_tokens()
            noise = _sampling_variance(own, depth)
            rows.append((target, curve, (curve[depth] - pooled[depth]) ** 2, noise))
        spread, n = 0.0, len(rows)
        chi2 = sum(dev / noise for _, _, dev, noise in rows if noise > 0)
        if n and chi2 > n + CONFIDENCE * math.sqrt(2 * n):
            spread = max(sum(dev - noise for _, _, dev, noise in rows) / n, 0.0)
        tokens = {}
        for target, curve, _, noise in rows:
            w = spread / (spread + noise) if spread + noise > 0 else 0.0
            doubt = CONFIDENCE * math.sqrt(w * w * noise + (1 - w) ** 2 * hub_noise)
            tokens[target] = [max(h + w * (x - h) - doubt, 1.0)
                           for h, x in zip(pooled, curve, strict=True)]
        return [self._confident(h, depth) for h in pooled], tokens

    def _others_keep_up(self, load: float, newcomer: list[float],
                        tokens: dict[TargetProfile, list[float]]) -> bool:
        """Whether every speculating session keeps its standalone speed at ``load``, its
        target's acceptance as admission counts it (a target with no rounds yet: as a
        newcomer's)."""
        for sm in self.sessions.values():
            step = sm.target.step_s()
            if not sm.s or step <= 0:
                continue
            e = tokens.get(sm.target, newcomer)[min(sm.choice.depth, MAX_AUTO_DEPTH)]
            if e / max(sm.s + sm.z, load) < 1.0 / step:
                return False
        return True

    # --- sessions and shapes -----------------------------------------------------------

    def open(self, tag: int, identity: bytes, step_s: float = 0.0,
             shared_cores: bool = False, batched: bool = False) -> None:
        target = self.targets.get(identity)
        if target is None:
            target = self.targets[identity] = TargetProfile(
                identity.hex()[:8], step_s, self.hub_acceptance, self.config)
        else:
            target.report_step(step_s)
        target.shared_cores = shared_cores
        target.sessions.add(tag)
        self.sessions[tag] = SessionModel(target, Acceptance(parent=target.acceptance),
                                          batched=batched,
                                          kept=Ema(target.kept.get(1.0), alpha=0.1, prior=2))

    def close(self, tag: int) -> None:
        sm = self.sessions.pop(tag, None)
        if sm is not None:
            sm.target.sessions.discard(tag)

    def _round(self, sm: SessionModel, depth: int, nodes: int) -> tuple[float, float, float]:
        """(S, Z, E) of one round of this shape."""
        return self._rounds(sm, [(depth, nodes)])[0][2:]

    def _rounds(self, sm: SessionModel, shapes: list[tuple[int, int]]
                ) -> list[tuple[int, int, float, float, float]]:
        """(depth, nodes, S, Z, E) of a round of each shape. The hub asks for every shape
        each round on its event loop, which the drafting thread waits on for the
        interpreter: each estimate is read once here, not once a shape."""
        target = sm.target
        t_c = target.t_c.get(self.config.t_c_prior_s)
        base, slope = target.verify_line()
        slope *= sm.kept.get(1.0)
        expected = sm.acceptance.expected_tokens()
        return [(d, n, s, t_c + max(base + slope * n, 0.0), expected[min(d, MAX_AUTO_DEPTH)])
                for (d, n), s in zip(shapes, self.services(shapes), strict=True)]

    def _load(self) -> float:
        return sum(sm.s for sm in self.sessions.values())

    def choose(self, tag: int) -> Choice:
        """The shape of this session's next round: fixed, or the one that maximises the
        hub's total goodput while no session falls below its standalone speed."""
        sm = self.sessions[tag]
        if not self.config.adaptive:
            depth, nodes = self.config.shapes()[0]
            return self._set(sm, Choice(depth, nodes), *self._round(sm, depth, nodes))
        others = [o for t, o in self.sessions.items() if t != tag and o.s]
        load = sum(o.s for o in others)
        cycles = [(o.e, o.s + o.z) for o in others]
        slowest = max((cycle for _, cycle in cycles), default=0.0)

        def others_rate(slow: float, total_load: float) -> float:
            return sum(session_rate(e, cycle, slow, total_load) for e, cycle in cycles)

        step = sm.target.step_s()
        standalone = 1.0 / step if step > 0 else 0.0
        best, best_total, probe = None, others_rate(slowest, load) + standalone, None
        for depth, nodes, s, z, e in self._rounds(sm, self.config.shapes()):
            slow = max(s + z, slowest)
            own = session_rate(e, s + z, slow, load + s)
            total = own + others_rate(slow, load + s)
            if depth <= PROBE_DEPTH and (probe is None or own > probe[0]):
                probe = (own, depth, nodes, s, z, e)
            if own >= TREE_MARGIN * standalone and total > best_total:
                best, best_total = (own, depth, nodes, s, z, e), total
        target = sm.target
        if best is not None:
            target.probes.trees()
            own, depth, nodes, s, z, e = best
            return self._set(sm, Choice(depth, nodes), s, z, e, own)
        if target.probes.plain():
            own, depth, nodes, s, z, e = probe
            return self._set(sm, Choice(depth, nodes, probe=True), s, z, e, own)
        return self._set(sm, Choice(plain=self.config.plain_tokens), 0.0, 0.0, 1.0)

    def _set(self, sm: SessionModel, choice: Choice, s: float, z: float, e: float,
             rate: float | None = None) -> Choice:
        """Record the choice; a tree's carries the floor at the session's predicted rate
        (default: its own round's, ``e / (s + z)``), or a batched session's the floor its
        target advised."""
        if choice.depth and self.config.prune:
            if sm.batched:
                floor = min(sm.advised, MAX_FLOOR)
            else:
                if rate is None:
                    rate = e / (s + z) if s + z > 0 else 0.0
                floor = self.floor(sm.target, rate)
            choice = replace(choice, floor=floor)
        sm.choice, sm.s, sm.z, sm.e = choice, s, z, e
        return choice

    def floor(self, target: TargetProfile, rate: float) -> float:
        """The draft path probability below which a tree node costs its session more than
        it adds, for a session committing ``rate`` tokens a second. A node adds its chance
        of being accepted, which the head's path probability tracks (with the shipped
        head, nodes of path probability 0.02, 0.04, 0.07 and 0.14 were accepted 2.9%, 5.1%,
        8.3% and 18% of the time over 10,000 held-out nodes), and costs the target's verify
        time per node, ``slope``: it pays where ``p >= slope · rate``. A session that waits
        on others' drafts commits less than its own round trip allows, and a node's verify
        time then delays it less: its rate is the model's, the queue included."""
        slope = target.verify_line()[1]
        return min(max(slope * rate, 0.0), MAX_FLOOR)

    # --- what the model predicts ---------------------------------------------------------

    def _rates_now(self) -> Callable[[TargetProfile], list[float]]:
        """Each session's predicted tokens/s of a target, at the hub's load now (read once
        for all the targets asked about)."""
        load = self._load()
        slowest = max((sm.s + sm.z for sm in self.sessions.values() if sm.s), default=0.0)
        return lambda target: [self.predicted_tok_s(self.sessions[t], slowest, load)
                               for t in target.sessions]

    def predicted_tok_s(self, sm: SessionModel, slowest: float, load: float) -> float:
        if not sm.s:
            step = sm.target.step_s()
            return 1.0 / step if step > 0 else 0.0
        return session_rate(sm.e, sm.s + sm.z, slowest, load)

    def typical(self) -> tuple[float, float, float, float, int]:
        """(S, Z, E, t_step, depth) of a typical target at its best fixed shape: the
        hub-wide acceptance and the mean of the admitted targets' measurements. Each
        target's estimates are read once: a hub with a thousand targets asks this at
        every STATS, on its event loop."""
        targets = list(self.targets.values())
        steps = [step for t in targets if (step := t.step_s()) > 0]
        step = sum(steps) / len(steps) if steps else self.hello_step.get(0.0)
        prior = self.config.t_c_prior_s
        t_c = sum(t.t_c.get(prior) for t in targets) / len(targets) if targets else prior
        lines = [(base, slope * t.kept.get(1.0)) for t in targets
                 if t.verify.samples or t.step.value for base, slope in [t.verify_line()]]
        expected = self.hub_acceptance.expected_tokens()
        best = None
        for depth, nodes in self.config.shapes():
            s = self.service_s(depth, nodes)
            verify = [max(base + slope * nodes, 0.0) for base, slope in lines]
            z = t_c + (sum(verify) / len(verify) if verify else step)
            e = float(expected[depth])
            key = (_n_max(s, z, self._confident(e, depth), step) or 0, e / (s + z))
            if best is None or key > best[0]:
                best = (key, s, z, e, depth)
        _, s, z, e, depth = best
        return s, z, e, step, depth

    def _confident(self, e: float, depth: int) -> float:
        """The hub's ``E(depth)`` less CONFIDENCE standard errors: what admission counts on
        for a target it has not seen."""
        noise = _sampling_variance(self.hub_acceptance, min(depth, MAX_AUTO_DEPTH))
        return max(e - CONFIDENCE * math.sqrt(noise), 1.0)

    def n_max(self) -> int | None:
        """The largest N of typical targets that all stay at or above standalone speed,
        by the acceptance admission counts on (CONFIDENCE standard errors below the
        hub's estimate): where admission stops when the targets are alike. None while no
        target has reported its step time."""
        s, z, e, step, depth = self.typical()
        return _n_max(s, z, self._confident(e, depth), step)

    def n_full(self) -> int:
        s, z, *_ = self.typical()
        return _n_full(s, z)

    def _forget_rejected(self, now: float) -> None:
        """Rejected targets count as waiting until they have not asked for a while."""
        for identity, since in list(self.rejected_recently.items()):
            if now - since > max(10.0, 5 * self.config.retry_after_s):
                del self.rejected_recently[identity]

    def snapshot(self, now: float, targets: bool = True) -> ControlReport:
        """The control plane's state; ``targets`` adds an entry per target (None without)."""
        load = self._load()
        rates_of = self._rates_now()
        self._forget_rejected(now)
        s, z, e, step, depth = self.typical()
        per_target = None
        if targets:
            per_target = []
            for target in list(self.targets.values())[:MAX_ENTRIES]:
                rates = rates_of(target)
                own = target.step_s()
                per_target.append(TargetEntry(
                    name=target.name, sessions=len(target.sessions), step_ms=1e3 * own,
                    standalone_tok_s=1.0 / own if own else None,
                    predicted_tok_s=sum(rates) if rates else None,
                    t_c_ms=1e3 * target.t_c.get(self.config.t_c_prior_s),
                    verify_ms_fit=[1e3 * w for w in target.verify.weights],
                    verify_samples=target.verify.samples, shared_cores=target.shared_cores,
                    kept_share=target.kept.get(1.0)))
        return ControlReport(
            depth=self.config.depth, max_targets=self.config.max_targets,
            admitted=len(self.targets), rejections=self.rejections,
            rejected_waiting=len(self.rejected_recently),
            n_max=_n_max(s, z, self._confident(e, depth), step), n_full=_n_full(s, z),
            typical=Typical(S_ms=1e3 * s, Z_ms=1e3 * z, tau=e, step_ms=1e3 * step,
                            depth=depth),
            draft_ms_fit=[1e3 * w for w in self.draft.weights],
            overhead_ms=1e3 * self.overhead.get(0.0),
            hub_load_ms=1e3 * load,
            acceptance_by_depth=self.hub_acceptance.by_depth(),
            unwanted=len(self.unwanted), targets=per_target)


def session_rate(e: float, cycle: float, slowest: float, load: float) -> float:
    """Tokens/s of a session committing ``e`` a round of round trip ``cycle``, beside
    sessions whose longest round trip is ``slowest``, at the hub's ``load``: its round
    stretched toward the slowest as the load nears it (IN_STEP_POWER), never shorter than
    the load."""
    busy = min(load / slowest, 1.0) ** IN_STEP_POWER if slowest > 0 else 0.0
    return e / max(cycle + busy * (slowest - cycle), load, 1e-9)


def _n_max(s: float, z: float, e: float, step: float) -> int | None:
    """Targets that can share a hub of service time ``s`` while each, returning after
    ``z`` with ``e`` tokens a round, keeps its standalone ``1 / step``: N·S <= E·t_step,
    and none if even one cannot (S + Z > E·t_step). None without a step time."""
    if not step:
        return None
    return math.floor(e * step / s) if s + z <= e * step else 0


def _sampling_variance(curve: Acceptance, depth: int) -> float:
    """Variance of ``curve``'s ``E(depth)`` from the rounds it counted: the mean of ``n``
    rounds' tokens ``X``, drawn toward its prior (worth ``pseudo`` rounds), varies as
    ``n·Var(X) / (n + pseudo)²``. No rounds, no sampling noise: the prior alone (the hub's
    is a deliberately low curve) admits the first targets."""
    n = curve.rounds()
    return curve.tokens_variance(depth) * n / (n + curve.pseudo) ** 2


def _n_full(s: float, z: float) -> int:
    """StarSD's N_full = ceil(Z / S) + 1: from here on the hub never idles."""
    return math.ceil(z / s - 1e-9) + 1
