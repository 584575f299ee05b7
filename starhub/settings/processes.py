"""The settings of each starhub process, one model per process, each field once: its type
and bounds (``starhub.options``), its default and its help.

``starhub <command> --help`` lists them (``starhub.settings.cli``), a launch file's tables
hold them (``starhub.launch.config``), and the process runs on the validated object.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated as A
from typing import ClassVar

from pydantic import Field

from starhub.options import (
    AUTO,
    DEFAULT_DEPTH,
    DEFAULT_DEVICE,
    DEFAULT_DRAFT_PROCESS,
    DEFAULT_LOOKUP,
    DEFAULT_PREDRAFT,
    DEFAULT_PRUNE,
    DEFAULT_SHAPE,
    DEFAULT_THREADS,
    MAX_AUTO_DEPTH,
    AutoOnOff,
    Budget,
    Count,
    Device,
    DraftDtype,
    Drafter,
    Dtype,
    Linear,
    MessageMb,
    Port,
    Positive,
    Schedule,
    Seconds,
    Seed,
    Shard,
    SharedCores,
    Speculate,
    Temperature,
    Threads,
    TokS,
    TopP,
    Tree,
    Ttl,
    auto_or,
)
from starhub.settings.base import Flag, Settings

DEMO_PROMPTS = Path(__file__).resolve().parents[2] / "scripts" / "prompts" / "demo.jsonl"
KEYS_HELP = ("made on first use in $STARHUB_KEYS, else $XDG_RUNTIME_DIR/starhub, else "
             "~/.cache/starhub/keys")
SECURITY = "security"
SERVER_SECURITY = (SECURITY, "CURVE encrypts every connection and admits only clients whose "
                   "public certificate is in --curve-allow. Without keys, this user's local "
                   f"keys are used ({KEYS_HELP}) and only loopback addresses are served (make "
                   "keys with `starhub keys generate DIR NAME`)")
CLIENT_SECURITY = (SECURITY, "both files, or neither: then this user's local keys, which a "
                   "server started without keys on this host uses")
MODEL_HELP = ("'default' (the embedded SmolLM2-135M-Instruct), a model folder, a .gguf file, "
              "or a model id already in the local Hugging Face cache")
PROMPTS_HELP = 'JSONL: {"id", "prompt"} or MT-Bench {"question_id", "turns"}'


# --- pieces several processes share ----------------------------------------------------

class ServerKeys(Settings):
    curve_secret: A[str | None, Flag(metavar="FILE")] = Field(
        None, description="this server's secret certificate (NAME.key_secret)")
    curve_allow: A[str | None, Flag(metavar="DIR")] = Field(
        None, description="folder of the allowed clients' public certificates (NAME.key), "
                          "read at start")
    insecure: A[bool, Flag(switch=True)] = Field(
        False, description="serve without CURVE (its clients pass --insecure too), on any "
                           "address (logs a warning off loopback): anyone who reaches it can "
                           "read prompts and send messages")
    SECTION: ClassVar = SERVER_SECURITY


class ClientKeys(Settings):
    curve_secret: A[str | None, Flag(metavar="FILE")] = Field(
        None, description="this client's secret certificate (NAME.key_secret); its NAME.key "
                          "must be in the server's --curve-allow folder")
    curve_server: A[str | None, Flag(metavar="FILE[,FILE...]")] = Field(
        None, description="the server's public certificate (its NAME.key). For a pool of "
                          "hubs: one certificate that every hub holds, or one per hub, "
                          "comma-separated, in the order of the hubs' addresses (--hub A,B; "
                          "in a launch file, [[hubs]] order), so that each hub keeps its own "
                          "key pair")
    insecure: A[bool, Flag(switch=True)] = Field(
        False, description="the server runs --insecure: connect without CURVE")
    SECTION: ClassVar = CLIENT_SECURITY


class Limits(Settings):
    """What a peer may make a server hold (``starhub.server.limits.SessionLimits``)."""

    SECTION: ClassVar = ("limits", "what the peers may make this server hold")

    max_sessions: Positive = Field(1024, description="sessions open at once, over all peers; "
                                                     "past it OPEN gets ERROR (REJECTED)")
    max_sessions_per_peer: Positive = Field(64, description="sessions one peer may hold at "
                                                            "once")
    max_prompt_tokens: Positive = Field(32768, description="the longest prompt an OPEN may "
                                                           "carry; longer ones get ERROR "
                                                           "(TOO_LARGE)")
    max_session_tokens: Positive = Field(65536, description="the most tokens one session may "
                                                            "grow to, prompt included")
    max_cache_mb: Positive = Field(
        2048, description="MiB held for sessions over all peers: each token at the server's "
                          "price for it (ids, KV caches) plus its features at their real "
                          "size. Each peer may hold a fair share; past it, or past the cap, "
                          "OPEN, PROPOSE and COMMIT get ERROR (REJECTED)")
    max_peers: Positive = Field(1024, description="peers (connections that sent their card) "
                                                  "known at once; past it the one idle the "
                                                  "longest is forgotten, and with none idle "
                                                  "the card gets REJECTED")

    def limit_values(self) -> dict[str, int]:
        """These settings as ``SessionLimits`` takes them."""
        return {name: getattr(self, name) for name in Limits.model_fields}

    @classmethod
    def default_limits(cls) -> dict[str, int]:
        """This process's limits when none is given."""
        return {name: cls.model_fields[name].default for name in Limits.model_fields}


