"""``starhub serve`` on the tiny model, with an n-gram hub process: the HTTP surface (errors,
capacity, disconnects, stop strings) and lossless batching, through the real server."""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque

import pytest
import torch
from openai import OpenAI
from serving import free_port, health, hub_errors, post, reference, scrape, wait_until

from starhub.launch.spawn import spawn_hub, spawn_serve
from targets.batcher import Batcher, Event, Request, Slot
from targets.generate import GenerationStats, SpeculativeGenerator
from targets.prefill import SLICE_S
from targets.verify import decoder_pass

PROMPTS = ["the quick brown fox", "one two three four five", "hello world, again",
           "a b c d e f g", "numbers: 1 2 3", "lorem ipsum dolor"]


@pytest.fixture(scope="module")
def stack(tiny_dir):
    """An n-gram hub with Prometheus metrics and a server of the tiny model (2 at once).
    Every request uses the hub (``--speculate always``): these tests pin the link, and on
    a random model the gate's verdict at one row sits within its margin (trees 1.05x)."""
    metrics = free_port()
    with spawn_hub(["--drafter", "ngram", "--depth", "4", "--metrics-port", str(metrics)]) \
            as hub:
        with spawn_serve(["--hub", hub.address, "--model", str(tiny_dir),
                          "--max-concurrency", "2", "--speculate", "always"]) as server:
            yield server.url, f"http://127.0.0.1:{metrics}/metrics", tiny_dir.name


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_models_and_health_name_the_served_model(stack):
    url, _, name = stack
    assert [m.id for m in client(url).models.list().data] == [name]
    body = health(url)
    assert body["status"] == "ok" and body["model"] == name and body["hub_connected"] is True


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "temperature": 3}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": [1, 2, 10 ** 9]}, 400, "prompt"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "logprobs": True}, 400, "logprobs"),
    ({"prompt": "x", "echo": True, "stream": True}, 400, "echo"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"prompt": "x", "logit_bias": {"50": 100}}, 400, "logit_bias"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"prompt": "x", "model": "nope"}, 404, "model"),
    ({}, 400, "model"),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "x", "seed": True}, 400, "seed"),
    ({"prompt": "x", "stream": 1}, 400, "stream"),
])
def test_bad_requests_get_an_openai_error_naming_the_field(stack, body, status, param):
    url, _, name = stack
    body = {"model": name, **body} if "model" not in body and body else body
    code, reply, _ = post(url, "/v1/completions", body)
    assert code == status
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["param"] == param and param in reply["error"]["message"]


