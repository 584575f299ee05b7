"""Every mode of ``starhub bench`` runs through its command line for a few seconds and
writes its rows: the star and edge topologies, real and emulated. (The hub-load and serve
modes run end to end in ``test_hub_load.py`` and ``test_bench.py``.)"""

from __future__ import annotations

import json

import pytest

from starhub.cli.main import main

EDGE_SPEC = "t_v=25ms,t_tok=1ms,t_d=0.1ms..0.5ms,beta=0.5..0.9"


def _prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n"
                            for i, p in enumerate(["a b c a b c a b", "one two one two"])))
    return str(path)


def _rows(argv: list[str], out) -> list[dict]:
    assert main(["bench", *argv, "--json", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())["rows"]


@pytest.mark.parametrize("real", [True, False], ids=["real", "emulated"])
def test_the_edge_bench_runs_each_schedule(tiny_dir, tmp_path, real):
    edge = ["--topology", "edge", "--drafters", "2", "--schedule", "fifo,goodspeed",
            "--log-dir", str(tmp_path / "logs")]
    if real:
        edge += ["--model", str(tiny_dir), "--prompts", _prompts(tmp_path),
                 "--max-new-tokens", "6", "--drafter", "ngram"]
    else:
        edge += ["--emulate", EDGE_SPEC, "--duration", "1", "--warmup", "0.5"]
    rows = [r for r in _rows(edge, tmp_path / "edge.json") if r.get("drafters") == 2]
    assert [r["schedule"] for r in rows] == ["fifo", "goodspeed"]
    assert all(r["system_tok_s"] > 0 for r in rows)


def test_the_emulated_star_bench_runs_a_row_per_target_count(tmp_path):
    rows = _rows(["--emulate", "t_s=1ms,t_v=10ms,t_c=1ms,beta=0.8,depth=3", "--targets",
                  "1,2", "--duration", "1", "--warmup", "0.5", "--log-dir",
                  str(tmp_path / "logs")], tmp_path / "star.json")
    star = [r for r in rows if r["mode"] == "star"]
    assert [r["targets"] for r in star] == [1, 2] and all(r["system_tok_s"] > 0 for r in star)


def test_the_emulated_pool_bench_spreads_targets_over_hubs_and_compares_random_placement(
        tmp_path):
    """Targets placed by the hubs' offers land evenly; every row reports one load and one
    target count per hub, and a plot is drawn."""
    plot = tmp_path / "pool.png"
    rows = _rows(["--emulate", "t_s=1ms,t_v=10ms,t_c=1ms,beta=0.8,depth=3", "--targets", "4",
                  "--hubs", "1,2", "--duration", "1", "--warmup", "0.5", "--plot", str(plot),
                  "--log-dir", str(tmp_path / "logs")], tmp_path / "pool.json")
    assert [(r["hubs"], r["placement"]) for r in rows] == [
        (1, "admission"), (2, "admission"), (2, "random")]
    assert all(len(r["hub_loads"]) == r["hubs"] and r["system_tok_s"] > 0 for r in rows)
    assert rows[0]["targets_per_hub"] == [4] and rows[1]["targets_per_hub"] == [2, 2]
    assert sum(rows[2]["targets_per_hub"]) == 4 and plot.stat().st_size > 0


def test_hubs_without_an_emulation_is_refused_with_where_to_go(caplog):
    assert main(["bench", "--hubs", "2"]) == 2
    assert "--emulate" in caplog.text and "starhub launch" in caplog.text
