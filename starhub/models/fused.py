"""A decoder layer's projections that read the same input, as one product.

The query, key and value projections of an attention block all multiply its normed input,
and so do the gate and up projections of a gated MLP. ``fuse_projections`` stacks each
group's weights into one ``nn.Linear`` (``qkv_proj``, ``gate_up_proj``), so a pass runs
one product where it ran three or two: fewer kernel calls, and one longer stream of
weights, which a single row's matrix-vector product reads closer to the memory's speed.
Each output element is the same dot product as before.

The target engine (``targets.forward``) calls the fused layers itself. transformers' own
forward still calls ``q_proj``, ``k_proj``, ``v_proj`` (or ``gate_proj``, ``up_proj``) one
after another on the same input: each is a ``Part`` of the fused layer, and the first to
be called runs the product for all of them; the others take their slices of it, as long
as the input is the same tensor, unchanged. So ``generate()`` and the hub's draft model
pay for one product as well. (A caller that changed the input in place between two parts
would get the first product's slice: transformers' layers do not.)
"""

from __future__ import annotations

import torch

GROUPS = {"self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
          "mlp": ("gate_up_proj", ("gate_proj", "up_proj"))}
"""Per block of a decoder layer: the fused layer's name, and the projections it stacks."""


class FusedLinear(torch.nn.Module):
    """Several linear layers over the same input as one (``joint``), their outputs laid
    side by side in ``sizes``."""

    def __init__(self, linears: list[torch.nn.Linear]):
        super().__init__()
        first = linears[0]
        self.sizes = [lin.out_features for lin in linears]
        self.joint = torch.nn.Linear(first.in_features, sum(self.sizes),
                                     bias=first.bias is not None, device=first.weight.device,
                                     dtype=first.weight.dtype)
        with torch.no_grad():
            self.joint.weight.copy_(torch.cat([lin.weight for lin in linears]))
            if first.bias is not None:
                self.joint.bias.copy_(torch.cat([lin.bias for lin in linears]))
        self._memo: tuple[torch.Tensor, list[torch.Tensor], set[int]] | None = None
        """The last input, its parts, and which parts are still to be taken."""

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each stacked layer's output, as views of one product."""
        return list(self.joint(x).split(self.sizes, dim=-1))

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Stacked layer ``index``'s output for ``x``: from the product a sibling part ran on
        this very input, or a new one. Once every part is taken nothing is held."""
        memo = self._memo
        if memo is None or memo[0] is not x or index not in memo[2]:
            memo = self._memo = (x, self(x), set(range(len(self.sizes))))
        memo[2].discard(index)
        if not memo[2]:
            self._memo = None
        return memo[1][index]


class Part(torch.nn.Module):
    """One stacked layer of a ``FusedLinear``, callable as the ``nn.Linear`` it replaced."""

    def __init__(self, fused: FusedLinear, index: int):
        super().__init__()
        self.index = index
        self.in_features = fused.joint.in_features
        self.out_features = fused.sizes[index]
        self._fused = [fused]  # in a list: registered once, under its block, not per part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0].part(x, self.index)

    def extra_repr(self) -> str:
        return f"part {self.index} of the fused layer, out_features={self.out_features}"


def fuse_projections(model: torch.nn.Module, blocks: tuple[str, ...] = tuple(GROUPS)) -> int:
    """Fuse each decoder layer's groups in ``blocks`` (of ``GROUPS``) whose layers are plain
    ``nn.Linear`` over one input on one device; returns how many groups were fused."""
    fused = 0
    for layer in getattr(getattr(model, "model", None), "layers", []):
        for block_name in blocks:
            name, parts = GROUPS[block_name]
            block = getattr(layer, block_name, None)
            linears = [getattr(block, p, None) for p in parts]
            if block is None or not all(type(lin) is torch.nn.Linear for lin in linears):
                continue
            weights = [lin.weight for lin in linears]
            if (len({lin.in_features for lin in linears}) > 1
                    or len({(w.device, w.dtype) for w in weights}) > 1
                    or len({lin.bias is None for lin in linears}) > 1):
                continue
            group = FusedLinear(linears)
            setattr(block, name, group)
            for i, p in enumerate(parts):
                setattr(block, p, Part(group, i))
            fused += 1
    return fused
