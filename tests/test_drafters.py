"""DFlash2 and DSpark drafters on the numpy backend, on tiny random checkpoints with the real tensor names.

- The engine's drafts equal those of an independent transcription of the formulas (tests/drafter_reference.py)
  at every step of a generation: DFlash2 conv + selector (sliding windows included), DSpark Markov walk with
  shifted rows (both config dialects, a smaller drafter vocabulary), the confidence cut, the sampling walk's q.
- An identity-initialised DFlash2 convolution with a neutral selector drafts exactly what the DFlash backbone does.
- Speculative greedy == autoregressive greedy for every kind and option.
- Sampling with the selector reproduces the target's distribution, and a wrong acceptance rule is caught.
- Checkpoints that do not match their config are clear errors, never a silent fallback.
"""
from __future__ import annotations

import itertools
import json
import numpy as np
import pytest

import cudflash.engine.sampler as sampler
from cudflash import LLM, SamplingParams
from cudflash.backends.numpy_backend import NumpyBackend
from cudflash.draft_config import DraftOptions
from cudflash.engine.propose import DraftProposer, adaptive_lengths, confident_lengths
from cudflash.engine.sampler import target_probs
from cudflash.errors import CudflashError
from cudflash.tiny import TinyHeads, TinyShape, write_random_pair
from tests.conftest import last_logits
from tests.drafter_reference import Reference
from tests.sampling_stats import chi_square_pvalue, wrong_rejection_sample

SLIDING = ["sliding_attention", "full_attention"]
KINDS = {
    # z-lab's sliding layers without is_causal: causal within the block (the reference rule, draft_config.py)
    "dflash-sliding-causal": TinyHeads(layer_types=SLIDING, sliding_window=5),
    "dflash2": TinyHeads(kind="dflash2", layer_types=SLIDING, sliding_window=5),
    "dflash2-projector-k3": TinyHeads(kind="dflash2", dialect="projector", conv_kernel_size=3, conv_group_size=8),
    "dflash2-small-vocab": TinyHeads(kind="dflash2", draft_vocab_size=100),
    "dspark-deepspec": TinyHeads(kind="dspark"),
    "dspark-nested-sliding": TinyHeads(kind="dspark", dialect="nested", layer_types=SLIDING, sliding_window=4),
    "dspark-small-vocab": TinyHeads(kind="dspark", draft_vocab_size=100, confidence_with_markov=False),
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 33)), [3, 4]]
MAX_NEW = 24


@pytest.fixture(scope="module", params=list(KINDS))
def pair(request, tmp_path_factory):
    shape = TinyShape(heads=KINDS[request.param])
    return write_random_pair(tmp_path_factory.mktemp(request.param), shape, seed=7), shape


def _llm(paths, block=None, **kw) -> LLM:
    target, draft = paths
    return LLM(target, draft=draft, backend="cpu", block_size=block, kv_block_size=8, **kw)


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def record(llm: LLM) -> list[tuple[list[list[int]], object]]:
    """Every proposal the engine makes, with the token ids (committed + pending) of each sequence at the time."""
    calls, inner = [], llm.proposer

    class Recording:
        drafts_on_device, first_row = False, inner.first_row  # every proposal passes through the host

        def device_part(self, runner, batch, rows):
            return inner.device_part(runner, batch, rows)

        def host_part(self, runner, out, seqs, block):
            proposal = inner.host_part(runner, out, seqs, block)
            calls.append(([list(s.token_ids) for s in seqs], proposal))
            return proposal
    llm.proposer = Recording()
    return calls


# ----------------------------------------------------------------------------------- against the formulas

def test_drafts_match_the_reference_transcription(pair):
    paths, shape = pair
    llm = _llm(paths, block=6)
    calls = record(llm)
    llm.generate(PROMPTS, _greedy(12))
    ref = Reference(*paths)
    checked = 0
    for seq_tokens, proposal in calls:
        for tokens, drafts in zip(seq_tokens, proposal.drafts):
            assert list(drafts) == ref.drafts(tokens, 6), (tokens, list(drafts))
            checked += 1
    assert checked >= 10


