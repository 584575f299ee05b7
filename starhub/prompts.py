"""Prompt files and chat templating, shared by every process that owns prompts: star
targets, edge drafters, the benchmark and the training data builder."""

from __future__ import annotations

import json
from pathlib import Path


def read_prompts(path: str | Path) -> list[tuple[object, str]]:
    """(id, prompt) pairs from ``{"id", "prompt"}`` or MT-Bench ``{"question_id", "turns"}``."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from None
            if "prompt" in row:
                out.append((row.get("id", lineno), str(row["prompt"])))
            elif "turns" in row and row["turns"]:
                out.append((row.get("question_id", lineno), str(row["turns"][0])))
            else:
                raise ValueError(f"{path}:{lineno}: needs 'prompt' or 'turns'")
    return out


def encode_prompt(tokenizer, prompt: str, chat_template: bool = True) -> list[int]:
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]
