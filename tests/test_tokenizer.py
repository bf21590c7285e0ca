"""Prompts through tokenizer.json as transformers and vLLM encode them: a plain prompt gets the tokens the
tokenizer's post-processor adds (Llama 3's `<|begin_of_text|>`, as its tokenizer.json's TemplateProcessing says), a
rendered chat template none (it wrote them itself)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cudflash import LLM, SamplingParams
from cudflash.tiny import TinyShape, target_config, target_tensors, write_model

tokenizers = pytest.importorskip("tokenizers")

WORDS = ["<|begin_of_text|>", "<|eot_id|>", "<unk>", "hello", "world", "again"]
BOS = 0
# Llama 3's template opens with {{ bos_token }} (its tokenizer_config.json's "<|begin_of_text|>").
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} <|eot_id|>{% endfor %}"


def _llama3_style(tmp_path: Path, post_processor: bool) -> Path:
    """A tiny Llama target whose tokenizer.json has (or lacks) a post-processor that puts the BOS token first."""
    shape = TinyShape(arch="llama", vocab_size=64, num_layers=1)
    d = write_model(tmp_path / "t", target_config(shape), target_tensors(shape, np.random.default_rng(0)))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|begin_of_text|>", "<|eot_id|>"])
    if post_processor:
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", BOS)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": TEMPLATE}))
    return d


def test_a_plain_prompt_gets_the_bos_token_the_tokenizer_adds(tmp_path):
    llm = LLM(_llama3_style(tmp_path, post_processor=True), backend="cpu")
    assert llm.admission.prompt_ids("hello world") == [BOS, 3, 4]
    out = llm.generate(["hello world"], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert out.prompt_ids == [BOS, 3, 4]
    # The template writes its own BOS: exactly one, none added around the rendered text.
    assert llm.apply_chat_template([{"role": "user", "content": "hello again"}]) == [BOS, 3, 5, 1]


def test_a_tokenizer_without_a_post_processor_adds_nothing(tmp_path):
    llm = LLM(_llama3_style(tmp_path, post_processor=False), backend="cpu")
    assert llm.admission.prompt_ids("hello world") == [3, 4]
    assert llm.apply_chat_template([{"role": "user", "content": "hello"}]) == [BOS, 3, 1]
