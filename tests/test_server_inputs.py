"""The server under inputs and events that went wrong before: engine failures that must not take other clients'
requests with them, limits that a request without max_tokens must respect, and malformed HTTP. Plain HTTP only (no
openai client), on the trained tiny pair on the CPU."""
from __future__ import annotations

import json
import socket
import threading

import pytest

pytest.importorskip("starlette", reason="the server needs `pip install cudflash[serve]`")
pytest.importorskip("uvicorn", reason="the server needs `pip install cudflash[serve]`")

from cudflash import LLM, SamplingParams  # noqa: E402
from cudflash.server.app import build_app  # noqa: E402

from conftest import poison_one_logit  # noqa: E402
from http_helpers import RunningServer, connect, request  # noqa: E402

MODEL = "tiny"
ERROR_KEYS = {"message", "type", "param", "code"}


def completion(prompt: str, max_tokens: int, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}


def finished(m: dict[str, float], reason: str) -> float:
    return m.get(f'cudflash_requests_finished_total{{finish_reason="{reason}"}}', 0.0)


@pytest.fixture(scope="module")
def reference(chat_target, tiny_pair):
    return LLM(chat_target, draft=tiny_pair / "drafter", backend="cpu")


@pytest.fixture
def one_seq(chat_target, tiny_pair):
    """A server that runs one sequence at a time (the others wait in the scheduler)."""
    llm = LLM(chat_target, draft=tiny_pair / "drafter", backend="cpu", max_num_seqs=1)
    server = RunningServer(build_app(llm, model_name=MODEL, max_queued=4))
    yield server, llm
    server.close()


def _open_stream(url: str, body: dict):
    conn = connect(url, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}).encode(),
                 headers={"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: {")
    return conn, response


def test_a_failed_step_fails_only_the_requests_it_ran(one_seq, reference):
    """A step that raises fails the request it was running (an error event on its stream); the requests waiting
    behind it were not touched by the step and complete exactly, and every block comes back."""
    server, llm = one_seq
    real_run, raised = llm.engine.run, []

    def run(plan, block_size):  # raise once, when the two other requests are queued behind the running one
        if not raised and len(llm.scheduler.waiting) == 2:
            raised.append(1)
            raise RuntimeError("injected kernel failure")
        return real_run(plan, block_size)

    llm.engine.run = run
    conn, stream = _open_stream(server.url, completion("def forever(", 3000))
    replies: dict[int, object] = {}

    def post(i: int) -> None:
        replies[i] = request(server.url, "POST", "/v1/completions", completion(f"def f{i}(", 8), timeout=60)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    rest = stream.read().decode()  # the stream ends once its request failed
    conn.close()
    for t in threads:
        t.join(timeout=60)
    assert raised and '"type":"server_error"' in rest and rest.rstrip().endswith("data: [DONE]")
    expected = reference.generate([f"def f{i}(" for i in range(2)], SamplingParams(max_tokens=8, ignore_eos=True))
    for i in range(2):
        assert replies[i].status_code == 200, replies[i].text
        assert replies[i].json()["choices"][0]["text"] == expected[i].text
    m = server.idle()
    assert m["cudflash_kv_blocks_used"] == 0 and finished(m, "error") == 1


