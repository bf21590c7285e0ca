"""Chat templates rendered as Hugging Face renders them, message checks, and `LLM.chat` on the tiny pair."""
from __future__ import annotations

import json
import shutil
from datetime import datetime

import pytest

from cudflash import LLM, SamplingParams
from cudflash.chat import load_chat_template, validate_messages
from cudflash.errors import ConfigError, RequestError
from tests.conftest import expect_error

# Exercises what transformers sets up: trim_blocks / lstrip_blocks, loop controls, the generation tag, its tojson
# (non-ASCII kept, HTML characters not escaped, indent / separators / sort_keys), special tokens from
# tokenizer_config.json (an AddedToken object included), tools, documents and an extra keyword.
FEATURES = """{{ bos_token }}
{% for m in messages %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    <{{ m.role }}>{% generation %}{{ m.content }}{% endgeneration %}</{{ m.role }}>
    {% if m.meta is defined %}
        {{ m.meta | tojson }}|{{ m.meta | tojson(indent=1) }}|{{ m.meta | tojson(separators=(',', ':'), sort_keys=true) }}
    {% endif %}
    {% if m.role == 'stop' %}{% break %}{% endif %}
{% endfor %}
{% if tools %}{% for t in tools %}tool:{{ t.name }};{% endfor %}{% endif %}
{% if documents %}{% for d in documents %}doc:{{ d.title }};{% endfor %}{% endif %}
{{ eos_token }}|{{ pad_token }}|{{ enable_thinking | default('unset') }}
{% if add_generation_prompt %}<assistant>{% endif %}"""
# What transformers 5.24 `apply_chat_template(..., tokenize=False)` returns for FEATURES and the inputs below.
FEATURES_RENDERED = (
    '<|endoftext|>\n    <user>héllo <b>&</user>\n        {"z": 1, "a": ["é", null]}|{\n "z": 1,\n "a": [\n  "é",\n'
    '  null\n ]\n}|{"a":["é",null],"z":1}\n    <stop>last</stop>\ntool:lookup;doc:D1;<|endoftext|>|<|mask|>|False\n')


def _model(tmp_path, config: dict | None = None, jinja: str | None = None):
    d = tmp_path / "model"
    d.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    return d


def test_renders_what_transformers_renders(tmp_path):
    config = {"bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
              "eos_token": "<|endoftext|>", "pad_token": "<|mask|>", "add_bos_token": False,
              "chat_template": FEATURES}
    template = load_chat_template(_model(tmp_path, config))
    messages = validate_messages([
        {"role": "user", "content": "héllo <b>&", "meta": {"z": 1, "a": ["é", None]}},
        {"role": "skip", "content": "hidden"}, {"role": "stop", "content": "last"}, {"role": "user", "content": "x"}])
    args = dict(tools=[{"name": "lookup"}], documents=[{"title": "D1", "text": "x"}],
                template_kwargs={"enable_thinking": False})
    assert template.render(messages, add_generation_prompt=False, **args) == FEATURES_RENDERED
    assert template.render(messages, add_generation_prompt=True, **args) == FEATURES_RENDERED + "<assistant>"
    assert template.special_tokens == {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                                       "pad_token": "<|mask|>"}


def test_globals_and_template_errors(tmp_path):
    d = _model(tmp_path, jinja="{% if messages[0].role != 'system' %}{{ raise_exception('system first!') }}"
                               "{% endif %}{{ strftime_now('%Y') }}")
    template = load_chat_template(d)
    assert template.render([{"role": "system", "content": "s"}]) == datetime.now().strftime("%Y")
    with pytest.raises(RequestError) as e:
        template.render([{"role": "user", "content": "u"}])
    expect_error(e, "system first!", "chat_template.jinja")
    broken = load_chat_template(_model(tmp_path / "b", jinja="{% for m in messages %}"))
    with pytest.raises(ConfigError) as e:
        broken.render([{"role": "user", "content": "u"}])
    expect_error(e, "chat_template.jinja", "does not compile")
    with pytest.raises(RequestError) as e:
        template.render([{"role": "system", "content": "s"}], template_kwargs={"messages": []})
    expect_error(e, "chat_template_kwargs", "messages")


