"""What a running hub or verifier says about itself (``STATS``): the launcher's live status
line and the ``starhub status`` table."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

import msgspec

from starhub.client.pool import pool_addresses
from starhub.wire.messages import ObserverCard, StatsQuery
from starhub.wire.reports import DrafterHealth, HubReport, VerifierReport
from starhub.wire.security import ClientSecurity, SecurityError, client_curve
from starhub.wire.text import printable

if TYPE_CHECKING:
    from starhub.client.connection import HubClient
    from starhub.launch.config import ServerSection, WorkerSection

T = TypeVar("T")


def observer_client(address: str, timeout_s: float = 5.0,
                    security: ClientSecurity | None = None, name: str = "status") -> HubClient:
    """A client that has sent an OBSERVER_CARD, so that the server's STATS include
    each target's (or edge session's) entries; a plain client gets aggregates only. It
    takes no admission slot. ``security``: how to connect (None: this process's default)."""
    # deferred: torch load only when this runs
    from starhub.client.connection import HubClient

    client = HubClient(address, timeout_s=timeout_s, security=security)
    try:
        client.request(ObserverCard(name=name))
    except BaseException:
        client.close()
        raise
    return client


def status_security(server: ServerSection, workers: WorkerSection,
                    addresses: str | Sequence[str] = ()) -> ClientSecurity | None:
    """The launcher asks for STATS as its workers connect: with their keys (a key per hub
    where ``curve_server`` lists one per hub of ``addresses``, the servers' addresses in
    the deployment's order), without CURVE where the server runs insecure, else with the
    local keys; None where this machine cannot read their keys (the status line then says
    why it has no numbers)."""
    try:
        curve = client_curve(workers.curve_secret, workers.curve_server,
                             pool_addresses(addresses) if addresses else ())
    except SecurityError:
        return None
    return ClientSecurity(curve, insecure=curve is None and server.insecure)


def query_stats(address: str, timeout_s: float = 5.0, peers: bool = False,
                security: ClientSecurity | None = None, observe: bool = True
                ) -> HubReport | VerifierReport:
    """One ``STATS`` request; ``peers`` adds each peer's totals (``counters.peers``).
    ``observe`` sends an OBSERVER_CARD first, for per-target entries."""
    # deferred: torch load only when this runs
    from starhub.client.connection import HubClient

    client = (observer_client(address, timeout_s, security) if observe
              else HubClient(address, timeout_s=timeout_s, security=security))
    try:
        return client.request(StatsQuery(counters=peers, peers=peers)).body
    finally:
        client.close()


def ask_each(addresses: Sequence[str], ask: Callable[[str], T]) -> dict[str, T | Exception]:
    """``ask(address)`` of every server at once, so that a hung one delays the answers by
    its own timeout only, not by the sum of them all: each one's result, or the exception
    it raised, in the order of ``addresses``."""
    def one(address: str) -> T | Exception:
        try:
            return ask(address)
        except Exception as exc:  # kept, in its place, for the caller to report
            return exc

    if len(addresses) == 1:
        return {addresses[0]: one(addresses[0])}
    with ThreadPoolExecutor(len(addresses), thread_name_prefix="stats") as pool:
        return dict(zip(addresses, pool.map(one, addresses), strict=True))


class StatusPoller:
    """Asks the server (every hub of a pool: ``address`` comma-separated) for ``STATS``
    every ``interval_s`` in a thread and keeps one line: peers up, rounds per second over
    the last interval, τ and tokens per second, over the whole pool."""

    def __init__(self, address: str, interval_s: float, expected: int, edge: bool,
                 security: ClientSecurity | None = None):
        self.addresses = pool_addresses(address)
        self.interval_s, self.security = interval_s, security
        self.expected, self.edge = expected, edge
        self.line: str | None = None
        self._stop = threading.Event()
        self._last: dict[str, tuple[float, float, float]] = {}
        """Each server's time, rounds and tokens at its last answer: rates are the sums of
        each one's own differences, so a hub that stops answering never makes them
        negative."""
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> StatusPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            bodies, failed = {}, ""
            answers = ask_each(self.addresses, lambda address: query_stats(
                address, timeout_s=max(self.interval_s, 2.0), security=self.security,
                observe=False))
            for address, answer in answers.items():
                if isinstance(answer, Exception):  # a status line must never stop the run
                    failed = f"no STATS from {address}: {answer}"
                else:
                    bodies[address] = answer
            self.line = self.summarize(bodies, time.monotonic()) if bodies else failed
            self._stop.wait(self.interval_s)

    def summarize(self, bodies: dict[str, HubReport | VerifierReport] | HubReport
                  | VerifierReport, now: float) -> str:
        """One line over ``bodies`` (one server's report, or each answering hub's of a
        pool, by address)."""
        if not isinstance(bodies, dict):
            bodies = {self.addresses[0]: bodies}
        rate = tok = 0.0
        for address, b in bodies.items():
            rounds, tokens = (b.rounds, b.committed) if isinstance(b, VerifierReport) \
                else (b.rounds, b.tokens)
            last = self._last.get(address)
            if last is not None and now > last[0]:
                rate += (rounds - last[1]) / (now - last[0])
                tok += (tokens - last[2]) / (now - last[0])
            self._last[address] = (now, rounds, tokens)
        bodies = list(bodies.values())
        body = bodies[0]
        if isinstance(body, VerifierReport):
            up, rounds, tokens = body.drafters, body.rounds, body.committed
            tau = tokens / rounds if rounds else 0.0
            who = "drafters"
        else:
            up, rounds, tokens = (sum(b.peers for b in bodies), sum(b.rounds for b in bodies),
                                  sum(b.tokens for b in bodies))
            tau = sum(b.mean_accept_len * b.rounds for b in bodies) / rounds if rounds \
                else body.mean_accept_len
            who = "targets"
        line = (f"{who} up {up}/{self.expected} | {rate:.1f} rounds/s | tau {tau:.2f} | "
                f"{tok:.1f} tok/s")
        if len(self.addresses) > 1:
            line += f" | hubs up {len(bodies)}/{len(self.addresses)}"
        for b in bodies:
            drafting = b.drafting if isinstance(b, HubReport) else None
            if drafting is not None and not drafting.healthy:
                line += " | drafting process restarting"
            elif drafting is not None and drafting.restarts:
                line += f" | drafting process restarted {drafting.restarts}x"
        return line


def _fmt(value, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                     for r in rows)


def drafting_line(health: DrafterHealth) -> str:
    """A hub's drafting process: up or restarting, its restarts, and the last loss."""
    if not health.process:
        return ""
    state = "up" if health.healthy else "RESTARTING (no targets admitted meanwhile)"
    line = (f"\ndrafting process {health.pid}: {state}, restarts {health.restarts}, "
            f"sessions ended {health.sessions_ended}")
    if health.events:
        last = health.events[-1]
        back = f"back after {last.restart_s:.1f}s" if last.restart_s else "not back yet"
        line += (f"\n  last lost at {time.strftime('%H:%M:%S', time.localtime(last.at))}: "
                 f"{last.reason} ({last.sessions} sessions ended, {back})")
    return line


def hub_report(address: str, body: HubReport) -> str:
    """The ``starhub status`` text for a hub: its settings and load, then one row per target.
    Names come from the server's report: printable and short here too, whatever it sent."""
    head = (f"hub {address}: {printable(body.drafter)} drafter, "
            f"depth {printable(str(body.depth))}, "
            f"topk {body.topk}, max_nodes {body.max_nodes}, threads {body.threads}\n"
            f"peers {body.peers}, sessions {body.active_sessions}, admitted "
            f"{body.admitted} (max_targets {printable(str(body.max_targets))}, n_max "
            f"{_fmt(body.n_max, 'd')}, n_full {_fmt(body.n_full, 'd')}), "
            f"rejections {body.rejections}\n"
            f"rounds {body.rounds}, r_q {_fmt(body.r_q)}/s, load "
            f"{_fmt(body.load, '.2f')}, t_s {_fmt(body.t_s_ms, '.2f')} ms, "
            f"tau {_fmt(body.mean_accept_len, '.2f')}, "
            f"{_fmt(body.system_tok_s)} tok/s, plain rounds {body.plain_rounds}"
            f"{drafting_line(body.drafting)}")
    control = {t.name: t for t in body.control.targets or []}
    rows = [["target", "state", "rounds", "tokens", "tok/s", "step ms", "alone tok/s",
             "predicted tok/s", "t_c ms", "nodes kept", "shares cores"]]
    peers = body.counters.peers if body.counters else None
    for name, rounds, _queue, _draft, _commits, tokens, first, last in peers or []:
        c = control.get(name)
        rows.append([printable(name), "admitted" if c else "-", str(rounds), str(tokens),
                     _fmt(tokens / (last - first) if last > first else None),
                     *(_fmt(getattr(c, key, None)) for key in
                       ("step_ms", "standalone_tok_s", "predicted_tok_s", "t_c_ms")),
                     _fmt(c.kept_share, ".2f") if c else "-",
                     ("yes" if c.shared_cores else "no") if c else "-"])
    if len(rows) == 1:
        return head + "\nno targets yet"
    return head + "\n\n" + table(rows)


def verifier_report(address: str, body: VerifierReport) -> str:
    rounds = body.rounds
    head = (f"verifier {address}: schedule {printable(body.schedule)}, budget "
            f"{body.budget}, max_batch {body.max_batch or 'auto'}, threads "
            f"{body.threads}\n"
            f"drafters {body.drafters}, sessions {body.sessions}, steps "
            f"{body.steps}, rounds {rounds}, mean batch "
            f"{_fmt(body.mean_batch, '.2f')}, verify "
            f"{_fmt(body.verify_ms_per_step)} ms/step, tau "
            f"{_fmt(body.committed / rounds if rounds else None, '.2f')}")
    sched = msgspec.to_builtins(body.scheduler)
    return head + f"\nscheduler: {json.dumps(sched, sort_keys=True)}"


def server_health(url: str, timeout_s: float = 5.0) -> dict:
    """A serving target's ``/health``: model, hub, load and speculation figures."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 503 while shutting down still has a body
        return json.loads(exc.read())


def serve_report(url: str, body: dict) -> str:
    """The ``starhub status`` text for a serving target."""
    hub = body.get("hub") or "none"
    return (f"server {url}: model {body.get('model')}, {body.get('status')}\n"
            f"hub {hub} ({'connected' if body.get('hub_connected') else 'not connected'})\n"
            f"load {body.get('inflight')}/{body.get('max_concurrency')} requests "
            f"({body.get('running')} decoding, {body.get('waiting')} prefilling), "
            f"tau {_fmt(body.get('mean_accept_len'), '.2f')}, mean verify batch "
            f"{_fmt(body.get('mean_verify_batch'), '.2f')}, output tokens "
            f"{body.get('output_tokens')}")


def report(address: str, body: HubReport | VerifierReport) -> str:
    if isinstance(body, VerifierReport):
        return verifier_report(address, body)
    return hub_report(address, body)


def pool_report(found: dict[str, HubReport | VerifierReport | str]) -> str:
    """The ``starhub status`` text for a pool of hubs: one line per hub (its load, admitted
    targets and N_max, or why it did not answer), where each target is, then each hub's
    own report."""
    rows = [["hub", "state", "load", "admitted", "n_max", "r_q/s", "tok/s", "targets"]]
    for address, body in found.items():
        if not isinstance(body, HubReport):
            state = body if isinstance(body, str) else "not a hub"
            rows.append([address, state, *["-"] * 6])
            continue
        names = sorted(printable(p[0]) for p in (body.counters.peers or [])) \
            if body.counters else []
        asked = body.control.unwanted
        rows.append([address, f"up, asks {asked} to move" if asked else "up",
                     _fmt(body.load, ".2f"), str(body.admitted),
                     _fmt(body.n_max, "d"), _fmt(body.r_q), _fmt(body.system_tok_s),
                     ", ".join(names) or "-"])
    up = sum(isinstance(b, HubReport) for b in found.values())
    parts = [f"pool of {len(found)} hubs, {up} answering", table(rows)]
    parts += [report(address, body) for address, body in found.items()
              if isinstance(body, HubReport)]
    return "\n\n".join(parts)
