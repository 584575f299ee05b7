"""A PNG shaped like StarSD's Figure 5: round speeds and load against N (left), throughput
against N with the baselines as horizontal lines (right)."""

from __future__ import annotations

from pathlib import Path


def _series(rows: list[dict], key: str, sub: str | None = None) -> tuple[list, list]:
    xs, ys = [], []
    for row in rows:
        value = (row.get(sub) or {}).get(key) if sub else row.get(key)
        if value is not None:
            xs.append(row["targets"])
            ys.append(value)
    return xs, ys


ROW_OPTIONS = ("draft", "depth", "topk", "max_nodes", "max_targets", "batch", "predraft",
               "lookup", "prune", "draft_process")
"""What a star row records of the hub's comparison options."""


def _variants(star: list[dict]) -> dict[str, list[dict]]:
    """Star rows by the comparison options they ran with, labelled by those that vary."""
    varied = [k for k in ROW_OPTIONS if len({str(row.get(k)) for row in star}) > 1]
    out: dict[str, list[dict]] = {}
    for row in star:
        label = ", ".join(f"{k.replace('_', '-')} {Path(str(row.get(k))).name}" for k in varied)
        out.setdefault(label or f"depth {row.get('depth')}", []).append(row)
    return out


def plot(doc: dict, out: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    star = sorted((r for r in doc["rows"] if r["mode"] == "star"), key=lambda r: r["targets"])
    baselines = [r for r in doc["rows"] if r["mode"] != "star"]
    emulated = doc["config"].get("mode") == "emulated"
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    groups = _variants(star)
    first_label, star = next(iter(groups.items()), ("", star))

    left.plot(*_series(star, "r_q"), "o-", color="tab:blue", label="$r_q$ (hub drafts/s)")
    left.plot(*_series(star, "r_p"), "s-", color="tab:orange",
              label="$r_p$ (verifications/s per target)")
    left.set_xlabel("targets N")
    left.set_ylabel("rounds per second")
    load_ax = left.twinx()
    load_ax.plot(*_series(star, "load"), "^-", color="tab:green", label="load")
    load_ax.set_ylabel("hub load")
    load_ax.set_ylim(0, 1.05)
    if emulated:
        left.plot(*_series(star, "r_q", "model"), "--", color="tab:blue", alpha=0.6,
                  label="$r_q$ model")
        left.plot(*_series(star, "r_p", "model"), "--", color="tab:orange", alpha=0.6,
                  label="$r_p$ model")
        load_ax.plot(*_series(star, "load", "model"), "--", color="tab:green", alpha=0.6,
                     label="load model")
        n_full = doc["config"]["model"]["n_full"]
        left.axvline(n_full, color="grey", linestyle=":", label=f"$N_{{full}}$={n_full}")
    left.set_ylim(bottom=0)
    handles = left.get_legend_handles_labels()
    more = load_ax.get_legend_handles_labels()
    left.legend(handles[0] + more[0], handles[1] + more[1], fontsize=8, loc="center right")
    left.set_title("round speeds and load" + (f" ({first_label})" if len(groups) > 1 else ""))

    for (label, rows), marker in zip(groups.items(), "osD^v<>p*h" * 4, strict=False):
        suffix = f" ({label})" if len(groups) > 1 else ""
        right.plot(*_series(rows, "system_tok_s"), marker + "-", label="system_tok_s" + suffix)
        right.plot(*_series(rows, "per_target_tok_s"), marker + ":",
                   label="per_target_tok_s" + suffix)
    if emulated:
        right.plot(*_series(star, "system_tok_s", "model"), "--", color="tab:red", alpha=0.6,
                   label="system_tok_s model")
        right.plot(*_series(star, "per_target_tok_s", "model"), "--", color="tab:purple",
                   alpha=0.6, label="per_target_tok_s model")
    styles = ["-.", ":", (0, (5, 2, 1, 2)), "--"]
    for style, row in zip(styles * 4, baselines, strict=False):
        right.axhline(row["per_target_tok_s"], linestyle=style, color="black", alpha=0.7,
                      label=f"{row['mode']} ({row['per_target_tok_s']:.1f} tok/s)")
    right.set_xlabel("targets N")
    right.set_ylabel("tokens per second")
    right.set_ylim(bottom=0)
    right.legend(fontsize=8)
    right.set_title("throughput")
    ns = sorted({r["targets"] for r in star})
    for ax in (left, right):
        if ns and ns[-1] / ns[0] > 20:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.grid(alpha=0.3)
    cfg = doc["config"]
    what = (f"emulated {cfg['emulate']}" if emulated else
            f"{cfg['drafter']} drafter, depth {cfg['depth']}, {cfg['n_prompts']} prompts x "
            f"{cfg['max_new_tokens']} tokens, {cfg['threads']} thread(s)/process")
    fig.suptitle(f"starhub star topology: {what}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_edge(doc: dict, out: str | Path) -> None:
    """Edge rows side by side: total goodput (left), each drafter's goodput (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if r["mode"] != "hf-generate"]
    labels = [f"N={r['drafters']}\n{r['schedule']}\nbatch {r['max_batch']}" for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    left.bar(range(len(rows)), [r["system_tok_s"] for r in rows], color="tab:blue")
    for row in doc["rows"]:
        if row["mode"] == "hf-generate":
            left.axhline(row["per_target_tok_s"], color="black", linestyle="--",
                         label=f"hf-generate ({row['per_target_tok_s']:.1f} tok/s)")
            left.legend(fontsize=8)
    left.set_xticks(range(len(rows)), labels, fontsize=7)
    left.set_ylabel("committed tokens per second, all drafters")
    left.set_title("system goodput")
    width = 0.8 / max((len(r["per_drafter_tok_s"]) for r in rows), default=1)
    for i, row in enumerate(rows):
        for j, rate in enumerate(row["per_drafter_tok_s"]):
            right.bar(i - 0.4 + (j + 0.5) * width, rate, width, color=f"C{j % 10}")
        jain = row.get("jain")
        if jain is not None:
            right.text(i, max(row["per_drafter_tok_s"], default=0), f"J={jain:.2f}",
                       ha="center", va="bottom", fontsize=7)
    right.set_xticks(range(len(rows)), labels, fontsize=7)
    right.set_ylabel("tokens per second")
    right.set_title("per drafter (J: Jain's fairness index)")
    for ax in (left, right):
        ax.grid(alpha=0.3, axis="y")
    cfg = doc["config"]
    what = cfg.get("emulate") or f"{cfg['drafter']} drafters, {cfg['n_prompts']} prompts"
    fig.suptitle(f"starhub edge topology: {what}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_serve(doc: dict, out: str | Path) -> None:
    """Serving rows against the offered rate, star and plain: output tokens/s (left), p99
    TTFT and TPOT (middle) and, with SLOs, the share of requests meeting them (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = doc["config"].get("slo_ms")
    closed = bool(doc["config"].get("concurrency"))
    xlabel = ("clients (closed loop, all servers)" if closed
              else "offered rate (requests/s, all servers)")
    fig, axes = plt.subplots(1, 3 if slo else 2, figsize=(18 if slo else 12, 4.8))
    left, right = axes[0], axes[1]
    lat = right.twinx()
    for mode, color, nudge in (("star", "tab:blue", -0.015), ("plain", "tab:orange", 0.015)):
        rows = sorted((r for r in doc["rows"] if r["mode"] == mode), key=lambda r: r["load"])
        if not rows:
            continue

        def series(key: str, rows=rows) -> tuple[list, list]:
            pts = [(r["load"], r[key]) for r in rows if r.get(key) is not None]
            return [x for x, _ in pts], [y for _, y in pts]

        left.plot(*series("output_tok_s"), "o-", color=color, label=f"{mode} output tok/s")
        spread = [(r["load"], min(r["output_tok_s_runs"]), max(r["output_tok_s_runs"]))
                  for r in rows if r.get("output_tok_s_runs")]
        if spread:  # with --repeat: every run of the row, the line through its median
            left.vlines([x * (1 + nudge) for x, _, _ in spread], [lo for _, lo, _ in spread],
                        [hi for _, _, hi in spread], color=color, linewidth=3, alpha=0.45,
                        label=f"{mode}: range of its runs")
        right.plot(*series("tpot_p99_ms"), "s-", color=color, label=f"{mode} TPOT p99")
        lat.plot(*series("ttft_p99_ms"), "^:", color=color, label=f"{mode} TTFT p99")
        if slo:
            rates, shares = series("slo_attainment")
            axes[2].plot(rates, [100 * x for x in shares], "o-", color=color, label=mode)
    left.set_xlabel(xlabel)
    left.set_ylabel("output tokens per second")
    left.set_title("throughput")
    right.set_xlabel(xlabel)
    right.set_ylabel("TPOT p99 (ms)")
    lat.set_ylabel("TTFT p99 (ms)")
    right.set_title("p99 latency")
    handles = right.get_legend_handles_labels()
    more = lat.get_legend_handles_labels()
    right.legend(handles[0] + more[0], handles[1] + more[1], fontsize=8, loc="upper left")
    left.legend(fontsize=8)
    rates = sorted({r["load"] for r in doc["rows"]})
    for ax in (left, right, lat):
        ax.set_ylim(bottom=0)
    if slo:
        goal = axes[2]
        goal.axhline(90, color="grey", linestyle="--", linewidth=1, label="90% (sustained)")
        goal.set_xlabel(xlabel)
        goal.set_ylabel("requests meeting every SLO (%)")
        goal.set_ylim(0, 105)
        goal.set_title("SLO attainment: " + ", ".join(f"{k} <= {v:g} ms"
                                                      for k, v in slo.items()))
        goal.legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.grid(alpha=0.3)
    cfg = doc["config"]
    fig.suptitle(f"starhub serve: {cfg['targets']} servers, star (one hub) vs plain, "
                 f"{cfg['requests']} {'closed-loop' if closed else 'Poisson'} requests per load "
                 f"x {cfg['max_new_tokens']} "
                 f"tokens, {cfg['threads_resolved']['servers']} thread(s)/server", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_pool(doc: dict, out: str | Path) -> None:
    """System tokens/s against N, one line per hub count: admission placement solid,
    random placement dashed, the model (targets spread evenly) dotted."""
    # deferred: matplotlib loads only when a plot is asked for
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.8))
    cfg = doc["config"]
    for i, hubs in enumerate(cfg["hubs"]):
        color = f"C{i}"
        rows = sorted((r for r in doc["rows"] if r["hubs"] == hubs), key=lambda r: r["targets"])
        for placement, style in (("admission", "o-"), ("random", "x--")):
            ours = [r for r in rows if r["placement"] == placement]
            if ours:
                ax.plot(*_series(ours, "system_tok_s"), style, color=color,
                        label=f"H={hubs}" + (f", {placement}" if hubs > 1 else ""))
        model = [r for r in rows if r["placement"] == "admission"]
        ax.plot(*_series(model, "system_tok_s", "model"), ":", color=color, alpha=0.6)
    ax.set_xlabel("targets N")
    ax.set_ylabel("system tokens/s")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.suptitle(f"starhub pool of hubs, emulated {cfg['emulate']} (dotted: model)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
