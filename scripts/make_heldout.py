"""Build ``scripts/prompts/heldout.jsonl`` from the hand-written ``heldout-turns.jsonl``.

The held-out set is written in a deliberately different style from the training prompts
(long multi-part instructions, passages to extract from or summarise, code to fix or
explain, personas, math word problems) and is never used for training or for choosing
hyperparameters. Its two-turn rows ask a follow-up to the target's *own* first answer, so
that answer is generated here, greedily, by the target, and stored in the row's
``messages``:

    python -m scripts.make_heldout [--model default] [--first-answer-tokens 192]

Single-turn rows are copied as ``{"id", "prompt", "category"}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from starhub.models.loading import eos_ids, load_model
from starhub.models.prompts import encode_prompt

HERE = Path(__file__).resolve().parent / "prompts"


def first_answer(model, tokenizer, question: str, max_new_tokens: int, stop: set[int]) -> str:
    ids = encode_prompt(tokenizer, question)
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    answer = [t for t in out[0, len(ids):].tolist() if t not in stop]
    return tokenizer.decode(answer, skip_special_tokens=True).strip()


def build(source: Path, model_spec: str, max_new_tokens: int) -> list[dict]:
    model, tokenizer = load_model(model_spec)
    stop = eos_ids(model_spec)
    rows = []
    for line in source.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        src = json.loads(line)
        turns = src["turns"]
        row = {"id": src["id"], "category": src["category"]}
        if len(turns) == 1:
            row["prompt"] = turns[0]
        else:
            answer = first_answer(model, tokenizer, turns[0], max_new_tokens, stop)
            row["messages"] = [{"role": "user", "content": turns[0]},
                               {"role": "assistant", "content": answer},
                               {"role": "user", "content": turns[1]}]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m scripts.make_heldout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default=str(HERE / "heldout-turns.jsonl"))
    p.add_argument("--out", default=str(HERE / "heldout.jsonl"))
    p.add_argument("--model", default="default",
                   help="the target whose own first answers the two-turn rows follow")
    p.add_argument("--first-answer-tokens", type=int, default=192)
    args = p.parse_args(argv)
    rows = build(Path(args.source), args.model, args.first_answer_tokens)
    with open(args.out, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{len(rows)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