class TreeFields(Settings):
    """The drafter and its trees, as ``starhub hub`` takes them."""

    SECTION: ClassVar = ("drafting", "the drafter and the trees it drafts")

    drafter: Drafter = Field(Drafter.EAGLE, description="eagle: a trained EAGLE head over the "
                             "target's features; ngram: prompt lookup, no model; model: an "
                             "independent causal LM")
    draft: str | None = Field(
        None, description="eagle: a head folder (default: the head shipped for the embedded "
                          "model). model: 'self' (the target's weights; every token is "
                          "accepted, for tests), 'self:layers=K' (its first K layers; the "
                          "default), or a model spec with the target's tokenizer")
    depth: auto_or(Tree) = Field(
        DEFAULT_DEPTH, description="'auto' (default): the hub picks each session's depth "
        f"every round, up to {MAX_AUTO_DEPTH}, for the most tokens per second given its "
        "measured acceptance, its target's verify cost and the hub's load, and lets a "
        "session that no tree speeds up decode plainly (re-probing it now and then). A "
        "number fixes the tree layers drafted per round (fewer when no deeper node could "
        "make the budget)")
    topk: Tree = Field(DEFAULT_SHAPE.topk, description="paths expanded per layer, and children "
                                                       "per expanded node")
    max_nodes: Tree = Field(
        DEFAULT_SHAPE.max_nodes, description="node budget of a tree. The defaults suit a "
        "small CPU target, where a 10-node tree verifies for about 1.4 one-token steps. On "
        "GPUs, where dozens of nodes verify for about the price of one, larger trees pay "
        "(EAGLE-2 uses --depth 6 --topk 10 --max-nodes 60)")
    draft_dtype: DraftDtype = Field(
        DraftDtype.AUTO, description="the drafter's weights (drafts may differ, output never "
        "does). auto: for an EAGLE head, bfloat16 where the hardware multiplies bf16 "
        "natively, else int8 where the CPU has int8 kernels (x86: float32 activations, int8 "
        "weights per output channel; twice as fast as float32 on an AVX2 CPU, nearly the "
        "same acceptance), else the target's dtype")


def device_field(what: str) -> object:
    return Field(DEFAULT_DEVICE, description=f"where {what} runs: cpu, cuda (the first "
                 "visible GPU), cuda:N, or auto (default: cuda where a GPU is visible, else "
                 "cpu). On a GPU the weights default to bfloat16; tensors cross to the CPU "
                 "only at the wire")


