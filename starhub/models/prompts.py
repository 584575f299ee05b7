"""Prompt files and chat templating, shared by every process that owns prompts: star
targets, edge drafters, the benchmark and the training data builder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

Prompt = str | list[dict]
"""One user message, or a conversation: chat messages ({"role", "content"}) whose last one
is the user's, as in a two-turn prompt whose second turn follows the model's own answer."""


def read_prompts(path: str | Path) -> list[tuple[object, Prompt]]:
    """(id, prompt) pairs from ``{"id", "prompt"}``, ``{"id", "messages"}`` or MT-Bench
    ``{"question_id", "turns"}`` (its first turn)."""
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
            elif "messages" in row:
                out.append((row.get("id", lineno), _messages(row["messages"], path, lineno)))
            elif "turns" in row and row["turns"]:
                out.append((row.get("question_id", lineno), str(row["turns"][0])))
            else:
                raise ValueError(f"{path}:{lineno}: needs 'prompt', 'messages' or 'turns'")
    return out


def _messages(messages: object, path: str | Path, lineno: int) -> list[dict]:
    ok = (isinstance(messages, list) and messages
          and all(isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                  and isinstance(m.get("content"), str) for m in messages)
          and messages[-1]["role"] == "user")
    if not ok:
        raise ValueError(f"{path}:{lineno}: 'messages' must be a list of {{\"role\": "
                         f"system|user|assistant, \"content\": text}} ending with the user's")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def encode_prompt(tokenizer, prompt: Prompt, chat_template: bool = True) -> list[int]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    text = "\n\n".join(m["content"] for m in messages)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def iter_results(path: str | Path) -> Iterator[dict]:
    """The rows of a JSONL output file (a target's, a baseline's), blank lines skipped."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)
