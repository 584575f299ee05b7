"""Plain greedy ``generate()`` over a shard of a prompt file, as a process of its own:
``python -m bench.plain_generate PROMPTS OUT --shard I/N``. ``starhub demo`` starts one
per target, all at once, so that the baseline shares the machine as its targets do.

Prompts are encoded as ``starhub target`` encodes them (chat template); OUT gets one row
per prompt: ``id``, ``output_ids`` and ``wall_s``."""

from __future__ import annotations

import argparse
import json
import sys

from bench.baselines import hf_generate
from starhub.models.loading import load_model, set_threads
from starhub.models.prompts import encode_prompt, read_prompts
from starhub.options import Positive, Shard
from starhub.settings.cli import value_type


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.plain_generate", description=__doc__)
    p.add_argument("prompts", help="JSONL prompt file, as `starhub target --prompts` takes")
    p.add_argument("out", help="JSONL to write: id, output_ids, wall_s")
    p.add_argument("--shard", type=value_type(Shard), default=(0, 1), metavar="I/N",
                   help="every N-th prompt starting at I")
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--linear", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=value_type(Positive), default=1)
    p.add_argument("--max-new-tokens", type=value_type(Positive), required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    index, count = args.shard
    set_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype, linear=args.linear,
                                  device=args.device)
    prompts = [(id_, encode_prompt(tokenizer, prompt))
               for id_, prompt in read_prompts(args.prompts)[index::count]]
    runs = hf_generate(model, prompts, args.max_new_tokens)
    with open(args.out, "w", encoding="utf-8") as fh:
        for run in runs:
            fh.write(json.dumps({"id": run.id, "output_ids": run.output_ids,
                                 "wall_s": run.wall_s}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