def test_a_request_that_ends_in_an_engine_error_is_answered_as_one(one_seq, reference):
    """Non-finite logits end one request with finish reason "error": the client gets a server error (OpenAI
    defines no such finish reason), and the next request is served as usual."""
    server, llm = one_seq
    restore = poison_one_logit(llm, step=2)
    try:
        r = request(server.url, "POST", "/v1/completions", completion("def g(", 12))
    finally:
        restore()
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "server_error"
    r = request(server.url, "POST", "/v1/completions", completion("def g(", 6))
    expected = reference.generate(["def g("], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected.text
    m = server.idle()
    assert m["cudflash_kv_blocks_used"] == 0 and finished(m, "error") == 1


def test_the_engine_thread_survives_an_error_outside_a_step(one_seq):
    """An exception in the engine thread's own bookkeeping (here: has_unfinished) must not kill the thread, which
    would leave every later request waiting forever: the request in flight fails, the next one is served."""
    server, llm = one_seq
    real, raised = llm.has_unfinished, []

    def has_unfinished() -> bool:
        if llm.requests and not raised:
            raised.append(1)
            raise RuntimeError("injected bookkeeping failure")
        return real()

    llm.has_unfinished = has_unfinished
    r = request(server.url, "POST", "/v1/completions", completion("x = ", 4))
    assert raised and r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert server.engine.alive and request(server.url, "GET", "/health").status_code == 200
    r = request(server.url, "POST", "/v1/completions", completion("x = ", 4), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert server.idle()["cudflash_kv_blocks_used"] == 0


@pytest.mark.parametrize("kwargs", [dict(max_model_len=64), dict(num_kv_blocks=6, draft_options={"tree_budget": 31})],
                         ids=["max_model_len", "tree-lookahead"])
def test_a_request_without_max_tokens_gets_the_rest_of_the_context(chat_target, tiny_pair, kwargs):
    """A chat request that sets no max_tokens gets what its prompt leaves, as admission counts it: within the
    LLM's max_model_len (not the model's 4096 positions) and the KV pool beside a draft tree's lookahead (not only
    the block's). /v1/models reports the max_model_len served; a prompt with no room is refused for its length."""
    llm = LLM(chat_target, draft=tiny_pair / "drafter", backend="cpu", **kwargs)
    server = RunningServer(build_app(llm, model_name=MODEL))
    try:
        messages = [{"role": "user", "content": "hi"}]
        prompt_len = len(llm.apply_chat_template(messages))
        r = request(server.url, "POST", "/v1/chat/completions", {"messages": messages, "ignore_eos": True,
                                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == llm.admission.room(prompt_len) > 0
        assert r.json()["usage"]["total_tokens"] <= llm.max_model_len
        assert request(server.url, "GET", "/v1/models").json()["data"][0]["max_model_len"] == llm.max_model_len
        long = [{"role": "user", "content": "word " * llm.max_model_len}]
        r = request(server.url, "POST", "/v1/chat/completions", {"messages": long})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "max_tokens" not in r.json()["error"]["message"]
        assert server.idle()["cudflash_kv_blocks_used"] == 0
    finally:
        server.close()


@pytest.fixture(scope="module")
def served(chat_target, tiny_pair):
    server = RunningServer(build_app(LLM(chat_target, draft=tiny_pair / "drafter", backend="cpu"), model_name=MODEL))
    yield server
    server.close()


def raw_http(url: str, data: bytes) -> tuple[int, dict]:
    """Send bytes as they are (a body without a content type, a chunked one) and read the status and JSON body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _length(reply):
            piece = sock.recv(65536)
            assert piece, reply
            reply += piece
    head, body = reply.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def _length(reply: bytes) -> int:
    head = reply.split(b"\r\n\r\n", 1)[0].lower()
    return int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])


def test_the_body_must_be_declared_as_json_and_fit_the_limit(served):
    """A body sent as form data or text is refused (vLLM's FastAPI does the same) instead of being parsed as JSON;
    JSON with parameters, +json types and an undeclared type are read; bodies over the limit get 413, whether the
    size is declared or only found while reading a chunked body; the server serves on."""
    body = completion("x = ", 2)
    for declared in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=b"):
        r = request(served.url, "POST", "/v1/completions", body, {"content-type": declared})
        assert r.status_code == 400, (declared, r.text)
        assert set(r.json()["error"]) == ERROR_KEYS and "Content-Type" in r.json()["error"]["message"]
    for declared in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.example+json", ""):
        assert request(served.url, "POST", "/v1/completions", body, {"content-type": declared}).status_code == 200
    raw = json.dumps(body).encode()
    status, reply = raw_http(served.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(raw), raw))
    assert status == 200 and reply["usage"]["completion_tokens"] == 2
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(raw[i:i + 7]), raw[i:i + 7]) for i in range(0, len(raw), 7))
    status, reply = raw_http(served.url, head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked + b"0\r\n\r\n")
    assert status == 200 and reply["usage"]["completion_tokens"] == 2
    status, reply = raw_http(served.url, head + b"Content-Length: 99999999999\r\n\r\n{}")
    assert status == 413 and set(reply["error"]) == ERROR_KEYS
    mib = b"a" * 2**20
    status, reply = raw_http(served.url, head + b"Transfer-Encoding: chunked\r\n\r\n"
                             + b"".join(b"%x\r\n%s\r\n" % (len(mib), mib) for _ in range(17)) + b"0\r\n\r\n")
    assert status == 413 and set(reply["error"]) == ERROR_KEYS
    assert request(served.url, "POST", "/v1/completions", body).status_code == 200


@pytest.mark.parametrize("arguments, kind", [("[1, 2]", "an array"), ('"x"', "a string"), ("3", "a number"),
                                             ("null", "null"), ("true", "true or false")])
def test_tool_call_arguments_must_decode_to_an_object(arguments, kind):
    """OpenAI sends a tool call's arguments as a JSON string; one that decodes to something other than an object
    was passed to the template as it was, where the message blamed its type ("a JSON string or an object")
    though it was a JSON string."""
    from cudflash.server.protocol import APIError, parse_chat

    call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
    with pytest.raises(APIError) as e:
        parse_chat({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call]}]})
    assert e.value.status == 400 and e.value.param == "messages[1].tool_calls[0].function.arguments"
    assert "JSON object" in e.value.message and kind in e.value.message
    ok = parse_chat({"messages": [{"role": "assistant", "tool_calls": [{**call, "function": {
        "name": "f", "arguments": '{"x": [1]}'}}]}]})
    assert ok.messages[0]["tool_calls"][0]["function"]["arguments"] == {"x": [1]}
