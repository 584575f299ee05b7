"""Drafters by name: ``eagle`` (a head over target features), ``ngram`` (prompt lookup) and
``model`` (an independent causal LM)."""

from __future__ import annotations

from starhub.drafters.base import DraftContext, Drafter, TreeShape
from starhub.drafters.ngram import NgramDrafter
from starhub.models.devices import resolve_device
from starhub.options import DRAFTERS

__all__ = ["DRAFTERS", "DraftContext", "Drafter", "TreeShape", "make_drafter", "parse_draft"]


def parse_draft(spec: str) -> tuple[str, int | None]:
    """``self`` | ``self:layers=K`` | a model spec -> (model spec or 'self', layers)."""
    if spec == "self":
        return "self", None
    if spec.startswith("self:"):
        key, _, value = spec[5:].partition("=")
        if key != "layers" or not value.isdigit():
            raise ValueError(f"bad draft spec '{spec}': expected self:layers=K")
        return "self", int(value)
    return spec, None


def make_drafter(kind: str, draft: str | None = None, model: str = "default",
                 dtype: str = "auto", device: str = "cpu") -> Drafter:
    """Build a drafter. ``draft`` is the head folder (eagle) or the draft model spec (model);
    ``model`` is the target's model spec, whose weights ``self`` and eagle heads borrow.

    ``dtype`` ``auto`` gives an EAGLE head bfloat16 where the hardware has it, else int8
    linear layers where the CPU has x86's int8 kernels (``draft_weights``); a draft model
    keeps the target's own dtype, so that ``self`` reproduces the target exactly. ``device``
    is cpu, cuda, cuda:N or auto (``starhub.models.devices``).
    """
    if kind == "eagle":
        # deferred: transformers load only when this runs
        from starhub.drafters.eagle import EagleDrafter
        from starhub.models.loading import draft_weights

        device = resolve_device(device)
        weights = draft_weights(dtype, device)
        return EagleDrafter.load(draft, model, dtype=weights.dtype, device=device,
                                 int8=weights.int8)
    if kind == "ngram":
        return NgramDrafter()
    if kind == "model":
        # deferred: transformers load only when this runs
        from starhub.drafters.model import ModelDrafter
        from starhub.models.loading import load_model

        if dtype == "int8":
            raise ValueError("--draft-dtype int8 is for an EAGLE head; a draft model keeps a "
                             "floating-point dtype")
        source, layers = parse_draft(draft or "self:layers=8")
        spec = model if source == "self" else source
        draft_model, tokenizer = load_model(spec, dtype=dtype, layers=layers, device=device)
        return ModelDrafter(draft_model, tokenizer, label=draft)
    raise ValueError(f"unknown drafter '{kind}'; choose from {', '.join(DRAFTERS)}")
