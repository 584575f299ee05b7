"""Training data for an EAGLE head: the target's own answers, its features and soft labels.

Everything is cached under the work folder and grows incrementally: answers are appended to
JSONL files and matched by prompt tokens, and per-sequence features live in a
:class:`FeatureStore` keyed by the sequence's ids. Generation records features and labels as
it decodes, so new data never needs a second pass over the target, and adding prompts never
redoes earlier work.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from targets.generate import encode_prompt


@dataclass
class Seq:
    id: object
    prompt_len: int
    ids: list[int]


@dataclass
class Dump:
    """Per-token data of many sequences, concatenated; ``offsets`` delimit sequences.

    Row t of ``feats`` is the target's feature at position t; row t of ``top_ids``/``top_p``
    is its top-k distribution for the token after position t (zero where unused: before the
    prompt's last position, and at a sequence's last position).
    """

    ids: Tensor
    feats: Tensor
    top_ids: Tensor
    top_p: Tensor
    offsets: Tensor
    prompt_lens: Tensor

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def span(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])


@dataclass(frozen=True)
class Record:
    """What to record while decoding: hidden states at ``layers`` and top-``topk`` labels."""

    layers: tuple[int, ...]
    topk: int


@dataclass
class Answer:
    """Generated ids; when recorded, the features of every position the target was fed and
    its top-k next-token distribution from the prompt's last position on."""

    ids: list[int]
    feats: list[Tensor] = field(default_factory=list)
    top_ids: list[Tensor] = field(default_factory=list)
    top_p: list[Tensor] = field(default_factory=list)

    def rows(self, prompt: list[int]) -> tuple[list[int], Tensor, Tensor, Tensor]:
        """(ids, feats, top_ids, top_p) with one row per position of prompt + answer."""
        feats = torch.cat(self.feats)
        top_ids, top_p = torch.cat(self.top_ids), torch.cat(self.top_p)
        before, after = len(prompt) - 1, 1
        return (prompt + self.ids,
                torch.cat([feats, feats.new_zeros(after, feats.shape[1])]),
                torch.cat([top_ids.new_zeros(before, top_ids.shape[1]), top_ids,
                           top_ids.new_zeros(after, top_ids.shape[1])]),
                torch.cat([top_p.new_zeros(before, top_p.shape[1]), top_p,
                           top_p.new_zeros(after, top_p.shape[1])]))


def _features(out, layers: tuple[int, ...]) -> Tensor:
    return torch.cat([out.hidden_states[j] for j in layers], dim=-1)


