"""What the star benchmark's JSON says about its own columns: how threads were set, and
what each metric means (``config.threads_note`` and ``config.metric_notes``)."""

from __future__ import annotations

THREADS_NOTE = ("every process sets its torch thread count: each target from --threads (auto: "
                "the usable cores over the row's N targets) and the hub from --hub-threads "
                "(via their own --threads flag), the benchmark process, which runs the "
                "baselines, from --threads (auto: every usable core) via "
                "torch.set_num_threads; child "
                "processes also get OMP_NUM_THREADS/MKL_NUM_THREADS; "
                "each row lists the count every process reported")
METRIC_NOTES = {
    "system_tok_s": "committed tokens over the run's wall time, from the first target's "
                    "first prompt to the last target's end",
    "per_target_tok_s": "mean over targets of its tokens over its decoding time",
    "t_idle_ms": "hub idle time per iteration (one request per active session): total idle "
                 "over sum(1/active sessions) per round, the model's T_idle; "
                 "t_idle_gap_ms is the plain mean per gap",
    "r_q": "hub draft rounds per second over its active window",
    "r_p": "mean over targets of verification rounds per second of decoding time",
    "load": "fraction of the hub's active window spent drafting",
    "mean_accept_len": "committed tokens per verification round, bonus included",
    "speedup_vs_generate": "per_target_tok_s over the hf-generate row's, same prompts and run",
    "passes_tok_s": "hf-generate runs once before and once after the star rows, so slow "
                    "drift of a shared host falls on both sides; its row pools the passes "
                    "and lists each pass's tok/s here",
    "target_split": "seconds summed over targets: prefill, verify, plain (rounds the target "
                    "decoded alone at the hub's word), hub_queue + hub_draft (waiting for "
                    "the hub, by the hub's own account), comm (the rest of each round trip), "
                    "other (the last, uncommitted plain round of each request included)",
    "admitted": "targets that got drafts from the hub (real mode: for at least one prompt; "
                "emulated: holding a slot at the end of the window); rejected: the others",
    "n_max": "the hub's load model's N_max at the end of the row: the most typical targets "
             "that all keep their standalone speed, acceptance counted two standard errors "
             "below the hub's estimate as admission counts it (alike targets are admitted "
             "to n_max +- 1)",
    "per_target": "each target's tokens/s, whether it was admitted, and its standalone speed "
                  "(1 / its measured plain step)",
    "choices": "rounds by the hub's shape choice: d{depth}n{nodes} or plain",
    "control": "the hub's load model at the end of the row (STATS 'control')",
    "lookup": "the hub's --lookup as given; lookup_token_share the committed tokens that only "
              "its grafted prompt-lookup branch held, lookup_round_share the tree rounds "
              "with a branch",
    "draft_process": "the hub's --draft-process as given: on, drafting in a process of its own; "
                     "off, in a thread of the hub's; auto, on for the eagle drafter",
}
