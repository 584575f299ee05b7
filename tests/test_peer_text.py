"""What a peer can make a server write: the names in its cards reach logs and
``starhub status`` printable and short, and a flood of bad messages is answered and counted
message by message but logged at a bounded rate."""

from __future__ import annotations

import logging

import msgspec
import pytest

from starhub.drafters.ngram import NgramDrafter
from starhub.launch.status import hub_report
from starhub.server.loop import BAD_INPUT_PER_PEER, BAD_INPUT_TOTAL, BAD_INPUT_WINDOW_S
from starhub.wire.codec import decode
from starhub.wire.messages import (
    MAX_TEXT,
    DrafterCard,
    Error,
    ObserverCard,
    StatsQuery,
    StatsReport,
    TargetCard,
)
from starhub.wire.text import MAX_NAME
from tests.servers import HubHarness, wire

HOSTILE = ("evil\n\x1b[2J\x1b[31mFAKE LOG LINE\r\u202e" * 200)[:MAX_TEXT]
"""As long as the wire allows, with newlines, ANSI escapes, a carriage return and a
right-to-left override."""


def with_field(msg, field: str, value: str) -> list[bytes]:
    """``msg``'s frames with ``field`` set on the wire, past any check the sender makes."""
    frames = wire(msg)
    header = msgspec.msgpack.decode(frames[0])
    header[field] = value
    return [msgspec.msgpack.encode(header), *frames[1:]]


def harmless(text: str) -> bool:
    return text.isprintable() and len(text) <= MAX_NAME


@pytest.fixture
def hub():
    harness = HubHarness(NgramDrafter())
    yield harness
    harness.close()


@pytest.mark.parametrize("msg, field", [(TargetCard(name="t", vocab_size=100), "name"),
                                        (ObserverCard(name="o"), "name"),
                                        (DrafterCard(drafter="d"), "drafter")])
def test_a_cards_name_is_printable_and_short_once_decoded(msg, field):
    text = getattr(decode(with_field(msg, field, HOSTILE)), field)
    assert harmless(text) and text.startswith("evil??[2J?[31mFAKE LOG LINE??"), text
    assert getattr(decode(with_field(msg, field, "target-0 ok")), field) == "target-0 ok"


def test_a_hostile_name_reaches_the_log_and_status_harmlessly(hub, caplog):
    with caplog.at_level(logging.INFO, logger="starhub"):
        reply = hub.ask(b"peer-a", with_field(TargetCard(name="t", vocab_size=100), "name",
                                              HOSTILE))
    assert isinstance(reply, DrafterCard)
    joined = [r.getMessage() for r in caplog.records if "joined" in r.getMessage()]
    assert len(joined) == 1 and joined[0].isprintable(), joined
    assert len(joined[0]) < MAX_NAME + 40, joined
    report = hub.ask(b"peer-a", StatsQuery(counters=True, peers=True))
    assert isinstance(report, StatsReport)
    text = hub_report("tcp://127.0.0.1:1", report.body)
    rows = [line for line in text.splitlines() if line.startswith("evil")]
    assert len(rows) == 1 and harmless(rows[0].split("  ")[0]), text
    assert "\x1b" not in text and "\r" not in text
    # and whatever a server sends, `starhub status` prints it harmlessly too
    body = msgspec.structs.replace(report.body, drafter=HOSTILE, depth=HOSTILE[:16])
    text = hub_report("tcp://127.0.0.1:1", body)
    assert all(line.isprintable() for line in text.splitlines()), text


def test_a_flood_of_bad_messages_is_answered_and_counted_but_logged_at_a_bounded_rate(
        hub, caplog):
    now = [0.0]
    hub.hub.bad_input.clock = lambda: now[0]
    hub.hub.bad_input.start = 0.0
    flood = 20 * BAD_INPUT_PER_PEER
    with caplog.at_level(logging.WARNING, logger="starhub"):
        replies = [hub.send(b"flooder", [b"\xc1 not msgpack"]) for _ in range(flood)]
        assert all(len(r) == 1 and isinstance(r[0], Error) for r in replies)
        assert hub.hub.errors["BAD_FRAME"] == flood
        assert len(caplog.records) == BAD_INPUT_PER_PEER
        # many peers together get no more than the total
        for i in range(2 * BAD_INPUT_TOTAL):
            (reply,) = hub.send(b"peer-%d" % i, [b"\xc1"])
            assert isinstance(reply, Error)
        assert hub.hub.errors["BAD_FRAME"] == flood + 2 * BAD_INPUT_TOTAL
        assert len(caplog.records) == BAD_INPUT_TOTAL
        # when the window ends, one line counts what was held back
        now[0] = BAD_INPUT_WINDOW_S
        hub.hub.bad_input.roll()
    quiet_peers = 2 * BAD_INPUT_TOTAL - (BAD_INPUT_TOTAL - BAD_INPUT_PER_PEER)
    held = flood - BAD_INPUT_PER_PEER + quiet_peers
    summary = caplog.records[-1].getMessage()
    assert len(caplog.records) == BAD_INPUT_TOTAL + 1
    assert summary.startswith(f"{held} more bad messages from {1 + quiet_peers} peers "
                              f"in the last 60s were answered with an ERROR but not logged"), \
        summary
    assert f"most from flooder: {flood - BAD_INPUT_PER_PEER}" in summary
    # a new window logs again
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="starhub"):
        hub.send(b"flooder", [b"\xc1"])
    assert len(caplog.records) == 1 and "peer flooder: " in caplog.records[0].getMessage()
