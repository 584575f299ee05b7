"""The star across a real network link: the hub in one Linux network namespace, a target
in another, joined by a veth pair, with ``tc netem`` delay on both ends where the kernel
has it. It shows that hub and target need nothing but the link, and that the measured
communication time per round (``t_c``) follows the injected delay.

    python -m bench.netns --delay-ms 0,1,20 --prompts scripts/prompts/demo.jsonl

No root is needed: the run re-executes itself in a new user and network namespace
(``unshare -rn``), makes a second network namespace for the target, and links the two.
Where the kernel has no netem, ``--delay-by relay`` (what ``auto`` falls back to) delays
the link in user space instead: the target connects across the veth pair to a relay in
the hub's namespace that holds every chunk for the delay, in each direction, before
passing it on. Where the system cannot make namespaces, it says why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from starhub.launch import child_env, spawn_hub, target_command

HUB_IP, TARGET_IP = "10.77.0.1", "10.77.0.2"
INSIDE = "--inside-namespaces"
DELAY_BY = ("auto", "netem", "relay")


def _quiet(cmd: list[str], timeout: float = 10.0) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def netns_unavailable() -> str | None:
    """Why this machine cannot run the hub and a target in linked namespaces, or None."""
    missing = [tool for tool in ("unshare", "nsenter", "ip") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed"
    probe = _quiet(["unshare", "-rn", "sh", "-c",
                    "ip link add v0 type veth peer name v1 && ip link del v0"])
    if probe.returncode:
        return (f"cannot make a user and network namespace with a veth pair: "
                f"{(probe.stderr or probe.stdout).strip() or 'unshare failed'}")
    return None


def netem_unavailable() -> str | None:
    """Why delay cannot be injected on a veth link here, or None."""
    if shutil.which("tc") is None:
        return "tc not installed"
    probe = _quiet(["unshare", "-rn", "sh", "-c",
                    "ip link add v0 type veth peer name v1 && "
                    "tc qdisc add dev v0 root netem delay 1ms"])
    if probe.returncode:
        why = (probe.stderr or probe.stdout).strip()
        return f"the kernel has no netem qdisc (sch_netem): tc says '{why}'"
    return None


@dataclass
class LinkRow:
    delay_ms: float
    """One-way delay injected on each end, so a round trip gains twice this."""
    delay_by: str
    """netem (the kernel's qdisc on both veth ends) or relay (user space, both ways)."""
    rounds: int
    t_c_ms: float
    """Measured communication per hub round: round trip minus the hub's queue and draft."""
    tokens_per_s: float
    mean_accept_len: float
    output_ids: list[list[int]]


def _sh(cmd: str) -> None:
    done = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"`{cmd}` failed: {done.stderr.strip()}")


class Link:
    """A second network namespace (held open by a sleeping process) and a veth pair to it,
    made from inside the first one."""

    def __init__(self) -> None:
        self.holder = subprocess.Popen(["unshare", "-n", "sleep", "infinity"])
        self.netem = False
        time.sleep(0.2)
        pid = self.holder.pid
        _sh(f"ip link set lo up && ip link add v0 type veth peer name v1 netns {pid} && "
            f"ip addr add {HUB_IP}/24 dev v0 && ip link set v0 up")
        self.run_there(f"ip link set lo up && ip addr add {TARGET_IP}/24 dev v1 && "
                       f"ip link set v1 up")

    def enter(self) -> list[str]:
        """The prefix that runs a command in the target's namespace."""
        return ["nsenter", "-t", str(self.holder.pid), "-n"]

    def run_there(self, cmd: str) -> None:
        _sh(" ".join(self.enter()) + f" sh -c '{cmd}'")

    def delay(self, ms: float) -> None:
        """netem delay on both ends; 0 takes an earlier delay off again."""
        if ms <= 0 and not self.netem:
            return
        rule = f"netem delay {ms}ms" if ms > 0 else "pfifo"
        _sh(f"tc qdisc replace dev v0 root {rule}")
        self.run_there(f"tc qdisc replace dev v1 root {rule}")
        self.netem = ms > 0

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()


