"""Chunked prefill run a slice at a time, and when a slice runs beside decoding sessions."""

from __future__ import annotations

import time

from targets.engine import VerifyEngine
from targets.prefill import SHARE, PrefillShare


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


def test_a_slice_is_due_whenever_nothing_else_has_a_pass_to_run():
    share = PrefillShare()
    share.ran(time.perf_counter() - 1.0)  # a one-second slice that just ended
    assert share.due(others=False, ready=True)
    assert share.due(others=True, ready=False)
    assert not share.due(others=True, ready=True), "the others' passes go first"
    share.ended -= share.took * (1 / SHARE - 1)
    assert share.due(others=True, ready=True), "but the prefill gets its share"
    assert PrefillShare.slice_s(others=True) == 0.0 < PrefillShare.slice_s(others=False)
