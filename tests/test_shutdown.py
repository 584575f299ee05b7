"""A hub shutting down closes every open session itself; a target's CLOSE that crosses
that ERROR on the wire is no fault of the target's and gets no error back."""

from __future__ import annotations

import asyncio

import numpy as np

from starhub.drafters.ngram import NgramDrafter
from starhub.hub.shutdown import drain
from starhub.wire.messages import Close, DrafterCard, Error, ErrorCode, Open, TargetCard
from tests.servers import HubHarness

A = b"peer-a"


def _shut_down(harness: HubHarness) -> list:
    """Run the hub's drain to the end and return what it sent."""
    async def serve_stand_in() -> None:
        await asyncio.sleep(3600)

    task = harness.loop.create_task(serve_stand_in())
    harness.loop.run_until_complete(drain(harness.hub, task, timeout_s=0.05))
    harness.loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
    sent = []
    while harness.hub.outbox:
        sent.append(harness.hub.next_reply()[1])
    return sent


def test_a_close_that_crosses_the_shutdown_gets_no_error():
    harness = HubHarness(NgramDrafter())
    try:
        assert isinstance(harness.ask(A, TargetCard(name="t", vocab_size=100)), DrafterCard)
        tag = harness.ask(A, Open(ref=1, prompt_len=3, tokens=np.arange(1, 5,
                                                                        dtype=np.int32))).tag
        unknown = harness.ask(A, Close(tag=tag + 1))
        assert isinstance(unknown, Error) and unknown.code == ErrorCode.UNKNOWN_TAG, \
            "in service, a CLOSE for a tag the hub does not hold is an error"
        harness.hub.metrics.errors.clear()
        sent = _shut_down(harness)
        assert [(type(m), m.tag, m.code) for m in sent] == [(Error, tag, ErrorCode.DRAINING)]
        assert harness.send(A, Close(tag=tag)) == []
        assert not harness.hub.metrics.errors
    finally:
        harness.close()
