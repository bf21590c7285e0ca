"""`cudflash serve` through the real `openai` client (and raw HTTP), on the tiny pair on the CPU.

Each server runs uvicorn in a background thread on a free loopback port; every wait below is bounded.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai", reason="the server tests need `pip install openai` (the test extra)")
pytest.importorskip("starlette", reason="the server needs `pip install cudflash[serve]`")
uvicorn = pytest.importorskip("uvicorn", reason="the server needs `pip install cudflash[serve]`")

from cudflash import LLM, SamplingParams  # noqa: E402
from cudflash.server.app import build_app  # noqa: E402

import http_helpers  # noqa: E402
from http_helpers import request  # noqa: E402

MODEL = "tiny-chat"
EXTENSIONS = ("ignore_eos", "top_k", "stop_token_ids", "chat_template_kwargs")  # not in the client's signature


def call(create, **kw):
    """`create(**kw)` of the openai client, with cudflash's extension fields sent as extra_body."""
    extra = {k: kw.pop(k) for k in EXTENSIONS if k in kw}
    return create(extra_body=extra or None, **kw)


class RunningServer(http_helpers.RunningServer):
    def client(self, api_key: str = "unused", timeout: float = 60.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def pair(chat_target, tiny_pair):
    return chat_target, tiny_pair / "drafter"


@pytest.fixture(scope="module")
def served(pair):
    target, draft = pair
    server = RunningServer(build_app(LLM(target, draft=draft, backend="cpu"), model_name=MODEL))
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference(pair):
    """A fresh LLM the server's outputs are compared with."""
    target, draft = pair
    return LLM(target, draft=draft, backend="cpu")


def test_completions_and_chat_through_the_openai_client(served, reference):
    client = served.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    text_prompt = "def quicksort(xs):"
    expected = reference.generate([text_prompt], params)[0]
    greedy = dict(model=MODEL, max_tokens=10, temperature=0, ignore_eos=True)
    out = call(client.completions.create, prompt=text_prompt, **greedy)
    assert out.choices[0].text == expected.text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(expected.prompt_ids), 10)
    ids = reference.tokenizer.encode(text_prompt)
    for prompt in (ids, [ids]):  # token ids, and a list of one such prompt
        out = call(client.completions.create, prompt=prompt, **greedy)
        assert out.choices[0].text == expected.text
    pieces = [c.choices[0].text for c in call(client.completions.create, prompt=text_prompt, stream=True, **greedy)]
    assert "".join(pieces) == expected.text and len([p for p in pieces if p]) > 1

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]
    chat_expected = reference.chat(messages, SamplingParams(max_tokens=12, temperature=0.0))[0]
    out = call(client.chat.completions.create, model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == chat_expected.text
    assert out.choices[0].finish_reason == chat_expected.finish_reason
    assert out.usage.prompt_tokens == len(reference.apply_chat_template(messages))
    chunks = list(call(client.chat.completions.create, model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat_expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(chat_expected.token_ids)


def test_n_choices_and_several_prompts(served, reference):
    client = served.client()
    out = call(client.completions.create, model=MODEL, prompt=["import os", "class A:"], n=2, max_tokens=6,
                                    temperature=0.9, seed=11, ignore_eos=True)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    params = [SamplingParams(max_tokens=6, temperature=0.9, seed=11 + c, ignore_eos=True) for c in range(2)]
    expected = reference.generate(["import os", "import os", "class A:", "class A:"], params * 2)
    assert [c.text for c in out.choices] == [e.text for e in expected]
    assert out.usage.completion_tokens == 24


def _mixed_request(i: int) -> tuple[dict, SamplingParams]:
    """32 kinds: completions or chat, greedy or seeded sampling, top-k / top-p, stop strings, lengths."""
    kw: dict = {"max_tokens": 6 + i % 7}
    sp: dict = {"max_tokens": kw["max_tokens"]}
    if i % 2:
        kw.update(temperature=0.7 + 0.1 * (i % 3), seed=1000 + i)
        sp.update(temperature=kw["temperature"], seed=kw["seed"])
        if i % 3 == 0:
            kw["top_k"] = sp["top_k"] = 20
        if i % 5 == 0:
            kw["top_p"] = sp["top_p"] = 0.9
    else:
        kw["temperature"] = sp["temperature"] = 0.0
    if i % 4 == 1:
        kw["stop"] = sp["stop"] = ["\n", "):"]
    if i % 6 == 0:
        kw["ignore_eos"] = sp["ignore_eos"] = True
    if i % 3 == 2:
        kw["messages"] = [{"role": "user", "content": f"def task_{i}(x):"}]
    else:
        kw["prompt"] = f"# helper {i}\ndef f{i}("
    return kw, SamplingParams(**{"temperature": 1.0, **sp})


def test_32_concurrent_streaming_clients_match_generate(served, reference):
    requests = [_mixed_request(i) for i in range(32)]
    prompts = [reference.apply_chat_template(kw["messages"]) if "messages" in kw else kw["prompt"]
               for kw, _ in requests]
    expected = reference.generate(prompts, [sp for _, sp in requests])
    client = served.client()
    start = threading.Barrier(32, timeout=30)

    def run(kw: dict) -> tuple[str, str | None, int]:
        start.wait()
        if "messages" in kw:
            stream = call(client.chat.completions.create, model=MODEL, stream=True, **kw)
            pieces = [(c.choices[0].delta.content or "", c.choices[0].finish_reason) for c in stream if c.choices]
        else:
            stream = call(client.completions.create, model=MODEL, stream=True, **kw)
            pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in stream]
        return "".join(p for p, _ in pieces), pieces[-1][1], len(pieces)

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, [kw for kw, _ in requests]))
    for (kw, _), (text, reason, _), exp in zip(requests, results, expected):
        assert (text, reason) == (exp.text, exp.finish_reason), kw
    assert sum(n for _, _, n in results) > 3 * 32  # tokens arrived in pieces, not in one chunk per request
    m = served.wait_until(lambda m: m["cudflash_requests_running"] == 0, "the requests to finish")
    assert m["cudflash_kv_blocks_used"] == 0


