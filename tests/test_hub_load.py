"""``starhub bench --hub-load``: greedy acceptance along a recording, the cached recording,
one short run against a real hub, and the batch/predraft rows of the star bench."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import replay
from bench.cli import main as bench_main
from bench.cli import tree_options
from bench.hub_load import parse_t_v
from bench.replay import ensure_recording
from bench.report import markdown_table, text_table
from bench.run import BenchConfig, StarVariant, hub_flags, variants
from bench.runs import median_run
from starhub.cli.main import build_parser
from starhub.wire.tree import accepted_path

# root -> 0:5 -> 2:9
#           \-> 3:7 -> 5:8
#      -> 1:7 -> 4:3
TOKENS = np.array([5, 7, 9, 7, 3, 8], np.int32)
PARENTS = np.array([-1, -1, 0, 0, 1, 3], np.int32)


@pytest.mark.parametrize("continuation, path", [
    ([5, 7, 8, 1], [0, 3, 5]),
    ([5, 9, 9], [0, 2]),
    ([7, 3, 4], [1, 4]),
    ([7, 8], [1]),
    ([2, 5], []),
    ([], []),
])
def test_greedy_walk_follows_the_recorded_tokens(continuation, path):
    assert accepted_path(TOKENS, PARENTS, np.array(continuation, np.int32)) == path


def test_hub_load_takes_only_a_verify_time():
    assert parse_t_v(None) is None
    assert parse_t_v("t_v=25ms") == pytest.approx(0.025)
    with pytest.raises(ValueError, match="t_v"):
        parse_t_v("t_s=1ms,t_v=2ms")


def test_star_rows_for_every_batch_predraft_lookup_prune_and_draft_process_value():
    cfg = BenchConfig(targets=[1], drafter="ngram", draft=None, depth=[3, "auto"], topk=2,
                      max_nodes=6, batch=[1, "auto"], predraft=[True, False],
                      lookup=[False, True], draft_process=[True, False], prune=[True, False])
    rows = variants(cfg)
    assert len(rows) == 64 and len({r.name for r in rows}) == 64
    flags = hub_flags(cfg, StarVariant(3, 0, 1, False, lookup=False, draft_process=False,
                                       prune=False))
    assert flags[flags.index("--batch") + 1] == "1"
    assert flags[flags.index("--predraft") + 1] == "off"
    assert flags[flags.index("--lookup") + 1] == "off"
    assert flags[flags.index("--prune") + 1] == "off"
    assert flags[flags.index("--draft-process") + 1] == "off"
    assert StarVariant("auto", 0, "auto", True).record() == {
        "depth": "auto", "topk": 4, "max_nodes": 10, "max_targets": 0, "batch": "auto",
        "predraft": "on", "lookup": "on", "draft_process": "auto", "prune": "on",
        "draft": None}


def test_star_rows_for_every_topk_and_node_budget_given():
    args = build_parser().parse_args(["bench", "--topk", "2,4", "--max-nodes", "10, 16"])
    tree = tree_options(args, None)
    assert (tree["topk"], tree["max_nodes"]) == ([2, 4], [10, 16])
    cfg = BenchConfig(targets=[1], **tree)
    rows = variants(cfg)
    assert [(r.topk, r.max_nodes) for r in rows] == [(2, 10), (2, 16), (4, 10), (4, 16)]
    assert len({r.name for r in rows}) == 4
    flags = hub_flags(cfg, rows[1])
    assert (flags[flags.index("--topk") + 1], flags[flags.index("--max-nodes") + 1]) == ("2", "16")
    assert (cfg.first_shape.topk, cfg.first_shape.max_nodes) == (2, 10), "colocated's tree"
    for bad in (["--max-nodes", "0"], ["--topk", "x"]):
        with pytest.raises(ValueError, match=bad[0]):
            tree_options(build_parser().parse_args(["bench", *bad]), None)
    edge = build_parser().parse_args(["bench", "--topology", "edge", "--max-nodes", "8,16"])
    with pytest.raises(ValueError, match="one value"):
        bench_main(edge)


def test_star_rows_for_every_draft_given():
    args = build_parser().parse_args(["bench", "--draft", "self:layers=2,self:layers=4",
                                      "--depth", "3,auto", "--drafter", "model", "--topk", "2",
                                      "--max-nodes", "6"])
    tree = tree_options(args, [3, "auto"])
    assert tree["draft"] == ["self:layers=2", "self:layers=4"]
    cfg = BenchConfig(targets=[1], **tree)
    rows = variants(cfg)
    assert [(r.draft, r.depth) for r in rows] == [
        ("self:layers=2", 3), ("self:layers=2", "auto"), ("self:layers=4", 3),
        ("self:layers=4", "auto")]
    assert len({r.name for r in rows}) == 4
    flags = hub_flags(cfg, rows[2])
    assert flags[flags.index("--draft") + 1] == "self:layers=4"
    assert cfg.first_draft == "self:layers=2"


def test_batch_and_predraft_refused_where_they_mean_nothing():
    args = build_parser().parse_args(["bench", "--emulate", "t_s=1ms", "--batch", "1,auto"])
    with pytest.raises(ValueError, match="--batch"):
        bench_main(args)
    args = build_parser().parse_args(["bench", "--hub-load", "--predraft", "maybe"])
    with pytest.raises(ValueError, match="--predraft"):
        bench_main(args)


def test_repeated_rows_keep_the_median_run_and_list_every_run():
    runs = [{"mode": "hub-load", "r_q": r_q, "t_s_ms": r_q / 100} for r_q in (130.0, 90.0, 110.0)]
    row = median_run(runs, "r_q")
    assert row["r_q"] == 110.0 and row["t_s_ms"] == 1.1, "figures come from one run"
    assert row["r_q_runs"] == [130.0, 90.0, 110.0]
    assert median_run(runs[:2], "r_q")["r_q"] == 90.0, "an even count keeps the lower median"
    assert "r_q_runs" not in median_run(runs[:1], "r_q")
    doc = {"machine": {}, "config": {"mode": "hub-load", "drafter": "eagle", "hub_threads": 1,
                                     "warmup_s": 1.0, "duration_s": 3.0, "t_v": None},
           "rows": [row]}
    assert "130.0/90.0/110.0" in text_table(doc)
    with pytest.raises(ValueError, match="--repeat applies to --hub-load and --serve only"):
        bench_main(build_parser().parse_args(["bench", "--repeat", "3"]))


def test_tables_show_hub_load_rows_and_star_controls():
    row = {"mode": "hub-load", "targets": 8, "depth": "auto", "max_targets": 0, "batch": "auto",
           "predraft": "on", "r_q": 120.0, "t_s_ms": 2.0, "t_draft_ms": 8.0, "load": 0.97,
           "system_tok_s": 300.0, "mean_accept_len": 2.9, "plain_rounds": 0,
           "batch_mean": 3.5, "draft_ms_per_batch": None}
    config = {"mode": "hub-load", "drafter": "eagle", "hub_threads": 1, "warmup_s": 1.0,
              "duration_s": 5.0, "t_v": None,
              "recording": {"prompts": "eval.jsonl", "prompt_names": ["a", "b"],
                            "max_new_tokens": 128, "feature_layers": [-1], "step_ms": 35.0,
                            "verify_ms": 60.0, "reused": True, "path": "x.npz"}}
    doc = {"machine": {}, "config": config, "rows": [row, {**row, "batch": 1}]}
    text = text_table(doc)
    assert "1 torch thread(s)" in text and "batch_mean" in text and "3.50" in text
    assert "predraft_hit" in text and " - " in text
    assert markdown_table(doc).count("\n| hub-load ") == 2
    star = {"mode": "star", "targets": 2, "drafter": "eagle", "depth": 5, "max_targets": 0,
            "batch": 1, "predraft": "off"}
    header = text_table({"machine": {}, "config": {"mode": "real", "n_prompts": 1,
                                                   "prompts": "p", "max_new_tokens": 8,
                                                   "threads": 1},
                         "rows": [star]}).splitlines()[2]
    assert "batch" in header and "predraft" in header
    assert "nodes" not in header, "one node budget needs no column"
    varied = {**doc, "rows": [{**row, "max_nodes": 10}, {**row, "max_nodes": 16}]}
    lines = text_table(varied).splitlines()
    header = next(line for line in lines if line.lstrip().startswith("mode"))
    assert "nodes" in header and " 16 " in lines[-1]


@pytest.mark.slow
def test_hub_load_end_to_end_with_a_cached_recording(tmp_path, monkeypatch):
    """Record 2 prompts of 16 tokens, replay them to a real hub with the shipped EAGLE head
    for each batch value, and read the recording back from the cache the second time. The
    depth is fixed: on a busy machine ``auto`` may rightly decode such short runs plainly."""
    out = tmp_path / "load.json"
    cache = tmp_path / "cache"
    args = build_parser().parse_args([
        "bench", "--hub-load", "--targets", "2", "--batch", "1,auto", "--depth", "4",
            "--predraft", "on",
        "--record-prompts", "2",
        "--max-new-tokens", "16", "--warmup", "0.5", "--duration", "1", "--repeat", "2",
        "--replay-cache", str(cache), "--json", str(out), "--no-progress",
        "--log-dir", str(tmp_path / "logs")])
    assert bench_main(args) == 0
    doc = json.loads(out.read_text())
    rec = doc["config"]["recording"]
    assert rec["feature_layers"] == [-1] and rec["reused"] is False
    assert rec["step_ms"] > 0 and rec["verify_ms"] > 0
    assert [r["batch"] for r in doc["rows"]] == [1, "auto"]
    for row in doc["rows"]:
        assert row["mode"] == "hub-load" and row["targets"] == 2 and row["predraft"] == "on"
        assert row["depth"] == 4 and row["plain_rounds"] == 0
        assert row["critical_draft_ms"] is not None and row["predraft_hit_rate"] is not None
        assert row["r_q"] > 0 and 0 < row["load"] <= 1 and row["t_s_ms"] > 0
        assert row["mean_accept_len"] > 1, "greedy replay accepted no drafted token"
        assert row["replay"]["errors"] == 0 and row["replay"]["stray"] == 0
        assert row["replay"]["admitted"] == 2 and row["replay"]["sessions"] > 0
        assert row["threads"]["hub"] == 1
        assert len(row["r_q_runs"]) == 2 and row["r_q"] in row["r_q_runs"]
    assert len(list((tmp_path / "logs").glob("hub-n2-*-run2.log"))) == 2

    def no_recording(*_a, **_k):
        raise AssertionError("the cached recording was not reused")

    monkeypatch.setattr(replay, "record", no_recording)
    again = ensure_recording("default", rec["prompts"], 2, 16, [-1], cache=cache)
    assert again.reused and str(again.path) == rec["path"]
    assert len(again) == 2 and rec["tokens"] == sum(len(o) for o in again.outputs)
    for prompt, output, feats in zip(again.prompts, again.outputs, again.features,
                                     strict=True):
        assert 1 <= len(output) <= 16 and output.dtype == np.int32
        assert feats.dtype == np.float16
        assert feats.shape == (len(prompt) + len(output) - 1, 576)
