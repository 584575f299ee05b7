"""The hub's control plane: an online load model, admission (N_max) and tree-shape choice.

StarSD's model (DESIGN.md), generalised to sessions that differ. Session j drafting a tree
of depth d_j with n_j nodes costs the hub ``S_j = draft(d_j, n_j) + overhead`` a round,
then waits ``Z_j = t_c + t_v(n_j)`` for its target, and commits ``E_j(d_j)`` tokens. The
hub drafts one request at a time, so every speculating session completes one round every
``max(S_j + Z_j, sum_k S_k)`` seconds. A plain-decoding session costs the hub nothing and
commits one token every ``t_step``, its target's standalone speed.

Admission keeps every admitted target at or above its standalone speed; the tree choice
maximises the hub's total goodput under the same rule, and falls back to plain decoding
where no tree pays. The hub calls this module; it never touches sockets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

AUTO = "auto"
MAX_AUTO_DEPTH = 8
PLAIN_TOKENS = 16
"""Tokens a target decodes on its own per plain round: the round trip is paid once."""
MAX_PROBE_GAP = 8
"""Plain rounds between two probes of a plain session grow 1, 2, 4, ... up to this."""
MARGIN = 1.02
"""A tree must beat plain decoding by this factor: the estimates are noisy, plain is not."""


@dataclass
class LinearFit:
    """``y ≈ w·x`` by exponentially weighted least squares, pulled toward a prior ``w0``.

    ``forget`` sets the memory (about ``1 / (1 - forget)`` samples) so the fit follows a
    machine whose speed drifts; the prior keeps directions the data never spans sane.
    """

    prior: np.ndarray
    forget: float = 0.97
    strength: float = 0.5
    a: np.ndarray = field(init=False)
    b: np.ndarray = field(init=False)
    samples: int = 0

    def __post_init__(self) -> None:
        self.prior = np.asarray(self.prior, float)
        self.a = np.zeros((len(self.prior), len(self.prior)))
        self.b = np.zeros(len(self.prior))
        self._w = self.prior.copy()

    def update(self, x, y: float) -> None:
        x = np.asarray(x, float)
        self.a = self.forget * self.a + np.outer(x, x)
        self.b = self.forget * self.b + x * y
        self.samples += 1
        scale = self.strength * np.eye(len(x))
        self._w = np.linalg.solve(self.a + scale, self.b + scale @ self.prior)

    def predict(self, x) -> float:
        return float(np.asarray(x, float) @ self._w)

    @property
    def weights(self) -> list[float]:
        return self._w.tolist()


@dataclass
class Ema:
    value: float | None = None
    alpha: float = 0.1

    def update(self, x: float) -> float:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        return self.value

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


class Acceptance:
    """Per-depth conditional acceptance ``beta_k = P(node at depth k accepted | depth k-1
    was)``, from decayed counts, shrunk toward a prior curve (the parent's) when data is
    thin: a new session starts from its target's curve, which starts from the hub's."""

    def __init__(self, parent: Acceptance | None = None, prior: float = 0.5,
                 pseudo: float = 8.0, forget: float = 0.995):
        self.parent, self.prior, self.pseudo, self.forget = parent, prior, pseudo, forget
        self.hits = np.zeros(MAX_AUTO_DEPTH + 1)
        self.trials = np.zeros(MAX_AUTO_DEPTH + 1)

    def observe(self, depth: int, accepted: int) -> None:
        """A round that drafted ``depth`` layers and had ``accepted`` nodes accepted."""
        depth = min(depth, MAX_AUTO_DEPTH)
        self.hits *= self.forget
        self.trials *= self.forget
        reached = min(accepted + 1, depth)
        self.trials[1:reached + 1] += 1
        self.hits[1:min(accepted, depth) + 1] += 1
        if self.parent is not None:
            self.parent.observe(depth, accepted)

    def betas(self) -> np.ndarray:
        """``beta_k`` for k = 1..MAX_AUTO_DEPTH (index 0 unused, 1.0).

        Deep nodes are tried less often, so each depth's prior carries what shallower data
        says: the parent's ``beta_k`` scaled by how this curve compares with the parent's
        one layer up (at the hub, which has no parent, the previous layer's estimate)."""
        parent = self.parent.betas() if self.parent is not None else None
        out = np.ones(MAX_AUTO_DEPTH + 1)
        for k in range(1, MAX_AUTO_DEPTH + 1):
            if parent is None:
                prior = out[k - 1] if k > 1 else self.prior
            else:
                prior = parent[k] * out[k - 1] / max(parent[k - 1], 1e-6)
            prior = min(max(prior, 0.0), 1.0)
            out[k] = (self.hits[k] + self.pseudo * prior) / (self.trials[k] + self.pseudo)
        return out

    def expected_tokens(self) -> np.ndarray:
        """``E(d)`` for d = 0..MAX_AUTO_DEPTH: committed tokens a round, the bonus included."""
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.betas()[1:]))])

    def by_depth(self) -> list[float]:
        """Unconditional acceptance of the node at depth k, as the metrics report it."""
        return np.cumprod(self.betas()[1:]).round(4).tolist()


