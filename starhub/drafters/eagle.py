"""EAGLE drafter: a one-layer head over the target's own features.

Pair i of a session is (token i+1, feature i). The head's cache covers committed pairs only;
tree nodes are fed as (node token, parent's head output) under a tree mask and cropped away
after the round, so each round costs one pass over the new pairs plus one per tree layer.

Sessions are drafted in continuous batches: ``EagleDrafter`` owns the model work (catching
sessions up, one packed pass per layer); ``DraftBatch`` decides what goes into each pass,
lets sessions join between layers, and hands trees over as they finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig

from starhub.drafters.base import DraftContext, Drafter, TargetNeeds, TreeShape
from starhub.drafters.eagle_head import EagleHead, load_eagle_head
from starhub.drafters.growing import (
    Frontier,
    Grower,
    Ranked,
    TreeFeed,
    grow_greedy,
    grow_sampled,
    grow_together,
    rank,
)
from starhub.drafters.outcomes import likely_outcomes, path_to
from starhub.models.kvcache import KVCache, Segment
from starhub.models.loading import onednn_packs, prepack_linears, quantize_linears, resolve
from starhub.wire.codec import to_torch
from starhub.wire.tree import DraftTree, depths

SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "heads"
DEFAULT_HEAD = SHIPPED_HEADS / "smollm2-135m"
PREDRAFT_OUTCOMES = 8
"""Outcomes pre-drafted per round: grown together, they cost about two plain drafts."""
FLOAT_LINEARS = ("fc",)
"""The head's layers that stay in floating point when the others go int8: ``fc`` reads the
target's features, whose few large channels an int8 input rounds the rest of away (the
shipped head's τ on ``scripts/prompts/demo.jsonl`` read 2.14 with ``fc`` int8, 2.33
without, 2.37 in float32)."""


def target_embeddings(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's token embedding and LM head, read from its safetensors without loading
    the rest of the model."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no safetensors weights to take embeddings from")
    found: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), "pt") as fh:
            for key in ("model.embed_tokens.weight", "lm_head.weight"):
                if key in fh.keys():
                    found[key] = fh.get_tensor(key)
    if "model.embed_tokens.weight" not in found:
        raise KeyError(f"{model_dir}: no model.embed_tokens.weight in its safetensors")
    embed = found["model.embed_tokens.weight"].float()
    return embed, found.get("lm_head.weight", embed).float()


Job = tuple[DraftContext, TreeShape]
Finished = Callable[[int, "DraftTree | Exception", float, float], None]


@dataclass
class HeadState:
    """What a session keeps in the head between rounds."""

    cache: KVCache = field(default_factory=KVCache)
    pairs: int = 0
    """Committed pairs already in ``cache``."""
    root_hidden: torch.Tensor | None = None
    """The head's output at the last committed pair: the feature the next tree grows from."""
    root_logits: torch.Tensor | None = None


class Growth:
    """One tree growing in a packed pass: which cache its nodes go into, where, and the head
    outputs that feed each node's children."""

    def __init__(self, cache: KVCache, base: int, hidden: dict[int, torch.Tensor]):
        self.cache = cache
        self.feed = TreeFeed(base)
        self.hidden = hidden


@dataclass
class CatchUp:
    """Committed (token, feature) pairs of sessions to feed: the rows, and per session its
    state and the pair count it reaches."""

    feats: list[torch.Tensor] = field(default_factory=list)
    ids: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    rows: list[tuple[HeadState, int]] = field(default_factory=list)
    jobs: list[int] = field(default_factory=list)
    """The batch's job numbers of the sessions it feeds."""

    @staticmethod
    def merge(parts: list[CatchUp]) -> CatchUp:
        out = CatchUp()
        for part in parts:
            for name in ("feats", "ids", "positions", "segments", "rows", "jobs"):
                getattr(out, name).extend(getattr(part, name))
        return out