def test_where_the_template_comes_from(tmp_path):
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    template = load_chat_template(_model(tmp_path, {"chat_template": named}))
    msgs = [{"role": "user", "content": "u"}]
    assert template.render(msgs) == "D" and template.render(msgs, tools=[{"name": "f"}]) == "T"
    # chat_template.jinja (transformers' newer layout) wins over tokenizer_config.json
    assert load_chat_template(_model(tmp_path, {"chat_template": "C"}, jinja="J")).render(msgs) == "J"
    no_default = load_chat_template(_model(tmp_path / "n", {"chat_template": [{"name": "a", "template": "A"},
                                                                                {"name": "b", "template": "B"}]}))
    with pytest.raises(ConfigError) as e:
        no_default.render(msgs)
    expect_error(e, "'default'", "a, b")
    assert load_chat_template(_model(tmp_path / "none", {"eos_token": "x"})) is None
    with pytest.raises(ConfigError) as e:
        load_chat_template(_model(tmp_path / "bad", {"chat_template": 5}))
    expect_error(e, "tokenizer_config.json", "chat_template")


def test_messages_as_transformers_passes_them(tmp_path):
    """Null-valued keys are dropped and reasoning under any of its names is seen under all of them; text parts
    are joined; continue_final_message cuts the text after the last message."""
    out = validate_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": None},
        {"role": "assistant", "content": None, "reasoning": "r",
         "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}])
    assert out[0] == {"role": "user", "content": "a\nb"}
    assert out[1]["thinking"] == out[1]["reasoning_content"] == "r" and "content" not in out[1]
    template = load_chat_template(_model(tmp_path, jinja="{% for m in messages %}[{{ m.content }}]{% endfor %}"
                                                         "{% if add_generation_prompt %}NEW{% endif %}"))
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    assert template.render(msgs) == "[q][The answer is]NEW"
    assert template.render(msgs, add_generation_prompt=False, continue_final_message=True) == "[q][The answer is"
    with pytest.raises(RequestError):
        template.render(msgs, add_generation_prompt=True, continue_final_message=True)


@pytest.mark.parametrize("messages, needles", [
    ([], ["non-empty list"]),
    ("hi", ["non-empty list"]),
    ([["user", "hi"]], ["messages[0]", "object"]),
    ([{"content": "hi"}], ["messages[0].role"]),
    ([{"role": 3, "content": "hi"}], ["messages[0].role"]),
    ([{"role": "", "content": "hi"}], ["messages[0].role"]),
    ([{"role": "user"}], ["messages[0].content", "missing"]),
    ([{"role": "user", "content": 5}], ["messages[0].content", "int"]),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": {"text": "b"}}], ["messages[1].content"]),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     ["messages[0].content[0].type", "image_url"]),
    ([{"role": "user", "content": [{"type": "text"}]}], ["messages[0].content[0].text"]),
    ([{"role": "user", "content": ["a"]}], ["messages[0].content[0]"]),
    ([{"role": "assistant", "content": "", "tool_calls": {"name": "f"}}], ["messages[0].tool_calls", "list"]),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], ["messages[0].tool_calls[0]"]),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
     ["messages[0].tool_calls[0].function.arguments"]),
    ([{"role": "user", "content": None}], ["messages[0].content"]),
    ([{"role": "tool", "content": "r", "tool_call_id": 7}], ["messages[0].tool_call_id"]),
    ([{"role": "user", "content": "x", "name": ["n"]}], ["messages[0].name"]),
])
def test_bad_messages_are_named(messages, needles):
    with pytest.raises(RequestError) as e:
        validate_messages(messages)
    expect_error(e, *needles)


