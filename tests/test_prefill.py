"""Chunked prefill run a slice at a time, and when a slice runs beside decoding sessions."""

from __future__ import annotations

import time

from targets.engine import VerifyEngine
from targets.prefill import LONG, SLICE_S, PrefillShare


def test_a_slice_of_no_time_runs_one_decoder_layer_and_a_slice_stops_at_a_chunks_end(
        tiny_model):
    model, _ = tiny_model
    layers = len(model.model.layers)
    prompt = [(13 * i) % 700 + 3 for i in range(70)]
    engine = VerifyEngine(model)
    whole, _ = engine.open(0, prompt)
    chunks = engine.open_chunks(1, prompt, 32)
    runs, seen = 0, []
    while chunks.run(0.0) is None:
        runs += 1
        seen.append(chunks.fed)
    runs += 1
    assert runs == 3 * (layers + 1), "each of three chunks: a run a layer, then its end"
    assert sorted(set(seen)) == [0, 32, 64]
    assert chunks.chunks == 3 and chunks.left == 0 and chunks.result[0] == whole
    long_slices = engine.open_chunks(2, prompt, 32)
    assert long_slices.run(60.0) is None and long_slices.fed == 32, "one chunk at most"
    assert engine.cached(1) == engine.cached(0) == len(prompt)


def test_beside_decoding_sessions_a_prefill_gets_its_share_of_the_time():
    share = PrefillShare()
    short, long = LONG, LONG + 1
    assert share.next_slice(False, True, long) == SLICE_S, "alone: a slice of its own"
    assert share.next_slice(True, False, long) == 0.0, "one layer while all wait"
    share.ran(time.perf_counter() - 0.03)  # a 30 ms slice that just ended
    assert share.next_slice(True, True, short) is None, "the others' passes go first"
    share.ended -= 0.03  # they have had as long as the slice took since
    owed = share.next_slice(True, True, short)
    assert owed is not None and 0 <= owed < 0.01, "a short prompt: half the time"
    assert share.next_slice(True, True, long) is None, "a long one: a quarter"
    share.ended -= 0.3
    assert share.next_slice(True, True, long) == SLICE_S, "never more than a slice at once"


def test_slices_that_run_while_nothing_else_could_count_towards_the_share():
    share = PrefillShare()
    share.next_slice(True, True, LONG + 1)
    share.ran(time.perf_counter())
    for _ in range(5):  # passes of 20 ms, each followed by a 20 ms layer in a wait
        share.ended -= 0.04
        share.ran(time.perf_counter() - 0.02)
    assert share.next_slice(True, True, LONG + 1) is None, "a long prompt had its share"
    assert share.credit == -SLICE_S, "and no more than a slice is taken ahead"
