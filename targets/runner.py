"""``starhub target``: run a prompt file through one target process, one JSON line each."""

from __future__ import annotations

import json
import logging
import sys

from tqdm import tqdm

from starhub.cores import load_target
from starhub.models.devices import model_device
from starhub.models.loading import linear_in_use, load_model, set_threads
from starhub.models.prompts import encode_prompt, read_prompts  # noqa: F401  (re-exported)
from starhub.options import resolve_threads
from targets.generate import SpeculativeGenerator

log = logging.getLogger("starhub.target")


def run(hub: str | None, weights: dict, prompts: str, out: str, max_new_tokens: int,
        temperature: float, top_p: float, seed: int, threads: int | str | None,
        chat_template: bool, name: str, shard: tuple[int, int] = (0, 1),
        hub_timeout_s: float = 3.0, shared_cores: str = "auto") -> int:
    """Decode ``prompts`` (this shard of them) with the target ``load_model(**weights)``
    loads, through ``hub`` where one is given, writing one JSON line each to ``out``."""
    threads = set_threads(resolve_threads(threads))
    items = read_prompts(prompts)[shard[0]::shard[1]]

    def start() -> tuple:
        model, tokenizer = load_model(**weights, one_row_only=hub is None)
        return model, tokenizer, SpeculativeGenerator(
            model, tokenizer, hub, name=name, timeout_s=hub_timeout_s,
            shared_cores=shared_cores)
    model, tokenizer, gen = load_target(start, hub, shared_cores)
    where = model_device(model)
    log.info("%s: %d prompts, %s weights on %s, %s linear%s, torch threads=%d, hub=%s", name,
             len(items), model.dtype, where,
             linear_in_use(model),
             ", compiled MLPs" if weights["compile"] else "", threads,
             hub if gen.client else "none")
    tokens = 0
    with open(out, "w", encoding="utf-8") as fh, tqdm(total=len(items), desc=name, unit="prompt",
                                                      file=sys.stderr) as bar:
        for id_, prompt in items:
            ids = encode_prompt(tokenizer, prompt, chat_template)
            result = gen.generate(ids, max_new_tokens, temperature, top_p, seed)
            fh.write(json.dumps(result.to_json(id_)) + "\n")
            fh.flush()
            tokens += len(result.output_ids)
            bar.update(1)
            bar.set_postfix(tok_s=f"{result.stats.tokens_per_s:.1f}",
                            tau=f"{result.stats.mean_accept_len:.2f}")
    gen.close()
    return 0