@pytest.fixture(scope="module")
def chat_llm(chat_target):
    return LLM(chat_target, backend="cpu")


def test_apply_chat_template_tokenizes_once(chat_llm):
    """The template writes the end-of-turn token; it becomes one special id, and nothing is added around it."""
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    ids = chat_llm.apply_chat_template(msgs)
    text = "<|system|>\nYou write Python.<|endoftext|>\n<|user|>\ndef add(a, b):<|endoftext|>\n<|assistant|>\n"
    assert ids == chat_llm.tokenizer.encode(text)
    assert ids.count(0) == 2 and ids[0] != 0  # the two turn ends, no BOS / EOS added
    assert chat_llm.apply_chat_template(msgs, chat_template_kwargs={"unused": 1}) == ids
    with pytest.raises(RequestError) as e:
        chat_llm.apply_chat_template(msgs, chat_template_kwargs={1: 2})
    expect_error(e, "chat_template_kwargs")


def test_chat_equals_generate_on_the_rendered_prompt(chat_llm):
    convs = [[{"role": "user", "content": "import numpy as np"}],
             [{"role": "user", "content": "class Stack:"}, {"role": "assistant", "content": "    pass"},
              {"role": "user", "content": "def push(self, x):"}]]
    params = [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=9, temperature=0.8, seed=3)]
    expected = chat_llm.generate([chat_llm.apply_chat_template(c) for c in convs], params)
    both = chat_llm.chat(convs, params)
    assert [r.token_ids for r in both] == [r.token_ids for r in expected]
    assert [len(r.token_ids) for r in both] == [12, 9]
    one = chat_llm.chat(convs[0], params[0])
    assert len(one) == 1 and one[0].token_ids == expected[0].token_ids and one[0].text == expected[0].text
    for bad in ([], [[]], [convs[0][0], convs[1]], "hi"):
        with pytest.raises(RequestError):
            chat_llm.chat(bad)


def test_a_bad_conversation_among_several_is_named(chat_llm):
    """With several conversations, an error names which one it is about, not only the message index inside it;
    nothing is queued."""
    good = [{"role": "user", "content": "x = 1"}]
    with pytest.raises(RequestError) as e:
        chat_llm.chat([good, good, [{"role": "user", "content": "y"}, {"role": 5, "content": "z"}]])
    expect_error(e, "conversations[2]", "messages[1].role")
    with pytest.raises(RequestError) as e:
        chat_llm.chat([good, [{"role": "user", "content": 3}]])
    expect_error(e, "conversations[1]", "messages[0].content")
    with pytest.raises(RequestError) as e:
        chat_llm.chat([{"role": "user", "content": 3}])  # one conversation: no index to give
    assert not str(e.value).startswith("conversations")
    assert not chat_llm.requests and not chat_llm.has_unfinished()


def test_a_model_without_a_template_says_so(tiny_pair):
    llm = LLM(tiny_pair / "target", backend="cpu")
    with pytest.raises(ConfigError) as e:
        llm.chat([{"role": "user", "content": "hi"}])
    expect_error(e, str(tiny_pair / "target"), "no chat template")


def test_generation_stops_at_every_eos_id_of_generation_config(chat_target, chat_llm, tmp_path):
    """generation_config.json's eos_token_id list (all of it) ends a turn, not only config.json's."""
    msgs = [{"role": "user", "content": "for i in range(10):"}]
    free = chat_llm.chat(msgs, SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    k = next(i for i in range(3, 16) if free[i] not in free[:i] and free[i] != 0)  # first new token past 3
    model = tmp_path / "target"
    shutil.copytree(chat_target, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, free[k]]}))
    llm = LLM(model, backend="cpu")
    assert {0, free[k]} <= llm.eos_token_ids
    out = llm.chat(msgs, SamplingParams(max_tokens=16))[0]
    assert out.token_ids == free[:k + 1] and out.finish_reason == "stop"
