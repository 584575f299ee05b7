"""The target model's side of a round: prefill, verify a tree in one pass, compact the cache.

Invariant: the KV cache holds every committed token except the last, which is the root of
the next tree and is fed together with it. After a verify the cache still holds the whole
tree until ``compact``, which the next step or verify calls if nobody did, so that a caller
can send its COMMIT first and compact while the hub drafts.

A session's cache is its own static storage (``targets.kv``), and its passes are rows of
``targets.forward.DecoderPass``: alone here, or beside other sessions' rows in
``targets.engine``. Either way a row is built and read back by the same two methods
(``tree_row``, ``verdict``), so one session verified alone or in a batch is decided the
same way.
"""

from __future__ import annotations

import weakref
from collections.abc import Generator
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from starhub.models.coupling import sample_at
from starhub.wire.tree import DraftTree, ancestor_mask, depths
from targets.acceptance import Sampling, accept_greedy, accept_sampled, argmax_rows, target_probs
from targets.forward import ALL, LAST, NONE, DecoderPass, Row, RowOut, run_through

HEADROOM = 256
"""Cache entries a session is given beyond its prompt at prefill."""

_PASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoder_pass(model: PreTrainedModel) -> DecoderPass:
    """The one ``DecoderPass`` of a loaded model."""
    runner = _PASSES.get(model)
    if runner is None:
        runner = _PASSES[model] = DecoderPass(model)
    return runner


@dataclass
class Verdict:
    path: list[int]
    """Accepted node indices, root to leaf."""
    tokens: list[int]
    """The accepted tokens followed by the bonus token."""
    features: torch.Tensor | None
    """One row per new token, for the tokens before each of them (root and accepted)."""
    logprobs: list[TokenLogprob] | None = None
    """One per new token, where the session asks for them (``TargetModel.logprobs``)."""


@dataclass
class TokenLogprob:
    """A decided token's log-probability under the target (its raw logits, before any
    temperature or nucleus), and the ``top`` likeliest tokens' as (id, logprob)."""

    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each row's log-softmax at its token, and its ``top`` best, from the same logits
    that decided the tokens (no pass of its own)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if top:
        values, ids = logp.topk(top, dim=-1)
        best = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(),
                                                            strict=True)]
    else:
        best = [[] for _ in tokens]
    return [TokenLogprob(lp, b) for lp, b in zip(chosen, best, strict=True)]