class WeightFields(Settings):
    """The target model's weights and where they live."""

    SECTION: ClassVar = ("weights", "the target model's weights and where it runs")

    dtype: Dtype = Field(Dtype.AUTO, description="the target's weights. auto: float32 on CPU, "
                         "where greedy output then matches generate() token for token; bfloat16 "
                         "on GPU. On CPUs with AVX512-BF16 or AMX, bfloat16 verifies a tree "
                         "for little more than the cost of one token")
    linear: Linear = Field(Linear.AUTO, description="the target's matrix-multiply kernel. "
                           "auto: oneDNN on CPU, for float32 and, where the CPU has it "
                           "natively, bfloat16 (weights prepacked at load; faster than "
                           "PyTorch's default for the few-row products of verification), "
                           "plus the plain weights for one-row products where a timing at "
                           "load finds PyTorch's faster on this CPU; torch otherwise")
    device: Device = device_field("the target model")
    device_map: A[str | None, Flag(metavar="auto|I,J,...")] = Field(
        None, description="spread a target too large for one GPU over several with "
                          "accelerate: 'auto' uses every visible GPU, '0,1' only those. "
                          "Replaces --device")
    compile: bool = Field(
        False, description="run the target's MLPs under torch.compile (inductor; the linears "
        "as torch runs them, never oneDNN's). Output never changes; the first passes wait "
        "for the compiler (seconds to a minute). Off by default: on the CPUs measured it was "
        "slower than the default oneDNN linears (docs/benchmarks.md)")


class SamplingFields(Settings):
    SECTION: ClassVar = ("sampling", "how every prompt is decoded")
    max_new_tokens: Positive = 128
    temperature: Temperature = Field(0.0, description="0 decodes greedily")
    top_p: TopP = 1.0
    seed: Seed = 0


CHAT_TEMPLATE = Field(True, description="off (--no-chat-template): tokenize prompts as plain "
                                        "text instead of the model's chat template")
ChatTemplate = A[bool, Flag(name="--no-chat-template", switch=True)]
HUB_TIMEOUT = ("seconds a hub reply may take at least: past max(this, 10x the typical round "
               "trip) the hub counts as gone; ")


class SharedCoresField(Settings):
    shared_cores: SharedCores = Field(
        SharedCores.AUTO, description="whether this target computes on its hub's CPU cores. "
        "auto (default): when the hub runs on this host and may use some of this process's "
        "CPUs (from its card). Shared, plain steps are timed by CPU time, so that the hub's "
        "drafting counts against trees and never makes plain decoding look slower than it "
        "is")


# --- the processes ---------------------------------------------------------------------

DRAFTER_KEYS = ("drafter", "draft", "model", "draft_dtype", "device")
"""The settings that pick and load a drafter (``starhub.drafters.make_drafter``)."""


def weight_args(settings: Settings) -> dict:
    """``load_model``'s arguments from the settings of a process that holds the target."""
    s = settings
    return {"spec": s.model, "dtype": str(s.dtype), "linear": str(s.linear),
            "device": s.device, "device_map": s.device_map, "compile": s.compile}


def drafter_args(settings: Settings) -> dict:
    """``make_drafter``'s arguments from the settings of a process that drafts."""
    s = settings
    return {"kind": str(s.drafter), "draft": s.draft, "model": s.model,
            "dtype": str(s.draft_dtype), "device": s.device}


