"""The batched generation engine against one-at-a-time decoding and teacher forcing."""

from __future__ import annotations

import json
import math
import random
import runpy
import sys
from pathlib import Path

import pytest
import torch

from pita.models.generation import forced_logprobs, generate, select_tokens
from pita.models.tiny import build_tiny_llama

PAD, BOS, EOS = 0, 1, 2
VOCAB = 32


@pytest.fixture(scope="module")
def model():
    # A larger init than the default makes logits decisive, so greedy ties cannot flip
    # between padded and unpadded runs.
    return build_tiny_llama(
        VOCAB,
        n_layer=2,
        d_model=32,
        n_head=4,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        seed=0,
        initializer_range=0.3,
    )


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    lengths = [1, 7, 3, 12, 5, 2, 9, 4, 15, 6, 3]  # mixed, unsorted
    return [[BOS] + [rng.randrange(3, VOCAB) for _ in range(n - 1)] for n in lengths]


def _gen(model, prompts, **kw):
    args = {"max_new_tokens": 8, "batch_size": 4, "pad_token_id": PAD, "eos_token_id": EOS}
    args.update(kw)
    return generate(model, prompts, **args)


def _close(a, b, tol=1e-4):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert len(ra) == len(rb)
        assert all(abs(x - y) < tol for x, y in zip(ra, rb)), (ra, rb)


def _gen_counting(model, prompts, **kw):
    """`_gen`, and the model's forward passes it made (one list item each)."""
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        return _gen(model, prompts, **kw), calls
    finally:
        handle.remove()


def test_batched_greedy_equals_one_at_a_time(model, prompts):
    batched = _gen(model, prompts, do_sample=False, batch_size=4)
    single = [_gen(model, [p], do_sample=False, batch_size=1) for p in prompts]
    assert batched.responses == [s.responses[0] for s in single]
    _close(batched.base_logprobs, [s.base_logprobs[0] for s in single])
    # Some rows really ran with left padding and more than one token was generated.
    assert max(map(len, batched.responses)) > 1


def test_batched_greedy_equals_one_at_a_time_with_sdpa(prompts):
    sdpa = build_tiny_llama(
        VOCAB,
        d_model=32,
        pad_token_id=PAD,
        eos_token_id=EOS,
        seed=1,
        initializer_range=0.3,
        attn_impl="sdpa",
    )
    batched = _gen(sdpa, prompts, do_sample=False, batch_size=6)
    single = [_gen(sdpa, [p], do_sample=False, batch_size=1).responses[0] for p in prompts]
    assert batched.responses == single


def test_hook_sees_fed_tokens_masks_and_positions(model, prompts):
    seen = []

    def factory():
        def hook(step_ids, attention_mask, position_ids, logits):
            seen.append((step_ids.clone(), attention_mask.clone(), position_ids.clone()))
            assert logits.dtype == torch.float32 and logits.shape == (step_ids.shape[0], VOCAB)

        return hook

    batch = prompts[:3]  # lengths 1, 7, 3
    _gen(
        model,
        batch,
        do_sample=False,
        batch_size=3,
        max_new_tokens=4,
        force_full_length=True,
        offset_hook_factory=factory,
    )
    assert len(seen) == 4
    ids0, mask0, pos0 = seen[0]
    assert ids0.shape == mask0.shape == pos0.shape == (3, 7)
    lengths = mask0.sum(-1).tolist()
    assert sorted(lengths) == [1, 3, 7]  # left padded, longest first
    for b, n in enumerate(lengths):
        assert mask0[b, : 7 - n].sum() == 0  # padding on the left
        assert pos0[b, 7 - n :].tolist() == list(range(n))  # positions start at 0
    for t, (ids, mask, pos) in enumerate(seen[1:], start=1):
        assert ids.shape == pos.shape == (3, 1)
        assert mask.shape == (3, 7 + t)
        assert pos[:, 0].tolist() == [n - 1 + t for n in lengths]


class ForceTokens:
    """Greedy-forcing hook: a row with a real prompt length of n emits n - 1 copies of
    token 5, then EOS (decided from the attention mask, so batch order does not matter)."""

    def __init__(self, fed):
        self.step = 0
        self.lengths = None
        self.fed = fed

    def __call__(self, step_ids, attention_mask, position_ids, logits):
        if self.lengths is None:
            self.lengths = attention_mask.sum(-1)
        else:
            self.fed.append((self.step, step_ids[:, 0].clone(), self.lengths.clone()))
        offsets = torch.zeros_like(logits)
        done = self.lengths - 1 == self.step
        offsets[:, 5] = torch.where(done, 0.0, 1e4)
        offsets[:, EOS] = torch.where(done, 1e4, 0.0)
        self.step += 1
        return offsets