def test_a_client_that_disconnects_is_aborted_and_its_blocks_freed(served):
    before = served.metrics()
    aborted = 'cudflash_requests_finished_total{finish_reason="abort"}'
    body = {"model": MODEL, "prompt": "def long_function(", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    conn = http_helpers.connect(served.url, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: {")
    served.wait_until(lambda m: m["cudflash_requests_running"] == 1, "the stream to run")
    conn.close()
    m = served.wait_until(lambda m: m[aborted] == before[aborted] + 1, "the abort")
    assert m["cudflash_requests_running"] == 0 and m["cudflash_kv_blocks_used"] == 0
    assert m["cudflash_generated_tokens_total"] - before["cudflash_generated_tokens_total"] < 3000
    # A non-streaming client that gives up waiting is aborted too.
    with pytest.raises(TimeoutError):
        request(served.url, "POST", "/v1/completions", {**body, "stream": False}, timeout=0.5)
    m = served.wait_until(lambda m: m[aborted] == before[aborted] + 2, "the second abort")
    assert m["cudflash_requests_running"] == 0 and m["cudflash_kv_blocks_used"] == 0


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "x = ", "max_tokens": 4}
BAD_REQUESTS = [  # (endpoint, body, the param the error names)
    ("completions", b"{not json", None),
    ("completions", b"[1, 2]", None),
    ("completions", b'{"prompt": "x", "temperature": NaN}', None),
    ("completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None),
    ("completions", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", None),
    ("completions", b'{"prompt": "\\ud800"}', None),
    ("completions", {"max_tokens": 4}, "prompt"),
    ("completions", {**COMPLETION, "prompt": ""}, "prompt"),
    ("completions", {**COMPLETION, "prompt": 5}, "prompt"),
    ("completions", {**COMPLETION, "prompt": [1, "a"]}, "prompt"),
    ("completions", {**COMPLETION, "prompt": [10**6]}, "prompt"),
    ("completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
    ("completions", {**COMPLETION, "max_tokens": "5"}, "max_tokens"),
    ("completions", {**COMPLETION, "max_tokens": True}, "max_tokens"),
    ("completions", {**COMPLETION, "max_tokens": 10**6}, "max_tokens"),
    ("completions", {**COMPLETION, "temperature": -1}, "temperature"),
    ("completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
    ("completions", {**COMPLETION, "top_p": 0}, "top_p"),
    ("completions", {**COMPLETION, "top_p": 1.5}, "top_p"),
    ("completions", {**COMPLETION, "top_k": 1.5}, "top_k"),
    ("completions", {**COMPLETION, "seed": -3}, "seed"),
    ("completions", {**COMPLETION, "seed": 2.5}, "seed"),
    ("completions", {**COMPLETION, "stop": 5}, "stop"),
    ("completions", {**COMPLETION, "stop": [""]}, "stop"),
    ("completions", {**COMPLETION, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {**COMPLETION, "n": 0}, "n"),
    ("completions", {**COMPLETION, "n": 1000}, "n"),
    ("completions", {**COMPLETION, "stream": "yes"}, "stream"),
    ("completions", {**COMPLETION, "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {**COMPLETION, "logprobs": 2}, "logprobs"),
    ("completions", {**COMPLETION, "echo": True}, "echo"),
    ("completions", {**COMPLETION, "best_of": 3}, "best_of"),
    ("completions", {**COMPLETION, "presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {**COMPLETION, "logit_bias": {"5": 10}}, "logit_bias"),
    ("completions", {**COMPLETION, "ignore_eos": 1}, "ignore_eos"),
    ("completions", {**COMPLETION, "max_tokenz": 5}, "max_tokenz"),
    ("chat/completions", {"model": MODEL}, "messages"),
    ("chat/completions", {**CHAT, "messages": []}, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": 1, "content": "x"}]}, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ("chat/completions", {**CHAT, "tools": {"name": "f"}}, "tools"),
    ("chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ("chat/completions", {**CHAT, "logprobs": True}, "logprobs"),
    ("chat/completions", {**CHAT, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("chat/completions", {**CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("chat/completions", {**CHAT, "add_generation_prompt": "no"}, "add_generation_prompt"),
]


def test_bad_requests_get_400_naming_the_field_and_the_server_keeps_serving(served):
    for endpoint, body, param in BAD_REQUESTS:
        r = request(served.url, "POST", "/v1/" + endpoint, body)
        assert r.status_code == 400, (body, r.text[:300])
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == param, (body, error)
        assert error["message"] and "Traceback" not in error["message"]
    assert len(BAD_REQUESTS) >= 20
    r = request(served.url, "POST", "/v1/completions", {**COMPLETION, "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = request(served.url, "GET", "/nowhere")
    assert r.status_code == 404 and "error" in r.json()
    r = request(served.url, "GET", "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = request(served.url, "POST", "/v1/completions", COMPLETION)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    m = served.wait_until(lambda m: m["cudflash_requests_running"] == 0, "idle")
    assert m["cudflash_kv_blocks_used"] == 0 and m["cudflash_requests_waiting"] == 0


def test_metrics_are_present_and_move(served):
    before = served.metrics()
    for name in ("cudflash_requests_running", "cudflash_requests_waiting", "cudflash_generated_tokens_total",
                 "cudflash_acceptance_length", "cudflash_kv_blocks_used", "cudflash_preemptions_total"):
        assert name in before
    call(served.client().completions.create, model=MODEL, prompt="def g(", max_tokens=7, temperature=0, ignore_eos=True)
    after = served.metrics()
    assert after["cudflash_generated_tokens_total"] == before["cudflash_generated_tokens_total"] + 7
    assert after["cudflash_prompt_tokens_total"] > before["cudflash_prompt_tokens_total"]
    assert 1.0 <= after["cudflash_acceptance_length"] <= 16.0  # tokens per speculative step, block 16
    assert 'cudflash_requests_finished_total{finish_reason="length"}' in after


@pytest.fixture(scope="module")
def guarded(pair):
    """One sequence at a time, one more queued, and an API key."""
    target, draft = pair
    llm = LLM(target, draft=draft, backend="cpu", max_num_seqs=1)
    server = RunningServer(build_app(llm, model_name=MODEL, api_key="sekret", max_queued=1))
    yield server
    server.close()


def test_api_key_is_required_everywhere_but_health(guarded):
    assert request(guarded.url, "GET", "/health").status_code == 200
    for path in ("/v1/models", "/metrics", "/nowhere"):
        r = request(guarded.url, "GET", path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert request(guarded.url, "GET", "/v1/models").status_code == 401
    assert request(guarded.url, "GET", "/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        call(guarded.client(api_key="wrong").completions.create, model=MODEL, prompt="x", max_tokens=2)
    out = call(guarded.client(api_key="sekret").completions.create, model=MODEL, prompt="x", max_tokens=2,
               ignore_eos=True)
    assert out.usage.completion_tokens == 2


def test_overload_answers_429_then_serves_again(guarded):
    client = guarded.client(api_key="sekret")
    body = dict(model=MODEL, prompt="def forever(", max_tokens=3000, ignore_eos=True, stream=True)
    first, second = call(client.completions.create, **body), call(client.completions.create, **body)
    try:
        next(iter(first))  # running; `second` is queued (create returns once the engine admitted it)
        with pytest.raises(openai.RateLimitError) as e:
            call(client.completions.create, model=MODEL, prompt="x", max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
    finally:
        first.close()
        second.close()
    deadline = time.monotonic() + 30
    while guarded.engine.inflight:
        assert time.monotonic() < deadline, "the closed streams were not aborted"
        time.sleep(0.05)
    out = call(client.completions.create, model=MODEL, prompt="x", max_tokens=3, ignore_eos=True)
    assert out.usage.completion_tokens == 3
    # more choices than the server could ever hold at once: 400, since retrying would not help
    r = request(guarded.url, "POST", "/v1/completions", {**COMPLETION, "n": 3}, {"Authorization": "Bearer sekret"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_serve_checks_its_options_before_loading(tmp_path):
    for args, needle in ((["--port", "70000"], "--port"), (["--max-queued", "-1"], "--max-queued"),
                         (["--target", str(tmp_path / "missing")], "not a directory")):
        argv = ["--target", str(tmp_path), *args] if args[0] != "--target" else args
        r = subprocess.run([sys.executable, "-m", "cudflash", "serve", *argv], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("cudflash: error: ") and needle in r.stderr


def test_a_model_without_a_chat_template_still_serves_completions(tiny_pair):
    server = RunningServer(build_app(LLM(tiny_pair / "target", backend="cpu"), model_name=MODEL))
    try:
        r = request(server.url, "POST", "/v1/chat/completions", CHAT)
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        r = request(server.url, "POST", "/v1/completions", {**COMPLETION, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert server.metrics()["cudflash_acceptance_length"] == 1.0  # plain decoding: one token per step
    finally:
        server.close()