class Relay:
    """A TCP delay line: listens on the hub's veth address, connects each client to
    ``upstream`` and passes every chunk on ``delay_ms`` after it arrived, in both
    directions and in order. It runs its own event loop on a thread."""

    def __init__(self, upstream: tuple[str, int], delay_ms: float):
        self.upstream, self.delay = upstream, delay_ms / 1e3
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.port = 0

        async def start() -> None:
            server = await asyncio.start_server(self._client, HUB_IP, 0)
            self.port = server.sockets[0].getsockname()[1]
            started.set()

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(start(), self.loop)
        started.wait(10)

    async def _client(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer),
                             return_exceptions=True)

    async def _pump(self, reader, writer) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def send() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.create_task(send())
        while data := await reader.read(1 << 16):
            queue.put_nowait((time.monotonic() + self.delay, data))
        queue.put_nowait(None)
        await sender

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def _run_delay(link: Link, args: argparse.Namespace, delay: float, tmp: Path) -> LinkRow:
    by = args.delay_by if delay else "none"
    link.delay(delay if by == "netem" else 0.0)
    hub_args = ["--bind", f"tcp://{HUB_IP}:0", "--insecure", "--drafter", args.drafter,
                "--depth", str(args.depth), "--model", args.model]
    out = tmp / f"delay{delay}.jsonl"
    relay = None
    with spawn_hub(hub_args, pre_args=["--log-level", "warning"]) as hub:
        address = hub.address
        if by == "relay":
            host, port = address.rsplit("/", 1)[1].rsplit(":", 1)
            relay = Relay((host, int(port)), delay)
            address = f"tcp://{HUB_IP}:{relay.port}"
        cmd = link.enter() + target_command(
            address, args.prompts, str(out), pre_args=["--log-level", "warning"],
            extra=["--insecure", "--model", args.model,
                   "--max-new-tokens", str(args.max_new_tokens),
                   "--hub-timeout", "10", *(["--no-chat-template"] if args.no_chat_template
                                             else [])])
        done = subprocess.run(cmd, env=child_env(1), capture_output=True, text=True,
                              timeout=1800)
        if relay is not None:
            relay.close()
        if done.returncode:
            raise RuntimeError(f"the target failed across the link: {done.stderr[-2000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    stats = [r["stats"] for r in rows]
    rounds = sum(s["rounds"] for s in stats)
    wall = sum(s["wall_s"] for s in stats)
    tokens = sum(len(r["output_ids"]) for r in rows)
    return LinkRow(delay, by, rounds, 1e3 * sum(s["comm_s"] for s in stats) / max(rounds, 1),
                   tokens / wall if wall else 0.0,
                   sum(s["mean_accept_len"] for s in stats) / max(len(stats), 1),
                   [r["output_ids"] for r in rows])


def inside(args: argparse.Namespace) -> int:
    """Runs as root of a fresh user namespace, in the hub's network namespace."""
    link = Link()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for delay in args.delay_ms:
                rows.append(_run_delay(link, args, delay, Path(tmp)))
                print(f"  delay {delay:g} ms each way ({rows[-1].delay_by}): t_c "
                      f"{rows[-1].t_c_ms:.2f} ms per round", file=sys.stderr)
    finally:
        link.close()
    print(json.dumps([asdict(r) for r in rows]))
    return 0


def measure(delays: list[float], prompts: str, model: str = "default", drafter: str = "eagle",
            depth: int = 3, max_new_tokens: int = 32, chat_template: bool = True,
            delay_by: str = "auto") -> list[LinkRow]:
    """Run the star across the link once per delay (one-way, both ends; 0 = none);
    ``auto`` delays with netem where the kernel has it, else with the relay."""
    if delay_by == "auto":
        delay_by = "relay" if netem_unavailable() else "netem"
    cmd = ["unshare", "-rn", sys.executable, "-m", "bench.netns", INSIDE,
           "--delay-by", delay_by,
           "--delay-ms", ",".join(f"{d:g}" for d in delays), "--prompts", prompts,
           "--model", model, "--drafter", drafter, "--depth", str(depth),
           "--max-new-tokens", str(max_new_tokens)]
    if not chat_template:
        cmd.append("--no-chat-template")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                          cwd=Path(__file__).resolve().parent.parent)
    if done.returncode:
        raise RuntimeError(f"the namespace run failed: {done.stderr[-3000:]}")
    return [LinkRow(**row) for row in json.loads(done.stdout.strip().splitlines()[-1])]


def _delays(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.netns",
        description="Run a hub and a target in two network namespaces joined by a veth "
                    "pair, once per delay, and print the measured t_c per round.")
    p.add_argument("--delay-ms", type=_delays, default=[0.0, 1.0, 20.0],
                   help="one-way delays to inject on both ends, comma list (default 0,1,20: "
                        "none, a LAN, a WAN link). Needs the kernel's netem")
    p.add_argument("--delay-by", choices=DELAY_BY, default="auto",
                   help="netem: the kernel's qdisc on both veth ends; relay: a user-space "
                        "delay line in the hub's namespace; auto (default): netem where the "
                        "kernel has it, else relay")
    p.add_argument("--prompts", default="scripts/prompts/demo.jsonl")
    p.add_argument("--model", default="default")
    p.add_argument("--drafter", default="eagle", choices=["eagle", "ngram"])
    p.add_argument("--depth", type=int, default=3,
                   help="a fixed depth, so that every round goes through the hub")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument(INSIDE, action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, INSIDE[2:].replace("-", "_")):
        return inside(args)
    why = netns_unavailable()
    if why:
        print(f"cannot run across namespaces here: {why}", file=sys.stderr)
        return 2
    if args.delay_by == "netem" and netem_unavailable():
        print(f"no netem here ({netem_unavailable()}); use --delay-by relay", file=sys.stderr)
        return 2
    rows = measure(args.delay_ms, args.prompts, args.model, args.drafter, args.depth,
                   args.max_new_tokens, not args.no_chat_template, args.delay_by)
    print(f"{'delay each way':>15} {'by':>6} {'round trip +':>13} {'rounds':>7} {'t_c ms':>8} "
          f"{'tok/s':>7} {'tau':>5}")
    for r in rows:
        print(f"{r.delay_ms:>12g} ms {r.delay_by:>6} {2 * r.delay_ms:>10g} ms {r.rounds:>7} "
              f"{r.t_c_ms:>8.2f} {r.tokens_per_s:>7.1f} {r.mean_accept_len:>5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