@dataclass(frozen=True)
class Choice:
    """One round's plan for a session: a tree of ``depth``/``nodes``, or ``plain`` tokens
    decoded by the target alone."""

    depth: int = 0
    nodes: int = 0
    plain: int = 0
    probe: bool = False

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

    @property
    def adaptive(self) -> bool:
        return self.depth == AUTO

    def nodes_for(self, depth: int) -> int:
        return max(1, min(self.max_nodes, self.topk * depth))

    def shapes(self) -> list[tuple[int, int]]:
        depths = range(1, MAX_AUTO_DEPTH + 1) if self.adaptive else [int(self.depth)]
        return [(d, self.nodes_for(d)) for d in depths]


class TargetModel:
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

    def step_s(self) -> float:
        return self.step.get(0.0)

    def verify_s(self, nodes: int) -> float:
        if not self.verify.samples and self.step.value:
            return self.step.value * (1 + self.config.verify_slope_prior * nodes)
        return max(self.verify.predict([1.0, nodes]), 0.0)


@dataclass
class SessionModel:
    target: TargetModel
    acceptance: Acceptance
    choice: Choice = Choice()
    s: float = 0.0
    """Hub time per round at the current choice (0 when plain)."""
    z: float = 0.0
    e: float = 1.0
    plain_streak: int = 0
    probes: int = 0


