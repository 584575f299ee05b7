"""One long edge session among short ones: the verifier's memory and outputs, measured.

    python -m bench.long_session [--long-tokens 32768] [--short 7] [--max-new-tokens 32]
                                 [--long-new-tokens 64] [--json report.json]

It starts a ``starhub verifier`` on the embedded model with its default flags but one torch
thread, then 1 + ``--short`` ``starhub drafter`` processes at once (EAGLE, greedy, one thread
each): one whose prompt is ``--long-tokens`` tokens long (questions of
scripts/prompts/train.jsonl, numbered and repeated, then cut), and ``--short`` with one short
prompt each (scripts/prompts/eval.jsonl). Once the long session is open (its prompt
prefilled), ``--short`` more drafters decode short prompts one after another until the long
one is done, so that the verify passes serve one long session among short ones. (Short
drafters that kept opening prompts through the prefill would hold it up without end: the
verifier prefills the prompt with the fewest tokens left first.) The long drafter waits
``--long-timeout`` seconds for its OPENED: a drafter's default 30 s is shorter than a long
prefill on a CPU. Drafters start at the verifier's priority and drop to nice 10 once
loaded, standing in for devices of their own as in the edge benchmark.

The verifier's resident memory (its process, from /proc) is sampled every 50 ms from before
the long prompt arrives to the end, and reported per phase (before the long prompt, its
prefill, the verify passes while its session decodes) against the model plus the caches:

- RSS after load: the verifier's RSS once it serves and before any drafter connects. It
  includes the Python process, torch and transformers, not only the weights.
- caches: the target's KV cache at each session's final length (prompt plus output), at
  ``layers × 2 × kv_heads × head_dim × dtype size`` bytes a token: the long session, plus
  the longest short session once per short drafter (at most that many are open at once).

Then every output is checked against ``generate()`` in this process, token by token (the long
prompt too: one more long prefill), and each drafter's verdict printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.edge import drafter_command
from bench.hostile import Sampler, _stop, tree_rss_mb
from bench.run import machine_info
from starhub.launch import child_env
from starhub.launch.spawn import die_with_parent, wait_ready
from starhub.launch.status import observer_client
from starhub.models.prompts import encode_prompt, iter_results, read_prompts
from starhub.wire.messages import StatsQuery

PROMPTS = Path(__file__).resolve().parent.parent / "scripts" / "prompts"
LONG_SOURCE = PROMPTS / "train.jsonl"
SHORT_SOURCE = PROMPTS / "eval.jsonl"
LONG_QUESTION = "Repeat the questions above, one per line."
SHORT_PER_DRAFTER = 200
"""Short prompts queued per short drafter: more than it decodes before the long one ends."""
DRAFTER_NICE = 10
MB = 1 << 20


def cpu_model() -> str:
    """``lscpu``'s Model name, else /proc/cpuinfo's."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return machine_info()["cpu"]


def long_prompt(tokenizer, tokens: int) -> str:
    """A prompt whose chat-templated encoding is ``tokens`` long or just under: numbered
    questions from ``LONG_SOURCE`` (repeated as needed), cut, then ``LONG_QUESTION``."""
    questions = [text for _, text in read_prompts(LONG_SOURCE)]
    lines, size, i = [], 0, 0
    while size < tokens:
        line = f"{i + 1}. {questions[i % len(questions)]}"
        lines.append(line)
        size += len(tokenizer(line + "\n", add_special_tokens=False)["input_ids"])
        i += 1
    body = tokenizer("\n".join(lines), add_special_tokens=False)["input_ids"]
    tail = "\n\n" + LONG_QUESTION
    keep = tokens - (len(encode_prompt(tokenizer, tail)))
    while True:
        text = tokenizer.decode(body[:keep]) + tail
        over = len(encode_prompt(tokenizer, text)) - tokens
        if over <= 0:
            return text
        keep -= over


