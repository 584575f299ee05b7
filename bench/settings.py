"""``starhub bench``'s settings. The comparison options (``--depth 2,4,auto``, ...) are comma
lists of a process's own setting, each value read by that setting's type (``hub_value``),
so that the bench refuses what ``starhub hub`` refuses, with the same words."""

from __future__ import annotations

from typing import Annotated as A
from typing import Any, ClassVar

from pydantic import Field, ValidationError

from bench.defaults import BASELINES, DEFAULT_PROMPTS, DEFAULT_REPLAY_PROMPTS
from starhub.options import (
    DEFAULT_DRAFT_PROCESS,
    DEFAULT_LOOKUP,
    DEFAULT_PREDRAFT,
    DEFAULT_PRUNE,
    DEFAULT_THREADS,
    Amount,
    Choice,
    Count,
    DraftDtype,
    Dtype,
    Linear,
    Port,
    Positive,
    Rate,
    Seconds,
    Speculate,
    Threads,
    Tree,
)
from starhub.settings.base import Flag, Settings, explain, field_value
from starhub.settings.processes import HubSettings

SERVE_TARGETS = 2
SERVE_REQUESTS = 30


def _on(value: bool) -> str:
    return "on" if value else "off"


def hub_value(name: str):
    """A reader of one value of ``starhub hub``'s setting ``name``, as its flag reads it."""
    return setting_value(HubSettings, name)


def setting_value(model: type[Settings], name: str):
    def read(text: str) -> Any:
        try:
            return field_value(model, name, text, typed=False)
        except ValidationError as exc:
            raise ValueError(explain(exc, lambda loc: "").lstrip(": ")) from None

    return read


def rate(text: str) -> float:
    return setting_value(ServeRate, "rate")(text)


class ServeRate(Settings):
    rate: Rate


class Topology(Choice):
    STAR = "star"
    EDGE = "edge"


def _comma(what: str) -> str:
    return (f"comma list of the hub's --{what}; each value gets its own star or hub-load row "
            "for every N")


LOAD = ("hub load", "--hub-load: a real hub and drafter, and N replay clients that compute "
        "nothing: they answer each PROPOSE from a recorded greedy run of --model (recorded "
        "once, then cached), at once or after --emulate t_v=TIME. One row per N and "
        "combination of --depth, --max-targets, --batch, --predraft, --lookup, --prune and "
        "--draft-process")
EDGE = ("edge topology", "--topology edge: one verifier and N drafters instead of one hub "
        "and N targets; one row per combination of --drafters, --schedule and --max-batch")
SERVE = ("serving", "--serve: N `starhub serve` processes sharing one hub (star) against the "
         "same N servers without a hub (plain), driven open-loop by seeded Poisson arrivals "
         "at each --rate, streamed by the openai client; one row per mode and rate, every "
         "output checked against the plain rows' and generate()'s. The hub runs its defaults "
         "unless a hub flag (--drafter, --depth, ...) is given, one value each")


class BenchSettings(Settings):
    """``starhub bench``."""

    PROCESS: ClassVar[str] = "BENCH"
    targets: str | None = Field(None, description="comma-separated values of N (default "
                                "1,2,3,4,6,8; --serve: one N, default 2)")
    model: str = Field("default", description="the targets' model")
    drafter: str | None = Field(None, description="the hub's drafter (default: the hub's)")
    draft: str | None = Field(
        None, description="comma list of drafter weights, as for `starhub hub` (e.g. two "
        "EAGLE heads); each value gets its own star rows, the colocated baseline uses the "
        "first")
    depth: str | None = Field(
        None, description="comma list of tree depths or 'auto' (e.g. 2,4,6,auto); each value "
        "gets its own star row for every N, measured in the same run (default: the hub's; "
        "emulation: the spec's depth=)")
    max_targets: str | None = Field(
        None, description="comma list of the hub's admission setting (0, N or auto); each "
        "value gets its own star row for every N (default 0)")
    batch: str | None = Field(None, description=_comma("batch") + " (default: auto)")
    predraft: str | None = Field(None, description=_comma("predraft") + " (default: "
                                 f"{_on(DEFAULT_PREDRAFT)}, as `starhub hub`)")
    lookup: str | None = Field(None, description=_comma("lookup") + " (default: "
                               f"{_on(DEFAULT_LOOKUP)}, as `starhub hub`)")
    prune: str | None = Field(None, description=_comma("prune") + " (default: "
                              f"{_on(DEFAULT_PRUNE)}, as `starhub hub`)")
    draft_process: str | None = Field(None, description=_comma("draft-process") + " "
                                      f"(default: {DEFAULT_DRAFT_PROCESS}, as `starhub hub`)")
    topk: str | None = Field(None, description=_comma("topk") + " (default: the hub's)")
    max_nodes: str | None = Field(None, description=_comma("max-nodes") + ", the tree's node "
                                  "budget (e.g. 10,16,24) (default: the hub's)")
    draft_dtype: DraftDtype | None = Field(None, description="the hub's drafter weights, as "
                                           "for `starhub hub` (the colocated baseline uses "
                                           "the same; default: the hub's)")
    dtype: Dtype = Field(Dtype.AUTO, description="weights of the targets and of every "
                         "baseline. auto is float32 on CPU; with bfloat16, tree verification "
                         "rounds differently from generate()'s one-token steps, so the "
                         "lossless column may read False")
    linear: Linear = Field(Linear.AUTO, description="matrix-multiply kernel of the targets and "
                           "of every baseline, as for `starhub target`")
    prompts: str | None = Field(None, description=f"JSONL prompt file (default "
                                f"{DEFAULT_PROMPTS.name}; --hub-load: "
                                f"{DEFAULT_REPLAY_PROMPTS.name})")
    max_new_tokens: Positive | None = Field(None, description="per prompt (default 64); "
                                            "emulated sessions default to 512, --hub-load "
                                            "recordings to 128")
    threads: Threads = Field(DEFAULT_THREADS, description="torch threads of each target and "
                             "of the baselines. auto (default): the usable cores split evenly "
                             "between a row's N targets; the baselines, one process, get them "
                             "all (the bench prints the counts)")
    hub_threads: Count = Field(1, description="torch threads of the hub, as for `starhub hub "
                                              "--threads`")
    baselines: str = Field(",".join(BASELINES), description="comma-separated subset of "
                           "hf-generate, hf-prompt-lookup, colocated ('' for none)")
    json_out: A[str | None, Flag(name="--json")] = Field(None, description="write the results "
                                                                            "here")
    plot: str | None = Field(None, description="write a PNG like StarSD's Figure 5")
    markdown: str | None = Field(None, description="write the table as Markdown")
    emulate: A[str | None, Flag(metavar="SPEC")] = Field(
        None, description="e.g. t_s=1.4ms,t_v=25ms,t_c=1ms,beta=0.8,depth=6; add "
                          "trace=RUN.json to replay a real run's accepted lengths instead of "
                          "beta")
    duration: Seconds = Field(3.0, description="emulation and --hub-load: measured seconds "
                              "per row (emulation: longer where N is large)")
    warmup: Amount = Field(1.0, description="emulation and --hub-load: unmeasured seconds "
                                            "first")
    emulate_procs: Positive = Field(1, description="emulation: processes the targets are "
                                                   "spread over")
    hubs: str | None = Field(
        None, description="emulation: comma-separated hub counts H (e.g. 1,2,4): each N "
        "targets over H emulated hubs of the spec, each target choosing its hub by the hubs' "
        "admission offers as a real target given a pool does, and again at random (H > 1) for "
        "comparison; one row per N, H and placement. A real pool: `starhub launch`")
    metrics_port: Port = Field(0, description="emulation: the hub serves Prometheus text on "
                                              "this port")
    log_dir: str | None = Field(None, description="hub and target logs (default: a temp dir)")
    progress: A[bool, Flag(name="--no-progress", switch=True)] = Field(
        True, description="off (--no-progress): no progress bars")