def test_confidence_cut_matches_the_reference(pair):
    paths, shape = pair
    if shape.heads.kind != "dspark":
        with pytest.raises(CudflashError, match="confidence head"):
            _llm(paths, draft_options={"confidence_threshold": 0.5})
        return
    llm = _llm(paths, draft_options=DraftOptions(confidence_threshold=0.6))
    calls = record(llm)
    llm.generate(PROMPTS, _greedy(12))
    ref, block, lengths = Reference(*paths), shape.block_size, []
    for seq_tokens, proposal in calls:
        for tokens, drafts in zip(seq_tokens, proposal.drafts):
            full = ref.drafts(tokens, block)
            conf = ref.confidence(tokens, block, full)
            cut = int(np.argmax(conf < 0.6)) if (conf < 0.6).any() else block - 1
            assert list(drafts) == full[:cut], (conf, list(drafts), full)
            lengths.append(cut)
    assert len(set(lengths)) > 1, lengths  # the threshold really cuts, and not always at the same row


@pytest.mark.parametrize("pair", [k for k in KINDS if k.startswith("dflash2")], indirect=True)
def test_selector_sampling_walk_returns_its_q(pair):
    paths, shape = pair
    llm = _llm(paths, block=5)
    calls = record(llm)
    llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True))
    ref = Reference(*paths)
    for seq_tokens, proposal in calls:
        assert proposal.q is not None
        for tokens, drafts, q in zip(seq_tokens, proposal.drafts, proposal.q):
            h, logits = ref.draft_rows(tokens, 5)
            _, q_ref = ref.selector_walk(tokens[-1], h, logits, path=list(drafts), temperature=0.8)
            np.testing.assert_allclose(q, np.stack(q_ref), atol=1e-5)
            assert all(q[j, d] > 0 for j, d in enumerate(drafts))  # each draft was drawn from its own row's q


def test_sliding_window_comes_from_the_checkpoint_and_can_be_overridden(pair):
    paths, shape = pair
    if not shape.heads.layer_types:
        with pytest.raises(CudflashError, match="no sliding_attention layers"):
            _llm(paths, draft_options={"sliding_window": 3})
        return
    window = shape.heads.sliding_window
    assert _llm(paths).draft_cfg.layer_windows == [window, 0]
    llm = _llm(paths, block=6, draft_options={"sliding_window": 2})
    assert llm.draft_cfg.layer_windows == [2, 0]
    calls = record(llm)
    llm.generate(PROMPTS[:2], _greedy(10))
    ref, ref_default = Reference(*paths, windows=[2, 0]), Reference(*paths)
    differs = False
    for seq_tokens, proposal in calls:
        for tokens, drafts in zip(seq_tokens, proposal.drafts):
            assert list(drafts) == ref.drafts(tokens, 6)
            differs |= not np.allclose(ref.hidden(tokens, 6), ref_default.hidden(tokens, 6))
    assert differs  # the window really changes what the drafter computes


