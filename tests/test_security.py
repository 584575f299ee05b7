"""Isolation and authentication: CURVE keys on real sockets (an allowed client decodes
losslessly, an unknown key and a plain client get nothing), the loopback rule, random
identities, and STATS that show per-peer detail only to peers that sent a card."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from msgspec import to_builtins

from starhub.client.connection import HubClient, HubUnavailable
from starhub.client.pool import survey
from starhub.drafters.base import TreeShape
from starhub.drafters.model import ModelDrafter
from starhub.drafters.ngram import NgramDrafter
from starhub.edge.drafter import EdgeDrafter, VerifierUnavailable
from starhub.launch import spawn_hub
from starhub.launch.config import ConfigError, parse_config
from starhub.launch.plan import build_plan
from starhub.launch.runner import ADDRESS_FILE
from starhub.launch.status import ask_each, query_stats, status_security
from starhub.server.isolation import AGGREGATES_ONLY
from starhub.wire.messages import DrafterCard, Open, Opened, StatsQuery, TargetCard
from starhub.wire.reports import HubReport, PeerReport, VerifierReport
from starhub.wire.security import (
    ClientCurve,
    ClientSecurity,
    SecurityError,
    ServerCurve,
    ServerSecurity,
    bind_server,
    check_bind,
    client_curve,
    generate_keys,
    is_loopback,
    load_certificate,
    local_keys,
    server_curve,
    use_client_security,
)
from targets import attach
from tests.conftest import HubThread
from tests.test_edge import VerifierThread

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [1, 5, 9, 14, 3, 1, 5, 9, 14, 3, 1, 5]
REFUSED_WITHIN_S = 0.5
"""How long a refused client waits for a reply that never comes (it fails, not the test)."""


@dataclass
class Keys:
    server: ServerSecurity
    server_public: Path
    allowed: ClientCurve
    stranger: ClientCurve


@pytest.fixture
def keys(tmp_path) -> Keys:
    """A server pair, one client whose public key is in the allow folder, one that is not."""
    allow = tmp_path / "allow"
    allow.mkdir()
    hub_public, hub_secret = generate_keys(tmp_path, "hub")
    client_public, client_secret = generate_keys(tmp_path, "client")
    shutil.copy(client_public, allow)
    _, stranger_secret = generate_keys(tmp_path, "stranger")
    return Keys(ServerSecurity(ServerCurve.load(hub_secret, allow)), hub_public,
                ClientCurve.load(client_secret, hub_public),
                ClientCurve.load(stranger_secret, hub_public))


def _reference(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def _starhub(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "starhub", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, **kwargs)


# -- keys -----------------------------------------------------------------------------------

def test_keys_generate_writes_loadable_certificates_and_never_overwrites(tmp_path):
    done = _starhub("keys", "generate", str(tmp_path / "keys"), "hub")
    assert done.returncode == 0, done.stderr
    public, secret = tmp_path / "keys" / "hub.key", tmp_path / "keys" / "hub.key_secret"
    pub_key, no_secret = load_certificate(public, "--curve-server", secret=False)
    same_pub, secret_key = load_certificate(secret, "--curve-secret", secret=True)
    assert no_secret is None and same_pub == pub_key and secret_key is not None
    assert os.stat(secret).st_mode & 0o077 == 0, "the secret certificate is owner-only"
    assert str(public) in done.stdout and str(secret) in done.stdout

    again = _starhub("keys", "generate", str(tmp_path / "keys"), "hub")
    assert again.returncode == 2 and "already exist" in again.stderr
    assert load_certificate(secret, "--curve-secret", secret=True)[1] == secret_key


def test_certificate_mistakes_are_clear_errors(tmp_path, keys):
    with pytest.raises(SecurityError, match="no such file"):
        client_curve(str(tmp_path / "missing.key_secret"), str(keys.server_public))
    with pytest.raises(SecurityError, match="only a public key"):
        client_curve(str(keys.server_public), str(keys.server_public))
    junk = tmp_path / "junk.key_secret"
    junk.write_text("not a certificate\n")
    with pytest.raises(SecurityError, match="not a ZeroMQ CURVE certificate"):
        client_curve(str(junk), str(keys.server_public))
    with pytest.raises(SecurityError, match="go together"):
        client_curve(str(tmp_path / "client.key_secret"), None)
    with pytest.raises(SecurityError, match="go together"):
        server_curve(None, str(tmp_path / "allow"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SecurityError, match=r"no public certificates \(\*\.key\)"):
        server_curve(str(tmp_path / "hub.key_secret"), str(empty))
    with pytest.raises(SecurityError, match="not a folder"):
        server_curve(str(tmp_path / "hub.key_secret"), str(tmp_path / "hub.key"))


# -- the loopback rule ----------------------------------------------------------------------

@pytest.mark.parametrize("address,local", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.0.0.2:0", True), ("tcp://localhost:1", True),
    ("tcp://[::1]:5555", True), ("ipc:///tmp/starhub.sock", True), ("inproc://hub", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://10.1.2.3:5555", False),
    ("tcp://eth0:5555", False), ("tcp://[::]:5555", False), ("tcp://hub.example:5555", False),
])
def test_loopback_addresses_are_recognised(address, local):
    assert is_loopback(address) is local


def test_plain_server_binds_beyond_loopback_only_when_insecure(keys, caplog):
    with pytest.raises(SecurityError, match="refusing to bind tcp://0.0.0.0:0 without CURVE"):
        check_bind("tcp://0.0.0.0:0", ServerSecurity())
    check_bind("tcp://0.0.0.0:0", keys.server)  # CURVE needs no --insecure
    check_bind("tcp://127.0.0.1:0", ServerSecurity())
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    with caplog.at_level(logging.WARNING, logger="starhub.security"):
        release = bind_server(sock, "tcp://0.0.0.0:0", ServerSecurity(insecure=True))
    try:
        assert sock.getsockopt_string(zmq.LAST_ENDPOINT).startswith("tcp://0.0.0.0:")
        assert "without CURVE (--insecure)" in caplog.text
    finally:
        sock.close(0)
        release()


def test_hub_and_verifier_commands_refuse_a_plain_non_loopback_bind():
    hub = _starhub("hub", "--bind", "tcp://0.0.0.0:0", "--drafter", "ngram")
    assert hub.returncode == 2
    assert "refusing to bind tcp://0.0.0.0:0 without CURVE" in hub.stderr
    assert "--insecure" in hub.stderr and "STARHUB READY" not in hub.stdout
    verifier = _starhub("verifier", "--bind", "tcp://*:0")
    assert verifier.returncode == 2 and "refusing to bind tcp://*:0" in verifier.stderr


def test_insecure_hub_starts_on_every_interface_and_warns(tmp_path):
    log = tmp_path / "hub.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "starhub", "hub", "--bind",
                                 "tcp://0.0.0.0:0", "--drafter", "ngram", "--insecure"],
                                stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert line.startswith("STARHUB READY tcp://0.0.0.0:"), log.read_text()
        assert "without CURVE (--insecure)" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(30)


def test_launch_config_applies_the_loopback_rule_and_passes_keys():
    base = {"backend": "ray", "targets": {"model": "default", "count": 1}}
    with pytest.raises(ConfigError, match=r"hub\.bind: tcp://0\.0\.0\.0:0 is reachable"):
        build_plan(parse_config({**base, "hub": {}}), "p.jsonl")
    plan = build_plan(parse_config({**base, "hub": {"insecure": True}}), "p.jsonl")
    assert plan.server.config["insecure"] is True
    with pytest.raises(ConfigError, match="its targets need curve_secret"):
        build_plan(parse_config({**base, "hub": {"curve_secret": "h.key_secret",
                                                 "curve_allow": "allow"}}), "p.jsonl")
    plan = build_plan(parse_config({
        "backend": "ray", "hub": {"curve_secret": "h.key_secret", "curve_allow": "allow"},
        "targets": {"model": "default", "curve_secret": "t.key_secret",
                    "curve_server": "h.key"}}), "p.jsonl")
    hub, target = plan.server.config, plan.workers[0].config
    assert hub["curve_allow"] == "allow" and not hub["insecure"]
    assert target["curve_server"] == "h.key"


# -- CURVE on real sockets ------------------------------------------------------------------

def test_curve_hub_serves_an_allowed_target_losslessly(tiny_model, keys):
    model, tokenizer = tiny_model
    hub = HubThread(NgramDrafter(), security=keys.server)
    use_client_security(ClientSecurity(keys.allowed))
    try:
        with attach(model, tokenizer, hub.address, name="allowed", timeout_s=30) as session:
            assert session.connected
            result = session.generate(PROMPT, max_new_tokens=16)
        assert result.output_ids == _reference(model, PROMPT, 16)
        assert result.stats.rounds > 0 and not result.stats.standalone, \
            "the tokens came through the hub's drafts, not from decoding alone"
    finally:
        use_client_security(None)
        hub.stop()


def test_curve_hub_refuses_unknown_keys_and_plain_clients(keys):
    hub = HubThread(NgramDrafter(), security=keys.server)
    allowed = HubClient(hub.address, timeout_s=30, security=ClientSecurity(keys.allowed))
    try:
        for security, cause in [
                (ClientSecurity(keys.stranger), "not in its --curve-allow folder"),
                (ClientSecurity(insecure=True), "it uses CURVE and this client connects "
                                                "without CURVE"),
                (ClientSecurity(), "or holds other keys")]:  # this user's local keys
            # the refusal is reported as it happens, with its likely cause, not at a timeout
            refused = HubClient(hub.address, timeout_s=60, security=security)
            try:
                with pytest.raises(HubUnavailable, match="refused this target: .*" + cause):
                    refused.greet(TargetCard(name="intruder", vocab_size=1000))
                with pytest.raises(HubUnavailable, match=cause):
                    refused.ping()  # a second request fails too, and never blocks
            finally:
                refused.close()
        assert allowed.greet(TargetCard(name="allowed", vocab_size=1000)).drafter == "ngram"
        assert [p.name for p in hub.hub.table.peers.values()] == ["allowed"]
    finally:
        allowed.close()
        hub.stop()


def test_curve_verifier_serves_allowed_drafters_and_refuses_others(tiny_model, keys):
    model, tokenizer = tiny_model
    verifier = VerifierThread(model, tokenizer, budget=16, security=keys.server)

    def drafter(security) -> EdgeDrafter:
        return EdgeDrafter(ModelDrafter(model, label="self"), verifier.address,
                           TreeShape(4, 2, 6), eos=set(), timeout_s=REFUSED_WITHIN_S,
                           retries=0, security=security)

    try:
        for security in (ClientSecurity(keys.stranger), ClientSecurity(insecure=True)):
            refused = drafter(security)
            with pytest.raises(VerifierUnavailable, match="no reply|refused this drafter"):
                refused.generate(PROMPT, 8)
            refused.close()
        allowed = drafter(ClientSecurity(keys.allowed))
        allowed.timeout_s = 30
        assert allowed.generate(PROMPT, 10)[0] == _reference(model, PROMPT, 10)
        allowed.close()
        assert verifier.verifier.stats.opened == 1
    finally:
        verifier.stop()


# -- a pool whose hubs each keep their own key pair -------------------------------------------

@dataclass
class PoolKeys:
    hubs: list[ServerSecurity]
    publics: list[Path]
    """Each hub's public certificate, in the hubs' order."""
    secrets: list[Path]
    allow: Path
    client_secret: Path


@pytest.fixture
def pool_keys(tmp_path) -> PoolKeys:
    """Two hubs with key pairs of their own, both admitting one client."""
    allow = tmp_path / "allow"
    allow.mkdir()
    client_public, client_secret = generate_keys(tmp_path, "client")
    shutil.copy(client_public, allow)
    pairs = [generate_keys(tmp_path, name) for name in ("hub0", "hub1")]
    return PoolKeys([ServerSecurity(ServerCurve.load(secret, allow)) for _, secret in pairs],
                    [public for public, _ in pairs], [secret for _, secret in pairs], allow,
                    client_secret)


def _listed(*files: Path) -> str:
    return ",".join(str(f) for f in files)


def test_a_target_given_each_hubs_own_key_reaches_every_hub_of_the_pool(tiny_model,
                                                                         pool_keys):
    model, tokenizer = tiny_model
    hubs = [HubThread(NgramDrafter(), security=s) for s in pool_keys.hubs]
    addresses = [h.address for h in hubs]
    secure = ClientSecurity(client_curve(str(pool_keys.client_secret),
                                         _listed(*pool_keys.publics), addresses))
    try:
        found = survey(addresses, timeout_s=30, client_options={"security": secure})
        assert sorted(found) == sorted(addresses)
        for address in addresses:
            client = HubClient(address, timeout_s=30, security=secure)
            try:
                assert client.greet(TargetCard(name="pooled", vocab_size=1000)).drafter \
                    == "ngram"
            finally:
                client.close()
        use_client_security(secure)
        with attach(model, tokenizer, addresses, name="pooled", timeout_s=30) as session:
            result = session.generate(PROMPT, max_new_tokens=12)
        assert result.output_ids == _reference(model, PROMPT, 12)
        assert result.stats.hub in addresses and result.stats.rounds > 0, result.stats
    finally:
        use_client_security(None)
        for hub in hubs:
            hub.stop()


def test_hub_keys_listed_in_the_wrong_order_fail_with_the_handshake_cause(pool_keys):
    hubs = [HubThread(NgramDrafter(), security=s) for s in pool_keys.hubs]
    addresses = [h.address for h in hubs]
    swapped = ClientSecurity(client_curve(str(pool_keys.client_secret),
                                          _listed(*reversed(pool_keys.publics)), addresses))
    try:
        for address in addresses:
            client = HubClient(address, timeout_s=60, security=swapped)
            start = time.monotonic()
            try:  # the refusal comes as the handshake fails, not at the 60 s timeout
                with pytest.raises(HubUnavailable, match=re.escape(
                        f"refused this target: the CURVE handshake failed and this client "
                        f"connects with the keys given (--curve-secret, --curve-server): the "
                        f"server runs without CURVE (--insecure), or the certificate "
                        f"--curve-server lists for {address} (one per server, in the order "
                        f"of the addresses: is that order the same?) is not its public key")):
                    client.greet(TargetCard(name="swapped", vocab_size=1000))
            finally:
                client.close()
            assert time.monotonic() - start < 30
        assert survey(addresses, timeout_s=0.5, client_options={"security": swapped}) == {}
        assert not any(h.hub.table.peers for h in hubs)
    finally:
        for hub in hubs:
            hub.stop()


def test_a_count_of_server_keys_that_fits_neither_one_nor_each_hub_is_a_clear_error(
        pool_keys):
    secret, (a, b) = str(pool_keys.client_secret), pool_keys.publics
    addresses = ["tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"]
    with pytest.raises(SecurityError, match=re.escape(
            "--curve-server lists 3 public certificates for 2 server addresses "
            "(tcp://127.0.0.1:5555, tcp://127.0.0.1:5556): give one certificate that every "
            "server holds, or one per address, in the same order as the addresses")):
        client_curve(secret, _listed(a, b, a), addresses)
    with pytest.raises(SecurityError, match="2 public certificates for 1 server address"):
        client_curve(secret, _listed(a, b), addresses[:1])
    shared = client_curve(secret, str(a), addresses)  # one key that every hub holds
    assert [shared.server_key(x) for x in addresses] == [load_certificate(
        a, "", secret=False)[0]] * 2
    each = client_curve(secret, _listed(a, b), addresses)
    assert [each.server_key(x) for x in addresses] == [
        load_certificate(f, "", secret=False)[0] for f in (a, b)]
    with pytest.raises(SecurityError, match="not for tcp://127.0.0.1:5557"):
        each.server_key("tcp://127.0.0.1:5557")


def test_launch_takes_a_key_pair_per_hub_and_checks_each_listed_key_against_its_hub(
        pool_keys):
    def pool(curve_server: str, secrets: list[Path] = pool_keys.secrets, **targets) -> dict:
        return {"hubs": [{"curve_secret": str(s), "curve_allow": str(pool_keys.allow)}
                         for s in secrets],
                "targets": {"model": "default", "count": 1, "curve_server": curve_server,
                            "curve_secret": str(pool_keys.client_secret), **targets}}

    a, b = (str(p) for p in pool_keys.publics)
    plan = build_plan(parse_config(pool(f"{a},{b}")), "p.jsonl")
    assert [s.config["curve_secret"] for s in plan.servers] == [str(s) for s in
                                                                pool_keys.secrets]
    assert plan.workers[0].config["curve_server"] == f"{a},{b}"
    dep = plan.deployment
    security = status_security(dep.server, dep.workers, "tcp://127.0.0.1:1,tcp://127.0.0.1:2")
    assert [security.keys().server_key(f"tcp://127.0.0.1:{port}") for port in (1, 2)] == [
        load_certificate(f, "", secret=False)[0] for f in (a, b)]
    # hubs that share a key pair still take one curve_server
    build_plan(parse_config(pool(a, [pool_keys.secrets[0]] * 2)), "p.jsonl")

    with pytest.raises(ConfigError, match=re.escape(
            f"targets.curve_server: entry 1 of 2, {b} is not the public key of "
            f"hubs[0].curve_secret ({pool_keys.secrets[0]}): list each hub's public "
            f"certificate (NAME.key), comma-separated, in [[hubs]] order")):
        build_plan(parse_config(pool(f"{b},{a}")), "p.jsonl")
    with pytest.raises(ConfigError, match=re.escape(
            f"targets.curve_server: {a} is not the public key of hubs[1].curve_secret")):
        build_plan(parse_config(pool(a)), "p.jsonl")  # one key, but the hubs' differ
    with pytest.raises(ConfigError, match=re.escape(
            "targets.curve_server lists 3 public certificates for 2 hubs: give one "
            "certificate that every hub holds, or one per hub, comma-separated, in [[hubs]] "
            "order")):
        build_plan(parse_config(pool(f"{a},{b},{a}")), "p.jsonl")
    with pytest.raises(ConfigError, match="lists 2 public certificates for one hub"):
        build_plan(parse_config(pool(f"{a},{b}", pool_keys.secrets[:1])), "p.jsonl")
    # on Ray the files live on the nodes: only the count is checked here
    ray = pool(f"{b},{a}")
    build_plan(parse_config({**ray, "backend": "ray"}), "p.jsonl")


def test_launch_still_refuses_a_pool_mixing_curve_and_other_hubs(pool_keys):
    keyed = {"curve_secret": str(pool_keys.secrets[0]), "curve_allow": str(pool_keys.allow)}
    for other in ({}, {"insecure": True}):  # the local keys, or none
        with pytest.raises(ConfigError, match="hubs: the hubs of a pool differ in how they "
                                              "are reached"):
            build_plan(parse_config({
                "hubs": [keyed, other],
                "targets": {"model": "default", "count": 1, "curve_server":
                            str(pool_keys.publics[0]),
                            "curve_secret": str(pool_keys.client_secret)}}), "p.jsonl")


def test_status_asks_a_pool_whose_hubs_keep_their_own_keys(pool_keys):
    hubs = [HubThread(NgramDrafter(), security=s) for s in pool_keys.hubs]
    addresses = ",".join(h.address for h in hubs)
    keys = ["--curve-secret", str(pool_keys.client_secret), "--curve-server"]
    try:
        status = _starhub("status", addresses, *keys, _listed(*pool_keys.publics),
                          "--timeout", "30")
        assert status.returncode == 0, status.stderr
        assert "pool of 2 hubs, 2 answering" in status.stdout, status.stdout
        wrong = _starhub("status", addresses, *keys, _listed(*pool_keys.publics * 2))
        assert wrong.returncode == 2
        assert "--curve-server lists 4 public certificates for 2 server addresses" \
            in wrong.stderr, wrong.stderr
    finally:
        for hub in hubs:
            hub.stop()


def test_status_of_a_running_deployment_file_asks_its_hubs_with_its_targets_keys(
        pool_keys, tmp_path):
    """``starhub status FILE``: the addresses its launch wrote in its output folder, and the
    keys its targets hold (one per hub); no launch running, a clear error."""
    hubs = [HubThread(NgramDrafter(), security=s) for s in pool_keys.hubs]
    out = tmp_path / "out"
    out.mkdir()
    config = tmp_path / "pool.toml"
    config.write_text("\n".join([
        f'out_dir = "{out}"',
        *[f'[[hubs]]\ndrafter = "ngram"\ncurve_secret = "{secret}"\n'
          f'curve_allow = "{pool_keys.allow}"' for secret in pool_keys.secrets],
        "[targets]", "count = 1", 'model = "default"',
        f'curve_secret = "{pool_keys.client_secret}"',
        f'curve_server = "{_listed(*pool_keys.publics)}"']))
    try:
        (out / ADDRESS_FILE).write_text(",".join(h.address for h in hubs) + "\n")
        status = _starhub("status", str(config), "--timeout", "30")
        assert status.returncode == 0, status.stderr
        assert "pool of 2 hubs, 2 answering" in status.stdout, status.stdout
        (out / ADDRESS_FILE).unlink()
        gone = _starhub("status", str(config))
        assert gone.returncode != 0 and "no running launch found" in gone.stderr, gone.stderr
    finally:
        for hub in hubs:
            hub.stop()


def test_a_pools_hubs_are_asked_for_stats_at_once_in_the_pools_order(ngram_hub):
    """Two hubs that never answer cost one timeout, not two; each answer keeps its place."""
    ctx = zmq.Context.instance()
    silent = [ctx.socket(zmq.ROUTER) for _ in range(2)]
    # they take the handshake (this user's local keys, as the hub) and never answer
    releases = [bind_server(sock, "tcp://127.0.0.1:0", ServerSecurity()) for sock in silent]
    try:
        addresses = [silent[0].LAST_ENDPOINT.decode(), ngram_hub.address,
                     silent[1].LAST_ENDPOINT.decode()]
        start = time.monotonic()
        answers = ask_each(addresses, lambda address: query_stats(
            address, timeout_s=1.5, observe=False))
        took = time.monotonic() - start
        assert list(answers) == addresses
        assert isinstance(answers[addresses[0]], HubUnavailable)
        assert isinstance(answers[addresses[1]], HubReport)
        assert isinstance(answers[addresses[2]], HubUnavailable)
        assert took < 2.9, f"the hubs were asked one after another ({took:.1f}s)"
    finally:
        for sock, release in zip(silent, releases, strict=True):
            sock.close(0)
            release()


def test_client_identities_are_random():
    identities = set()
    for _ in range(2):
        client = HubClient("tcp://127.0.0.1:9", timeout_s=1)
        identities.add(client.sock.getsockopt(zmq.IDENTITY))
        client.close()
    assert len(identities) == 2
    for identity in identities:  # a role letter and 128 random bits: no host, no pid
        assert re.fullmatch(rb"t-[0-9a-f]{32}", identity), identity


# -- STATS by introduction ------------------------------------------------------------------

def _stats(address: str, **request) -> HubReport | VerifierReport | PeerReport:
    client = HubClient(address, timeout_s=30)
    try:
        return client.request(StatsQuery(**request)).body
    finally:
        client.close()


def test_hub_stats_without_hello_show_aggregates_only(tiny_model):
    model, tokenizer = tiny_model
    hub = HubThread(NgramDrafter(), peer_grace_s=600.0)
    try:
        with attach(model, tokenizer, hub.address, name="secret-target") as session:
            result = session.generate(PROMPT, max_new_tokens=12)
            assert result.stats.rounds > 0
            assert result.stats.hub_draft_s > 0, "a known target still gets its own totals"

            stranger = _stats(hub.address, counters=True, peers=True)
            assert stranger.aggregates_only is True
            assert stranger.rounds == result.stats.rounds and stranger.peers == 1
            assert stranger.control.targets is None and "n_max" in to_builtins(stranger.control)
            assert stranger.counters.peers is None and stranger.counters.rounds > 0
            assert "secret-target" not in repr(stranger)
            assert AGGREGATES_ONLY in to_builtins(stranger)
            assert _stats(hub.address, peer=True) == PeerReport(peer=None)

            target = session._gen.client.request(StatsQuery(counters=True, peers=True))
            assert not target.body.aggregates_only
            assert AGGREGATES_ONLY not in to_builtins(target.body)
            assert [t.name for t in target.body.control.targets] == ["secret-target"]

            observed = query_stats(hub.address, timeout_s=30, peers=True)
            assert not observed.aggregates_only
            assert [p[0] for p in observed.counters.peers] == ["secret-target"]
            assert [t.name for t in observed.control.targets] == ["secret-target"]
            assert observed.admitted == 1, "an observer takes no admission slot"
    finally:
        hub.stop()


def test_verifier_stats_without_welcome_hide_sessions(tiny_model):
    model, tokenizer = tiny_model
    verifier = VerifierThread(model, tokenizer, budget=16)
    drafter = HubClient(verifier.address, timeout_s=30)
    try:
        assert isinstance(drafter.request(DrafterCard(drafter="raw")), TargetCard)
        opened = drafter.request(Open(ref=1, prompt_len=3, tokens=np.array([1, 2, 3], np.int32)),
                                 ref=1)
        assert isinstance(opened, Opened)
        own = drafter.request(StatsQuery()).body
        assert str(opened.tag) in own.scheduler.sessions

        stranger = _stats(verifier.address)
        assert stranger.aggregates_only is True and stranger.sessions == 1
        assert stranger.scheduler.sessions is None and stranger.scheduler.policy
        assert "sessions" not in to_builtins(stranger.scheduler)
        assert str(opened.tag) not in repr(stranger)

        observed = query_stats(verifier.address, timeout_s=30)
        assert str(opened.tag) in observed.scheduler.sessions
        assert observed.drafters == 1, "an observer is not counted as a drafter"
    finally:
        drafter.close()
        verifier.stop()


# -- the local keystore: what servers and clients use when given no keys ---------------------

KEYS_OF = ("import sys, time; from starhub.wire.security import local_keys; "
           "time.sleep(max(0.0, float(sys.argv[1]) - time.time())); k = local_keys(); "
           "print(k.server.public.decode(), k.client.public.decode(), k.client.server.decode())")


def _local_keys_in(folder: Path, n: int) -> list[str]:
    """The keys ``n`` processes find in a keystore at ``folder``, opening it at one moment."""
    at = str(time.time() + 3.0)  # once every process has started
    procs = [subprocess.Popen([sys.executable, "-c", KEYS_OF, at], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "STARHUB_KEYS": str(folder)})
             for _ in range(n)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    return [out for out, _ in outs]


def test_local_keystore_is_made_once_private_and_shared_by_concurrent_makers(tmp_path):
    folder = tmp_path / "deep" / "keys"
    found = _local_keys_in(folder, 4)  # four processes race to make it
    assert len(set(found)) == 1, "every process got the winner's keys"
    server, client, trusted = found[0].split()
    assert trusted == server != client
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert sorted(p.name for p in folder.iterdir()) == [
        "allow", "client.key", "client.key_secret", "server.key", "server.key_secret"]
    assert [p.name for p in (folder / "allow").iterdir()] == ["client.key"]
    assert [p.name for p in folder.parent.iterdir()] == ["keys"], "no build folder left"
    assert _local_keys_in(folder, 1) == found[:1], "made once, then reused"


def test_local_keystore_others_may_enter_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "open"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    monkeypatch.setenv("STARHUB_KEYS", str(folder))
    with pytest.raises(SecurityError, match=r"others may enter it \(mode 755\)"):
        local_keys()
    with pytest.raises(SecurityError, match="others may enter"):
        check_bind("tcp://127.0.0.1:0", ServerSecurity())  # a server fails before it loads
    if os.getuid() == 0:  # only root can give a folder away
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 12345, 12345)
        monkeypatch.setenv("STARHUB_KEYS", str(theirs))
        with pytest.raises(SecurityError, match="belongs to uid 12345, not to this user"):
            local_keys()


def test_default_hub_and_target_use_the_local_keys_and_refuse_plain_clients(tiny_dir,
                                                                              tmp_path):
    prompts, out, log = tmp_path / "p.jsonl", tmp_path / "out.jsonl", tmp_path / "hub.log"
    prompts.write_text('{"id": 0, "prompt": "Hello there"}\n')
    # a fixed depth: on a random model an adaptive hub may choose plain rounds only
    with open(log, "w") as err, spawn_hub(["--drafter", "ngram", "--depth", "4"],
                                          log_file=err) as hub:
        target = _starhub("target", "--hub", hub.address, "--model", str(tiny_dir),
                          "--prompts", str(prompts), "--out", str(out), "--threads", "1",
                          "--max-new-tokens", "8")
        assert target.returncode == 0, target.stderr
        assert "CURVE on with this user's local keys" in log.read_text()
        (row,) = [json.loads(line) for line in out.read_text().splitlines()]
        assert row["stats"]["rounds"] > 0 and not row["stats"]["standalone"], target.stderr
        plain = _starhub("status", hub.address, "--insecure", "--timeout", "60")
        assert plain.returncode == 1
        assert "refused this target: it uses CURVE" in plain.stderr, plain.stderr


def test_insecure_on_both_sides_connects_without_curve(tiny_model, tmp_path):
    model, tokenizer = tiny_model
    log = tmp_path / "hub.log"
    with open(log, "w") as err, spawn_hub(["--drafter", "ngram", "--depth", "4", "--insecure"],
                                          log_file=err) as hub:
        assert "without CURVE (--insecure)" in log.read_text()
        status = _starhub("status", hub.address, "--insecure")
        assert status.returncode == 0 and "ngram drafter" in status.stdout, status.stderr
        curved = _starhub("status", hub.address, "--timeout", "60")  # the local keys
        assert curved.returncode == 1
        # which side notices first decides how much libzmq tells; either way it is named
        assert re.search(r"it does not use CURVE \(it runs --insecure\?\)|the server runs "
                         r"without CURVE \(--insecure: pass it too\)", curved.stderr), \
            curved.stderr
        use_client_security(ClientSecurity(insecure=True))
        try:
            with attach(model, tokenizer, hub.address, name="plain", timeout_s=30) as session:
                result = session.generate(PROMPT, max_new_tokens=12)
        finally:
            use_client_security(None)
        assert result.output_ids == _reference(model, PROMPT, 12) and result.stats.rounds > 0


def test_launch_passes_insecure_to_clients_and_nothing_for_the_local_keys():
    base = {"targets": {"model": "default", "count": 1}}
    plan = build_plan(parse_config(base), "p.jsonl")
    configs = [plan.server.config, plan.workers[0].config]
    assert not any(c["insecure"] for c in configs)
    assert not any(v for c in configs for k, v in c.items() if k.startswith("curve"))
    dep = parse_config({**base, "hub": {"insecure": True}})
    plan = build_plan(dep, "p.jsonl")
    assert plan.server.config["insecure"] and plan.workers[0].config["insecure"]
    assert status_security(dep.server, dep.workers) == ClientSecurity(insecure=True)
    serving = parse_config({"hub": {"insecure": True},
                            "targets": {"model": "default", "serve": True}})
    assert build_plan(serving).workers[0].config["insecure"]
    edge = parse_config({"topology": "edge", "verifier": {"model": "default", "insecure": True},
                         "drafters": {"model": "default", "count": 1}})
    assert build_plan(edge, "p.jsonl").workers[0].config["insecure"]
    with pytest.raises(SecurityError, match="not both"):
        ClientSecurity(ClientCurve(b"", b"", b""), insecure=True)
