"""The benchmark: baselines, rows, tables, the plot, the CLI, and one small real run."""

from __future__ import annotations

import json

import pytest
import torch

from bench.baselines import colocated, hf_generate
from bench.cli import hub_defaults, parse_targets
from bench.plot import plot
from bench.report import markdown_table, text_table
from bench.run import METRICS, BenchConfig, baseline_row, run_real
from starhub.cli.main import build_parser
from starhub.drafters.base import TreeShape
from starhub.drafters.model import ModelDrafter
from starhub.drafters.ngram import NgramDrafter
from starhub.options import AUTO, resolve_threads, usable_cores

PROMPTS = ["a b c a b c a b", "one two three one two three one"]


def _prompts_file(tmp_path):
    """``PROMPTS`` as a JSONL prompt file."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    return prompts


def encoded(tok) -> list[tuple[str, list[int]]]:
    return [(f"p{i}", tok(p, add_special_tokens=False)["input_ids"])
            for i, p in enumerate(PROMPTS)]


def test_baselines_are_lossless_and_fill_every_metric(tiny_model):
    model, tok = tiny_model
    prompts = encoded(tok)
    ref_runs = hf_generate(model, prompts, 10)
    reference = {r.id: r.output_ids for r in ref_runs}
    lookup = hf_generate(model, prompts, 10, prompt_lookup=3)
    coloc = colocated(model, NgramDrafter(), TreeShape(3, 2, 6), prompts, 10)
    assert [r.output_ids for r in lookup] == [r.output_ids for r in ref_runs]
    assert [r.output_ids for r in coloc] == [r.output_ids for r in ref_runs]
    rows = [baseline_row("hf-generate", ref_runs, "none", None, 1, None),
            baseline_row("hf-prompt-lookup", lookup, "prompt-lookup", 3, 1, reference),
            baseline_row("colocated", coloc, "ngram", 3, 1, reference)]
    for row in rows:
        assert set(METRICS) <= set(row)
        assert row["tokens"] == sum(len(r.output_ids) for r in ref_runs)
        assert row["threads"] == {"bench": 1}
    assert rows[0]["mean_accept_len"] == 1.0 and rows[0]["lossless"] is None
    assert rows[1]["lossless"] and rows[2]["lossless"]
    assert rows[2]["t_s_ms"] is not None and 0 <= rows[2]["load"] <= 1
    accepted = sum(rows[2]["accept_rate_by_depth"])  # drafted tokens accepted per round
    assert rows[2]["mean_accept_len"] == pytest.approx(1 + accepted)
    own = colocated(model, ModelDrafter(model), TreeShape(4, 1, 4), prompts, 10)
    row = baseline_row("colocated", own, "model", 4, 1, reference)
    assert row["lossless"] and row["mean_accept_len"] > 4.5, \
        "a drafter that is the target has (almost) every 4-token chain accepted"


def synthetic_doc(emulated: bool) -> dict:
    rows = []
    for n in (1, 2, 4):
        row = {"mode": "star", "targets": n, "drafter": "ngram", "depth": 5,
               **{k: float(n) for k in METRICS}, "load": 0.2 * n, "tokens": 10, "wall_s": 1.0}
        if emulated:
            row["model"] = {"t_idle_ms": 1.0, "r_q": n, "r_p": 1.0, "load": 0.25 * n,
                            "system_tok_s": n, "per_target_tok_s": 1.0}
        rows.append(row)
    config = {"mode": "real", "n_prompts": 2, "prompts": "p.jsonl", "max_new_tokens": 8,
              "threads": 1, "drafter": "ngram", "depth": 5}
    if emulated:
        config.update(mode="emulated", emulate="t_s=1ms", model={
            "S_ms": 5.0, "Z_ms": 10.0, "n_full": 3, "r_q_sat": 200.0, "tau": 2.0})
    else:
        rows.append({"mode": "hf-generate", "targets": 1, "drafter": "none", "depth": None,
                     **dict.fromkeys(METRICS), "per_target_tok_s": 3.0, "system_tok_s": 3.0,
                     "lossless": None})
    return {"machine": {"cpu": "some CPU", "isa": "AVX2"}, "config": config, "rows": rows}


@pytest.mark.parametrize("emulated", [False, True])
def test_tables_and_plot(tmp_path, emulated):
    doc = synthetic_doc(emulated)
    text = text_table(doc)
    assert text.splitlines()[0].startswith("CPU some CPU (AVX2)"), "the machine comes first"
    assert "system_tok_s" in text and "t_idle_ms" in text
    assert ("model r_q" in text) == emulated and ("N_full=3" in text) == emulated
    md = markdown_table(doc)
    assert md.count("\n| star ") == 3
    out = tmp_path / "fig.png"
    plot(doc, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_registers_bench_and_metrics_port():
    args = build_parser().parse_args(["bench", "--targets", "1,2", "--json", "o.json"])
    assert args.command == "bench" and args.json_out == "o.json"
    assert build_parser().parse_args(["hub", "--metrics-port", "9100"]).metrics_port == 9100
    assert hub_defaults()["drafter"] == build_parser().parse_args(["hub"]).drafter
    assert parse_targets("1, 2,8") == [1, 2, 8]
    for bad in ("", "0", "a,b"):
        with pytest.raises(ValueError):
            parse_targets(bad)


def test_real_bench_end_to_end(tiny_dir, tmp_path):
    prompts = _prompts_file(tmp_path)
    cfg = BenchConfig(targets=[2], drafter="ngram", draft=None, depth=3, topk=2, max_nodes=6,
                      model=str(tiny_dir), prompts=str(prompts), max_new_tokens=8,
                      log_dir=str(tmp_path / "logs"))
    doc = run_real(cfg, progress=False)
    assert {"machine", "config", "rows"} == set(doc)
    assert "threads_note" in doc["config"] and "t_idle_ms" in doc["config"]["metric_notes"]
    modes = [r["mode"] for r in doc["rows"]]
    assert modes == ["hf-generate", "hf-prompt-lookup", "colocated", "star"]
    star = doc["rows"][-1]
    for key in (*METRICS, "mode", "targets", "drafter", "depth", "tokens", "wall_s",
                "threads", "accept_rate_by_depth", "accept_len_hist", "target_split"):
        assert star[key] is not None, key
    assert star["targets"] == 2 and star["prompts"] == 2
    assert star["lossless"] is True and star["standalone_prompts"] == 0
    per_target = resolve_threads(AUTO, sharing=2)  # auto: the usable cores over 2 targets
    assert star["threads"] == {"hub": 1, "targets": [per_target, per_target]}
    assert doc["config"]["threads_resolved"] == {
        "cores": usable_cores(), "baselines": resolve_threads(AUTO), "targets": {"2": per_target}}
    assert doc["rows"][0]["threads"] == {"bench": resolve_threads(AUTO)}
    assert torch.get_num_threads() == 1, "the bench restores this process's threads"
    generate = doc["rows"][0]
    assert len(generate["passes_tok_s"]) == 2 and generate["deterministic"] is True
    assert star["tokens"] * 2 == generate["tokens"] and generate["prompts"] == 2
    assert doc["rows"][0]["speedup_vs_generate"] == 1.0
    assert star["speedup_vs_generate"] == pytest.approx(
        star["per_target_tok_s"] / doc["rows"][0]["per_target_tok_s"])
    assert star["target_split"]["verify_s"] > 0 and star["target_split"]["hub_draft_s"] > 0
    json.dumps(doc)


def test_auto_threads_split_the_usable_cores_between_the_processes(monkeypatch):
    import starhub.options as options

    monkeypatch.setattr(options, "usable_cores", lambda: 8)
    assert [resolve_threads(AUTO, n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    assert resolve_threads(None) == 8 and resolve_threads(3, 4) == 3
    assert build_parser().parse_args(["target", "--prompts", "p", "--out", "o"]).threads == AUTO
    assert build_parser().parse_args(["bench"]).threads == AUTO


@pytest.mark.parametrize("cpu_max, cores", [
    (None, 8),  # no cgroup quota: the affinity
    ("max 100000", 8),  # a cgroup without a limit
    ("150000 100000", 2),  # 1.5 cores of quota: two cores may run at once
    ("400000 100000", 4),
    ("50000 100000", 1),  # less than a core still runs
    ("1600000 100000", 8),  # a quota beyond the affinity: the affinity
    ("garbage", 8),
])
def test_usable_cores_are_the_affinity_capped_by_the_cgroup_quota(monkeypatch, tmp_path,
                                                                   cpu_max, cores):
    import os

    import starhub.options as options

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max + "\n")
    monkeypatch.setattr(options, "CPU_MAX", path)
    assert usable_cores() == cores


def serve_doc(rows: list[dict]) -> dict:
    config = {"mode": "serve", "targets": 2, "seed": 0, "requests": 4, "n_prompts": 2,
              "prompts": "p.jsonl", "max_new_tokens": 8, "hub_args": [],
              "plain_note": "plain: no hub",
              "threads_resolved": {"cores": 2, "servers": 1, "hub": 1, "generate": 2}}
    return {"machine": {"cpu": "some CPU", "isa": "AVX2", "loadavg_at_start": [0.5, 0.4, 0.3]},
            "config": config, "rows": rows}


def test_poisson_schedule_is_seeded_open_loop_and_round_robin():
    from bench.serve_load import poisson_schedule

    a = poisson_schedule(2.0, 400, 3, 5, seed=7)
    assert a == poisson_schedule(2.0, 400, 3, 5, seed=7)
    assert a != poisson_schedule(2.0, 400, 3, 5, seed=8)
    assert a[0].at_s == 0.0 and all(x.at_s <= y.at_s for x, y in zip(a, a[1:], strict=False))
    assert [x.server for x in a[:7]] == [0, 1, 2, 0, 1, 2, 0]
    assert {x.prompt for x in a} == set(range(5))
    assert 150 < a[-1].at_s < 250, "400 arrivals at 2/s in total take about 200 s"
    with pytest.raises(ValueError):
        poisson_schedule(0.0, 4, 1, 1, seed=0)


def test_serve_lossless_compares_every_output_with_plain_and_generate():
    from bench.serve import check_lossless
    from bench.serve_load import Outcome

    def out(i, prompt, ids, error=None):
        return Outcome(i, 0, prompt, token_ids=ids, error=error)

    rows = [{"mode": "plain"}, {"mode": "star"}, {"mode": "star"}]
    outcomes = [[out(0, 0, [1, 2]), out(1, 1, [3, 4])],
                [out(0, 0, [1, 2]), out(1, 1, [3, 4]), out(2, 1, [], "boom")],
                [out(0, 0, [1, 2]), out(1, 1, [3, 5])]]
    check_lossless(rows, outcomes, generated={0: [1, 2]})
    assert [r["lossless"] for r in rows] == [True, True, False]
    assert rows[1]["lossless_compared"] == 2, "a failed request is not compared"
    assert rows[2]["lossless_mismatches"] == [1]
    check_lossless(rows[:1], outcomes[:1], generated={1: [3, 9]})
    assert rows[0]["lossless"] is False, "generate() judges the plain rows too"


def test_serve_table_and_plot(tmp_path):
    from bench.plot import plot_serve

    rows = [{"mode": mode, "targets": 2, "rate": rate, "load": rate, "request_throughput": rate,
             "output_tok_s": 10 * rate * (1.5 if mode == "star" else 1), "ttft_p50_ms": 100.0,
             "ttft_p99_ms": 300.0, "tpot_p50_ms": 40.0, "tpot_p99_ms": 60.0,
             "tau": 2.5 if mode == "star" else None, "lossless": True, "completed": 4,
             "failed": 0} for rate in (0.5, 1.0) for mode in ("star", "plain")]
    text = text_table(serve_doc(rows))
    first = text.splitlines()[0]
    assert "some CPU" in first and "AVX2" in first and "1 per server, 1 for the hub" in first
    assert "ttft_p99_ms" in text and "tpot_p50_ms" in text and "lossless" in text
    assert markdown_table(serve_doc(rows)).count("\n| star ") == 2
    out = tmp_path / "serve.png"
    plot_serve(serve_doc(rows), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repeated_serve_rows_keep_the_median_run_and_every_run_failure(tmp_path):
    from bench.plot import plot_serve
    from bench.serve import add_ratios, merge_runs

    def run(mode, tok_s, lossless=True, failed=0):
        return {"mode": mode, "targets": 2, "rate": 1.0, "load": 1.0, "output_tok_s": tok_s,
                "tpot_p50_ms": 1e3 / tok_s, "requests": 4, "completed": 4 - failed,
                "failed": failed, "lossless": lossless, "lossless_compared": 4 - failed,
                "lossless_mismatches": [] if lossless else [2]}

    runs = [run("star", 30.0), run("plain", 25.0), run("plain", 20.0, failed=1),
            run("star", 18.0, lossless=False), run("star", 24.0), run("plain", 22.0)]
    star, plain = merge_runs(runs)
    assert star["output_tok_s"] == 24.0 and star["tpot_p50_ms"] == 1e3 / 24.0, \
        "figures come from the median run"
    assert star["output_tok_s_runs"] == [30.0, 18.0, 24.0]
    assert star["lossless"] is False and star["lossless_mismatches"] == [2], \
        "a mismatch in a run the median leaves out still counts"
    assert plain["failed"] == 1 and plain["requests"] == 12 and plain["completed"] == 11
    add_ratios([star, plain])
    assert star["tok_s_vs_plain"] == pytest.approx(24.0 / 22.0)
    assert star["tok_s_vs_plain_runs"] == pytest.approx([30 / 25, 18 / 20, 24 / 22])
    assert "30.0/18.0/24.0" in text_table(serve_doc([star, plain]))
    plot_serve(serve_doc([star, plain]), tmp_path / "serve.png")
    assert merge_runs(runs[:2])[0] is runs[0], "a single run is its row"


@pytest.mark.parametrize("argv, error", [
    (["--targets", "1,2"], "one N"),
    (["--rate", "1,0"], "--rate"),
    (["--concurrency", "2,0"], "--concurrency"),
    (["--depth", "3,4"], "--depth takes one value"),
    (["--topk", "0"], "--topk"),
    (["--hub-load"], "--hub-load"),
])
def test_serve_rejects_what_it_cannot_run(argv, error):
    from bench.cli import main

    with pytest.raises(ValueError, match=error):
        main(build_parser().parse_args(["bench", "--serve", *argv]))


def test_serve_bench_end_to_end(tiny_dir, tmp_path):
    from bench.cli import main

    prompts = _prompts_file(tmp_path)
    out = tmp_path / "serve.json"
    args = build_parser().parse_args([
        "bench", "--serve", "--targets", "1", "--rate", "2", "--requests", "3",
        "--max-new-tokens", "8", "--model", str(tiny_dir), "--drafter", "ngram",
        "--depth", "3", "--threads", "1", "--prompts", str(prompts), "--json", str(out),
        "--plot", str(tmp_path / "serve.png"), "--log-dir", str(tmp_path / "logs"),
        "--speculate", "always", "--repeat", "2", "--slo", "ttft=60000,tpot=60000",
        "--no-progress"])  # n-gram trees on a random model never pay
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["mode"] == "serve" and doc["machine"]["isa"]
    assert doc["config"]["hub_args"] == ["--drafter", "ngram", "--depth", "3"]
    assert [(r["mode"], r["rate"]) for r in doc["rows"]] == [("star", 2.0), ("plain", 2.0)]
    for row in doc["rows"]:
        for key in ("output_tok_s", "request_throughput", "ttft_p50_ms", "ttft_p99_ms",
                    "tpot_p50_ms", "tpot_p99_ms", "mean_verify_batch"):
            assert row[key] is not None and row[key] > 0, key
        assert row["completed"] == 6 and row["failed"] == 0, "both runs count"
        assert row["lossless"] is True and row["lossless_compared"] == 6
        assert len(row["output_tok_s_runs"]) == 2
        assert row["threads"]["servers"] == 1
        assert [r["tokens"] > 0 and r["error"] is None for r in row["per_request"]] == [True] * 3
    star, plain = doc["rows"]
    assert star["tau"] is not None and star["hub_rounds"] > 0 and star["threads"]["hub"] == 1
    assert plain["tau"] is None and plain["hub_load"] is None
    assert len(star["tok_s_vs_plain_runs"]) == 2
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"
    assert doc["config"]["slo_ms"] == {"ttft": 60000.0, "tpot": 60000.0}
    assert all(row["slo_attainment"] == 1.0 and row["goodput_rps"] > 0 for row in doc["rows"])
    assert doc["sustained_rate"] == {"star": 2.0, "plain": 2.0, "star_vs_plain": 1.0}
    records = doc["requests"]
    assert len(records) == 12 and {r["mode"] for r in records} == {"star", "plain"}
    assert all(r["lossless"] and r["ttft_ms"] > 0 and r["e2el_ms"] >= r["ttft_ms"]
               for r in records)


def test_closed_loop_serve_bench_keeps_at_most_its_clients_in_flight(tiny_dir, tmp_path):
    from bench.cli import main

    prompts = _prompts_file(tmp_path)
    out = tmp_path / "serve.json"
    args = build_parser().parse_args([
        "bench", "--serve", "--targets", "1", "--concurrency", "1,2", "--requests", "4",
        "--max-new-tokens", "6", "--model", str(tiny_dir), "--drafter", "ngram",
        "--threads", "1", "--prompts", str(prompts), "--json", str(out),
        "--log-dir", str(tmp_path / "logs"), "--slo", "e2el=60000", "--no-progress"])
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert [(r["mode"], r["concurrency"], r["rate"]) for r in doc["rows"]] == \
        [("star", 1, None), ("plain", 1, None), ("star", 2, None), ("plain", 2, None)]
    for row in doc["rows"]:
        assert row["completed"] == 4 and row["lossless"] is True
        spans = [(r["sent_s"], r["sent_s"] + r["e2e_ms"] / 1e3) for r in row["per_request"]]
        busiest = max(sum(s <= t < e - 0.002 for s, e in spans) for t, _ in spans)
        assert busiest <= row["concurrency"], (row["concurrency"], spans)
        assert row["e2e_p50_vs_plain"] is not None
    assert doc["sustained_concurrency"]["plain"] == 2
    assert {r["concurrency"] for r in doc["requests"]} == {1, 2}


def test_the_long_session_bench_builds_its_prompt_to_length_and_splits_its_phases(tokenizer):
    from bench.long_session import long_prompt, phase_peaks
    from starhub.models.prompts import encode_prompt

    text = long_prompt(tokenizer, 700)
    assert long_prompt(tokenizer, 700) == text, "the same prompt each time"
    assert 690 <= len(encode_prompt(tokenizer, text)) <= 700
    samples = [(0.0, 100.0), (1.0, 500.0), (2.0, 300.0), (3.0, 350.0)]
    peaks = phase_peaks(samples, {"long_sent": 0.5, "long_opened": 1.5, "long_done": 3.0})
    assert list(peaks.values()) == [100.0, 500.0, 350.0]


def test_goodput_counts_the_requests_that_meet_every_slo():
    from bench.serve_load import Outcome, parse_slo, slo_summary

    slo = parse_slo("ttft=200,tpot=50")
    assert slo == {"ttft": 0.2, "tpot": 0.05}

    def out(i, ttft, tpot, tokens=11, error=None):
        o = Outcome(i, 0, 0, sent=float(i), tokens=tokens, error=error)
        if error is None:
            o.first = o.sent + ttft
            o.done = o.first + tpot * (tokens - 1)
        return o

    outs = [out(0, 0.1, 0.04), out(1, 0.3, 0.04), out(2, 0.1, 0.06), out(3, 0.1, 0.01),
            out(4, 0.0, 0.0, error="boom"), out(5, 0.15, 9.0, tokens=1)]
    summary = slo_summary(outs, slo)
    span = outs[-1].done - outs[0].sent
    assert summary["slo_attainment"] == pytest.approx(3 / 6), "0, 3 and the one-token 5"
    assert summary["goodput_rps"] == pytest.approx(3 / span)
    assert slo_summary(outs, parse_slo("e2el=450"))["slo_attainment"] == pytest.approx(2 / 6)


@pytest.mark.parametrize("text, error", [
    ("ttft", "KEY=MS"), ("latency=5", "KEY=MS"), ("tpot=fast", "milliseconds"),
    ("tpot=nan", "positive"), ("tpot=-1", "positive"), ("tpot=inf", "positive"),
    ("", "at least one"),
])
def test_a_bad_slo_is_refused_naming_what_is_allowed(text, error):
    from bench.serve_load import parse_slo

    with pytest.raises(ValueError, match=error):
        parse_slo(text)


def test_the_sustained_rate_is_the_highest_with_ninety_percent_attainment(tmp_path):
    from bench.plot import plot_serve
    from bench.serve import request_records
    from bench.serve_load import Outcome, sustained_rates

    attain = {("star", 0.5): 1.0, ("star", 1.0): 0.95, ("star", 2.0): 0.6,
              ("plain", 0.5): 0.92, ("plain", 1.0): 0.5, ("plain", 2.0): 0.1}
    rows = [{"mode": mode, "targets": 2, "rate": rate, "load": rate, "request_throughput": rate,
             "output_tok_s": 10 * rate, "ttft_p50_ms": 100.0, "ttft_p99_ms": 300.0,
             "tpot_p50_ms": 40.0, "tpot_p99_ms": 60.0, "tau": None, "lossless": True,
             "completed": 4, "failed": 0, "slo_attainment": share, "goodput_rps": share * rate}
            for (mode, rate), share in attain.items()]
    best = sustained_rates(rows)
    assert best == {"star": 1.0, "plain": 0.5, "star_vs_plain": 2.0}
    assert sustained_rates([r for r in rows if r["rate"] == 2.0])["star"] is None
    doc = serve_doc(rows)
    doc["config"]["slo_ms"] = {"tpot": 50.0}
    doc["sustained_rate"] = best
    text = text_table(doc)
    assert "goodput" in text and "95%" in text
    assert "star 1/s, plain 0.5/s (2.00x)" in text and "tpot <= 50 ms" in text
    plot_serve(doc, tmp_path / "slo.png")
    assert (tmp_path / "slo.png").read_bytes()[:4] == b"\x89PNG"
    runs = [{"mode": "star", "rate": 1.0, "lossless_mismatches": [1]}]
    outs = [[Outcome(0, 0, 3, sent=0.0, first=0.1, done=0.5, tokens=5),
             Outcome(1, 1, 4, sent=0.2, first=0.4, done=0.9, tokens=5)]]
    first, second = request_records(runs, outs)
    assert first["ttft_ms"] == 100.0 and first["e2el_ms"] == 500.0 and first["lossless"]
    assert first["tpot_ms"] == 100.0 and first["output_tokens"] == 5
    assert second["lossless"] is False and {first["mode"], first["rate"]} == {"star", 1.0}