def test_zlab_sliding_layers_attend_causally_in_the_block(pair):
    """A DFlash sliding_attention layer without is_causal is causal in the block (z-lab dflash/model.py): the engine's
    drafter hidden states are the causal reference's, which a bidirectional block's are not."""
    paths, shape = pair
    if not (shape.heads.kind == "dflash" and shape.heads.layer_types):
        return
    llm = _llm(paths, block=6)
    assert llm.draft_cfg.layer_causal == [True, False]
    inner, seen = llm.proposer, []

    class Recording:
        drafts_on_device, first_row = False, inner.first_row

        def device_part(self, runner, batch, rows):
            return inner.device_part(runner, batch, rows)

        def host_part(self, runner, out, seqs, block):
            h = runner.backend.to_numpy(out.h).astype(np.float32).reshape(-1, block - 1, shape.hidden_size)
            seen.extend(zip([list(s.token_ids) for s in seqs], h))
            return inner.host_part(runner, out, seqs, block)
    llm.proposer = Recording()
    llm.generate(PROMPTS, _greedy(12))
    ref, bidirectional = Reference(*paths), Reference(*paths)
    bidirectional.causal = [False, False]
    assert len(seen) >= 10
    for tokens, h in seen:
        np.testing.assert_allclose(h, ref.draft_rows(tokens, 6)[0], rtol=1e-4, atol=1e-4)
        assert not np.allclose(h, bidirectional.draft_rows(tokens, 6)[0], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------- losslessness

@pytest.fixture(scope="module")
def reference_outputs(pair):
    paths, _ = pair
    llm = LLM(paths[0], backend="cpu", kv_block_size=8)
    return [o.token_ids for o in llm.generate(PROMPTS, _greedy())]


@pytest.mark.parametrize("block", [None, 3, 10])
def test_speculative_greedy_equals_autoregressive(pair, reference_outputs, block):
    paths, shape = pair
    opts = [None]
    if shape.heads.kind == "dspark":
        opts += [DraftOptions(confidence_threshold=0.5), DraftOptions(adaptive=True, verify_cost=0.3)]
    for o in opts:
        outs = _llm(paths, block, draft_options=o).generate(PROMPTS, _greedy())
        assert [x.token_ids for x in outs] == reference_outputs, o


def test_identity_conv_drafts_exactly_what_the_dflash_backbone_drafts(tmp_path):
    """Same seed, same backbone: DFlash, and DFlash2 with identity conv and an all-zero selector."""
    dflash = write_random_pair(tmp_path / "a", TinyShape(), seed=11)
    dflash2 = write_random_pair(tmp_path / "b", TinyShape(heads=TinyHeads(kind="dflash2", conv_identity=True,
                                                                         selector_scale=0.0)), seed=11)
    runs = []
    for paths in (dflash, dflash2):
        llm = _llm(paths, block=8)
        calls = record(llm)
        outs = llm.generate(PROMPTS, _greedy())
        runs.append(([[d.tolist() for d in p.drafts] for _, p in calls], [o.acceptance_lengths for o in outs]))
    assert runs[0] == runs[1]


def test_dspark_dialects_draft_the_same(tmp_path):
    """DeepSpec-native (own copies of the target's embedding and head) and nested: same weights, same drafts."""
    out = []
    for dialect in ("deepspec", "nested"):
        shape = TinyShape(heads=TinyHeads(kind="dspark", dialect=dialect))
        paths = write_random_pair(tmp_path / dialect, shape, seed=5)
        llm = _llm(paths, block=6)
        calls = record(llm)
        llm.generate(PROMPTS, _greedy(16))
        out.append([[d.tolist() for d in p.drafts] for _, p in calls])
    assert out[0] == out[1]


# ----------------------------------------------------------------------------------------- verify policies

def test_confident_lengths():
    conf = np.array([[0.9, 0.8, 0.2, 0.9], [0.1, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9]])
    assert confident_lengths(conf, 0.5).tolist() == [2, 0, 4]


def test_adaptive_lengths_trade_expected_tokens_against_verify_cost():
    conf = np.array([[0.95, 0.9, 0.9, 0.2], [0.3, 0.9, 0.9, 0.9]])
    full = np.array([4, 4])
    assert adaptive_lengths(conf, full, 0.0).tolist() == [4, 4]  # free verification: verify everything
    assert adaptive_lengths(conf, full, 100.0).tolist() == [0, 0]  # verification dominates: no drafts
    # In between, drafts go in order of survival probability while they pay for themselves.
    lengths = adaptive_lengths(conf, full, 0.1)
    assert lengths.tolist() == [3, 0]
    survival = np.cumprod(conf, axis=1)

    def throughput(k):
        return (2 + sum(survival[i, :k[i]].sum() for i in range(2))) / (1 + 0.1 * (2 + sum(k)))
    best = max(itertools.product(range(5), repeat=2), key=throughput)
    assert throughput(lengths) == pytest.approx(throughput(best))
    assert adaptive_lengths(conf, np.array([1, 4]), 0.0).tolist() == [1, 4]  # never past a cut


# -------------------------------------------------------------------------- sampling with the selector

VOCAB, BLOCK, RUNS = 16, 4, 2000
PROMPT = [3, 7, 2, 9, 4]


@pytest.fixture(scope="module")
def selector_pair(tmp_path_factory):
    shape = TinyShape(vocab_size=VOCAB, hidden_size=32, num_layers=2, intermediate_size=64, target_layer_ids=[0, 1],
                      block_size=BLOCK, mask_token_id=15, eos_token_id=0,
                      heads=TinyHeads(kind="dflash2", selector_top_k=8, selector_rank=8, selector_scale=0.3))
    return write_random_pair(tmp_path_factory.mktemp("selector"), shape, seed=7)


def _exact_first_tokens(llm: LLM, params: SamplingParams) -> list[np.ndarray]:
    p1 = target_probs(last_logits(llm, PROMPT), params)
    p2_given = np.stack([target_probs(last_logits(llm, PROMPT + [a]), params) for a in range(VOCAB)])
    p3 = sum(p1[a] * p2_given[a, b] * target_probs(last_logits(llm, PROMPT + [a, b]), params)
             for a, b in itertools.product(range(VOCAB), repeat=2) if p1[a] * p2_given[a, b] > 1e-9)
    return [p1, p1 @ p2_given, p3]


def _sampled_pvalues(llm: LLM) -> tuple[list[float], float]:
    params = SamplingParams(temperature=1.0)
    outs = llm.generate([PROMPT] * RUNS, [SamplingParams(max_tokens=3, seed=i, ignore_eos=True, temperature=1.0)
                                          for i in range(RUNS)])
    tokens = np.array([o.token_ids[:3] for o in outs])
    exact = _exact_first_tokens(llm, params)
    pvalues = [chi_square_pvalue(np.bincount(tokens[:, i], minlength=VOCAB), exact[i]) for i in range(3)]
    return pvalues, float(np.mean([a for o in outs for a in o.acceptance_lengths]))


def test_selector_sampling_matches_the_target_distribution(selector_pair):
    llm = _llm(selector_pair, BLOCK, max_num_seqs=256)
    pvalues, tau = _sampled_pvalues(llm)
    assert tau > 1.3, tau  # drafts are accepted often enough for the acceptance rule to matter
    assert min(pvalues) > 1e-3, pvalues


def test_a_wrong_acceptance_rule_fails_the_selector_test(selector_pair, monkeypatch):
    """Accept with min(1, p/q) but resample from p (not the residual max(p - q, 0)): the test must catch it."""
    monkeypatch.setattr(sampler, "rejection_sample", wrong_rejection_sample)
    pvalues, _ = _sampled_pvalues(_llm(selector_pair, BLOCK, max_num_seqs=256))
    assert min(pvalues) < 1e-3, pvalues


# ------------------------------------------------------------------------------------- checkpoint errors

def _rewrite(paths, edit_cfg=None, drop=(), add=None):
    """Change a written drafter: its config (edit_cfg(cfg)), drop tensors, add tensors."""
    from cudflash.checkpoint import Checkpoint
    from cudflash.tiny import write_safetensors
    _, draft = paths
    if edit_cfg is not None:
        cfg = json.loads((draft / "config.json").read_text())
        edit_cfg(cfg)
        (draft / "config.json").write_text(json.dumps(cfg))
    if drop or add:
        ckpt = Checkpoint(draft)
        tensors = {n: ckpt.float32(n) for n in ckpt.names if ckpt.info(n).dtype in ("BF16", "F32") and n not in drop}
        tensors.update(add or {})
        write_safetensors(draft / "model.safetensors", tensors, "F32")


def _drafter_error(paths, *needles):
    with pytest.raises(CudflashError) as e:
        _llm(paths)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("case", ["undeclared-markov", "missing-selector", "unknown-tensor", "gated-markov",
                                  "missing-d2t"])
def test_checkpoint_config_mismatch_is_an_error(tmp_path, case):
    heads = {"undeclared-markov": TinyHeads(kind="dspark"), "missing-selector": TinyHeads(kind="dflash2"),
             "unknown-tensor": TinyHeads(kind="dflash2"), "gated-markov": TinyHeads(kind="dspark", dialect="nested"),
             "missing-d2t": TinyHeads(kind="dspark", draft_vocab_size=100)}[case]
    paths = write_random_pair(tmp_path, TinyShape(heads=heads), seed=1)
    if case == "undeclared-markov":  # a DSpark checkpoint whose config lost its Markov fields
        def edit(cfg):
            cfg["architectures"] = ["DFlashDraftModel"]
            for k in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
                cfg.pop(k)
        _rewrite(paths, edit)
        _drafter_error(paths, "markov_head.markov_w1.weight", "markov_rank")
    elif case == "missing-selector":
        _rewrite(paths, drop=("candidate_selector.successor_codebook",))
        _drafter_error(paths, "candidate_selector.successor_codebook")
    elif case == "unknown-tensor":
        _rewrite(paths, add={"layers.0.self_attn.g_proj.weight": np.zeros((4, 64), np.float32)})
        _drafter_error(paths, "layers.0.self_attn.g_proj.weight", "would not use")
    elif case == "gated-markov":
        _rewrite(paths, lambda cfg: cfg["dflash_config"].update(markov_head_type="gated"))
        _drafter_error(paths, "gated", "vanilla")
    else:
        _rewrite(paths, drop=("d2t",))
        _drafter_error(paths, "d2t")


def test_new_ops_reference_semantics():
    """The numpy definitions of the ops added for the drafters, against direct loops."""
    b, rng = NumpyBackend(), np.random.default_rng(0)
    x, base = rng.standard_normal((6, 8)).astype(np.float32), rng.standard_normal((2, 8)).astype(np.float32)
    coeff = rng.standard_normal((6, 4)).astype(np.float32)  # K = 2 taps x G = 2 groups of 4 channels
    out = b.block_conv(x, coeff, base, block=3)
    for t, c in itertools.product(range(6), range(8)):
        want = (base[0, c] + coeff[t, c // 4]) * x[t, c]
        if t % 3:
            want += (base[1, c] + coeff[t, 2 + c // 4]) * x[t - 1, c]
        assert out[t, c] == pytest.approx(want, rel=1e-5, abs=1e-6)
    v = np.array([[1.0, 3.0, 3.0, 2.0, 3.0]], dtype=np.float32)
    vals, ids = b.topk(v, 3)
    assert ids.tolist() == [[1, 2, 4]] and vals.tolist() == [[3.0, 3.0, 3.0]]
    vals, ids = b.topk(v, 4)
    assert ids.tolist() == [[1, 2, 4, 3]]
    A, B = rng.standard_normal((5, 3)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    h, unary = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((2, 2)).astype(np.float32)
    cand, pred = np.array([[1, 4], [0, 2]], np.int32), np.array([[3, 3], [1, 4]], np.int32)
    s = b.pair_scores(unary, cand, pred, h, A, B)
    for t, p, c in itertools.product(range(2), range(2), range(2)):
        assert s[t, p, c] == pytest.approx(unary[t, c] + float(np.sum(A[pred[t, p]] * h[t] * B[cand[t, c]])), rel=1e-5)


def test_dflash_drafts_stay_on_the_device_and_equal_the_host_path(tmp_path):
    """A plain DFlash drafter's drafts are final on the device (the step writes them into the verify batch with no
    host round trip); passed through the host instead, they are exactly the same drafts and the same output."""
    paths = write_random_pair(tmp_path, TinyShape(), seed=2)
    llm = _llm(paths)
    assert isinstance(llm.proposer, DraftProposer) and llm.proposer.drafts_on_device
    direct = llm.generate(PROMPTS, _greedy())
    calls = record(llm)  # the same proposer, every proposal read on the host before verification
    through_host = llm.generate(PROMPTS, _greedy())
    assert [o.token_ids for o in through_host] == [o.token_ids for o in direct]
    assert [o.acceptance_lengths for o in through_host] == [o.acceptance_lengths for o in direct]
    assert calls and all(len(d) == llm.block_size - 1 for _, p in calls for d in p.drafts)


# ------------------------------------------------------------------------------------------------- CLI

def test_cli_draft_options(tmp_path):
    import subprocess
    import sys
    dspark = write_random_pair(tmp_path / "s", TinyShape(heads=TinyHeads(kind="dspark")), seed=1)
    dflash = write_random_pair(tmp_path / "d", TinyShape(), seed=1)

    def run(paths, *args):
        return subprocess.run([sys.executable, "-m", "cudflash", "generate", "--target", str(paths[0]), "--draft",
                               str(paths[1]), "--prompts", str(prompts), "--backend", "cpu", "--ignore-eos",
                               "--max-new-tokens", "8", *args], capture_output=True, text=True)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7, 8]}\n')
    base = subprocess.run([sys.executable, "-m", "cudflash", "generate", "--target", str(dspark[0]), "--prompts",
                           str(prompts), "--backend", "cpu", "--ignore-eos", "--max-new-tokens", "8"],
                          capture_output=True, text=True)
    for args in (["--confidence-threshold", "0.5"], ["--adaptive-verify", "--verify-cost", "0.2"]):
        r = subprocess.run([sys.executable, "-m", "cudflash", "generate", "--target", str(dspark[0]), "--draft",
                            str(dspark[1]), "--prompts", str(prompts), "--backend", "cpu", "--ignore-eos",
                            "--max-new-tokens", "8", *args], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["token_ids"] == json.loads(base.stdout)["token_ids"]
    r = run(dflash, "--adaptive-verify")
    assert r.returncode == 2 and r.stderr.startswith("cudflash: error:") and "confidence head" in r.stderr
    r = run(dflash, "--draft-window", "16")
    assert r.returncode == 2 and "no sliding_attention layers" in r.stderr