class HubSettings(ServerKeys, Limits, TreeFields):
    """``starhub hub``: serve drafts to targets."""

    PROCESS: ClassVar[str] = "HUB"
    bind: str = Field("tcp://127.0.0.1:5555",
                      description="ZeroMQ address to bind (port 0 picks a free one)")
    model: str = Field("default", description="the targets' model, used by --draft self "
                                              "('default' is the embedded "
                                              "SmolLM2-135M-Instruct)")
    threads: Threads = Field(1, description="torch threads for drafting. A head pass is a few "
                             "small matrix products; a second thread saves little and, on a "
                             "machine the hub shares with targets, takes cores from them "
                             "(0: torch's own choice; auto: every usable core)")
    device: Device = device_field("the drafter")
    ttl: Ttl = Field(120.0, description="seconds without messages after which a session is "
                                        "released")
    max_targets: auto_or(Count) = Field(
        0, description="admission. auto: admit a target only while every admitted target "
        "stays at or above its own standalone speed (the load model's N_max); N: at most N "
        "targets; 0: no limit. A rejected target decodes on its own and asks again later")
    batch: auto_or(Positive) = Field(
        AUTO, description="requests drafted together, one pass per tree layer for all of "
        "them. auto (default): every request waiting when the drafter frees up (never waits "
        "for more); 1: one at a time")
    predraft: bool = Field(
        DEFAULT_PREDRAFT, description="on: while a target verifies and no request waits, "
        "draft its next tree for the likeliest outcomes of its round, so a matching COMMIT "
        "gets its PROPOSE at once (greedy sessions; output never changes). Off by default: "
        "with the shipped head too few guesses hit to pay")
    lookup: bool = Field(
        DEFAULT_LOOKUP, description="on (default): graft onto each greedy session's tree what "
        "followed the latest earlier occurrence of its last 2-4 tokens (prompt lookup), one "
        "branch of at most --depth tokens, where the tree lacks it. Pays where answers copy "
        "from their prompt: passages, code")
    prune: bool = Field(
        DEFAULT_PRUNE, description="on (default): a greedy tree leaves out the nodes whose "
        "draft probability is below what they cost, each round: the target's measured verify "
        "time per node over its round, times the tokens a round commits. A node is accepted "
        "about as often as that probability says, so on a CPU target, where a node costs "
        "about a twentieth of a step, the unlikely ones slow it; on a GPU almost none are "
        "left out. EAGLE drafter only (its probabilities were measured to track acceptance). "
        "Output never changes")
    draft_process: AutoOnOff = Field(
        DEFAULT_DRAFT_PROCESS, description="on: draft in a process of its own, so that "
        "drafting never waits on the hub's message handling (in one process the two share "
        "one interpreter lock, which cost batched drafting about a fifth of its rounds at 8 "
        "targets); off: draft in a thread of the hub's process; auto (default): on for the "
        "eagle drafter, off for the ngram and model drafters, which do not batch")
    max_message_mb: MessageMb = Field(64.0, description="larger messages are refused with an "
                                                        "ERROR")
    metrics_port: Port = Field(0, description="serve Prometheus metrics on "
                                              "127.0.0.1:PORT/metrics (0: off)")


class TargetSettings(ClientKeys, SharedCoresField, WeightFields, SamplingFields):
    """``starhub target``: decode a prompt file with drafts from a hub."""

    PROCESS: ClassVar[str] = "TARGET"
    hub: str | None = Field(None, description="hub address, e.g. tcp://127.0.0.1:5555, or a "
                            "pool's addresses separated by commas: sessions open on the hub "
                            "that offers the most, and move when it dies or drains (omit to "
                            "decode alone)")
    model: str = Field("default", description=MODEL_HELP)
    prompts: str = Field(description=PROMPTS_HELP)
    out: str = Field(description="JSONL output")
    threads: Threads = Field(
        DEFAULT_THREADS, description="torch threads for this target. auto (default): every "
        "core this process may use (the hub drafts while the target waits, so they take "
        "turns). Several targets on one machine should split the cores, as `demo`, `bench` "
        "and `launch` do")
    chat_template: ChatTemplate = CHAT_TEMPLATE
    name: str | None = Field(None, description="name shown by the hub and progress bar "
                                               "(default: targetI, I from --shard)")
    shard: A[Shard, Flag(metavar="I/N")] = Field(
        (0, 1), description="I/N: take every N-th prompt starting at I (to split across "
                            "targets)")
    hub_timeout: Seconds = Field(3.0, description=HUB_TIMEOUT + "the target finishes on its "
                                 "own and reconnects in the background")


