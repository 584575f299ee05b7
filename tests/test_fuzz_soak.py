"""A bounded version of the hostile-input soak run (``python -m bench.fuzz_hub``): a real
hub process keeps serving a real session, losslessly, while sockets blast it."""

from __future__ import annotations

from bench.fuzz_hub import run


def test_a_malformed_blast_gets_one_error_each_and_leaves_a_real_session_lossless(tiny_dir):
    report = run(2000, str(tiny_dir), drafter="ngram", senders=3, max_new_tokens=16,
                 hub_args=("--depth", "3"))
    assert report.messages == 2000
    assert report.errors == 2000, report.summary()
    assert report.other_replies == 0 and report.missing_replies == 0
    assert report.serving and report.hub_errors.get("INTERNAL", 0) == 0
    assert report.outputs_equal and report.rounds > 0 and report.fallbacks == 0
    assert report.prompts >= 4
    assert {"TOO_LARGE", "BAD_FRAME", "BAD_FIELD", "BAD_VERSION", "BAD_TYPE", "NO_CARD",
            "UNKNOWN_TAG", "STALE"} <= set(report.codes)