class Controller:
    """The load model plus the two decisions the hub asks for: admit a target, shape a round."""

    def __init__(self, config: ControlConfig):
        self.config = config
        self.hub_acceptance = Acceptance()
        self.draft = LinearFit([0.0, 1e-3, 0.0])
        """Seconds to draft as ``c0 + c1·depth + c2·nodes``."""
        self.overhead = Ema(0.0, alpha=0.05)
        """Hub time per round outside drafting (codec, event loop, thread hand-off)."""
        self.targets: dict[bytes, TargetModel] = {}
        self.sessions: dict[int, SessionModel] = {}
        self.rejections = 0
        self.rejected_recently: dict[bytes, float] = {}

    # --- the load model -------------------------------------------------------------

    def observe_draft(self, depth: int, nodes: int, seconds: float) -> None:
        self.draft.update([1.0, depth, nodes], seconds)

    def observe_overhead(self, seconds: float) -> None:
        self.overhead.update(seconds)

    def service_s(self, depth: int, nodes: int) -> float:
        """``S``: the hub's time for one round of this shape."""
        return max(self.draft.predict([1.0, depth, nodes]), 1e-5) + self.overhead.get(0.0)

    def observe_commit(self, tag: int, accepted: int, depth: int, nodes: int,
                       verify_s: float, return_s: float | None, step_s: float) -> None:
        sm = self.sessions.get(tag)
        if sm is None:
            return
        target = sm.target
        if step_s > 0:
            target.step.update(step_s)
        if sm.choice.plain == 0 and depth > 0:
            sm.acceptance.observe(depth, accepted)
            if verify_s > 0:
                target.verify.update([1.0, nodes], verify_s)
        if return_s is not None and verify_s > 0:
            target.t_c.update(max(return_s - verify_s, 0.0))

    # --- admission -------------------------------------------------------------------

    def join(self, identity: bytes, name: str, step_s: float, now: float) -> str | None:
        """Admit a target (None) or say why not. An admitted target keeps its slot until
        ``leave``; admission never drops or slows anyone already admitted."""
        if identity in self.targets:
            if step_s > 0:
                self.targets[identity].step.update(step_s)
            return None
        limit = self.config.max_targets
        candidate = TargetModel(name, step_s, self.hub_acceptance, self.config)
        reason = None
        if limit == AUTO:
            if not self._fits(candidate):
                reason = "saturated"
        elif limit and len(self.targets) >= int(limit):
            reason = f"at its admission limit of {limit} targets"
        if reason is not None:
            self.rejections += 1
            self.rejected_recently[identity] = now
            return reason
        self.rejected_recently.pop(identity, None)
        self.targets[identity] = candidate
        return None

    def leave(self, identity: bytes) -> None:
        target = self.targets.pop(identity, None)
        if target is not None:
            for tag in list(target.sessions):
                self.close(tag)

    def _fits(self, new: TargetModel) -> bool:
        """Whether, with ``new`` speculating at its best shape, every speculating session
        (and ``new``) still decodes at least as fast as its target alone."""
        if new.step_s() <= 0:
            return True
        probe = SessionModel(new, Acceptance(parent=new.acceptance))
        load = self._load()
        for target in self.targets.values():
            if not target.sessions:
                load += self._typical_s(target)
        best = None
        for depth, nodes in self.config.shapes():
            s, z, e = self._round(probe, depth, nodes)
            if e / max(s + z, load + s) >= 1.0 / new.step_s():
                if self._others_keep_up(load + s) and (best is None or s < best):
                    best = s
        return best is not None

    def _typical_s(self, target: TargetModel) -> float:
        """Hub time of an admitted target between sessions, at its best shape."""
        sm = SessionModel(target, Acceptance(parent=target.acceptance))
        return min((self._round(sm, d, n)[0] for d, n in self.config.shapes()), default=0.0)

    def _others_keep_up(self, load: float) -> bool:
        for sm in self.sessions.values():
            step = sm.target.step_s()
            if sm.s and step > 0 and sm.e / max(sm.s + sm.z, load) < 1.0 / step:
                return False
        return True

    # --- sessions and shapes -----------------------------------------------------------

    def open(self, tag: int, identity: bytes, step_s: float = 0.0) -> None:
        target = self.targets.get(identity)
        if target is None:
            target = self.targets[identity] = TargetModel(
                identity.hex()[:8], step_s, self.hub_acceptance, self.config)
        elif step_s > 0:
            target.step.update(step_s)
        target.sessions.add(tag)
        self.sessions[tag] = SessionModel(target, Acceptance(parent=target.acceptance))

    def close(self, tag: int) -> None:
        sm = self.sessions.pop(tag, None)
        if sm is not None:
            sm.target.sessions.discard(tag)

    def _round(self, sm: SessionModel, depth: int, nodes: int) -> tuple[float, float, float]:
        s = self.service_s(depth, nodes)
        z = sm.target.t_c.get(self.config.t_c_prior_s) + sm.target.verify_s(nodes)
        return s, z, float(sm.acceptance.expected_tokens()[min(depth, MAX_AUTO_DEPTH)])

    def _load(self, skip: int | None = None) -> float:
        return sum(sm.s for tag, sm in self.sessions.items() if tag != skip)

    def choose(self, tag: int) -> Choice:
        """The shape of this session's next round: fixed, or the one that maximises the
        hub's total goodput while no session falls below its standalone speed."""
        sm = self.sessions[tag]
        if not self.config.adaptive:
            depth, nodes = self.config.shapes()[0]
            return self._set(sm, Choice(depth, nodes), *self._round(sm, depth, nodes))
        others = [o for t, o in self.sessions.items() if t != tag and o.s]
        load = sum(o.s for o in others)
        cycles = np.array([o.s + o.z for o in others])
        gains = np.array([o.e for o in others])

        def others_rate(total_load: float) -> float:
            return float((gains / np.maximum(cycles, total_load)).sum()) if others else 0.0

        step = sm.target.step_s()
        standalone = 1.0 / step if step > 0 else 0.0
        best, best_total, best_tree = None, others_rate(load) + standalone, None
        for depth, nodes in self.config.shapes():
            s, z, e = self._round(sm, depth, nodes)
            own = e / max(s + z, load + s)
            total = own + others_rate(load + s)
            if best_tree is None or total > best_tree[0]:
                best_tree = (total, depth, nodes, s, z, e)
            if own >= MARGIN * standalone and total > best_total:
                best, best_total = (depth, nodes, s, z, e), total
        if best is not None:
            sm.plain_streak = 0
            depth, nodes, s, z, e = best
            return self._set(sm, Choice(depth, nodes), s, z, e)
        sm.plain_streak += 1
        if sm.plain_streak > min(2 ** sm.probes, MAX_PROBE_GAP):
            sm.plain_streak = 0
            sm.probes += 1
            _, depth, nodes, s, z, e = best_tree
            return self._set(sm, Choice(depth, nodes, probe=True), s, z, e)
        return self._set(sm, Choice(plain=self.config.plain_tokens), 0.0, 0.0, 1.0)

    def _set(self, sm: SessionModel, choice: Choice, s: float, z: float, e: float) -> Choice:
        sm.choice, sm.s, sm.z, sm.e = choice, s, z, e
        return choice

    # --- what the model predicts ---------------------------------------------------------

    def predicted_tok_s(self, sm: SessionModel, load: float) -> float:
        if not sm.s:
            step = sm.target.step_s()
            return 1.0 / step if step > 0 else 0.0
        return sm.e / max(sm.s + sm.z, load)

    def typical(self) -> tuple[float, float, float, float, int]:
        """(S, Z, E, t_step, depth) of a typical target at its best fixed shape: the
        hub-wide acceptance and the mean of the admitted targets' measurements."""
        targets = list(self.targets.values())
        steps = [t.step_s() for t in targets if t.step_s() > 0]
        step = float(np.mean(steps)) if steps else 0.0
        t_c = float(np.mean([t.t_c.get(self.config.t_c_prior_s) for t in targets])) \
            if targets else self.config.t_c_prior_s
        expected = self.hub_acceptance.expected_tokens()
        best = None
        for depth, nodes in self.config.shapes():
            s = self.service_s(depth, nodes)
            verify = [t.verify_s(nodes) for t in targets if t.verify.samples or t.step.value]
            z = t_c + (float(np.mean(verify)) if verify else step)
            e = float(expected[depth])
            n_max = math.floor(e * step / s) if step and s + z <= e * step else 0
            key = (n_max, e / (s + z))
            if best is None or key > best[0]:
                best = (key, s, z, e, depth)
        _, s, z, e, depth = best
        return s, z, e, step, depth

    def n_max(self) -> int | None:
        """The largest N of typical targets that all stay at or above standalone speed;
        None while no target has reported its step time."""
        s, z, e, step, _ = self.typical()
        if not step:
            return None
        return math.floor(e * step / s) if s + z <= e * step else 0

    def n_full(self) -> int:
        s, z, *_ = self.typical()
        return math.ceil(z / s - 1e-9) + 1

    def snapshot(self, now: float) -> dict:
        load = self._load()
        for identity, since in list(self.rejected_recently.items()):
            if now - since > max(10.0, 5 * self.config.retry_after_s):
                del self.rejected_recently[identity]
        s, z, e, step, depth = self.typical()
        per_target = []
        for target in self.targets.values():
            rates = [self.predicted_tok_s(self.sessions[t], load) for t in target.sessions]
            per_target.append({
                "name": target.name, "sessions": len(target.sessions),
                "step_ms": 1e3 * target.step_s(),
                "standalone_tok_s": 1.0 / target.step_s() if target.step_s() else None,
                "predicted_tok_s": sum(rates) if rates else None,
                "t_c_ms": 1e3 * target.t_c.get(self.config.t_c_prior_s),
                "verify_ms_fit": [1e3 * w for w in target.verify.weights],
            })
        return {
            "depth": self.config.depth, "max_targets": self.config.max_targets,
            "admitted": len(self.targets), "rejections": self.rejections,
            "rejected_waiting": len(self.rejected_recently),
            "n_max": self.n_max(), "n_full": self.n_full(),
            "typical": {"S_ms": 1e3 * s, "Z_ms": 1e3 * z, "tau": e, "step_ms": 1e3 * step,
                        "depth": depth},
            "draft_ms_fit": [1e3 * w for w in self.draft.weights],
            "overhead_ms": 1e3 * self.overhead.get(0.0),
            "hub_load_ms": 1e3 * load,
            "acceptance_by_depth": self.hub_acceptance.by_depth(),
            "targets": per_target,
        }
