"""Train an EAGLE-1/2 (or EAGLE-3) draft head for a causal LM target, on CPU or GPU.

Stages, each cached in ``--work-dir`` so that re-running the same command resumes and more
prompts add only what is new (``scripts/eagle_data.py``):

1. prompts: the hand-written set, plus ``--synth-prompts`` user messages the target writes
   from its own chat template;
2. the target's own answers (chat template, batched, left padded): greedy, plus one sampled
   answer per prompt for each ``--gen-temperatures`` value above 0. While it decodes, the
   target's features and its top-k next-token distribution (the soft labels) are recorded,
   so the data costs no second pass;
3. training: smooth-L1 feature regression plus soft cross-entropy (EAGLE-1 weights 1.0 and
   0.1), uniform feature noise, optional unrolling over the head's own outputs, AdamW with
   warmup and cosine decay, gradient clipping, bf16 autocast where the hardware has it, and
   a resumable checkpoint of the optimizer state;
4. held-out metrics: teacher-forced top-1 agreement, and drafting simulated the way the hub
   drafts (the head runs on its own outputs) for the mean accepted length of a chain.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import random
import re
import time
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from scripts.eagle_data import (
    Dump,
    FeatureStore,
    Record,
    choose_draft_vocab,
    dump_features,
    follow_ups,
    generate,
    synthesize_prompts,
)
from scripts.eagle_eval import evaluate
from scripts.eagle_losses import losses, make_batch
from starhub.drafters.eagle_head import (
    EAGLE,
    EAGLE3,
    EagleHead,
    default_feature_layers,
    head_config,
    load_eagle_head,
    save_eagle_head,
)
from starhub.models.loading import DTYPES, cache_dir, load_model, native_bf16_cpu
from targets.runner import read_prompts

PROMPTS = Path(__file__).resolve().parent / "prompts"


def build_head(model, kind: str, draft_ids: Tensor | None, init: str, init_layer: int,
               fc_init: str) -> EagleHead:
    """A fresh head; ``init="target"`` copies a target decoder layer (minus its input norm)."""
    embed = model.get_input_embeddings().weight.detach()
    lm_head = model.get_output_embeddings().weight.detach()
    head = EagleHead(head_config(model.config), kind, embed, lm_head,
                     draft_vocab_size=None if draft_ids is None else len(draft_ids),
                     target_num_layers=model.config.num_hidden_layers)
    with torch.no_grad():
        if init == "target":
            src = model.model.layers[init_layer].state_dict()
            src = {k: v for k, v in src.items() if not k.startswith("input_layernorm")}
            head.layer.load_state_dict(src, strict=kind == EAGLE)
        if fc_init == "identity" and kind == EAGLE:
            h = head.cfg.hidden_size
            head.fc.weight.zero_()
            head.fc.weight[:, :h].normal_(0.0, 0.02)
            head.fc.weight[:, h:] = torch.eye(h)
            head.fc.bias.zero_()
        if draft_ids is not None:
            head.set_draft_vocab(draft_ids)
        if head.lm_head is not None:
            rows = head.to_target_ids(torch.arange(head.draft_vocab_size))
            head.lm_head.weight.copy_(lm_head[rows])
        if kind == EAGLE3:
            head.norm.weight.copy_(model.model.norm.weight)
    return head


def batch_plan(dump: Dump, batch_tokens: int) -> list[list[int]]:
    """Length-sorted batches of about ``batch_tokens`` padded tokens each."""
    order = sorted(range(len(dump)), key=dump.length)
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * dump.length(i) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def lr_at(step: int, total: int, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def train(head: EagleHead, data: Dump, eval_data: Dump, args, work: Path) -> dict:
    device = args.device
    head.to(device).train()
    params = [p for n, p in head.named_parameters()
              if args.train_lm_head or not n.startswith("lm_head")]
    for n, p in head.named_parameters():
        p.requires_grad_(args.train_lm_head or not n.startswith("lm_head"))
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=args.weight_decay)
    plan = batch_plan(data, args.batch_tokens)
    total = args.max_steps or args.epochs * len(plan)
    warmup = max(1, int(args.warmup * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_at(s, total, warmup, args.min_lr_ratio))
    # plain values only: the saved state is read back with weights_only=True
    signature = {k: str(v) if isinstance(v := getattr(args, k), Path) else v for k in (
        "target", "kind", "draft_vocab", "init", "init_from", "init_layer", "fc_init", "epochs",
        "batch_tokens", "lr", "noise", "v_weight", "p_weight", "max_steps", "max_new_tokens",
        "max_prompts", "train_lm_head", "seed", "weight_decay", "clip", "unroll", "unroll_decay",
        "gen_temperatures", "data_dtype", "synth_prompts", "synth_openers", "follow_ups")}
    state_path = work / "train_state.pt"
    step = 0
    if state_path.exists():
        try:
            state = torch.load(state_path, map_location=device, weights_only=True)
        except (RuntimeError, pickle.UnpicklingError) as exc:
            tqdm.write(f"cannot read the saved training state ({str(exc).splitlines()[0]}); "
                       f"starting afresh")
            state = {}
        if state.get("signature") == signature:
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            step = state["step"]
            tqdm.write(f"resuming from step {step}/{total}")
        else:
            tqdm.write("settings changed since the saved training state; starting afresh")

    def save() -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "step": step, "signature": signature}, tmp)
        tmp.replace(state_path)

    t2d_index = None if head.d2t is None else head.draft_index()
    bar = tqdm(total=total, initial=step, desc="train", unit="step")
    log = (work / "train_log.jsonl").open("a")
    while step < total:
        epoch, pos = divmod(step, len(plan))
        order = list(range(len(plan)))
        random.Random(args.seed * 1000 + epoch).shuffle(order)
        for j in order[pos:]:
            if step >= total:
                break
            batch = make_batch(data, plan[j], t2d_index, device)
            with torch.autocast(torch.device(device).type, torch.bfloat16, enabled=args.bf16):
                vloss, ploss, acc = losses(head, batch, args.noise, args.unroll,
                                           args.unroll_decay)
            loss = args.v_weight * vloss + args.p_weight * ploss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, args.clip)
            opt.step()
            sched.step()
            step += 1
            bar.update(1)
            bar.set_postfix(vloss=f"{vloss.item():.3f}", ploss=f"{ploss.item():.3f}",
                            acc=f"{acc.item():.3f}")
            record = {"step": step, "vloss": vloss.item(), "ploss": ploss.item(),
                      "acc": acc.item(), "lr": sched.get_last_lr()[0]}
            if args.eval_every and step % args.eval_every == 0 and step < total:
                record.update(evaluate(head, eval_data, args.depth, widths=(1,)))
                tqdm.write(f"step {step}: top1 {record['top1']:.3f} "
                           f"tau_w1 {record['tau_w1']:.2f}")
                head.train()
            log.write(json.dumps(record) + "\n")
            if step % args.save_every == 0 or step == total:
                save()
    bar.close()
    log.close()
    head.eval()
    return {"steps": total, "batches_per_epoch": len(plan)}


def parse_temperatures(text: str) -> list[float]:
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--gen-temperatures takes numbers like 0,0.8, not '{text}'") from None
    if not temps or min(temps) < 0:
        raise SystemExit("--gen-temperatures needs at least one value, none below 0")
    return temps


def read_openers(path: Path | None) -> list[str]:
    if path is None:
        return []
    try:
        openers = [json.loads(line)["opener"] for line in path.read_text().splitlines()
                   if line.strip()]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--synth-openers {path}: need JSON lines with an 'opener' ({e})"
                         ) from None
    if not openers:
        raise SystemExit(f"--synth-openers {path} holds no openers")
    return openers


def slug(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(spec).name or spec)[:64] or "target"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="starhub train-eagle", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="default", help="model spec or HF model folder")
    ap.add_argument("--out", default="eagle-head", help="where to write the trained head")
    ap.add_argument("--work-dir", default=None,
                    help="cache for generations, features and the resumable training state")
    ap.add_argument("--prompts", type=Path, default=PROMPTS / "train.jsonl")
    ap.add_argument("--eval-prompts", type=Path, default=PROMPTS / "eval.jsonl")
    ap.add_argument("--max-prompts", type=int, default=None, help="use the first N prompts only")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--synth-prompts", type=int, default=0,
                    help="add N user messages the target writes itself from its chat "
                         "template (self-instruct, as in Magpie) to the training prompts")
    ap.add_argument("--synth-openers", type=Path, default=None,
                    help="a JSONL file of {\"opener\": ...}: each self-written message starts "
                         "with one of them, steering the prompts across styles (e.g. "
                         f"{(PROMPTS / 'openers.jsonl').relative_to(PROMPTS.parent.parent)})")
    ap.add_argument("--follow-ups", type=int, default=0,
                    help="add N two-turn conversations: for N training prompts, the target "
                         "writes the user's follow-up to its own first answer, then answers it")
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--gen-temperatures", default="0",
                    help="comma-separated; each value adds one answer per training prompt "
                         "(0: greedy). Sampled answers widen the data at no prompt cost")
    ap.add_argument("--data-dtype", default="float32", choices=DTYPES,
                    help="the target's weights while it writes the data (answers, features, "
                         "labels). bfloat16 is ~2x faster on CPUs with AVX512-BF16, and its "
                         "rounding is far inside the feature noise the head trains with")
    ap.add_argument("--teacher-topk", type=int, default=20)
    ap.add_argument("--kind", choices=(EAGLE, EAGLE3), default=EAGLE,
                    help="eagle: EAGLE-1/2 on the final feature; eagle3: three layers' features")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="keep the N most frequent target tokens (0: the full vocab); with "
                         "--init-from, resize the head's draft vocabulary: its trained rows "
                         "stay (as many as N allows), new tokens start from the target's "
                         "lm_head rows")
    ap.add_argument("--train-lm-head", action=argparse.BooleanOptionalAction, default=True,
                    help="fine-tune the reduced-vocab lm_head (only exists with --draft-vocab)")
    ap.add_argument("--init", choices=("target", "random"), default="random",
                    help="target: copy a target layer into an EAGLE-1/2 head")
    ap.add_argument("--init-from", default=None,
                    help="start from a saved head (fine-tuning); overrides --init")
    ap.add_argument("--init-layer", type=int, default=-1, help="target layer to copy")
    ap.add_argument("--fc-init", choices=("identity", "random"), default="random")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--max-steps", type=int, default=0, help="overrides --epochs when > 0")
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=float, default=0.03, help="fraction of steps")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip", type=float, default=0.5)
    ap.add_argument("--v-weight", type=float, default=1.0)
    ap.add_argument("--p-weight", type=float, default=0.1)
    ap.add_argument("--noise", type=float, default=0.2, help="width of the uniform feature noise")
    ap.add_argument("--unroll", type=int, default=1,
                    help="train on the head's own outputs for this many drafting steps")
    ap.add_argument("--unroll-decay", type=float, default=0.8)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--data-only", action="store_true", help="stop after the feature dump")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the head at --out")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="bf16 autocast for the head's matrix products (weights and optimizer "
                         "stay fp32); default: on where the hardware multiplies bf16 natively")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.kind == EAGLE3 and args.init == "target":
        raise SystemExit("--init target applies to EAGLE-1/2 heads only")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.bf16 is None:
        args.bf16 = args.device != "cpu" or native_bf16_cpu()
    torch.manual_seed(args.seed)
    if args.work_dir is None:
        args.work_dir = str(cache_dir() / "train-eagle" / slug(args.target))
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model, tokenizer = load_model(args.target, dtype=torch.float32, device=args.device,
                                  linear="torch")
    for p in model.parameters():
        p.requires_grad_(False)
    times: dict[str, float] = {}
    rows = read_prompts(args.prompts)[:args.max_prompts]
    eval_rows = read_prompts(args.eval_prompts)
    suffix = f"n{args.max_new_tokens}"
    data_model, data_tag = model, ""
    if args.data_dtype not in ("auto", "float32"):
        data_model = load_model(args.target, dtype=args.data_dtype, device=args.device)[0]
        data_tag = f"-{args.data_dtype}"
    if args.synth_prompts:
        openers = read_openers(args.synth_openers)
        name = f"synth-prompts{data_tag}" + (f"-{args.synth_openers.stem}" if openers else "")
        # steered messages carry passages and code, so they get room to finish
        rows += synthesize_prompts(data_model, tokenizer, args.synth_prompts,
                                   work / f"{name}.jsonl", args.gen_batch, seed=args.seed,
                                   max_tokens=192 if openers else 96, openers=openers,
                                   exclude={p for _, p in eval_rows if isinstance(p, str)})
    record = Record(default_feature_layers(args.kind, model.config.num_hidden_layers),
                    args.teacher_topk)
    store = FeatureStore(work / (f"features-k{args.teacher_topk}{data_tag}"
                                 + ("-eagle3" if args.kind == EAGLE3 else "")))
    seqs = []
    for temp in parse_temperatures(args.gen_temperatures):
        name = data_tag + (f"-t{temp:g}" if temp > 0 else "")
        seqs += generate(data_model, tokenizer, rows, work / f"gen-train-{suffix}{name}.jsonl",
                         args.max_new_tokens, args.gen_batch, temp, args.seed, store, record)
    if args.follow_ups:
        text = {sid: p for sid, p in rows if isinstance(p, str)}
        firsts = [(s.id, text[s.id], tokenizer.decode(s.ids[s.prompt_len:],
                                                       skip_special_tokens=True).strip())
                  for s in seqs[:len(rows)] if s.id in text]
        random.Random(args.seed).shuffle(firsts)
        turns = follow_ups(data_model, tokenizer, firsts, work / f"follow-ups{data_tag}.jsonl",
                           args.gen_batch, count=args.follow_ups, seed=args.seed)
        seqs += generate(data_model, tokenizer, turns,
                         work / f"gen-train-{suffix}{data_tag}-turn2.jsonl",
                         args.max_new_tokens, args.gen_batch, 0.0, args.seed, store, record)
    eval_seqs = generate(data_model, tokenizer, eval_rows,
                         work / f"gen-eval-{suffix}{data_tag}.jsonl", args.max_new_tokens,
                         args.gen_batch, store=store, record=record)
    times["generate_s"] = time.time() - t0
    t1 = time.time()
    data = dump_features(data_model, seqs, store, record)
    eval_data = dump_features(data_model, eval_seqs, store, record)
    times["features_s"] = time.time() - t1
    answer_tokens = int(sum(len(s.ids) - s.prompt_len for s in seqs))
    tqdm.write(f"data: {len(seqs)} sequences, {len(data.ids)} tokens "
               f"({answer_tokens} generated); eval {len(eval_seqs)} sequences")
    if args.data_only:
        return {"train_tokens": len(data.ids), "train_answer_tokens": answer_tokens, **times}
    if args.eval_only:
        head = load_eagle_head(args.out, model.config, model.get_input_embeddings().weight,
                               model.get_output_embeddings().weight).to(args.device)
        metrics = evaluate(head, eval_data, args.depth)
        print(json.dumps(metrics, indent=2))
        return metrics
    draft_ids, head = None, None
    if args.init_from:
        head = load_eagle_head(args.init_from, model.config, model.get_input_embeddings().weight,
                               model.get_output_embeddings().weight)
        if head.kind != args.kind:
            raise SystemExit(f"--init-from holds a {head.kind} head, not {args.kind}")
    if args.draft_vocab and args.draft_vocab < model.config.vocab_size:
        trained = None
        if head is not None and head.d2t is not None:
            trained = head.to_target_ids(torch.arange(head.draft_vocab_size))
        draft_ids = choose_draft_vocab(data, args.draft_vocab, model.config.vocab_size,
                                       prefer=trained)
    if head is None:
        head = build_head(model, args.kind, draft_ids, args.init, args.init_layer, args.fc_init)
    elif draft_ids is not None and len(draft_ids) != head.draft_vocab_size:
        head.resize_draft_vocab(draft_ids, fill=model.get_output_embeddings().weight.detach())
    t2 = time.time()
    info = train(head, data, eval_data, args, work)
    times["train_s"] = time.time() - t2
    t3 = time.time()
    metrics = evaluate(head, eval_data, args.depth)
    times["eval_s"] = time.time() - t3
    save_eagle_head(head.cpu(), args.out)
    summary = {**metrics, **info, **times, "total_s": time.time() - t0,
               "train_sequences": len(seqs), "train_tokens": len(data.ids),
               "train_answer_tokens": answer_tokens, "draft_vocab": head.draft_vocab_size}
    (work / "metrics.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
