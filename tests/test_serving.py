"""The serving engine: continuous batching, chunked prefill, prefix caching, preemption, streaming, aborts."""
from __future__ import annotations

import numpy as np
import pytest

from cudflash import LLM, SamplingParams
from cudflash.tiny import TinyShape, write_random_pair

GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def golden_llm(tiny_pair):
    return LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cpu")


def test_prefix_cache_reuses_target_kv_and_drafter_context(tiny_pair, goldens):
    """A repeated prompt takes its cached blocks (target KV + drafter context K/V) and still reproduces the
    golden drafts step by step, which it could not if the reused drafter context were wrong."""
    llm = LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cpu", kv_block_size=16)
    g = goldens[2]
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    first = llm.generate([g["prompt_ids"]], params)[0]
    computed = llm.scheduler.num_prefill_tokens
    second = llm.generate([g["prompt_ids"]], params)[0]
    assert llm.scheduler.num_prefix_hit_tokens == 112  # 7 full blocks; the 8th is recomputed for its logits
    assert llm.scheduler.num_prefill_tokens - computed == 128 - 112
    for out in (first, second):
        assert out.token_ids == g["spec_ids"] and out.acceptance_lengths == g["acceptance_lengths"]


def test_prefix_cache_shares_a_common_prefix_between_requests(tiny_pair, goldens):
    """A prompt that extends another's committed tokens (prompt + generated) hits blocks of both kinds."""
    llm = LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cpu", kv_block_size=16)
    g = goldens[4]
    llm.generate([g["prompt_ids"]], SamplingParams(max_tokens=128, ignore_eos=True))
    follow_up = g["prompt_ids"] + g["spec_ids"][:64]
    out = llm.generate([follow_up], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert llm.scheduler.num_prefix_hit_tokens >= 176  # 11 of the 12 full blocks came from the first request
    assert out.token_ids == g["ar_ids"][64:96]


def test_chunked_prefill_and_small_batches_reproduce_the_goldens(tiny_pair, goldens):
    llm = LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cpu", max_num_seqs=2,
              max_num_batched_tokens=40, enable_prefix_caching=False)
    target, scored = llm.runner.target, []
    logits = target.logits
    target.logits = lambda hidden: scored.append(hidden.shape[0]) or logits(hidden)
    outs = llm.generate([g["prompt_ids"] for g in goldens[:4]], SamplingParams(max_tokens=128, ignore_eos=True))
    for out, g in zip(outs, goldens):
        assert out.token_ids == g["spec_ids"]
        assert out.acceptance_lengths == g["acceptance_lengths"]
    # The LM head runs on the rows that need logits only: a prompt's last row and the verify blocks, never over a
    # chunk of a prompt that it does not complete (the logits of a 40-row chunk would be 40 rows).
    block = llm.runner.draft_cfg.block_size
    assert scored and max(scored) <= 2 * block


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("pair"), TinyShape(num_layers=2, target_layer_ids=[0, 1]), seed=5)


