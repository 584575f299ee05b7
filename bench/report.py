"""Tables in StarSD's Table 1 layout, as aligned text for the terminal and as Markdown."""

from __future__ import annotations

COLUMNS = [
    ("mode", "mode", "{}"),
    ("N", "targets", "{}"),
    ("drafter", "drafter", "{}"),
    ("d", "depth", "{}"),
    ("max", "max_targets", "{}"),
    ("adm", "admitted", "{}"),
    ("n_max", "n_max", "{}"),
    ("system_tok_s", "system_tok_s", "{:.1f}"),
    ("per_target_tok_s", "per_target_tok_s", "{:.1f}"),
    ("t_s_ms", "t_s_ms", "{:.2f}"),
    ("t_wait_ms", "t_wait_ms", "{:.2f}"),
    ("t_idle_ms", "t_idle_ms", "{:.2f}"),
    ("r_q", "r_q", "{:.1f}"),
    ("r_p", "r_p", "{:.2f}"),
    ("load", "load", "{:.3f}"),
    ("tau", "mean_accept_len", "{:.2f}"),
]
REAL_EXTRA = [("vs generate", "speedup_vs_generate", "{:.2f}x"), ("lossless", "lossless", "{}")]
EMULATED_EXTRA = [
    ("model t_idle_ms", ("model", "t_idle_ms"), "{:.2f}"),
    ("model r_q", ("model", "r_q"), "{:.1f}"),
    ("model r_p", ("model", "r_p"), "{:.2f}"),
    ("model load", ("model", "load"), "{:.3f}"),
    ("model system_tok_s", ("model", "system_tok_s"), "{:.1f}"),
    ("z_ms", "z_ms", "{:.2f}"),
    ("round_ms", "round_ms", "{:.3f}"),
    ("overhead_ms", "overhead_ms", "{:.3f}"),
]


CONTROL_COLUMNS = [("batch", "batch", "{}"), ("predraft", "predraft", "{}"),
                   ("lookup", "lookup", "{}"), ("prune", "prune", "{}"),
                   ("process", "draft_process", "{}")]
"""After ``max`` in star tables whose rows record the hub's batching and pre-drafting."""
DRAFT_COLUMNS = [("batch_mean", "batch_mean", "{:.2f}"),
                 ("predraft_hit", "predraft_hit_rate", "{:.3f}"),
                 ("critical_ms", "critical_draft_ms", "{:.2f}"),
                 ("lookup_tok", "lookup_token_share", "{:.3f}")]
"""At the end of real star tables: how the hub drafted."""
HUB_LOAD_COLUMNS = [
    ("mode", "mode", "{}"),
    ("N", "targets", "{}"),
    ("d", "depth", "{}"),
    ("max", "max_targets", "{}"),
    *CONTROL_COLUMNS,
    ("r_q", "r_q", "{:.1f}"),
    ("t_s_ms", "t_s_ms", "{:.2f}"),
    ("draft_ms", "t_draft_ms", "{:.2f}"),
    ("load", "load", "{:.3f}"),
    ("system_tok_s", "system_tok_s", "{:.1f}"),
    ("tau", "mean_accept_len", "{:.2f}"),
    ("plain", "plain_rounds", "{}"),
    ("batch_mean", "batch_mean", "{:.2f}"),
    ("ms/batch", "draft_ms_per_batch", "{:.2f}"),
    ("ms/session", "draft_ms_per_session", "{:.2f}"),
    ("predraft_hit", "predraft_hit_rate", "{:.3f}"),
    ("critical_ms", "critical_draft_ms", "{:.2f}"),
]

POOL_COLUMNS = [
    ("H", "hubs", "{}"),
    ("placement", "placement", "{}"),
    ("N", "targets", "{}"),
    ("system_tok_s", "system_tok_s", "{:.1f}"),
    ("vs 1 hub", "vs_one_hub", "{:.2f}x"),
    ("model system_tok_s", ("model", "system_tok_s"), "{:.1f}"),
    ("slowest target tok/s", "slowest_tok_s", "{:.1f}"),
    ("hub loads", "hub_loads", "{:.2f}"),
    ("load spread", "load_spread", "{:.1%}"),
    ("targets/hub", "targets_per_hub", "{}"),
    ("alone", "alone", "{}"),
    ("r_q per hub", "hub_r_q", "{:.0f}"),
    ("sched ms/round", "sched_ms_per_round", "{:.3f}"),
    ("overhead_ms", "overhead_ms", "{:.2f}"),
]
"""An emulated pool of hubs (``bench.emulate_pool``): one value per hub where listed."""