def _top(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    top = logits.float().softmax(-1).topk(k, dim=-1)
    return top.indices.int().cpu(), top.values.half().cpu()


@torch.no_grad()
def answer_batch(model, prompts: list[list[int]], max_new_tokens: int, eos: int, pad: int,
                 temperature: float = 0.0, generator: torch.Generator | None = None,
                 record: Record | None = None) -> list[Answer]:
    """Answers for left-padded prompts, greedy or sampled at ``temperature``; finished rows
    leave the batch (and the cache), so short answers cost nothing after their end."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                use_cache=True, logits_to_keep=1, output_hidden_states=record is not None)
    answers = [Answer([]) for _ in prompts]
    if record:
        feats = _features(out, record.layers).half().cpu()
        for r, p in enumerate(prompts):
            answers[r].feats.append(feats[r, width - len(p):])
    logits = out.logits[:, -1]
    rows = torch.arange(len(prompts), device=device)
    last = pos[:, -1]
    for step in range(max_new_tokens):
        if record:
            top_ids, top_p = _top(logits, record.topk)
            for j, r in enumerate(rows.tolist()):
                answers[r].top_ids.append(top_ids[j:j + 1])
                answers[r].top_p.append(top_p[j:j + 1])
        if temperature > 0:
            probs = torch.softmax(logits.float().cpu() / temperature, -1)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0].to(device)
        else:
            nxt = logits.argmax(-1)
        keep = []
        for j, (r, t) in enumerate(zip(rows.tolist(), nxt.tolist(), strict=True)):
            answers[r].ids.append(t)
            if t != eos and step + 1 < max_new_tokens:
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(rows):
            sel = torch.tensor(keep, device=device)
            cache.batch_select_indices(sel)
            rows, nxt, mask, last = rows[sel], nxt[sel], mask[sel], last[sel]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        last = last + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None],
                    cache=cache, use_cache=True, output_hidden_states=record is not None)
        logits = out.logits[:, -1]
        if record:
            feats = _features(out, record.layers)[:, -1].half().cpu()
            for j, r in enumerate(rows.tolist()):
                answers[r].feats.append(feats[j:j + 1])
    return answers


class FeatureStore:
    """Features and soft labels per sequence, in safetensors shards keyed by a hash of the
    sequence's ids, so that growing the data computes only what is new."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.index: dict[bytes, tuple[Path, int]] = {}
        for shard in sorted(folder.glob("shard-*.safetensors")):
            with safe_open(str(shard), "pt") as fh:
                keys = fh.get_tensor("keys")
            for row, key in enumerate(keys.tolist()):
                self.index[bytes(key)] = (shard, row)

    @staticmethod
    def key(ids: list[int]) -> bytes:
        return hashlib.sha256(json.dumps(list(ids)).encode()).digest()[:16]

    def missing(self, seqs: list[Seq]) -> list[Seq]:
        return [s for s in seqs if self.key(s.ids) not in self.index]

    def add(self, rows: list[tuple[list[int], Tensor, Tensor, Tensor]]) -> None:
        """Write one shard of (ids, feats, top_ids, top_p) with a row per position."""
        if not rows:
            return
        path = self.folder / f"shard-{len(list(self.folder.glob('shard-*'))):06d}.safetensors"
        lens = torch.tensor([len(r[0]) for r in rows])
        tensors = {
            "keys": torch.tensor([list(self.key(r[0])) for r in rows], dtype=torch.uint8),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
            "feats": torch.cat([r[1] for r in rows]).half().contiguous(),
            "top_ids": torch.cat([r[2] for r in rows]).int().contiguous(),
            "top_p": torch.cat([r[3] for r in rows]).half().contiguous(),
        }
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(path)
        for row, r in enumerate(rows):
            self.index[self.key(r[0])] = (path, row)

    def dump(self, seqs: list[Seq]) -> Dump:
        shards: dict[Path, dict[str, Tensor]] = {}
        feats, top_ids, top_p = [], [], []
        for s in seqs:
            path, row = self.index[self.key(s.ids)]
            if path not in shards:
                shards[path] = load_file(str(path))
            t = shards[path]
            span = slice(int(t["offsets"][row]), int(t["offsets"][row + 1]))
            feats.append(t["feats"][span])
            top_ids.append(t["top_ids"][span])
            top_p.append(t["top_p"][span])
        lens = torch.tensor([len(s.ids) for s in seqs])
        return Dump(ids=torch.tensor([t for s in seqs for t in s.ids], dtype=torch.long),
                    feats=torch.cat(feats), top_ids=torch.cat(top_ids), top_p=torch.cat(top_p),
                    offsets=torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
                    prompt_lens=torch.tensor([s.prompt_len for s in seqs]))


def eos_and_pad(tokenizer) -> tuple[int, int]:
    """Left padding uses the pad token, or EOS where the tokenizer has none."""
    eos = tokenizer.eos_token_id
    return eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos


def generate(model, tokenizer, rows: list[tuple[object, str]], path: Path, max_new_tokens: int,
             batch_size: int, temperature: float = 0.0, seed: int = 0,
             store: FeatureStore | None = None, record: Record | None = None) -> list[Seq]:
    """Answers, appended to ``path`` batch by batch so an interrupted run resumes; with a
    ``store``, each batch's features and labels are recorded into it as well.

    Cached answers are matched by prompt tokens, so editing the prompt set reuses the rest.
    """
    done: dict[tuple[int, ...], Seq] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                s = Seq(**json.loads(line))
                done[tuple(s.ids[:s.prompt_len])] = s
    prompts = [(sid, encode_prompt(tokenizer, prompt)) for sid, prompt in rows]
    todo = sorted({tuple(p): (sid, p) for sid, p in prompts if tuple(p) not in done}.values(),
                  key=lambda x: len(x[1]))
    eos, pad = eos_and_pad(tokenizer)
    batches = [todo[i:i + batch_size] for i in range(0, len(todo), batch_size)]
    generator = torch.Generator().manual_seed(seed + len(done))
    with path.open("a") as out:
        for batch in tqdm(batches, desc=f"generate {path.stem}", unit="batch"):
            answers = answer_batch(model, [p for _, p in batch], max_new_tokens, eos, pad,
                                   temperature, generator, record if store else None)
            if store is not None:
                store.add([a.rows(p) for (_, p), a in zip(batch, answers, strict=True)])
            for (sid, p), a in zip(batch, answers, strict=True):
                s = Seq(sid, len(p), p + a.ids)
                done[tuple(p)] = s
                out.write(json.dumps(s.__dict__) + "\n")
            out.flush()
    return [Seq(sid, len(p), done[tuple(p)].ids) for sid, p in prompts]


def user_turn_prefix(tokenizer, history: list[dict] | None = None) -> list[int]:
    """The chat template's ids up to where the next user message begins, after ``history``
    (earlier messages of the conversation, if any)."""
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit("self-written prompts need a target with a chat template")
    marker = "\x00PROMPT\x00"
    text = tokenizer.apply_chat_template([*(history or []), {"role": "user", "content": marker}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text[:text.index(marker)], add_special_tokens=False)["input_ids"]


def _write_user_turns(model, tokenizer, starts: list[tuple[list[int], str]], max_tokens: int,
                      temperature: float, generator: torch.Generator) -> list[str | None]:
    """The target's own user messages, one per (template ids, opening words) in ``starts``;
    None where a message did not end (no EOS within ``max_tokens``) or has under 3 words."""
    eos, pad = eos_and_pad(tokenizer)
    prompts = [ids + (tokenizer(o, add_special_tokens=False)["input_ids"] if o else [])
               for ids, o in starts]
    out: list[str | None] = []
    for (_, opener), answer in zip(starts, answer_batch(model, prompts, max_tokens, eos, pad,
                                                         temperature, generator), strict=True):
        g = answer.ids
        text = (opener + tokenizer.decode(g, skip_special_tokens=True)).strip()
        out.append(text if g[-1] == eos and len(text.split()) >= 3 else None)
    return out


def synthesize_prompts(model, tokenizer, count: int, path: Path, batch_size: int,
                       temperature: float = 0.8, max_tokens: int = 96, seed: int = 0,
                       exclude: set[str] = frozenset(), openers: list[str] = ()
                       ) -> list[tuple[object, str]]:
    """User messages the target writes itself, sampled from its own chat template's user
    turn (as in Magpie): prompt diversity at generation cost, with no data download.

    With ``openers``, message i starts with ``openers[i % len(openers)]`` and the target
    writes the rest: that steers the prompts across styles (passages, code to fix, personas,
    word problems...) the free-running target rarely writes by itself.

    Only complete messages (ended by EOS) of 3+ words are kept, without duplicates or
    any prompt in ``exclude`` (the held-out set). Appended to ``path``, so reruns resume.
    """
    seen = {p.strip().lower() for p in exclude}
    rows: list[tuple[object, str]] = []
    if path.exists():
        rows = [(r["id"], r["prompt"]) for r in map(json.loads, path.read_text().splitlines())]
    seen |= {p.lower() for _, p in rows}
    prefix = user_turn_prefix(tokenizer)
    generator = torch.Generator().manual_seed(seed + len(rows))
    tried = len(rows)
    with path.open("a") as out, tqdm(total=count, initial=min(len(rows), count),
                                     desc="synthesize prompts", unit="prompt") as bar:
        while len(rows) < count:
            starts = [(prefix, openers[(tried + i) % len(openers)] if openers else "")
                      for i in range(batch_size)]
            tried += batch_size
            for text in _write_user_turns(model, tokenizer, starts, max_tokens, temperature,
                                          generator):
                if text is None or text.lower() in seen:
                    continue
                seen.add(text.lower())
                rows.append((f"s{len(rows):05d}", text))
                out.write(json.dumps({"id": rows[-1][0], "prompt": text}) + "\n")
                bar.update(1)
                if len(rows) == count:
                    break
            out.flush()
    return rows[:count]


def follow_ups(model, tokenizer, firsts: list[tuple[object, str, str]], path: Path,
               batch_size: int, count: int | None = None, temperature: float = 0.8,
               max_tokens: int = 96, seed: int = 0) -> list[tuple[object, list[dict]]]:
    """Second turns: for ``count`` of the (id, user message, the target's own answer) in
    ``firsts`` (all by default), the target writes the user's follow-up to its answer,
    sampled from its chat template, and the conversation so far becomes a training prompt.
    Conversations whose follow-up did not end or is too short are dropped. Appended to
    ``path``, so reruns resume; conversations already written are chosen first, so a larger
    ``count`` later extends the set instead of drawing a new one."""
    done: dict[str, list[dict]] = {}
    if path.exists():
        done = {str(r["id"]): r["messages"]
                for r in map(json.loads, path.read_text().splitlines())}
    count = len(firsts) if count is None else count
    firsts = sorted(firsts, key=lambda f: f"{f[0]}-2" not in done)[:count]  # stable: written first
    todo = [f for f in firsts if f"{f[0]}-2" not in done]
    generator = torch.Generator().manual_seed(seed + len(done))
    with path.open("a") as out:
        for b in tqdm(range(0, len(todo), batch_size), desc="follow-ups", unit="batch",
                      disable=not todo):
            batch = todo[b:b + batch_size]
            history = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                       for _, q, a in batch]
            texts = _write_user_turns(model, tokenizer,
                                      [(user_turn_prefix(tokenizer, h), "") for h in history],
                                      max_tokens, temperature, generator)
            for (sid, _, _), h, text in zip(batch, history, texts, strict=True):
                messages = [*h, {"role": "user", "content": text}] if text else []
                done[f"{sid}-2"] = messages
                out.write(json.dumps({"id": f"{sid}-2", "messages": messages}) + "\n")
            out.flush()
    return [(f"{sid}-2", done[f"{sid}-2"]) for sid, _, _ in firsts if done[f"{sid}-2"]]


@torch.no_grad()
def dump_features(model, seqs: list[Seq], store: FeatureStore, record: Record,
                  batch_size: int = 4, shard_size: int = 64) -> Dump:
    """Features and labels for the sequences ``store`` lacks (answers cached before
    recording, or written elsewhere), one target forward each; then all of ``seqs``."""
    todo = sorted(store.missing(seqs), key=lambda s: len(s.ids))
    device = next(model.parameters()).device
    pending: list[tuple[list[int], Tensor, Tensor, Tensor]] = []
    for b in tqdm(range(0, len(todo), batch_size), desc="features", unit="batch",
                  disable=not todo):
        batch = todo[b:b + batch_size]
        width = max(len(s.ids) for s in batch)
        ids = torch.tensor([s.ids + [0] * (width - len(s.ids)) for s in batch])
        mask = torch.tensor([[1] * len(s.ids) + [0] * (width - len(s.ids)) for s in batch])
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                    output_hidden_states=True)
        feats = _features(out, record.layers)
        top_ids, top_p = _top(out.logits, record.topk)
        for row, s in enumerate(batch):
            n = len(s.ids)
            pending.append((s.ids, feats[row, :n].half().cpu(), top_ids[row, :n],
                            top_p[row, :n]))
        if len(pending) >= shard_size:
            store.add(pending)
            pending = []
    store.add(pending)
    return store.dump(seqs)


def choose_draft_vocab(dump: Dump, size: int, vocab: int, prefer: Tensor | None = None
                       ) -> Tensor:
    """The ``size`` most frequent target tokens in the data (teacher mass breaks ties).
    Ids in ``prefer`` (a trained head's vocabulary) come first, so resizing a head keeps
    as many trained rows as the new size allows."""
    score = torch.bincount(dump.ids, minlength=vocab).double()
    score += torch.zeros(vocab, dtype=torch.float64).index_add_(
        0, dump.top_ids.flatten().long(), dump.top_p.flatten().double()) * 1e-3
    score -= torch.arange(vocab, dtype=torch.float64) * 1e-12
    if prefer is not None:
        score[prefer.long()] += score.max() + 1
    return torch.sort(score.topk(size).indices).values