def test_rows_stop_at_eos_and_are_truncated(model):
    prompts = [[BOS, 7, 8], [BOS], [BOS, 9]]  # EOS at steps 2, 0, 1
    fed = []
    out, calls = _gen_counting(
        model,
        prompts,
        do_sample=False,
        max_new_tokens=6,
        offset_hook_factory=lambda: ForceTokens(fed),
    )
    assert out.responses == [[5, 5, EOS], [EOS], [5, EOS]]
    assert [len(x) for x in out.logprobs] == [3, 1, 2]
    assert [len(x) for x in out.base_logprobs] == [3, 1, 2]
    assert len(calls) == 3  # the loop stops once every row has emitted EOS
    # A finished row is fed pad from the step after its EOS.
    for step, ids, lengths in fed:
        for tok, n in zip(ids.tolist(), lengths.tolist()):
            if step - 1 > n - 1:
                assert tok == PAD


def test_sparse_eos_checks_run_extra_steps_but_return_the_same_rows(model, prompts, monkeypatch):
    """On an accelerator the loop reads "all finished?" back every EOS_CHECK_EVERY steps;
    the padding steps it runs after the last EOS must not change any row (forced here on
    CPU, one batch so the generator's stream is the same up to the last real step)."""
    from pita.models import generation

    class RisingEos:  # pushes EOS a little more every step, so every row stops early
        def __init__(self):
            self.step = 0

        def __call__(self, step_ids, attention_mask, position_ids, logits):
            self.step += 1
            off = torch.zeros_like(logits)
            off[:, EOS] = 0.6 * self.step
            return off

    kw = dict(
        max_new_tokens=20,
        batch_size=len(prompts),
        do_sample=True,
        temperature=2.0,
        offset_hook_factory=RisingEos,
    )
    first = _gen(model, prompts, generator=torch.Generator().manual_seed(5), **kw)
    lengths = [len(r) for r in first.responses]
    assert max(lengths) < 20, "some row must stop early for this test to mean anything"
    monkeypatch.setattr(generation, "eos_check_every", lambda device: 8)
    sparse, calls = _gen_counting(model, prompts, generator=torch.Generator().manual_seed(5), **kw)
    assert sparse.responses == first.responses
    _close(sparse.logprobs, first.logprobs)
    _close(sparse.base_logprobs, first.base_logprobs)
    assert max(lengths) % 8 != 0  # so the sparse loop really ran padding steps
    assert len(calls) == min(20, -(-max(lengths) // 8) * 8)  # ran on to the next check


def test_force_full_length_ignores_eos(model):
    prompts = [[BOS, 7, 8], [BOS], [BOS, 9]]
    out, calls = _gen_counting(
        model,
        prompts,
        do_sample=False,
        max_new_tokens=6,
        force_full_length=True,
        offset_hook_factory=lambda: ForceTokens([]),
    )
    assert [len(r) for r in out.responses] == [6, 6, 6]
    assert out.responses[1][0] == EOS  # EOS emitted, generation went on
    assert len(calls) == 6


def test_several_eos_ids(model, prompts):
    free = _gen(model, prompts, do_sample=False)
    first = [r[0] for r in free.responses]
    out = _gen(model, prompts, do_sample=False, eos_token_id=[EOS, first[3]])
    assert out.responses[3] == [first[3]]


def test_logprobs_equal_teacher_forcing_at_temperature_one(model, prompts):
    gen = torch.Generator().manual_seed(1)
    out = _gen(model, prompts, do_sample=True, generator=gen, max_new_tokens=10)
    forced = forced_logprobs(model, prompts, out.responses, batch_size=3, pad_token_id=PAD)[0]
    _close(out.logprobs, forced)
    _close(out.base_logprobs, forced)
    assert all(abs(k) < 1e-4 for k in out.kl())


def _hf_processed_logprobs(model, prompt, response, *, temperature, top_k, top_p):
    """Independent reference: HF's own logits warpers on an unpadded full forward."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    scores = TopKLogitsWarper(top_k)(ids, logits) if top_k else logits
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    scores = TopPLogitsWarper(top_p)(ids, scores)
    lp = scores.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
    return lp.tolist()


def test_processed_logprobs_and_base_logprobs(model, prompts):
    kw = {"temperature": 0.7, "top_k": 6, "top_p": 0.8}
    gen = torch.Generator().manual_seed(2)
    out = _gen(model, prompts, do_sample=True, generator=gen, max_new_tokens=6, **kw)
    forced = forced_logprobs(model, prompts, out.responses, batch_size=5, pad_token_id=PAD)[0]
    _close(out.base_logprobs, forced)
    expected = [_hf_processed_logprobs(model, p, r, **kw) for p, r in zip(prompts, out.responses)]
    _close(out.logprobs, expected)
    assert all(k > -1e-4 for k in out.kl())
    assert sum(out.kl()) > 0.1


def test_offset_hook_steers_greedy_and_sampling(model, prompts):
    def factory():
        def hook(step_ids, attention_mask, position_ids, logits):
            offsets = torch.zeros_like(logits)
            offsets[:, 7] = 1e4
            return offsets

        return hook

    greedy = _gen(model, prompts, do_sample=False, offset_hook_factory=factory)
    assert all(r == [7] * 8 for r in greedy.responses)
    gen = torch.Generator().manual_seed(0)
    sampled = _gen(model, prompts, generator=gen, offset_hook_factory=factory)
    assert all(r == [7] * 8 for r in sampled.responses)
    assert all(abs(x) < 1e-4 for row in sampled.logprobs for x in row)
    forced = forced_logprobs(model, prompts, sampled.responses, batch_size=4, pad_token_id=PAD)[0]
    _close(sampled.base_logprobs, forced)
    assert min(sampled.kl()) > 0  # guidance moved the policy away from the model


def test_offsets_apply_only_to_top_k_candidates(model, prompts):
    free = _gen(model, prompts, do_sample=False, max_new_tokens=1)
    logits = model(input_ids=torch.tensor([prompts[0]])).logits[0, -1]
    worst = int(logits.argmin())

    def factory():
        def hook(step_ids, attention_mask, position_ids, logits):
            offsets = torch.zeros_like(logits)
            offsets[:, worst] = 1e4  # outside the top-2: must have no effect
            return offsets

        return hook

    out = _gen(
        model, prompts[:1], do_sample=False, max_new_tokens=1, top_k=2, offset_hook_factory=factory
    )
    assert out.responses[0] == free.responses[0]


def test_sampling_is_reproducible_with_a_seeded_generator(model, prompts):
    def run(seed):
        return _gen(model, prompts, generator=torch.Generator().manual_seed(seed)).responses

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_top_k_one_and_tiny_top_p_equal_greedy(model, prompts):
    greedy = _gen(model, prompts, do_sample=False).responses
    gen = torch.Generator().manual_seed(0)
    assert _gen(model, prompts, top_k=1, generator=gen).responses == greedy
    assert _gen(model, prompts, top_p=1e-6, generator=gen).responses == greedy


def test_sampler_follows_the_distribution():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0, float("-inf")]]).repeat(20000, 1)
    gen = torch.Generator().manual_seed(0)
    tok, lp, base = select_tokens(
        logits, None, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, generator=gen
    )
    freq = torch.bincount(tok, minlength=5).float() / tok.numel()
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.015)
    assert freq[4] == 0  # never a -inf token
    assert torch.allclose(lp, base)


def test_sequence_logprobs_matches_unbatched_forward(model, prompts):
    responses = [[5, 6, 7][: 1 + i % 3] for i in range(len(prompts))]
    responses[2] = []  # an empty response gives an empty list
    got = forced_logprobs(model, prompts, responses, batch_size=4, pad_token_id=PAD)[0]
    assert got[2] == []
    for p, r, g in zip(prompts, responses, got):
        if not r:
            continue
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
        want = logits.log_softmax(-1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(g, want.tolist()))


def test_bad_arguments_raise(model):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        _gen(model, [[BOS], []])
    with pytest.raises(ValueError, match="temperature"):
        _gen(model, [[BOS]], temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        _gen(model, [[BOS]], top_p=0.0)
    assert _gen(model, []).responses == []
    assert _gen(model, [[BOS]], max_new_tokens=0).responses == [[]]


def test_model_training_flag_is_restored(model, prompts):
    model.train()
    try:
        _gen(model, prompts[:2], do_sample=False)
        assert model.training
    finally:
        model.eval()


def test_bench_quick_prints_one_json_object(monkeypatch, capsys):
    bench = Path(__file__).resolve().parents[1] / "bench" / "generation.py"
    monkeypatch.setattr(
        sys, "argv", [str(bench), "--quick", "--n-prompts", "8", "--batch-size", "4"]
    )
    runpy.run_path(str(bench), run_name="__main__")
    result = json.loads(capsys.readouterr().out)
    for key in ("batched_tokens_per_s", "loop_tokens_per_s", "speedup", "device", "batch_size"):
        assert key in result
    assert result["n_prompts"] == 8 and result["outputs_match"] is True
