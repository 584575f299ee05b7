"""The messages between the hub and its drafting process (``starhub.hub.drafting_process``).

They are the wire's kind of message (``starhub.wire.messages.Framed``): msgspec Structs in
a tagged union, a msgpack header with each array in a raw frame of its own, nothing
pickled. The hub sends jobs (``Draft``, ``More``, ``Predraft``) and control (``Stop``,
``Quit``); each carries the sessions the child may forget. The child answers with
``Ready`` or ``Failed`` once, then ``Done`` per drafted tree and ``End`` per batch, or
``Predrafted``. On a socket of its own, a thread of the child sends a ``Beat`` every so
often, whatever its drafting is doing.
"""

from __future__ import annotations

import msgspec
import numpy as np

from starhub.drafters.base import TargetNeeds, TreeShape
from starhub.wire.codec import Decoder, Limits
from starhub.wire.messages import Framed, describe
from starhub.wire.tree import DraftTree

LINK_LIMITS = Limits(max_message_bytes=1 << 40)
"""The link joins two processes of one hub: no peer to bound, only the codec's checks."""
MAX_LINK_ARRAYS = 1 << 16


class SessionJob(msgspec.Struct, forbid_unknown_fields=True):
    """One job: its session (``sid``), what the session gained since the child last heard
    of it (``tokens``; the next ``features`` arrays of the message), and the tree to draw.
    ``temperature``, ``seed`` and ``probe`` set up a session the child does not hold yet."""

    sid: int
    tokens: np.ndarray
    features: int
    shape: TreeShape
    temperature: float = 0.0
    seed: int | None = None
    probe: bool = False


# -- the hub to its drafting process ---------------------------------------------------------

class ToChild(Framed):
    forget: list[int] = msgspec.field(default_factory=list)
    """Sessions the hub has let go of."""


class Jobs(ToChild):
    jobs: list[SessionJob] = msgspec.field(default_factory=list)
    features: list[np.ndarray] = msgspec.field(default_factory=list)
    """The jobs' new feature rows, job after job."""


class Draft(Jobs, tag="DRAFT"):
    """Draft these jobs as one batch; ``admit``: take ``More`` between tree layers."""

    batch: int = 0
    admit: bool = False


class More(Jobs, tag="MORE"):
    """Jobs for batch ``batch`` if it is still running (else only the sessions' news)."""

    batch: int = 0


class Predraft(Jobs, tag="PREDRAFT", kw_only=True):
    """Draft the likely next trees of the one job, whose round in flight drafted ``tree``."""

    tree: DraftTree


class Stop(ToChild, tag="STOP"):
    """Stop pre-drafting."""


class Quit(ToChild, tag="QUIT"):
    pass


# -- the drafting process to the hub ---------------------------------------------------------

class Ready(Framed, tag="READY"):
    """The drafter loaded: what the hub's ``RemoteDrafter`` takes on from it."""

    name: str = ""
    label: str = ""
    weights: str = "none"
    feature_layers: list[int] = msgspec.field(default_factory=list)
    feature_size: int = 0
    lookup_branches: bool = True
    calibrated: bool = False
    batches: bool = False
    predrafts: bool = False
    needs: TargetNeeds = msgspec.field(default_factory=TargetNeeds)


class Failed(Framed, tag="FAILED"):
    error: str = ""


class Done(Framed, tag="DONE"):
    """Job ``k`` of the batch: its tree, or ``error``."""

    k: int = 0
    seconds: float = 0.0
    shared: float = 0.0
    tree: DraftTree | None = None
    error: str = ""


class End(Framed, tag="END"):
    """The batch ended, with ``admitted`` jobs in all; ``error``: it failed."""

    admitted: int = 0
    error: str = ""


class Predrafted(Framed, tag="PREDRAFTED"):
    """The pre-drafted trees, each keyed by the outcome it assumes."""

    trees: list[tuple[list[int], DraftTree]] = msgspec.field(default_factory=list)
    error: str = ""


class Beat(Framed, tag="BEAT"):
    """The child is alive at ``at`` (``time.monotonic()``: one machine, one clock);
    ``gap``: seconds since its previous beat."""

    at: float = 0.0
    gap: float = 0.0


TO_CHILD = (Draft, More, Predraft, Stop, Quit)
TO_HUB = (Ready, Failed, Done, End, Predrafted)
describe(*TO_CHILD, *TO_HUB, Beat)
CHILD_DECODER = Decoder(TO_CHILD, max_arrays=MAX_LINK_ARRAYS)
HUB_DECODER = Decoder(TO_HUB, max_arrays=MAX_LINK_ARRAYS)
BEAT_DECODER = Decoder((Beat,), max_arrays=0)


def owned(tree: DraftTree) -> DraftTree:
    """A received tree with arrays of its own (received ones are read-only views)."""
    return DraftTree(*(None if a is None else np.array(a) for a in
                       (tree.tokens, tree.parents, tree.dist_ids, tree.dist_probs)))