def _prompts(n, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 256, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def test_preemption_keeps_outputs_and_returns_every_block(pair):
    target, draft = pair
    prompts = _prompts(8)
    solo = LLM(target, draft=draft, backend="cpu", kv_block_size=8)
    expected = [solo.generate([p], GREEDY)[0].token_ids for p in prompts]
    tight = LLM(target, draft=draft, backend="cpu", kv_block_size=8, num_kv_blocks=24, enable_prefix_caching=False)
    outs = tight.generate(prompts, GREEDY)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    assert tight.runner.blocks.num_free == 24


def test_stream_yields_what_generate_returns(golden_llm, goldens):
    g = goldens[1]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    chunks = list(golden_llm.stream(g["prompt_ids"], params))
    assert len(chunks) > 1 and chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert not any(c.finished for c in chunks[:-1])
    assert [t for c in chunks for t in c.new_token_ids] == g["spec_ids"][:60]
    assert "".join(c.new_text for c in chunks) == golden_llm.tokenizer.decode(g["spec_ids"][:60])


def test_closing_a_stream_aborts_the_request(golden_llm, goldens):
    blocks = golden_llm.runner.blocks
    free_before = blocks.num_free
    stream = golden_llm.stream(goldens[0]["prompt_ids"], SamplingParams(max_tokens=100, ignore_eos=True))
    next(stream)
    assert blocks.num_free < free_before
    stream.close()
    assert blocks.num_free == free_before and not golden_llm.has_unfinished()


def test_abort_frees_blocks_and_leaves_others_untouched(pair):
    target, draft = pair
    llm = LLM(target, draft=draft, backend="cpu", kv_block_size=8)
    a, b = _prompts(2, seed=3)
    expected_b = llm.generate([b], GREEDY)[0].token_ids
    ia, ib = llm.add_request(a, GREEDY), llm.add_request(b, GREEDY)
    llm.step(), llm.step()
    llm.abort(ia)
    while llm.has_unfinished():
        llm.step()
    assert llm.result(ia).finish_reason == "abort"
    assert llm.result(ib).token_ids == expected_b
    assert llm.runner.blocks.num_free == llm.runner.blocks.num_blocks


def test_stop_string_cuts_tokens_and_text(golden_llm, goldens):
    g = goldens[0]
    text = golden_llm.tokenizer.decode(g["spec_ids"][:40])
    stop = text[25:29]
    out = golden_llm.generate([g["prompt_ids"]], SamplingParams(max_tokens=40, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert stop in golden_llm.tokenizer.decode(out.token_ids)
    assert stop not in golden_llm.tokenizer.decode(out.token_ids[:-1])


def test_load_mixed_requests_with_preemption_and_aborts(pair):
    """Hundreds of requests with random lengths, parameters and stops through a pool small enough to preempt:
    all finish or abort as asked, greedy ones equal their solo runs, and no block leaks."""
    target, draft = pair
    rng = np.random.default_rng(42)
    n = 300
    prompts = _prompts(n, seed=1, lo=2, hi=60)
    params = []
    for i in range(n):
        greedy = rng.random() < 0.6
        params.append(SamplingParams(
            max_tokens=int(rng.integers(1, 40)), temperature=0.0 if greedy else float(rng.uniform(0.5, 1.5)),
            top_k=int(rng.choice([0, 5, 50])), top_p=float(rng.choice([1.0, 0.9])), seed=i,
            stop_token_ids=[int(rng.integers(2, 256))] if rng.random() < 0.3 else [], ignore_eos=rng.random() < 0.5))
    llm = LLM(target, draft=draft, backend="cpu", kv_block_size=8, num_kv_blocks=80, max_num_seqs=32,
              max_num_batched_tokens=256)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    to_abort = set(rng.choice(ids, 30, replace=False).tolist())
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
        if steps % 3 == 0 and to_abort:
            llm.abort(to_abort.pop())
    results = {i: llm.result(i) for i in ids}
    assert llm.scheduler.num_preemptions > 0
    assert llm.runner.blocks.num_free == llm.runner.blocks.num_blocks
    solo = LLM(target, draft=draft, backend="cpu", kv_block_size=8)
    for i, p, sp in zip(ids, prompts, params):
        r = results[i]
        if r.finish_reason == "abort":
            continue
        assert r.finish_reason in ("stop", "length") and 1 <= len(r.token_ids) <= sp.max_tokens
        if r.finish_reason == "length":
            assert len(r.token_ids) == sp.max_tokens
        # Greedy: the target's own output. Sampled: same seed, same output, whatever shared the batch.
        assert r.token_ids == solo.generate([p], sp)[0].token_ids


def test_finished_streams_and_results_are_forgotten(pair):
    target, draft = pair
    llm = LLM(target, draft=draft, backend="cpu", kv_block_size=8)
    list(llm.stream([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True)))
    llm.generate([[8, 9]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert llm.requests == {} and not llm.has_unfinished()


def _interleave(llm, prompts, params, expected, rng, texts=None):
    """Consume every request through a stream or a generate call, in a random order of actions: open a stream,
    pull from one, run a generate over some other requests, step the engine directly, or close a stream early.
    Each stream's concatenated deltas equal the request's solo output (a prefix, for one closed early)."""
    pending = list(rng.permutation(len(prompts)))
    streams: dict[int, tuple] = {}  # index -> (stream, tokens so far, text so far)
    while pending or streams:
        action = rng.choice(["open", "next", "next", "next", "generate", "step", "close"])
        if action == "open" and pending:
            i = pending.pop()
            streams[i] = (llm.stream(prompts[i], params[i]), [], [])
        elif action == "next" and streams:
            i = list(streams)[int(rng.integers(len(streams)))]
            stream, tokens, text = streams[i]
            out = next(stream)
            tokens += out.new_token_ids
            text.append(out.new_text or "")
            if out.finished:
                assert tokens == expected[i] and next(stream, None) is None
                if texts is not None:
                    assert "".join(text) == texts[i]
                del streams[i]
        elif action == "generate" and pending:
            chosen = [pending.pop() for _ in range(min(len(pending), int(rng.integers(1, 3))))]
            outs = llm.generate([prompts[i] for i in chosen], [params[i] for i in chosen])
            assert [o.token_ids for o in outs] == [expected[i] for i in chosen]
            if texts is not None:
                assert [o.text for o in outs] == [texts[i] for i in chosen]
        elif action == "step":
            llm.step()
        elif action == "close" and streams and rng.random() < 0.3:
            i = list(streams)[int(rng.integers(len(streams)))]
            stream, tokens, _ = streams.pop(i)
            stream.close()
            assert tokens == expected[i][:len(tokens)]
            pending.append(i)  # run it again later, from the start
    assert not llm.requests and not llm.has_unfinished()
    assert llm.runner.blocks.num_free == llm.runner.blocks.num_blocks


def test_streams_and_generate_interleave_in_any_order(pair):
    """Seeded random schedules of many open streams and generate calls on one LLM (a pool small enough to
    preempt): every token of every request is delivered exactly once."""
    target, draft = pair
    prompts = _prompts(6, seed=11, hi=24)
    rng = np.random.default_rng(5)
    params = [SamplingParams(max_tokens=int(rng.integers(4, 16)), temperature=0.0 if i % 3 else 0.8, seed=i,
                             ignore_eos=True) for i in range(len(prompts))]
    solo = LLM(target, draft=draft, backend="cpu", kv_block_size=8)
    expected = [solo.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    llm = LLM(target, draft=draft, backend="cpu", kv_block_size=8, num_kv_blocks=12, max_num_seqs=6)
    for schedule in range(8):
        _interleave(llm, prompts, params, expected, np.random.default_rng(schedule))
    assert llm.scheduler.num_preemptions > 0


def test_interleaved_streams_deliver_text_with_stop_strings_once(golden_llm, goldens):
    """Text too: a stream holds back what could still start a stop string, so its deltas add up to the final
    text (never to text a stop string later cuts), whoever steps the engine."""
    prompts = [g["prompt_ids"] for g in goldens[:3]]
    texts_free = [golden_llm.tokenizer.decode(g["spec_ids"][:24]) for g in goldens[:3]]
    params = [SamplingParams(max_tokens=24, stop=[t[10:14], "\x00never"]) for t in texts_free]
    solo = [golden_llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    assert all(o.finish_reason == "stop" for o in solo)
    for schedule in range(3):
        _interleave(golden_llm, prompts, params, [o.token_ids for o in solo], np.random.default_rng(schedule),
                    texts=[o.text for o in solo])


def test_stream_holds_back_text_a_stop_string_may_still_cut(golden_llm, goldens):
    """A stop string that starts in one step's text and ends in the next: the first step must not have shown
    its start, so the deltas add up to the final text, and the stop string never appears in them."""
    prompt = goldens[2]["prompt_ids"]
    free = SamplingParams(max_tokens=40, ignore_eos=True)
    chunks = [c.new_text for c in golden_llm.stream(prompt, free)]
    text = "".join(chunks)
    stop = None
    for i in range(len(chunks) - 1):
        end = len("".join(chunks[:i + 1]))
        candidate = text[end - 2:end + 2]
        if len(chunks[i]) >= 2 and len(chunks[i + 1]) >= 2 and text.find(candidate) == end - 2:
            stop = candidate
            break
    assert stop is not None
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop])
    deltas = [c.new_text for c in golden_llm.stream(prompt, params)]
    assert "".join(deltas) == text[:text.find(stop)] == golden_llm.generate([prompt], params)[0].text