class HubLoadSettings(Settings):
    SECTION: ClassVar = LOAD
    hub_load: A[bool, Flag(switch=True)] = Field(False, description="run the hub-load bench")
    repeat: A[Positive, Flag(metavar="R")] = Field(
        1, description="--hub-load and --serve: run every row R times, all rows and then all "
        "again, and show each row's median run (by r_q, or by output_tok_s for --serve; "
        "r_q_runs and output_tok_s_runs list them all): on a shared machine a single run can "
        "be far off")
    record_prompts: Positive = Field(8, description="prompts of --prompts to record and "
                                                    "replay")
    replay_cache: str | None = Field(None, description="where recordings are cached (default "
                                     "$XDG_CACHE_HOME/starhub/hub-load)")


class EdgeBenchSettings(Settings):
    SECTION: ClassVar = EDGE
    topology: Topology = Topology.STAR
    drafters: str = Field("4", description="comma list of drafter counts N")
    schedule: str = Field("goodspeed", description="comma list of verifier schedules: fifo, "
                                                   "goodspeed, slo, random")
    max_batch: str = Field("auto", description="comma list of the verifier's sessions per "
                                               "pass (auto or N)")
    budget: str = Field("auto", description="the verifier's tokens per forward pass (C), or "
                        "auto (as `starhub verifier`; emulated: where a pass costs 1.5x one "
                        "token)")
    nodes: Tree | None = Field(None, description="tree nodes per draft (fifo's fixed S_i; "
                                                 "default: --max-nodes)")
    verifier_threads: Threads = Field(
        DEFAULT_THREADS, description="torch threads of the verifier process. auto (default): "
        "every core, as `starhub verifier`; the drafters, standing in for devices of their "
        "own, run at a lower priority")


class ServeBenchSettings(Settings):
    SECTION: ClassVar = SERVE
    serve: A[bool, Flag(switch=True)] = Field(False, description="run the serving bench")
    rate: str = Field("0.5,1,2", description="comma list of request rates: requests per "
                      "second in total, sent round-robin to the N servers")
    concurrency: str | None = Field(
        None, description="comma list of client counts for a closed loop instead of --rate "
        "(as vLLM's --max-concurrency): each client sends its next request when its last "
        "ends; one row per count and mode")
    requests: Positive = Field(SERVE_REQUESTS, description="requests per rate and mode")
    seed: Count = Field(0, description="seed of the arrival times and the prompts drawn")
    slo: str | None = Field(
        None, description="service-level objectives, ttft=MS,tpot=MS[,e2el=MS] (any of "
        "them): each row adds its goodput (requests/s meeting every one) and attainment, and "
        "the run the highest rate each mode sustains (90% attainment). Choose them from what "
        "your users need, or from the plain servers' unloaded figures (a row at a low rate): "
        "e.g. TPOT at 1.5x plain's p50 at rate 0.5")
    max_concurrency: Positive | None = Field(None, description="each server's "
                                             "--max-concurrency (default: the server's)")
    speculate: Speculate = Field(Speculate.AUTO, description="the star servers' --speculate: "
                                 "auto (default) uses the hub only while trees serve a batch "
                                 "faster than plain batching; always uses it for every "
                                 "request")


class Bench(ServeBenchSettings, EdgeBenchSettings, HubLoadSettings, BenchSettings):
    """Every option of ``starhub bench``."""

    PROCESS: ClassVar[str] = "BENCH"
