"""``starhub serve`` on the embedded model with a default hub, called by the official
``openai`` client: chat and completions, streamed and not, alone and 8 at once, and a hub
that dies mid-load. Every output is token for token what transformers' generate() gives."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
from openai import OpenAI
from serving import free_port, health, hub_errors, scrape, wait_until

from starhub.launch.spawn import spawn_hub, spawn_serve
from starhub.launch.status import observer_client
from starhub.models.loading import DEFAULT_NAME, load_model
from starhub.models.prompts import encode_prompt
from starhub.wire.messages import StatsQuery
from tests.test_e2e_default_model import PROMPTS

NEW = 40

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model():
    return load_model("default")


@pytest.fixture(scope="module")
def expected(model):
    """generate()'s greedy tokens for each prompt as a chat message."""
    net, tokenizer = model
    out = {}
    for prompt in PROMPTS:
        ids = encode_prompt(tokenizer, prompt)
        out[prompt] = net.generate(torch.tensor([ids]), max_new_tokens=NEW,
                                   do_sample=False)[0, len(ids):].tolist()
    return out


@pytest.fixture(scope="module")
def stack():
    """A hub with its default flags (and metrics), and a server with its defaults."""
    metrics = free_port()
    with spawn_hub(["--metrics-port", str(metrics)]) as hub, \
            spawn_serve(["--hub", hub.address], threads=2) as server:
        yield server.url, f"http://127.0.0.1:{metrics}/metrics"


def chat(api: OpenAI, prompt: str, stream: bool) -> tuple[list[int], str, dict]:
    """(token ids, text, spec_decode) of one greedy chat completion."""
    body = {"model": DEFAULT_NAME, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": NEW, "temperature": 0, "extra_body": {"return_token_ids": True}}
    if not stream:
        reply = api.chat.completions.create(**body)
        extra = reply.choices[0].model_extra
        return extra["token_ids"], reply.choices[0].message.content, reply.model_extra[
            "spec_decode"]
    text, ids, spec = [], None, None
    for chunk in api.chat.completions.create(**body, stream=True):
        choice = chunk.choices[0]
        text.append(choice.delta.content or "")
        if choice.finish_reason:
            ids, spec = choice.model_extra["token_ids"], chunk.model_extra["spec_decode"]
    return ids, "".join(text), spec


def test_chat_and_completions_streamed_or_not_equal_generate(stack, model, expected):
    url, hub_metrics = stack
    _, tokenizer = model
    api = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    before = scrape(hub_metrics)["starhub_rounds_total"]
    # the first request goes to the hub (the gate assumes trees pay until it has measured
    # them); a later one goes where the gate's measurements say, which on some CPUs is
    # rightly plain for one row: its figures must then say so
    specs = []
    for prompt, stream in ((PROMPTS[1], True), (PROMPTS[0], False)):
        ids, text, spec = chat(api, prompt, stream)
        assert ids == expected[prompt]
        assert text == tokenizer.decode(expected[prompt], skip_special_tokens=True)
        if not specs or spec["rounds"]:
            assert spec["rounds"] > 0 and spec["mean_accept_len"] > 1.2, spec
        else:
            assert spec["plain_steps"] == len(ids) - 1 and spec["draft_tokens"] == 0, spec
        specs.append(spec)
    # the hub counts a round at its COMMIT; a request's last round is never committed
    drafted = sum(max(spec["rounds"] - 1, 0) for spec in specs)
    assert drafted > 0 and scrape(hub_metrics)["starhub_rounds_total"] >= before + drafted
    prompt_ids = encode_prompt(tokenizer, PROMPTS[2])
    plain = api.completions.create(model=DEFAULT_NAME, prompt=prompt_ids, max_tokens=NEW,
                                   temperature=0, extra_body={"return_token_ids": True})
    assert plain.choices[0].model_extra["token_ids"] == expected[PROMPTS[2]]
    assert plain.usage.prompt_tokens == len(prompt_ids)
    assert plain.usage.completion_tokens == NEW
    pieces = api.completions.create(model=DEFAULT_NAME, prompt=prompt_ids, max_tokens=NEW,
                                    temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(pieces)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == NEW


def test_eight_concurrent_streams_equal_generate_in_shared_passes(stack, expected):
    url, hub_metrics = stack
    api = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    before = scrape(url + "/metrics")
    errors = hub_errors(hub_metrics, ignore=("NO_CARD",))
    results: dict[str, list[int]] = {}

    def ask(prompt: str) -> None:
        results[prompt] = chat(api, prompt, stream=True)[0]

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected
    after = scrape(url + "/metrics")
    passes = after["starhub_serve_verify_passes_total"] - before[
        "starhub_serve_verify_passes_total"]
    rows = after["starhub_serve_verify_rows_total"] - before["starhub_serve_verify_rows_total"]
    assert rows / passes > 2, f"mean verify batch {rows / passes:.2f}"
    # where plain batching serves the batch faster, requests that joined it sent those
    # using the hub on alone, closing their sessions: each once, and none the hub had not
    # opened (either would earn an ERROR). The last request left alone takes the hub up
    # again, and if the batch decoded plain for longer than the hub keeps an idle
    # server's slot, its OPEN earns NO_CARD and the server greets the hub again
    assert hub_errors(hub_metrics, ignore=("NO_CARD",)) == errors


def test_a_serving_requests_trees_keep_only_the_nodes_its_server_says_pay(expected):
    """The server advises each tree's node floor from its own passes (a COMMIT's
    ``floor``), and the hub leaves out the nodes below it: the share of the chosen trees'
    nodes kept, which the hub reports per target, falls below 1. The hub's depth is fixed
    and the gate is off (``--speculate always``), so that every round has a tree whatever
    this CPU's costs say; the first request teaches the server's fit what a node costs."""
    with spawn_hub(["--depth", "4"]) as hub, \
            spawn_serve(["--hub", hub.address, "--speculate", "always"]) as server:
        api = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for prompt in PROMPTS[2:4]:
            ids, _, spec = chat(api, prompt, stream=False)
            assert ids == expected[prompt] and spec["rounds"] > 0, spec
        client = observer_client(hub.address, timeout_s=30, name="test")
        try:
            targets = client.request(StatsQuery()).body.control.targets
        finally:
            client.close()
    assert targets and all(t.kept_share < 1.0 for t in targets), targets


def test_a_hub_killed_mid_load_loses_no_request_and_is_used_again(expected):
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    hub = spawn_hub(["--bind", address])
    # the link is pinned here, not the gate (tests/test_serve_gate.py): on a fast CPU the
    # gate may rightly judge one row plain
    with spawn_serve(["--hub", address, "--hub-timeout", "1", "--speculate", "always"],
                     threads=1) as server:
        api = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        results: dict[str, list[int]] = {}
        threads = [threading.Thread(target=lambda p=p: results.update(
            {p: chat(api, p, stream=True)[0]})) for p in PROMPTS[:4]]
        for t in threads:
            t.start()
        time.sleep(1.5)
        hub.proc.send_signal(signal.SIGKILL)
        hub.proc.wait()
        for t in threads:
            t.join()
        assert results == {p: expected[p] for p in PROMPTS[:4]}
        with spawn_hub(["--bind", address]):
            assert wait_until(lambda: health(server.url)["hub_connected"], 30)
            ids, _, spec = chat(api, PROMPTS[5], stream=False)
            assert ids == expected[PROMPTS[5]]
            assert spec["rounds"] > 0, "the server did not go back to the hub"