class ServeSettings(ClientKeys, SharedCoresField, WeightFields):
    """``starhub serve``: an OpenAI-compatible HTTP server for a target."""

    PROCESS: ClassVar[str] = "SERVE"
    hub: str | None = Field(None, description="hub address, e.g. tcp://127.0.0.1:5555, or a "
                            "pool's addresses separated by commas: sessions open on the hub "
                            "that offers the most, and move when it dies or drains (omit to "
                            "serve without drafts)")
    model: str = Field("default", description=MODEL_HELP)
    served_model_name: str | None = Field(
        None, description="the name requests give as 'model' (default: the model's own name)")
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 for every "
                                               "interface)")
    port: Port = Field(8000, description="HTTP port (0 picks a free one)")
    allowed_hosts: str | None = Field(
        None, description="comma-separated names the Host header may give, '*' for any "
        "(default: localhost and the --host address; any when --host listens on every "
        "interface). Other hosts get a 400: a web page cannot reach a loopback server by a "
        "name it controls")
    threads: Threads = Field(DEFAULT_THREADS, description="torch threads of the model. auto "
                             "(default): every core this process may use")
    max_concurrency: Positive = Field(16, description="requests in flight at once; past it, "
                                                      "429 with Retry-After")
    prefill_chunk: Count = Field(
        0, description="prompt tokens per prefill pass; each pass pauses between layers "
        "for the other requests' passes, so a long prompt holds them up by about one layer. "
        "0 (default): 256")
    speculate: Speculate = Field(
        Speculate.AUTO, description="auto (default): a request that would decode alone uses "
        "the hub, whose control plane judges each round; one that joins other requests uses "
        "the hub's trees only while they serve the batch faster than plain batched decoding, "
        "as measured on this server's own passes; always: every request uses the hub while "
        "one is connected")
    name: str = Field("serve", description="this target's name at the hub")
    hub_timeout: Seconds = Field(3.0, description=HUB_TIMEOUT + "requests go on alone and the "
                                 "server reconnects in the background")
    chat_template: ChatTemplate = Field(True, description="off (--no-chat-template): join chat "
                                        "messages as plain text instead of the model's "
                                        "template")


class GenerateSettings(WeightFields, SamplingFields, TreeFields):
    """``starhub generate``: one prompt through a local hub and target."""

    PROCESS: ClassVar[str] = "GENERATE"
    prompt: A[str, Flag(positional=True)] = Field(description="the prompt")
    model: str = Field("default", description=MODEL_HELP)
    threads: Threads = Field(DEFAULT_THREADS, description="torch threads of the target (this "
                             "process). auto (default): every core it may use; the hub it "
                             "starts drafts with 1")
    chat_template: ChatTemplate = CHAT_TEMPLATE


class DemoSettings(WeightFields, TreeFields):
    """``starhub demo``: targets sharing one hub, against plain generate()."""

    PROCESS: ClassVar[str] = "DEMO"
    model: str = Field("default", description=MODEL_HELP)
    prompts: str = Field(str(DEMO_PROMPTS), description="JSONL prompt file (default: the 8 "
                                                        "shipped demo prompts)")
    max_new_tokens: Positive = 48
    targets: Positive = Field(2, description="target processes; prompt i goes to target i "
                                             "mod N")
    threads: Threads = Field(DEFAULT_THREADS, description="torch threads of each target and of "
                             "the generate() it is compared with. auto (default): the usable "
                             "cores split evenly between the targets")