def write_prompts(path: Path, rows: list[tuple[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for id_, text in rows:
            fh.write(json.dumps({"id": id_, "prompt": text}) + "\n")


def phase_peaks(samples: list[tuple[float, float]], marks: dict[str, float]) -> dict:
    """The peak RSS (MB) of each phase: before the long prompt was sent, its prefill (until
    its OPENED), and the verify passes while its session decoded."""
    edges = [("before the long prompt", 0.0, marks["long_sent"]),
             ("prefill of the long prompt", marks["long_sent"], marks["long_opened"]),
             ("verify passes with the long session", marks["long_opened"], marks["long_done"])]
    out = {}
    for name, start, end in edges:
        inside = [mb for t, mb in samples if start <= t <= end]
        out[name] = max(inside, default=None)
    return out


def reference(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """``generate()``'s greedy output. The mask says every prompt token counts: without it,
    ``generate()`` may take the chat template's end-of-turn tokens (they share the pad id)
    for padding."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]),
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def weight_bytes(model) -> int:
    """What the loaded model's weights take: its parameters (a tied embedding once) plus the
    oneDNN-packed linears' own copies (the tied lm_head's included)."""
    seen, total = set(), 0
    for t in model.parameters():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    for m in model.modules():
        packed = getattr(m, "packed", None)
        if packed is not None:
            total += packed.numel() * packed.element_size()
    return total


def run(args: argparse.Namespace) -> dict:
    import torch

    # deferred: transformers load only when this runs
    from starhub.models.loading import load_model, load_tokenizer, set_threads
    from targets.engine import kv_bytes_per_token

    set_threads(1)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="long-session-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer("default")
    text = long_prompt(tokenizer, args.long_tokens)
    long_ids = encode_prompt(tokenizer, text)
    write_prompts(log_dir / "long.jsonl", [("long", text)])
    shorts = read_prompts(SHORT_SOURCE)
    short_text = {str(id_): text for id_, text in shorts}
    for i in range(args.short):
        queue = [shorts[(i + k * args.short) % len(shorts)] for k in range(SHORT_PER_DRAFTER)]
        write_prompts(log_dir / f"short{i}.jsonl", [(f"{queue[0][0]}#0", queue[0][1])])
        write_prompts(log_dir / f"late{i}.jsonl",
                      [(f"{id_}#{k}", text) for k, (id_, text) in enumerate(queue[1:], 1)])
    print(f"long prompt: {len(long_ids)} tokens; {args.short} short drafters; "
          f"{args.max_new_tokens} new tokens each; logs in {log_dir}", flush=True)

    cmd = [sys.executable, "-m", "starhub", "verifier", "--bind", "tcp://127.0.0.1:0",
           "--threads", "1"]
    samples: list[tuple[float, float]] = []
    procs: dict[str, subprocess.Popen] = {}
    starting: dict[str, subprocess.Popen] = {}
    arm = die_with_parent()

    def preexec() -> None:
        if arm is not None:
            arm()

    with open(log_dir / "verifier.log", "w") as vlog, \
            open(log_dir / "drafters.log", "w") as dlog:
        verifier = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=vlog, text=True,
                                    env=child_env(1), preexec_fn=die_with_parent())

        def start(name: str, timeout: float = 30.0, new_tokens: int = args.max_new_tokens
                  ) -> None:
            procs[name] = proc = subprocess.Popen(
                drafter_command(address, str(log_dir / f"{name}.jsonl"),
                                str(log_dir / f"{name}.out"), new_tokens, name,
                                timeout_s=timeout),
                env=child_env(1), stderr=dlog, stdout=subprocess.DEVNULL, preexec_fn=preexec)
            starting[name] = proc

        def renice_started() -> None:
            """Drafters start at the verifier's priority, so that the busy verifier does not
            hold their loading up, and drop to ``DRAFTER_NICE`` once loaded (their output
            file exists): they stand in for devices of their own."""
            for name, proc in list(starting.items()):
                if (log_dir / f"{name}.out").exists() or proc.poll() is not None:
                    with contextlib.suppress(OSError):
                        os.setpriority(os.PRIO_PROCESS, proc.pid, DRAFTER_NICE)
                    del starting[name]

        try:
            address = wait_ready(verifier, "verifier", 300.0)
            time.sleep(1.0)
            after_load = tree_rss_mb(verifier.pid)
            client = observer_client(address, timeout_s=600, name="long-session")
            with Sampler(verifier.pid, samples) as sampler:
                start("long", args.long_timeout, args.long_new_tokens)
                for i in range(args.short):
                    start(f"short{i}")
                # the long session is open once every OPEN so far is answered
                while procs["long"].poll() is None and \
                        client.request(StatsQuery()).body.opened < 1 + args.short:
                    renice_started()
                    time.sleep(0.5)
                late_at = time.time()
                print(f"long session open after {late_at - samples[0][0]:.0f} s: starting "
                      f"{args.short} more short drafters", flush=True)
                for i in range(args.short):
                    start(f"late{i}")
                while procs["long"].poll() is None:
                    renice_started()
                    time.sleep(0.2)
                ended = time.time()
                for i in range(args.short):
                    _stop(procs[f"late{i}"])
                for i in range(args.short):
                    procs[f"short{i}"].wait()
            stats = client.request(StatsQuery()).body
            client.close()
        finally:
            for p in procs.values():
                _stop(p)
            _stop(verifier)
    if procs["long"].returncode:
        raise RuntimeError(f"the long drafter failed (exit {procs['long'].returncode}); see "
                           f"{log_dir / 'drafters.log'}")

    results = {name: [r for r in iter_results(str(log_dir / f"{name}.out")) if "output_ids" in r]
               for name in procs if (log_dir / f"{name}.out").exists()}
    (long_run,) = results["long"]
    st = long_run["stats"]
    marks = {"long_sent": st["started_at"],
             "long_opened": st["started_at"] + st["wall_s"] - st["wait_s"] - st["draft_s"],
             "long_done": st["started_at"] + st["wall_s"]}
    overlap = sum(1 for name, rs in results.items() if name != "long" for r in rs
                  if r["stats"]["started_at"] < marks["long_done"]
                  and r["stats"]["started_at"] + r["stats"]["wall_s"] > marks["long_opened"])

    print("checking every output against generate() ...", flush=True)
    model, _ = load_model("default")
    refs: dict[str, list[int]] = {}
    identical = {}
    for name, rs in results.items():
        same = True
        for r in rs:
            key = "long" if name == "long" else r["id"].split("#")[0]
            if key not in refs:
                ids = long_ids if key == "long" else encode_prompt(tokenizer, short_text[key])
                refs[key] = reference(model, ids, args.long_new_tokens if key == "long"
                                      else args.max_new_tokens)
            same &= r["output_ids"] == refs[key]
        identical[name] = {"prompts": len(rs), "identical": same}

    token_bytes = kv_bytes_per_token(model)
    cfg = model.config
    long_len = len(long_run["prompt_ids"]) + len(long_run["output_ids"])
    short_len = max((len(r["prompt_ids"]) + len(r["output_ids"])
                     for name, rs in results.items() if name != "long" for r in rs), default=0)
    caches = (long_len + args.short * short_len) * token_bytes / MB
    weights = weight_bytes(model) / MB
    peaks = phase_peaks(samples, marks)
    passes = peaks["verify passes with the long session"]
    report = {
        "machine": {**machine_info(), "lscpu_model": cpu_model(),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "command": "python -m bench.long_session " + " ".join(sys.argv[1:]),
        "long_prompt_tokens": len(long_ids),
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
        "max_new_tokens": args.max_new_tokens, "long_new_tokens": args.long_new_tokens,
        "short_drafters": args.short,
        "short_sessions_during_long_passes": overlap,
        "kv_bytes_per_token": token_bytes,
        "kv_formula": f"{cfg.num_hidden_layers} layers x 2 x {cfg.num_key_value_heads} kv heads"
                      f" x {token_bytes // (2 * cfg.num_hidden_layers * cfg.num_key_value_heads)}"
                      f" bytes (head_dim x dtype size)",
        "long_session_tokens": long_len, "longest_short_session_tokens": short_len,
        "caches_mb": caches, "weights_mb": weights, "rss_after_load_mb": after_load,
        "process_rest_at_load_mb": after_load - weights,
        "peak_rss_mb": sampler.peak, "peak_rss_by_phase_mb": peaks,
        "ratio_passes": passes / (after_load + caches) if passes else None,
        "ratio_overall": sampler.peak / (after_load + caches),
        "ratio_passes_weights_only": passes / (weights + caches) if passes else None,
        "long_prefill_s": marks["long_opened"] - marks["long_sent"],
        "long_decode_s": marks["long_done"] - marks["long_opened"],
        "run_s": ended - samples[0][0] if samples else None,
        "verifier": {k: getattr(stats, k) for k in ("steps", "mean_batch", "batch_hist",
                                                  "prefill_s", "verify_s",
                                                  "verify_ms_per_step")},
        "identical": identical,
        "rss_timeline_mb": [(round(t - samples[0][0], 2), mb) for t, mb in samples[::20]],
        "logs": str(log_dir),
    }
    return report


def print_report(r: dict) -> None:
    m = r["machine"]
    print(f"\nCPU: {r['machine']['lscpu_model']} (torch CPU capability {m['cpu_capability']}, "
          f"{m['cpu_count']} cores)")
    print(f"long prompt {r['long_prompt_tokens']} tokens (the model's max_position_embeddings: "
          f"{r['max_position_embeddings']}); {r['short_drafters']} short drafters, "
          f"{r['short_sessions_during_long_passes']} short sessions decoded while the long "
          f"session did")
    print(f"long session: prefill {r['long_prefill_s']:.1f} s, decode {r['long_decode_s']:.1f} s"
          f"; verifier: {r['verifier']['steps']} passes, mean batch "
          f"{r['verifier']['mean_batch']:.2f}")
    short = r["longest_short_session_tokens"]
    print(f"KV cache: {r['kv_bytes_per_token']} bytes a token ({r['kv_formula']}); long "
          f"session {r['long_session_tokens']} tokens, longest short {short} x "
          f"{r['short_drafters']}: {r['caches_mb']:.0f} MB")
    print(f"weights as loaded: {r['weights_mb']:.0f} MB; RSS after load "
          f"{r['rss_after_load_mb']:.0f} MB (the rest, {r['process_rest_at_load_mb']:.0f} MB, "
          f"is Python, torch, transformers and the allocator)")
    for phase, mb in r["peak_rss_by_phase_mb"].items():
        print(f"peak RSS, {phase}: {'-' if mb is None else f'{mb:.0f} MB'}")
    base = r["rss_after_load_mb"] + r["caches_mb"]
    print(f"model plus caches = RSS after load + caches = {base:.0f} MB")
    if r["ratio_passes"] is not None:
        print(f"ratio, verify passes: {r['ratio_passes']:.2f} (against weights + caches only,"
              f" {r['weights_mb'] + r['caches_mb']:.0f} MB: "
              f"{r['ratio_passes_weights_only']:.2f})")
    print(f"ratio, whole run (prefill included): {r['ratio_overall']:.2f}")
    for name, v in r["identical"].items():
        verdict = "none finished" if not v["prompts"] else "yes" if v["identical"] else "NO"
        print(f"{name}: {v['prompts']} prompts, identical to generate(): {verdict}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.long_session", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long-tokens", type=int, default=32768,
                   help="the long prompt's tokens, chat template included (at most the "
                        "verifier's --max-prompt-tokens, 32768 by default)")
    p.add_argument("--short", type=int, default=7, help="drafters with short prompts")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="new tokens of each short prompt")
    p.add_argument("--long-new-tokens", type=int, default=64,
                   help="new tokens of the long prompt: its decoding lasts long enough for "
                        "the short drafters started after its OPENED to decode beside it")
    p.add_argument("--long-timeout", type=float, default=3600.0,
                   help="seconds the long drafter waits for a reply (its OPENED comes after "
                        "the whole prefill)")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the children on the way
    import torch

    print(f"CPU: {cpu_model()}; torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}", flush=True)
    report = run(args)
    print_report(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0 if all(v["identical"] for v in report["identical"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