class EagleDrafter(Drafter):
    name = "eagle"
    batches = True
    calibrated = True

    def __init__(self, head: EagleHead, label: str = "eagle", int8: bool = False):
        self.head = head
        self.label = label
        self.feature_layers = list(head.feature_layers)
        self.feature_size = head.feature_size
        weight = next(head.parameters())
        self.dtype = weight.dtype
        self.device = weight.device
        self._index: torch.Tensor | None = None
        self._targets: torch.Tensor | None = None
        self.int8 = int8
        self.weights = ("int8 linear layers (fc in float32)" if int8
                        else str(weight.dtype).removeprefix("torch."))
        if int8:
            quantize_linears(head, keep=FLOAT_LINEARS)
        if onednn_packs(weight.dtype, weight.device.type):
            prepack_linears(head)  # the linear layers left in floating point

    @classmethod
    def load(cls, head_dir: str | Path | None, model: str = "default",
             dtype: torch.dtype = torch.float32, device: str = "cpu", int8: bool = False
             ) -> EagleDrafter:
        if head_dir is None and model != "default":
            raise ValueError(f"the shipped EAGLE head drafts for the embedded default model, not "
                             f"'{model}': pass --draft HEAD_DIR (see `starhub train-eagle`) or "
                             f"use --drafter ngram")
        head_dir = Path(head_dir) if head_dir else DEFAULT_HEAD
        if not (head_dir / "config.json").exists():
            raise FileNotFoundError(f"no EAGLE head at {head_dir} (config.json missing)")
        model_dir = resolve(model)
        embed, lm_head = target_embeddings(model_dir)
        head = load_eagle_head(head_dir, AutoConfig.from_pretrained(model_dir), embed, lm_head,
                               dtype=dtype).to(device)
        return cls(head, label=str(head_dir), int8=int8)

    def probe_context(self) -> DraftContext:
        ctx = super().probe_context()
        ctx.features = [torch.zeros(len(ctx.tokens) - 1, self.head.feature_size)]
        return ctx

    def needs(self) -> TargetNeeds:
        return TargetNeeds(f"EAGLE head '{self.label}'", self.head.vocab_size,
                           self.head.target_hidden_size)

    def _to_target_ids(self, tree: DraftTree) -> DraftTree:
        """Trees grow over the draft vocabulary (cheaper top-k and softmax when it is
        reduced) and travel in target ids."""
        targets = self._target_index()
        if targets is None:
            return tree
        table = targets.numpy().astype(np.int32)
        tree.tokens = table[tree.tokens]
        if tree.dist_ids is not None:
            tree.dist_ids = table[tree.dist_ids]
        return tree

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        result = self.propose_batch([(ctx, shape)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    @torch.inference_mode()
    def propose_batch(self, jobs: list[Job], admit: Callable[[], list[Job]] | None = None,
                      finished: Finished | None = None) -> list[DraftTree | Exception]:
        """All sessions' new committed pairs go through the head in one pass, then every
        tree layer of every session in one more: each weight is read once per layer for
        the whole batch, while attention stays within each session's own cache.

        Continuous batching: ``admit()``, asked between layers, returns more jobs, which
        join the running batch (numbered after the ones before), and ``finished(k, tree,
        seconds, batch)`` hears of job k as soon as its tree (or error) is ready, with its
        share of the time spent on the passes it took part in and the mean number of
        sessions in those passes."""
        return DraftBatch(self, admit, finished).run(jobs)

    def _catch_up(self, ctxs: list[DraftContext], strict: bool = True) -> list[Exception | None]:
        """Feed each session's newly committed (token, feature) pairs, all sessions in one
        pass, leaving the head's output at the last pair as the session's tree root."""
        errors, catch = self._catch_up_inputs(ctxs, strict)
        if catch.segments:
            self._pass([], catch)
        return errors

    def _catch_up_inputs(self, ctxs: list[DraftContext], strict: bool = True
                         ) -> tuple[list[Exception | None], CatchUp]:
        """What feeding each session's new committed pairs takes, and the sessions that
        cannot be fed. Received features are copied and cast here, on the drafting
        thread."""
        errors: list[Exception | None] = []
        catch = CatchUp()
        for ctx in ctxs:
            if ctx.state is None:
                ctx.state = HeadState()
            state: HeadState = ctx.state
            take = len(ctx.features)
            new = [f if isinstance(f, torch.Tensor) else to_torch(f) for f in ctx.features[:take]]
            del ctx.features[:take]
            count = sum(len(f) for f in new)
            total = state.pairs + count
            have = len(ctx.tokens) - 1
            if have < total or (strict and have != total) or total == 0:
                errors.append(ValueError(f"session has {len(ctx.tokens)} tokens but {total} "
                                         f"feature rows"))
                continue
            errors.append(None)
            if not count:
                if state.root_hidden is None:  # an earlier pass failed before setting it
                    errors[-1] = ValueError("no feature rows to draft from")
                continue
            state.cache.crop(state.pairs)
            catch.feats.append(torch.cat(new).to(self.device, self.dtype))
            catch.ids.append(torch.tensor(ctx.tokens[state.pairs + 1: total + 1]))
            catch.positions.append(torch.arange(state.pairs, total))
            catch.segments.append(Segment(count, state.cache))
            catch.rows.append((state, total))
        return errors, catch

    def _pass(self, asks: list[tuple[Growth, Frontier]], catch: CatchUp | None = None
              ) -> list[torch.Tensor]:
        """One head pass over the frontiers of several growing trees, plus the committed
        pairs of sessions catching up (``catch``): their rows are packed, each tree attends
        over its own cache under its tree mask, each catching-up session over its cache."""
        feats, ids, positions, segments = [], [], [], []
        appended: dict[int, int] = {}
        for growth, (nodes, tokens, parents) in asks:
            key = id(growth.cache)
            start = growth.cache.length + appended.get(key, 0)
            appended[key] = appended.get(key, 0) + len(nodes)
            mask, pos = growth.feed.layout(nodes, parents, start)
            feats.append(torch.stack([growth.hidden[p] for p in parents]))
            ids.append(torch.tensor(list(tokens)))
            positions.append(pos)
            segments.append(Segment(len(nodes), growth.cache, mask.to(self.device)))
        tree_rows = sum(len(nodes) for _, (nodes, _, _) in asks)
        token_ids = [self.head.to_target_ids(torch.cat(ids).to(self.device))] if ids else []
        catch = catch if catch is not None else CatchUp()
        if catch.segments:
            # their tokens are target ids already; their features are the target's, wider
            # than the trees' rows for an EAGLE-3 head until its fc folds them
            feats += [self.head.fused(f) for f in catch.feats]
            token_ids += [t.to(self.device) for t in catch.ids]
            positions += catch.positions
            segments += catch.segments
        hidden, _ = self.head(torch.cat(feats)[None], torch.cat(token_ids)[None],
                              position_ids=torch.cat(positions).to(self.device),
                              segments=segments, num_logits=0)
        rows = torch.arange(tree_rows, device=self.device)
        if catch.segments:
            lengths = torch.tensor([seg.rows for seg in catch.segments], device=self.device)
            ends = tree_rows + lengths.cumsum(0) - 1
            rows = torch.cat([rows, ends])
        picked = hidden[0, rows]
        logits = self.head.logits(picked)
        out, start = [], 0
        for growth, (nodes, _, _) in asks:
            for row, node in enumerate(nodes):
                growth.hidden[node] = picked[start + row]
            out.append(logits[start:start + len(nodes)])
            start += len(nodes)
        for j, (state, total) in enumerate(catch.rows):
            state.pairs = total
            state.root_hidden, state.root_logits = picked[start + j], logits[start + j]
        return out

    @torch.inference_mode()
    def predraft(self, ctx: DraftContext, tree: DraftTree, shape: TreeShape,
                 stop: Callable[[], bool], limit: int = PREDRAFT_OUTCOMES
                 ) -> dict[tuple[int, ...], DraftTree]:
        """Feed the tree in flight again (its nodes' outputs stand in for the target's
        features, which are not known yet), rank the ways its round can end, and grow the
        next tree for the likeliest, all in lockstep. Greedy sessions only: a sampled
        session's random draws must not depend on how much idle time there was."""
        if not ctx.greedy or ctx.state is None or not len(tree) or shape.depth < 1:
            return {}
        if self._catch_up([ctx], strict=False)[0] is not None:
            return {}
        state: HeadState = ctx.state
        base = state.pairs
        try:
            return self._predraft(state, tree, shape, stop, limit)
        finally:
            state.cache.crop(base)

    def _predraft(self, state: HeadState, tree: DraftTree, shape: TreeShape,
                  stop: Callable[[], bool], limit: int) -> dict[tuple[int, ...], DraftTree]:
        index = self._draft_index()
        tokens = index[torch.from_numpy(tree.tokens.astype(np.int64))].tolist()
        parents = tree.parents.tolist()
        if min(tokens) < 0:
            return {}
        refeed = Growth(state.cache, state.pairs, {-1: state.root_hidden})
        logp = grow_together([_replay(tokens, parents)], lambda asks: self._pass(
            [(refeed, frontier) for _, frontier in asks]), stop)[0]
        if logp is None:
            return {}
        logp[-1] = torch.log_softmax(state.root_logits.float(), -1)
        outcomes = likely_outcomes(parents, tokens, logp, limit)
        growths, growers = [], []
        for _, v, b in outcomes:
            growth = Growth(state.cache, state.pairs, {-2: refeed.hidden[v]})
            growth.feed.ancestors[-2] = refeed.feed.ancestors[v]
            growths.append(growth)
            growers.append(_after_outcome(b, shape))
        trees = grow_together(growers, lambda asks: self._pass(
            [(growths[j], frontier) for j, frontier in asks]), stop)
        sent = tree.tokens.tolist()
        bonus = self.head.to_target_ids(
            torch.tensor([b for _, _, b in outcomes], device=self.device)).tolist()
        found = {}
        for (_, v, _), b, grown in zip(outcomes, bonus, trees, strict=True):
            if grown is not None and len(grown):
                key = tuple(sent[i] for i in path_to(parents, v)) + (b,)
                found[key] = self._to_target_ids(grown)
        return found

    def _target_index(self) -> torch.Tensor | None:
        """Target id of every draft id (None when the vocabularies are the same)."""
        if self.head.d2t is None:
            return None
        if self._targets is None:
            draft = torch.arange(self.head.draft_vocab_size, device=self.head.d2t.device)
            self._targets = self.head.to_target_ids(draft).cpu()
        return self._targets

    def _draft_index(self) -> torch.Tensor:
        if self._index is None:
            self._index = self.head.draft_index()
        return self._index


class DraftBatch:
    """One run of packed passes. Jobs are numbered in the order they arrive: the first
    ones, then whatever ``admit()`` returns between layers. A job that joins catches up
    inside the next layer's pass (when trees already wait for one) and grows from the
    layer after; ``finished(k, result, seconds, batch)`` hears of job k as soon as its
    tree (or error) is ready, with its share of the time of the passes it took part in
    and the mean number of sessions in them."""

    def __init__(self, drafter: EagleDrafter, admit: Callable[[], list[Job]] | None = None,
                 finished: Finished | None = None):
        self.drafter = drafter
        self.admit = admit
        self.finished = finished
        self.results: list[DraftTree | Exception | None] = []
        self.jobs: list[Job] = []
        self.cost: list[float] = []
        self.shared: list[list[int]] = []  # per job: passes, and sessions in them
        self.owners: list[int] = []  # grower -> job
        self.ranked: list[int] = []  # grower -> top-k it is sent ranked, 0: raw logits
        self.growths: list[Growth] = []
        self.growing = 0
        self.queued: list[CatchUp] = []  # admitted; their pairs ride the next pass
        self.ready: list[Grower] = []  # caught up; they join at the next layer
        self.mark = time.perf_counter()

    def run(self, jobs: list[Job]) -> list[DraftTree | Exception]:
        grow_together(self.alone(self.enqueue(jobs)), self.expand,
                      admit=self.more if self.admit else None, finished=self.done)
        return self.results  # type: ignore[return-value]

    def charge(self, jobs: list[int]) -> None:
        """Split the time since the last charge among the jobs it was spent on."""
        now = time.perf_counter()
        for k in jobs:
            self.cost[k] += (now - self.mark) / len(jobs)
            self.shared[k][0] += 1
            self.shared[k][1] += len(jobs)
        self.mark = now

    def report(self, k: int, result: DraftTree | Exception) -> None:
        self.results[k] = result
        if self.finished is not None:
            passes, rows = self.shared[k]
            self.finished(k, result, self.cost[k], rows / passes if passes else 1.0)

    def enqueue(self, new: list[Job]) -> CatchUp:
        """Number the new jobs; their catch-up inputs (errors reported at once)."""
        first = len(self.results)
        self.results.extend([None] * len(new))
        self.jobs.extend(new)
        self.cost.extend([0.0] * len(new))
        self.shared.extend([0, 0] for _ in new)
        errors, catch = self.drafter._catch_up_inputs([ctx for ctx, _ in new])
        catch.jobs = [k for k, err in enumerate(errors, first) if err is None]
        for k, err in enumerate(errors, first):
            if err is not None:
                self.report(k, err)
        return catch

    def start(self, jobs: list[int]) -> list[Grower]:
        """Growers for jobs whose sessions have caught up."""
        drafter = self.drafter
        scores = [self.jobs[k][0].coupled(drafter.head.vocab_size, drafter._target_index())
                  for k in jobs]
        plain = [k for k, score in zip(jobs, scores, strict=True)
                 if self.jobs[k][0].greedy and score is None]
        roots = iter(self.rank([self.jobs[k][0].state.root_logits[None] for k in plain],
                               [self.jobs[k][1].topk for k in plain]))
        growers = []
        for k, score in zip(jobs, scores, strict=True):
            ctx, shape = self.jobs[k]
            state: HeadState = ctx.state
            self.growths.append(Growth(state.cache, state.pairs, {-1: state.root_hidden}))
            self.owners.append(k)
            self.ranked.append(shape.topk if k in plain else 0)
            if k in plain:
                growers.append(grow_greedy(next(roots), shape.depth, shape.topk,
                                           shape.max_nodes, floor=shape.floor))
            elif score is not None:
                growers.append(grow_greedy(state.root_logits, shape.depth, shape.topk,
                                           shape.max_nodes, score, shape.floor))
            else:
                growers.append(grow_sampled(state.root_logits, shape.depth, shape.topk,
                                            shape.max_nodes, ctx.temperature, shape.support,
                                            ctx.generator))
        self.growing += len(growers)
        return growers

    def alone(self, catch: CatchUp) -> list[Grower]:
        """Catch up in a pass of their own (nothing is growing to ride with)."""
        if catch.segments:
            self.drafter._pass([], catch)
        self.charge(catch.jobs)
        return self.start(catch.jobs)

    def more(self) -> list[Grower]:
        """Between layers: the caught-up jobs join; newly admitted ones queue for the
        next pass, or catch up at once if no tree is waiting for a pass."""
        joining, self.ready = self.ready, []
        new = self.admit()
        if new:
            catch = self.enqueue(new)
            if self.growing > len(joining):
                self.queued.append(catch)
            else:
                joining += self.alone(catch)
        return joining

    def expand(self, asks: list[tuple[int, Frontier]]) -> list[torch.Tensor | Ranked]:
        catch = CatchUp.merge(self.queued)
        self.queued = []
        out = self.drafter._pass([(self.growths[j], frontier) for j, frontier in asks], catch)
        plain = [i for i, (j, _) in enumerate(asks) if self.ranked[j]]
        for i, ranked in zip(plain, self.rank([out[i] for i in plain],
                                              [self.ranked[asks[i][0]] for i in plain]),
                             strict=True):
            out[i] = ranked
        self.charge([self.owners[j] for j, _ in asks] + catch.jobs)
        self.ready.extend(self.start(catch.jobs))
        return out

    @staticmethod
    def rank(logits: list[torch.Tensor], topk: list[int]) -> list[Ranked]:
        """Each greedy tree's rows ranked, all trees' in one top-k."""
        if not logits:
            return []
        return rank(torch.cat(logits), max(topk)).split([len(rows) for rows in logits])

    def done(self, j: int, tree: DraftTree) -> None:
        self.growing -= 1
        state: HeadState = self.jobs[self.owners[j]][0].state
        state.cache.crop(state.pairs)
        self.report(self.owners[j], self.drafter._to_target_ids(tree))


def _replay(tokens: list[int], parents: list[int]):
    """A grower that feeds an existing tree layer by layer and returns the draft's
    log-probabilities after each of its nodes (None when stopped)."""
    depth = depths(np.asarray(parents))
    logp: dict[int, torch.Tensor] = {}
    for d in range(1, int(depth.max(initial=0)) + 1):
        nodes = [i for i in range(len(tokens)) if depth[i] == d]
        logits = yield nodes, [tokens[i] for i in nodes], [parents[i] for i in nodes]
        if logits is None:
            return None
        for row, node in enumerate(nodes):
            logp[node] = torch.log_softmax(logits[row].float(), -1)
    return logp


def _after_outcome(bonus: int, shape: TreeShape):
    """A grower for one guessed outcome: feed the bonus token after the accepted node
    (virtual id -2), then grow a greedy tree from the bonus token's output."""
    logits = yield [-1], [bonus], [-2]
    if logits is None:
        return None
    return (yield from grow_greedy(logits[0], shape.depth, shape.topk, shape.max_nodes,
                                   floor=shape.floor))
