"""What a target reports of each request it decoded: its ``GenerationStats`` (rounds,
acceptance, where the time went) and, for a whole request, its ``GenerationResult``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    rounds: int = 0
    new_tokens: int = 0
    mean_accept_len: float = 0.0
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    verify_s: float = 0.0
    hub_wait_s: float = 0.0
    """Round trips to the hub: ``hub_queue_s + hub_draft_s + comm_s``."""
    hub_queue_s: float = 0.0
    hub_draft_s: float = 0.0
    comm_s: float = 0.0
    plain_rounds: int = 0
    """Rounds in which the hub found no tree worth drafting and the target decoded alone."""
    plain_tokens: int = 0
    plain_s: float = 0.0
    step_ms: float = 0.0
    """This target's measured one-token step: its standalone speed is 1000 / step_ms."""
    started_at: float = 0.0
    """Wall-clock start (time.time()), to line up several targets' runs."""
    threads: int = 0
    tree_nodes: int = 0
    max_depth: int = 0
    """The deepest tree a round offered: the most draft tokens one round could accept."""
    accepted_at_depth: list[int] = field(default_factory=list)
    accept_len_hist: dict[str, int] = field(default_factory=dict)
    standalone: bool = False
    note: str = ""
    hub: str = ""
    """The hub its session opened on (the last, if it opened more than one); empty: none."""


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    stats: GenerationStats

    def to_json(self, id_: object = None) -> dict:
        return {"id": id_, "prompt_ids": self.prompt_ids, "output_ids": self.output_ids,
                "text": self.text, "stats": asdict(self.stats)}