class TargetModel:
    """One decoding stream over a loaded causal LM."""

    def __init__(self, model: PreTrainedModel, sampling: Sampling = Sampling(), seed: int = 0,
                 feature_layers: list[int] | None = None, logprobs: int | None = None,
                 echo: bool = False):
        self.model = model
        self.runner = decoder_pass(model)
        self.sampling = sampling
        self.seed = seed
        """Sampled tokens are seeded draws keyed by (seed, sequence index): the output is a
        function of the seed alone, whatever the hub drafted (``starhub.models.coupling``)."""
        self.feature_layers = tuple(feature_layers or ())
        self.kv = self.runner.new_cache(0)  # sized at prefill
        self.last: int | None = None
        self.step_features: torch.Tensor | None = None
        """Features of the token the last ``step`` fed, when features are wanted."""
        self._keep: tuple[int, list[int]] | None = None
        self.logprobs = logprobs
        """None: no log-probabilities; else each decided token's, with this many of the
        likeliest (``TokenLogprob``)."""
        self.first_logprob: TokenLogprob | None = None
        """The prompt's next token's, once prefilled (where asked for)."""
        self.echo = echo and logprobs is not None
        """Whether prefill computes every prompt token's log-probability too."""
        self.prompt_logprobs: list[TokenLogprob | None] = []
        """Each prompt token's given the ones before (None for the first), with ``echo``."""
        self.picks = sampling.greedy and logprobs is None
        """Whether its rows ask the pass for greedy picks, not logits (``Row.picks``)."""

    @property
    def cached(self) -> int:
        """Cache entries once the last verify is compacted (without compacting now)."""
        if self._keep is None:
            return self.kv.length
        return self._keep[0] + len(self._keep[1])

    def compact(self) -> None:
        """Drop the rejected tree nodes of the last verify from the cache."""
        if self._keep is not None:
            self.kv.keep(*self._keep)
            self._keep = None

    def _run(self, row: Row) -> RowOut:
        return self.runner([row])[0]

    def next_token(self, out: RowOut, index: int) -> int:
        """The token at sequence ``index`` from the pass's output for the position before
        it (the row's last)."""
        if out.picks is not None:
            return out.picks[-1]
        if self.sampling.greedy:
            return argmax_rows(out.logits[-1:])[0]
        return sample_at(target_probs(out.logits[-1].float().cpu(), self.sampling), self.seed,
                         index)

    def prefill(self, prompt: list[int]) -> tuple[int, torch.Tensor | None]:
        """Process the prompt in one pass; return the first generated token and the prompt's
        features."""
        return run_through(self.prefill_chunks(prompt, len(prompt)))

    def _echo(self, prompt: list[int], start: int, logits: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens that the rows of a chunk beginning at
        ``start`` predict (with ``echo``)."""
        if not self.echo:
            return
        if start == 0:
            self.prompt_logprobs = [None]
        nxt = list(prompt[start + 1:start + len(logits) + 1])
        self.prompt_logprobs += token_logprobs(logits[:len(nxt)], nxt, self.logprobs)

    def _first_logprob(self, logits: torch.Tensor) -> None:
        if self.logprobs is not None:
            self.first_logprob = token_logprobs(logits, [self.last], self.logprobs)[0]

    def prefill_chunks(self, prompt: list[int], chunk: int
                       ) -> Generator[int | None, None, tuple[int, torch.Tensor | None]]:
        """``prefill``, ``chunk`` tokens a forward pass, paused so that a caller can run
        other sessions' passes in between: after each decoder layer (yields None) and at
        each chunk's end (yields the prompt tokens cached so far); returns what ``prefill``
        returns. Only the last chunk computes logits, of its last token."""
        self.kv.reserve(len(prompt) + HEADROOM)
        feats = []
        for begin in range(0, len(prompt), chunk):
            part = list(prompt[begin:begin + chunk])
            done = begin + len(part) == len(prompt)
            (out,) = yield from self.runner.layer_by_layer([Row(
                self.kv, part, logits=ALL if self.echo else LAST if done else NONE,
                picks=self.picks, features=self.feature_layers)])
            self._echo(prompt, begin, out.logits)
            if out.features is not None:
                feats.append(out.features)
            if not done:
                yield begin + len(part)
        self.last = self.next_token(out, len(prompt))
        if out.logits is not None:
            self._first_logprob(out.logits[-1:])
        return self.last, None if not feats else feats[0] if len(feats) == 1 else \
            torch.cat(feats)

    def step(self) -> int:
        """One plain autoregressive step, for decoding without a hub."""
        self.compact()
        index = self.kv.length + 1
        out = self._run(Row(self.kv, [self.last], picks=self.picks,
                            features=self.feature_layers))
        self.step_features = out.features
        self.last = self.next_token(out, index)
        return self.last

    def accept(self, tree: DraftTree, out: RowOut, cached: int) -> tuple[list[int], int]:
        """The accepted path and the bonus token, from the pass's output for the root and
        nodes; ``cached`` entries precede the root, so the root's child is token ``cached +
        1``."""
        if out.picks is not None:
            return accept_greedy(tree, out.picks)
        logits = out.logits.float().cpu()
        if self.sampling.greedy:
            return accept_greedy(tree, argmax_rows(logits))
        return accept_sampled(tree, logits, self.sampling, self.seed, cached + 1)

    def tree_row(self, tree: DraftTree) -> Row:
        """This session's row of a pass that verifies ``tree``: the last token (the root)
        and the tree's nodes, each at its depth after the cache, each seeing its ancestors."""
        self.compact()
        cached = self.kv.length
        positions = cached + torch.cat([torch.zeros(1, dtype=torch.long),
                                        torch.from_numpy(depths(tree.parents))])
        return Row(self.kv, [self.last, *tree.tokens.tolist()], positions,
                   ancestor_mask(tree.parents), picks=self.picks, features=self.feature_layers)

    def verdict(self, tree: DraftTree, out: RowOut) -> Verdict:
        """What the pass of ``tree_row(tree)`` decided; the rejected nodes stay in the cache
        until ``compact``."""
        cached = self.kv.length - len(tree) - 1
        path, bonus = self.accept(tree, out, cached)
        keep = [0] + [i + 1 for i in path]
        self._keep = (cached, keep)
        self.last = bonus
        tokens = [int(tree.tokens[i]) for i in path] + [bonus]
        return Verdict(path=path, tokens=tokens,
                       features=out.features[keep] if out.features is not None else None,
                       logprobs=None if self.logprobs is None else
                       token_logprobs(out.logits[keep], tokens, self.logprobs))

    def verify(self, tree: DraftTree) -> Verdict:
        return self.verdict(tree, self._run(self.tree_row(tree)))