TOOL = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize("extra,refused", [
    ({"tools": [TOOL]}, "tools"),
    ({"tools": [TOOL], "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required"}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 2}, None),
    ({"tools": [TOOL], "tool_choice": "none"}, None),
    ({"functions": [{"name": "f"}], "function_call": "none"}, None),
    ({"response_format": {"type": "text"}, "user": "u1"}, None),
])
def test_a_chat_request_asking_for_tool_calls_or_json_is_refused_not_answered_in_free_text(
        stack, extra, refused):
    url, _, name = stack
    code, reply, _ = post(url, "/v1/chat/completions",
                          {"model": name, "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 2, **extra})
    if refused is None:
        assert code == 200, reply
    else:
        assert code == 400 and reply["error"]["param"] == refused, reply


def test_an_unknown_path_or_method_gets_the_openai_error_shape(stack):
    url, _, _ = stack
    code, reply, _ = post(url, "/v1/embeddings", {"input": "x"})
    assert code == 404 and "/v1/embeddings" in reply["error"]["message"]
    request = urllib.request.Request(url + "/v1/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 405 and caught.value.headers["Allow"] == "POST"
    assert set(json.loads(caught.value.read())["error"]) == {"message", "type", "param", "code"}
    counted = scrape(url + "/metrics")
    assert not any("/v1/embeddings" in key for key in counted)
    for status in (404, 405):
        assert counted[f'starhub_serve_requests_total{{route="other",status="{status}"}}'] >= 1


def test_a_body_that_is_not_json_is_a_400(stack):
    url, _, _ = stack
    code, reply, _ = post(url, "/v1/chat/completions", b"{not json")
    assert code == 400 and "JSON" in reply["error"]["message"]


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
    b"[" * 200_000 + b"]" * 200_000,
    b'{"model": "\\ud800", "prompt": "a"}',
    b'{"model": "NAME", "prompt": "a\\ud800b"}',
    b'{"model": "NAME", "messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"model": "NAME", "prompt": "a", "temperature": NaN}',
    b'{"model": "NAME", "prompt": "a", "max_tokens": Infinity}',
    b"\xff\xfe{",
], ids=["long-int", "deep-nesting", "surrogate-model", "surrogate-prompt",
        "surrogate-chat", "nan", "infinity", "not-utf8"])
def test_a_body_that_cannot_be_parsed_is_a_short_400_and_the_server_serves_on(stack, raw):
    url, _, name = stack
    route = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    code, reply, _ = post(url, route, raw.replace(b"NAME", name.encode()))
    assert code == 400 and set(reply["error"]) == {"message", "type", "param", "code"}
    assert len(reply["error"]["message"]) < 200, reply
    assert health(url)["status"] == "ok"


def test_an_error_repeats_only_a_short_printable_prefix_of_what_the_client_sent(stack):
    url, _, _ = stack
    code, reply, _ = post(url, "/v1/completions", {"model": "\x07m" + "x" * 100_000,
                                                   "prompt": "a"})
    message = reply["error"]["message"]
    assert code == 404 and len(message) < 250 and "\x07" not in message, message


def test_a_body_not_sent_as_json_is_refused_with_415(stack):
    """A web page can POST text/plain across origins without asking first: such a body
    never starts a generation."""
    url, _, name = stack
    body = json.dumps({"model": name, "prompt": "x", "max_tokens": 2}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        request = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": kind} if kind else {})
        if kind is None:
            request.remove_header("Content-type")
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == 415
        assert "application/json" in json.loads(caught.value.read())["error"]["message"]


def test_health_answers_head_and_the_api_docs_are_not_served(stack):
    url, _, _ = stack
    with urllib.request.urlopen(urllib.request.Request(url + "/health", method="HEAD"),
                                timeout=30) as resp:
        assert resp.status == 200
    for path in ("/docs", "/redoc", "/openapi.json"):
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(url + path, timeout=30)
        assert caught.value.code == 404


def test_a_temperature_too_small_to_divide_by_decodes_greedily(stack, tiny_model):
    """Logits over 1e-320 overflow to inf, whose softmax is NaN: such a temperature is
    greedy decoding (its limit), never id 0 over and over."""
    from targets.acceptance import MIN_TEMPERATURE, Sampling

    model, _ = tiny_model
    url, _, name = stack
    ids = [5, 9, 14, 3, 7]
    for temperature in (1e-320, MIN_TEMPERATURE / 2):
        assert Sampling(temperature).greedy
        code, reply, _ = post(url, "/v1/completions", {
            "model": name, "prompt": ids, "max_tokens": 8, "temperature": temperature,
            "return_token_ids": True})
        assert code == 200 and reply["choices"][0]["token_ids"] == reference(model, ids, 8)
    assert not Sampling(2 * MIN_TEMPERATURE).greedy


def test_a_prompt_far_past_the_context_is_refused_before_it_is_tokenized(stack):
    """Four megabytes of text cannot fit the context however it tokenizes: it is refused
    from its length alone (the message says "at least"), and the server serves on."""
    from targets.serve.app import MAX_BODY_BYTES

    url, _, name = stack
    for route, body in (
            ("/v1/completions", {"model": name, "prompt": "ab " * (MAX_BODY_BYTES // 4)}),
            ("/v1/chat/completions", {"model": name, "messages": [
                {"role": "user", "content": "ab " * (MAX_BODY_BYTES // 4)}]})):
        code, reply, _ = post(url, route, body)
        assert code == 400 and "at least" in reply["error"]["message"], reply
    assert health(url)["status"] == "ok"


def test_batched_greedy_requests_equal_generate(stack, tiny_model):
    model, tokenizer = tiny_model
    url, hub_metrics, name = stack
    api = client(url)
    results: dict[int, list[int]] = {}

    def ask(i: int) -> None:
        reply = api.completions.create(model=name, prompt=PROMPTS[i], max_tokens=24,
                                       temperature=0, extra_body={"return_token_ids": True})
        results[i] = reply.choices[0].model_extra["token_ids"]
        assert reply.usage.completion_tokens == len(results[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, ids in results.items():
        prompt = tokenizer(PROMPTS[i])["input_ids"]
        assert ids == reference(model, prompt, 24), PROMPTS[i]
    assert scrape(hub_metrics)["starhub_rounds_total"] > 0


def test_seeded_sampling_equals_the_targets_own_seeded_sampling(stack, tiny_model):
    model, tokenizer = tiny_model
    url, _, name = stack
    reply = client(url).completions.create(model=name, prompt=PROMPTS[0], max_tokens=20,
                                           temperature=0.8, top_p=0.9, seed=7,
                                           extra_body={"return_token_ids": True})
    ids = tokenizer(PROMPTS[0])["input_ids"]
    alone = SpeculativeGenerator(model, tokenizer).generate(ids, 20, 0.8, 0.9, seed=7)
    assert reply.choices[0].model_extra["token_ids"] == alone.output_ids


def test_a_stop_string_ends_the_text_before_it(stack, tiny_model):
    url, _, name = stack
    api = client(url)
    full = api.completions.create(model=name, prompt=PROMPTS[1], max_tokens=24,
                                  temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), "the tiny model's text has no usable middle"
    cut = api.completions.create(model=name, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                 stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]
    streamed = api.completions.create(model=name, prompt=PROMPTS[1], max_tokens=24,
                                      temperature=0, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.text


def open_stream(url: str, name: str, max_tokens: int = 1500) -> http.client.HTTPConnection:
    """A streamed completion whose first event has been read; the rest is left unread."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": name, "prompt": PROMPTS[2], "max_tokens": max_tokens, "stream": True,
         "temperature": 0}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read1(64).startswith(b"data: ")
    return conn


def test_past_max_concurrency_a_request_gets_429_with_retry_after(stack):
    url, _, name = stack
    held = [open_stream(url, name) for _ in range(2)]
    try:
        code, reply, headers = post(url, "/v1/completions", {"model": name, "prompt": "x"})
        assert code == 429 and reply["error"]["type"] == "rate_limit_error"
        assert int(headers["Retry-After"]) >= 1
    finally:
        for conn in held:
            conn.close()
    assert wait_until(lambda: health(url)["inflight"] == 0)
    code, _, _ = post(url, "/v1/completions", {"model": name, "prompt": "x", "max_tokens": 2})
    assert code == 200


def test_a_client_that_disconnects_frees_its_session_here_and_at_the_hub(stack):
    url, hub_metrics, name = stack
    errors = hub_errors(hub_metrics)
    for _ in range(4):
        conn = open_stream(url, name)
        assert wait_until(lambda: scrape(hub_metrics)["starhub_active_sessions"] == 1)
        conn.close()
        assert wait_until(lambda: health(url)["inflight"] == 0, 10)
        assert wait_until(lambda: scrape(hub_metrics)["starhub_active_sessions"] == 0, 10)
        assert scrape(url + "/metrics")["starhub_serve_active_sessions"] == 0
    # each session is closed once: a second CLOSE (the hub's answer to a round that crossed
    # the first is dropped, not closed again) would earn an ERROR
    assert hub_errors(hub_metrics) == errors


def test_after_the_hub_frees_an_idle_servers_slot_requests_use_the_hub_again(stack):
    url, hub_metrics, name = stack
    api = client(url)
    assert wait_until(lambda: scrape(hub_metrics)["starhub_peers"] == 0, 20), \
        "the hub kept the idle server's slot"
    reply = api.completions.create(model=name, prompt=PROMPTS[3], max_tokens=16, temperature=0)
    assert reply.model_extra["spec_decode"]["hub"] is True
    assert scrape(hub_metrics)["starhub_peers"] == 1


def test_a_body_past_the_size_limit_is_refused_with_413(stack):
    from targets.serve.app import MAX_BODY_BYTES

    url, _, _ = stack
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
    conn.endheaders()
    conn.send(b'{"prompt": "' + b"x" * 1000)  # the server answers without reading the rest
    resp = conn.getresponse()
    assert resp.status == 413 and b"larger than" in resp.read()
    conn.close()
    assert health(url)["status"] == "ok"


def test_a_chat_prompt_longer_than_the_context_is_a_400_even_without_max_tokens(stack):
    url, _, name = stack
    code, reply, _ = post(url, "/v1/chat/completions", {
        "model": name, "messages": [{"role": "user", "content": "hello " * 2100}]})
    assert code == 400 and "context" in reply["error"]["message"]


def test_a_stream_whose_client_leaves_before_any_byte_gives_its_place_back(stack):
    url, _, name = stack
    parts = urllib.parse.urlsplit(url)
    for _ in range(4):  # twice --max-concurrency: a leak would leave no room
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": name, "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 200, "stream": True}), {"Content-Type": "application/json"})
        conn.close()
    # a request whose client left may still be on its way in (its prompt is tokenized on
    # another thread): room must come back, and stay, once every one is in and let go
    assert wait_until(lambda: health(url)["inflight"] == 0, 20)
    assert wait_until(lambda: post(url, "/v1/completions", {
        "model": name, "prompt": "x", "max_tokens": 2})[0] == 200, 20)
    assert wait_until(lambda: health(url)["inflight"] == 0, 20)


def test_streamed_text_ends_with_the_decoding_of_every_id_even_a_split_character(tokenizer):
    from targets.serve.text import TextStream

    ids = tokenizer("sea 🙂🙂", add_special_tokens=False)["input_ids"][:-1]
    stream = TextStream(tokenizer)
    pieces = [stream.push([i]) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_earliest_of_several_stop_strings_ends_the_text(tokenizer):
    from targets.serve.text import TextStream

    ids = tokenizer("one two three four", add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, stops=["four", "two"])
    text = "".join(stream.push([i]) for i in ids) + stream.flush()
    assert stream.stopped and text == "one "


def test_ids_committed_past_a_stop_string_are_not_counted(tokenizer):
    from targets.serve.text import TextStream

    ids = tokenizer("one two three four", add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, stops=["two"])
    text = stream.push(ids) + stream.flush()  # one round committed every id at once
    assert text == "one " and stream.stopped
    assert tokenizer.decode(stream.ids) == "one two"


def test_an_engine_that_fails_fails_every_request_and_refuses_new_ones(tiny_model):
    model, tokenizer = tiny_model
    batcher = Batcher(model, tokenizer)

    def broken(work):
        raise MemoryError("out of memory in a pass")

    batcher.engine.verify = broken  # a fault inside a forward pass
    events: queue.SimpleQueue = queue.SimpleQueue()
    batcher.start()
    try:
        batcher.submit(Request(prompt=[1, 2, 3], max_tokens=8, sink=events.put))
        last = events.get(timeout=30)
        while not last.done:
            last = events.get(timeout=30)
        assert last.done == "error" and "out of memory" in last.error
        assert "MemoryError" in batcher.failed
        batcher.submit(Request(prompt=[1, 2], max_tokens=4, sink=events.put))
        assert events.get(timeout=5).done == "error"
    finally:
        batcher.stop()


def test_a_request_in_flight_equals_itself_only_and_prints_without_its_features():
    """Releasing a request looks it up among those still prefilling; a lookup that compared
    or printed its features (a tensor a token) stalled the engine for 200 ms a request."""
    req = Request(prompt=[1, 2, 3], max_tokens=8)
    one = Slot(req=req, stats=GenerationStats(), history=[torch.zeros(1, 8)])
    other = Slot(req=req, stats=GenerationStats(), history=[torch.ones(1, 8)])
    long = Slot(req=req, stats=GenerationStats(), history=[torch.ones(1, 8)] * 512)
    assert one == one and one != other and other not in deque([one])
    assert len(repr(long)) == len(repr(other)) and "tensor" not in repr(long)


def test_a_decoding_request_steps_between_the_layers_of_a_long_prompts_prefill(tiny_model):
    """A long prompt prefilled as one chunk does not hold a decoding request up for that
    whole pass: the request's one-token passes run between the chunk's decoder layers, and
    both outputs are the target's own."""
    model, tokenizer = tiny_model
    calls: list[int] = []  # the tokens each decoder layer's MLP or a numpy pass's row ran, in order
    long, short = [(7 * i) % 900 + 3 for i in range(400)], [5, 6, 7]

    def timed(_, args, out) -> None:
        calls.append(args[0].shape[1])
        if args[0].shape[1] == len(long):  # each layer of the chunk as slow as a slice
            time.sleep(SLICE_S)

    hooks = [layer.mlp.down_proj.register_forward_hook(timed) for layer in model.model.layers]
    runner = decoder_pass(model)
    on_numpy = runner.numpy_pass  # a short pass runs there, not through the layers

    class Counted:  # the numpy pass, counting each pass's rows' tokens
        def __call__(self, rows, *rest):
            calls.extend(len(row.ids) for row in rows)
            return on_numpy(rows, *rest)

        def __getattr__(self, name):
            return getattr(on_numpy, name)

    if on_numpy is not None:
        runner.numpy_pass = Counted()
    heard: list[tuple[str, Event]] = []
    batcher = Batcher(model, tokenizer, prefill_chunk=512)
    batcher.start()
    try:
        batcher.submit(Request(prompt=short, max_tokens=200,
                               sink=lambda e: heard.append(("short", e))))
        assert wait_until(lambda: any(who == "short" for who, _ in heard), 30)
        batcher.submit(Request(prompt=long, max_tokens=2,
                               sink=lambda e: heard.append(("long", e))))
        assert wait_until(lambda: sum(e.done != "" for _, e in heard) == 2, 60)
    finally:
        batcher.stop()
        runner.numpy_pass = on_numpy
        for hook in hooks:
            hook.remove()
    chunk = [i for i, n in enumerate(calls) if n == len(long)]
    assert len(chunk) == len(model.model.layers) > 1
    assert calls[chunk[0]:chunk[-1]].count(1) > 0, "no step ran inside the chunk's pass"
    for name, ids, new in (("long", long, 2), ("short", short, 200)):
        got = [t for who, e in heard if who == name for t in e.tokens]
        assert got == reference(model, ids, new)[:len(got)] and len(got) > 0


def test_a_short_prompt_is_not_prefilled_behind_a_whole_long_one(tiny_model):
    """Chunks go in turn to the prompt with the fewest tokens left and to the oldest: a
    short prompt queued just after a ten-chunk one has its first token after two chunks,
    not eleven, and both outputs are the target's own."""
    model, tokenizer = tiny_model
    heard: list[tuple[str, Event]] = []
    batcher = Batcher(model, tokenizer, prefill_chunk=4)
    long, short = list(range(3, 43)), [5, 6, 7]
    batcher.submit(Request(prompt=long, max_tokens=6, sink=lambda e: heard.append(("long", e))))
    batcher.submit(Request(prompt=short, max_tokens=6,
                           sink=lambda e: heard.append(("short", e))))
    batcher.start()
    try:
        assert wait_until(lambda: sum(e.done != "" for _, e in heard) == 2, 60)
    finally:
        batcher.stop()
    assert heard[0][0] == "short", "the short prompt's first token came first"
    assert batcher.core.prefill_chunks == 11
    for name, ids in (("long", long), ("short", short)):
        got = [t for who, e in heard if who == name for t in e.tokens]
        assert got == reference(model, ids, 6)


SPEC_FIELDS = {"mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram",
               "num_spec_steps", "num_accepted_draft_tokens", "num_draft_tokens",
               "num_spec_tokens"}


def test_each_response_reports_its_rounds_in_vllms_speculative_decoding_shape(stack):
    """``metrics.speculative_decoding`` (vLLM's per-request fields), streamed or not, agrees
    with the request's own round log (``spec_decode``): steps, accepted and drafted tokens,
    and a histogram of steps by draft tokens accepted."""
    url, _, name = stack
    api = client(url)
    prompt = "a b c a b c a b c a b c a b c a b c"
    whole = api.completions.create(model=name, prompt=prompt, max_tokens=40, temperature=0)
    streamed = list(api.completions.create(model=name, prompt=prompt, max_tokens=40,
                                           temperature=0, stream=True))
    for extra in (whole.model_extra, streamed[-1].model_extra):
        spec, log = extra["metrics"]["speculative_decoding"], extra["spec_decode"]
        assert set(spec) == SPEC_FIELDS
        assert spec["num_spec_steps"] == log["rounds"] > 0
        assert spec["num_accepted_draft_tokens"] == log["accepted_draft_tokens"] > 0
        assert spec["num_draft_tokens"] == log["draft_tokens"]
        hist = spec["acceptance_histogram"]
        assert len(hist) == spec["num_spec_tokens"] + 1 and sum(hist) == log["rounds"]
        assert sum(n * count for n, count in enumerate(hist)) == log["accepted_draft_tokens"]
        steps, accepted = spec["num_spec_steps"], spec["num_accepted_draft_tokens"]
        assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
        assert spec["mean_acceptance_length"] == pytest.approx(log["mean_accept_len"], abs=1e-3)
        assert spec["draft_acceptance_rate"] == pytest.approx(accepted /
                                                              spec["num_draft_tokens"])
    assert all("metrics" not in chunk.model_extra for chunk in streamed[:-1])


class CountingTokenizer:
    """A real tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def test_streamed_text_costs_the_same_work_per_token_however_long_the_answer(tokenizer):
    """Detokenizing re-decoded every id on each new token: quadratic, seconds of CPU on
    the event loop for a long answer. Each push decodes a few ids, and the text is still
    the decoding of every id."""
    from targets.serve.text import TextStream

    text = " ".join(f"Élan {i}: naïve café 🙂 résumé, {i * 7} ½." for i in range(300))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 3000
    counting = CountingTokenizer(tokenizer)
    stream = TextStream(counting, stops=["never appears"])
    pieces = [stream.push([i]) for i in ids]
    pushed = counting.decoded
    pieces.append(stream.flush())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert pushed < 8 * len(ids), f"{pushed / len(ids):.1f} ids decoded per token"


def reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Stock transformers' log-softmax at each output position, for the same prefix."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_logprobs_are_the_targets_own_and_leave_the_tokens_alone(stack, tiny_model, chat,
                                                                  stream):
    """Greedy, through hub trees: each token's logprob and its top 5 equal transformers'
    log-softmax for the same prefix (float32, 1e-4), and the tokens equal the same
    request's without logprobs."""
    model, _ = tiny_model
    url, _, name = stack
    top = 5
    body = {"model": name, "max_tokens": 24, "temperature": 0, "return_token_ids": True,
            "stream": stream}
    route = "/v1/chat/completions" if chat else "/v1/completions"
    if chat:
        body["messages"] = [{"role": "user", "content": "a b c a b c a b c a b c"}]
        asks = {"logprobs": True, "top_logprobs": top}
    else:
        body["prompt"] = "a b c a b c a b c a b c"
        asks = {"logprobs": top}
    plain, plain_ids = _logprob_request(url, route, {**body, "stream": False})
    got, ids = _logprob_request(url, route, {**body, **asks})
    assert ids["out"] == plain_ids["out"] and len(ids["out"]) == 24
    assert plain["logprobs"] is None
    ref = reference_logprobs(model, ids["prompt"], ids["out"])
    if chat:
        entries = [(e["logprob"], [t["logprob"] for t in e["top_logprobs"]])
                   for e in got["logprobs"]["content"]]
    else:
        lp = got["logprobs"]
        assert len(lp["tokens"]) == len(lp["text_offset"]) == 24
        entries = [(chosen, sorted(tops.values(), reverse=True)[:top])
                   for chosen, tops in zip(lp["token_logprobs"], lp["top_logprobs"],
                                           strict=True)]
    assert len(entries) == 24
    for k, (chosen, tops) in enumerate(entries):
        assert chosen == pytest.approx(float(ref[k, ids["out"][k]]), abs=1e-4)
        assert tops == pytest.approx(ref[k].topk(top).values.tolist(), abs=1e-4)


def _logprob_request(url: str, route: str, body: dict) -> tuple[dict, dict]:
    """(the choice, with its logprobs merged over a stream's chunks; prompt and output
    ids) of one request."""
    if not body["stream"]:
        code, reply, _ = post(url, route, body)
        assert code == 200, reply
        choice = reply["choices"][0]
        return choice, {"prompt": reply["prompt_token_ids"], "out": choice["token_ids"]}
    request = urllib.request.Request(url + route, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    merged: dict = {}
    with urllib.request.urlopen(request, timeout=60) as resp:
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if not chunk["choices"]:
                continue
            choice = chunk["choices"][0]
            for key, value in (choice.get("logprobs") or {}).items():
                merged.setdefault(key, []).extend(value)
            if choice.get("finish_reason"):
                ids = {"prompt": chunk["prompt_token_ids"], "out": choice["token_ids"]}
    return {"logprobs": merged}, ids


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_gives_the_prompt_tokens_logprobs_as_a_likelihood_harness_asks(stack, tiny_model,
                                                                             max_tokens):
    """lm-evaluation-harness scores a continuation with ``echo: true, logprobs: 1,
    max_tokens: 0`` (or 1): each prompt token's logprob given the ones before (None for the
    first) equals transformers' log-softmax, and the text begins with the prompt."""
    model, tokenizer = tiny_model
    url, _, name = stack
    prompt = "the quick brown fox jumps over the lazy dog"
    code, reply, _ = post(url, "/v1/completions", {
        "model": name, "prompt": prompt, "echo": True, "logprobs": 1, "temperature": 0,
        "max_tokens": max_tokens, "return_token_ids": True})
    assert code == 200, reply
    choice = reply["choices"][0]
    ids, out = reply["prompt_token_ids"], choice["token_ids"]
    assert choice["text"].startswith(prompt) and len(out) == max_tokens
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate((ids + out)[1:], start=1):
        assert lp["token_logprobs"][i] == pytest.approx(float(ref[i - 1, token]), abs=1e-4)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