EDGE_COLUMNS = [
    ("mode", "mode", "{}"),
    ("N", "drafters", "{}"),
    ("schedule", "schedule", "{}"),
    ("batch", "max_batch", "{}"),
    ("system_tok_s", "system_tok_s", "{:.1f}"),
    ("per_drafter_tok_s", "per_drafter_tok_s", "{:.1f}"),
    ("jain", "jain", "{:.3f}"),
    ("sum_log", "sum_log_goodput", "{:.2f}"),
    ("slo", "slo_attainment", "{:.3f}"),
    ("mean_batch", "mean_batch", "{:.2f}"),
    ("verify_ms", "verify_ms_per_step", "{:.1f}"),
    ("idle", "drafter_idle", "{:.2f}"),
    ("tau", "mean_accept_len", "{:.2f}"),
]
EDGE_REAL_EXTRA = [("lossless", "lossless", "{}")]
EDGE_EMULATED_EXTRA = [("mape", "time_model_mape", "{:.3f}")]
SERVE_COLUMNS = [
    ("mode", "mode", "{}"),
    ("N", "targets", "{}"),
    ("rate", "rate", "{:g}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("output_tok_s", "output_tok_s", "{:.1f}"),
    ("vs plain", "tok_s_vs_plain", "{:.2f}x"),
    ("ttft_p50_ms", "ttft_p50_ms", "{:.0f}"),
    ("ttft_p99_ms", "ttft_p99_ms", "{:.0f}"),
    ("tpot_p50_ms", "tpot_p50_ms", "{:.1f}"),
    ("tpot_p99_ms", "tpot_p99_ms", "{:.1f}"),
    ("tpot vs plain", "tpot_p50_vs_plain", "{:.2f}x"),
    ("e2e_p50_ms", "e2e_p50_ms", "{:.0f}"),
    ("e2e vs plain", "e2e_p50_vs_plain", "{:.2f}x"),
    ("tau", "tau", "{:.2f}"),
    ("plain_share", "plain_token_share", "{:.2f}"),
    ("hub_load", "hub_load", "{:.3f}"),
    ("verify_batch", "mean_verify_batch", "{:.2f}"),
    ("done", "completed", "{}"),
    ("failed", "failed", "{}"),
    ("lossless", "lossless", "{}"),
]


def _get(row: dict, key):
    if isinstance(key, tuple):
        for part in key:
            row = row.get(part) if isinstance(row, dict) else None
        return row
    return row.get(key)


def _cell(row: dict, key, fmt: str) -> str:
    value = _get(row, key)
    if value is None:
        return "-"
    if isinstance(value, list):
        return "/".join(_cell({"v": v}, "v", fmt) for v in value)
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def with_tree_columns(cols: list, rows: list[dict]) -> list:
    """``cols`` with topk and node-budget columns after the depth where the rows compare
    more than one value."""
    hub_rows = [row for row in rows if row["mode"] in ("star", "hub-load")]
    varied = [(name, key, "{}") for name, key in (("k", "topk"), ("nodes", "max_nodes"))
              if len({row.get(key) for row in hub_rows}) > 1]
    at = [c[1] for c in cols].index("depth") + 1
    return cols[:at] + varied + cols[at:]


def columns(doc: dict) -> list[tuple[str, object, str]]:
    emulated = doc["config"].get("mode") == "emulated"
    if doc["config"].get("mode") == "pool":
        return POOL_COLUMNS
    if doc["config"].get("mode") == "serve":
        cols = SERVE_COLUMNS
        if any("slo_attainment" in row for row in doc["rows"]):
            at = [c[1] for c in cols].index("tok_s_vs_plain") + 1
            cols = cols[:at] + [("goodput", "goodput_rps", "{:.3f}"),
                                ("slo_ok", "slo_attainment", "{:.0%}")] + cols[at:]
        if any(row.get("concurrency") for row in doc["rows"]):  # closed loop
            cols = [("clients", "concurrency", "{}") if c[1] == "rate" else c for c in cols]
        for after, key, fmt in (("tok_s_vs_plain", "tok_s_vs_plain_runs", "{:.2f}"),
                                ("output_tok_s", "output_tok_s_runs", "{:.1f}")):
            if any(key in row for row in doc["rows"]):
                at = [c[1] for c in cols].index(after) + 1
                cols = cols[:at] + [(key.replace("_runs", " runs"), key, fmt)] + cols[at:]
        return cols
    if doc["config"].get("topology") == "edge":
        return EDGE_COLUMNS + (EDGE_EMULATED_EXTRA if emulated else EDGE_REAL_EXTRA)
    if doc["config"].get("mode") == "hub-load":
        cols = with_tree_columns(HUB_LOAD_COLUMNS, doc["rows"])
        if any("r_q_runs" in row for row in doc["rows"]):
            at = [c[1] for c in cols].index("r_q") + 1
            cols = cols[:at] + [("r_q_runs", "r_q_runs", "{:.1f}")] + cols[at:]
        return cols
    cols = COLUMNS + (EMULATED_EXTRA if emulated else REAL_EXTRA)
    if any("batch" in row or "predraft" in row for row in doc["rows"]):
        at = [c[1] for c in cols].index("max_targets") + 1
        cols = cols[:at] + CONTROL_COLUMNS + cols[at:]
    cols = with_tree_columns(cols, doc["rows"])
    if len({row.get("draft") for row in doc["rows"] if row["mode"] == "star"}) > 1:
        at = [c[1] for c in cols].index("drafter") + 1
        cols = cols[:at] + [("draft", "draft", "{}")] + cols[at:]
    if any(row.get("critical_draft_ms") is not None for row in doc["rows"]):
        cols = cols + DRAFT_COLUMNS
    return cols


def table_cells(doc: dict) -> tuple[list[str], list[list[str]]]:
    cols = columns(doc)
    return [c[0] for c in cols], [[_cell(row, key, fmt) for _, key, fmt in cols]
                                  for row in doc["rows"]]


def machine_line(doc: dict) -> str:
    """The CPU model, the instruction set torch ran (``AVX2`` where it was forced) and the
    host's load when the run began: every figure is read against these."""
    machine = doc.get("machine") or {}
    load = machine.get("loadavg_at_start")
    return (f"CPU {machine.get('cpu', '?')} ({machine.get('isa', '?')}), load average at "
            f"start {'/'.join(f'{x:.2f}' for x in load) if load else '?'}")


def preamble(doc: dict) -> list[str]:
    """The lines above a table: the machine first (a serving run's line says more), then
    what ran."""
    cfg = doc["config"]
    if cfg.get("mode") == "serve":
        return serve_preamble(doc)
    return [machine_line(doc), *run_lines(doc)]


def run_lines(doc: dict) -> list[str]:
    cfg = doc["config"]
    lines = []
    if cfg.get("topology") == "edge":
        what = (f"emulated {cfg['emulate']}" if cfg.get("mode") == "emulated" else
                f"real: {cfg['n_prompts']} prompts from {cfg['prompts']}, "
                f"{cfg['max_new_tokens']} new tokens, {cfg['drafter']} drafters")
        budget = cfg["budget"] or "auto"
        return [f"edge, {what}; verifier budget {budget} tokens per pass (rows: 'budget')",
                cfg.get("threads_note", "")]
    if cfg.get("mode") == "hub-load":
        return hub_load_preamble(cfg)
    if cfg.get("mode") == "pool":
        m = cfg["model"]
        return [f"emulated pool {cfg['emulate']}, hubs {cfg['hubs']}, max-targets "
                f"{cfg['max_targets']}: each hub S(d)={m['S_ms']:.2f}ms Z(d)={m['Z_ms']:.2f}ms "
                f"N_full={m['n_full']} tau={m['tau']:.2f}",
                "placement admission: every hub's STATS read, the best offer greeted first; "
                "random: one hub at random; model: StarSD's per hub, targets spread evenly"]
    if cfg.get("mode") == "emulated":
        m = cfg["model"]
        lines.append(f"emulated {cfg['emulate']}: S(d)={m['S_ms']:.2f}ms Z(d)={m['Z_ms']:.2f}ms "
                     f"N_full={m['n_full']} r_q at saturation 1/S={m['r_q_sat']:.1f}/s "
                     f"tau={m['tau']:.2f}")
        lines.append("model: T_idle(N)=max(0, Z-(N-1)S), T(N)=N*S+T_idle, "
                     "system_tok_s(N)=N*tau/T(N); overhead_ms = measured busy time per round "
                     "minus S(d)")
    else:
        lines.append(f"real: {cfg['n_prompts']} prompts from {cfg['prompts']}, "
                     f"{cfg['max_new_tokens']} new tokens, {threads_phrase(cfg)}, "
                     f"{cfg.get('hub_threads', cfg['threads'])} for "
                     f"the hub, target weights {cfg.get('dtype', 'auto')}, drafter "
                     f"weights {cfg.get('draft_dtype', 'auto')}, linear kernel "
                     f"{cfg.get('linear', 'auto')}")
    return lines


def threads_phrase(cfg: dict) -> str:
    """How many torch threads each target and the baselines ran, and why."""
    resolved = cfg.get("threads_resolved")
    if not resolved:
        return f"{cfg['threads']} torch thread(s) per target and baseline"
    per_n = ", ".join(f"{t} with N={n}" for n, t in resolved["targets"].items())
    return (f"torch threads {cfg['threads']} ({resolved['cores']} usable cores): per target "
            f"{per_n}; baselines {resolved['baselines']}")


def serve_preamble(doc: dict) -> list[str]:
    cfg = doc["config"]
    threads = cfg["threads_resolved"]
    return [f"serve: {machine_line(doc)}, {threads['cores']} usable cores; torch threads: "
            f"{threads['servers']} per server, {threads['hub']} for the hub "
            f"(N={cfg['targets']} servers per mode; the load generator shares the cores)",
            (f"closed loop: each of the 'clients' sends its next request when its last ends "
             f"(prompts seeded by {cfg['seed']})" if cfg.get("concurrency") else
             f"open-loop Poisson arrivals (seed {cfg['seed']}), rate = requests/s over all N "
             f"servers") + f", sent round-robin; {cfg['requests']} requests per row, prompts drawn "
            f"from {cfg['n_prompts']} in {cfg['prompts']}, {cfg['max_new_tokens']} new tokens, "
            f"greedy, streamed by the openai client",
            f"star: one hub ({' '.join(cfg['hub_args']) or 'default flags'}) shared by the "
            f"N servers; {cfg['plain_note']}", *slo_lines(doc)]


def slo_lines(doc: dict) -> list[str]:
    """The SLOs a serving run judged its rows by, and the rates each mode sustained."""
    slo = doc["config"].get("slo_ms")
    if not slo:
        return []
    closed = "sustained_concurrency" in doc
    best = doc.get("sustained_concurrency" if closed else "sustained_rate") or {}
    unit = " clients" if closed else "/s"

    def rate(mode: str) -> str:
        return "none" if best.get(mode) is None else f"{best[mode]:g}{unit}"

    ratio = best.get("star_vs_plain")
    return [f"SLO {', '.join(f'{k} <= {v:g} ms' for k, v in slo.items())}: goodput = "
            f"requests/s meeting all; highest {'concurrency' if closed else 'rate'} with "
            f">= 90% attainment: star {rate('star')}, plain {rate('plain')}"
            + (f" ({ratio:.2f}x)" if ratio else "")]


def hub_load_preamble(cfg: dict) -> list[str]:
    rec = cfg.get("recording") or {}
    answer = (f"after t_v={1e3 * cfg['t_v']:g}ms" if cfg.get("t_v") is not None
              else "as soon as it arrives")
    return [f"hub-load: a real hub ({cfg['drafter']} drafter, {cfg['hub_threads']} torch "
            f"thread(s)) and N replay clients that compute nothing: each tree is answered "
            f"{answer}, a plain round after the recorded step per token; "
            f"{cfg['warmup_s']:g}s warm-up, {cfg['duration_s']:g}s measured per row",
            f"replaying {len(rec.get('prompt_names') or [])} prompts from {rec.get('prompts')}, "
            f"{rec.get('max_new_tokens')} new tokens each, features {rec.get('feature_layers')}"
            f"; recorded step {rec.get('step_ms') or 0:.1f}ms, verify "
            f"{rec.get('verify_ms') or 0:.1f}ms ({'cached' if rec.get('reused') else 'recorded'}"
            f": {rec.get('path')})",
            "t_s_ms: draft time per tree layer; draft_ms: per round; '-': the hub does not "
            "report it"]


def text_table(doc: dict) -> str:
    head, body = table_cells(doc)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h)
              for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([*preamble(doc), fmt.format(*head),
                      *(fmt.format(*r) for r in body)])


def markdown_table(doc: dict) -> str:
    head, body = table_cells(doc)
    lines = [f"_{line}_" for line in preamble(doc)] + [""]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(":---" if h in ("mode", "drafter") else "---:"
                                for h in head) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines) + "\n"