class VerifierSettings(ServerKeys, Limits, WeightFields):
    """``starhub verifier``: the edge topology's server, holding the target."""

    PROCESS: ClassVar[str] = "VERIFIER"
    bind: str = Field("tcp://127.0.0.1:5556",
                      description="ZeroMQ address to bind (port 0 picks a free one)")
    model: str = Field("default", description=MODEL_HELP)
    budget: auto_or(Budget) = Field(
        AUTO, description="tokens one forward pass may feed, summed over its sessions (C): "
        "each session's tree nodes plus one. auto (default): the most a pass feeds for about "
        "the price of one token, measured at start (about 16 on a small CPU, hundreds on a "
        "GPU)")
    max_batch: auto_or(Positive) = Field(
        AUTO, description="sessions per forward pass. auto (default): as many as the budget "
                          "holds; 1 verifies one session at a time")
    schedule: Schedule = Field(
        Schedule.GOODSPEED, description="goodspeed (default): split the budget into "
        "per-drafter tree sizes for proportional fairness (GoodSpeed), so that every waiting "
        "drafter fits one pass. fifo: arrival order, every drafter --nodes nodes. slo: "
        "sessions that ask for a speed are served by deadline (WISP). random: random tree "
        "sizes, a baseline for comparisons")
    nodes: Tree = Field(DEFAULT_SHAPE.max_nodes, description="tree nodes a session may draft "
                                                             "at first, and always under fifo")
    max_nodes: Tree = Field(32, description="the most nodes goodspeed grants one tree; larger "
                                            "trees are refused")
    max_depth: Tree = Field(16, description="deeper trees are refused with an ERROR "
                                            "(TOO_LARGE)")
    max_message_mb: MessageMb = Field(64.0, description="larger messages are refused with an "
                                                        "ERROR")
    max_sessions: Positive = Field(256, description="sessions open at once, over all peers; "
                                                    "past it OPEN gets ERROR (REJECTED)")
    max_cache_mb: Positive = Field(
        12288, description="MiB held for sessions over all peers: each token at the "
        "verifier's price for it (a full target KV cache, about 46 kB a token for the "
        "embedded model in float32) plus its features. Each peer may hold a fair share; past "
        "it, or past the cap, OPEN, PROPOSE and COMMIT get ERROR (REJECTED)")
    ttl: Ttl = Field(120.0, description="seconds without messages after which a session is "
                                        "released")
    threads: Threads = Field(DEFAULT_THREADS, description="torch threads for verification. auto "
                             "(default): every core this process may use; the verifier is "
                             "the one shared server")


class DrafterSettings(ClientKeys, SamplingFields):
    """``starhub drafter``: the edge topology's client, drafting for a prompt file."""

    PROCESS: ClassVar[str] = "DRAFTER"
    verifier: str = Field(description="verifier address, e.g. tcp://127.0.0.1:5556")
    model: str = Field("default", description="the verifier's target model, for the "
                       "tokenizer, end-of-sequence ids and (model and eagle drafters) the "
                       "weights a draft borrows")
    drafter: Drafter = Field(Drafter.EAGLE, description=TreeFields.model_fields["drafter"]
                             .description)
    draft: str | None = Field(None, description="eagle: a head folder (default: the shipped "
                              "head). model: 'self:layers=K' (default 8) or a model spec")
    draft_dtype: DraftDtype = Field(DraftDtype.AUTO, description="the drafter's weights "
                                    "(drafts may differ, output never does)")
    device: Device = device_field("the drafter")
    depth: Tree = Field(DEFAULT_SHAPE.depth, description="tree layers drafted per round")
    topk: Tree = Field(DEFAULT_SHAPE.topk, description="paths expanded per layer")
    max_nodes: Tree = Field(DEFAULT_SHAPE.max_nodes, description="nodes of a session's first "
                            "tree where the verifier names none; trees follow the verifier's "
                            "budget")
    prompts: str = Field(description=PROMPTS_HELP)
    out: str = Field(description="JSONL output, as `starhub target` writes")
    target_tok_s: TokS = Field(0.0, description="the speed to ask the verifier for (its slo "
                                                "schedule serves by it)")
    timeout: Seconds = Field(30.0, description="seconds to wait for a reply before "
                                               "reconnecting")
    retries: Count = Field(3, description="reconnections (with doubling backoff) before a "
                                          "request fails")
    threads: Threads = Field(DEFAULT_THREADS, description="torch threads for drafting. auto "
                             "(default): every core this process may use, as on a device of "
                             "its own; give 1 to drafters that share a host")
    name: str | None = Field(None, description="name shown by the verifier (default: drafterI, "
                                               "I from --shard)")
    shard: A[Shard, Flag(metavar="I/N")] = Field((0, 1), description="I/N: take every N-th "
                                                 "prompt starting at I")
    chat_template: ChatTemplate = CHAT_TEMPLATE


PROCESSES: dict[str, type[Settings]] = {
    "hub": HubSettings, "target": TargetSettings, "serve": ServeSettings,
    "verifier": VerifierSettings, "drafter": DrafterSettings,
    "generate": GenerateSettings, "demo": DemoSettings}
"""Each ``starhub`` command that runs a process, and its settings."""
