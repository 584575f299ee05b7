"""What the bench's modules share: its default prompt files and the baselines it knows."""

from __future__ import annotations

from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "scripts" / "prompts" / "demo.jsonl"
DEFAULT_REPLAY_PROMPTS = DEFAULT_PROMPTS.with_name("eval.jsonl")
BASELINES = ("hf-generate", "hf-prompt-lookup", "colocated")
