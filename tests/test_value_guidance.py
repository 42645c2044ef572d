"""Value model, losses and guided decoding (pita/models/value_model.py, pita/algos/guidance.py,
pita/algos/losses.py): hand-computed offsets, η = 0 is π_ref exactly, a certain token wins
greedy decoding, one value forward per step with a KV cache equal to full recomputation."""

from __future__ import annotations

import math

import pytest
import torch

from pita.algos import losses
from pita.algos.guidance import HookStats, ValueGuidanceHook, hook_factory, offsets_from_values
from pita.core.schema import ValueGuidedConfig, settings
from pita.models.generation import generate
from pita.models.tiny import build_tiny_llama, tiny_llama_config
from pita.models.value_model import ValueModel, build_value_model

V, PAD, EOS = 12, 10, 11


def _value_model(num_atoms: int = 1, seed: int = 0) -> ValueModel:
    from transformers import LlamaModel

    torch.manual_seed(seed)
    config = tiny_llama_config(
        V, n_layer=2, d_model=32, n_head=4, max_position=64, pad_token_id=PAD, eos_token_id=EOS
    )
    return ValueModel(LlamaModel(config), V, num_atoms=num_atoms).eval()


def _reference(seed: int = 1):
    return build_tiny_llama(
        V, n_layer=1, d_model=32, n_head=4, pad_token_id=PAD, eos_token_id=EOS, seed=seed
    )


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3]]


# --- offsets against hand-computed values -------------------------------------------------


def test_bernoulli_offsets():
    logits = torch.tensor([[0.0], [math.log(3.0)], [-math.log(3.0)]])  # p = 1/2, 3/4, 1/4
    off = offsets_from_values(logits, 2.0, "bernoulli", torch.tensor([1.0]))
    want = [
        math.log(0.5 + 0.5 * math.e**2),
        math.log(0.25 + 0.75 * math.e**2),
        math.log(0.75 + 0.25 * math.e**2),
    ]
    assert off.tolist() == pytest.approx(want, rel=1e-6)
    assert (off > 0).all()  # offsets are not clamped to <= 0


def test_expectation_offsets():
    logits = torch.tensor([[math.log(3.0)], [0.0], [-math.log(4.0)]])  # p = 3/4, 1/2, 1/5
    off = offsets_from_values(logits, 2.0, "expectation", torch.tensor([1.0]))
    assert off.tolist() == pytest.approx([2 * math.log(3.0), 0.0, -2 * math.log(4.0)], abs=1e-6)


def test_mle_offsets():
    pmf = torch.tensor([0.2, 0.3, 0.5])
    atoms = torch.tensor([0.0, 0.5, 1.0])
    off = offsets_from_values(pmf.log()[None], 2.0, "mle", atoms)
    assert off.item() == pytest.approx(math.log(0.2 + 0.3 * math.e + 0.5 * math.e**2), rel=1e-6)
    with pytest.raises(ValueError, match="distributional"):
        offsets_from_values(torch.zeros(1, 1), 2.0, "mle", torch.tensor([1.0]))


def test_p_clamped_only_for_numerics():
    big = torch.tensor([[100.0], [-100.0]])  # σ = 1 and 0 in fp32
    expect = offsets_from_values(big, 1.0, "expectation", torch.tensor([1.0]))
    bound = math.log((1 - 1e-6) / 1e-6)
    assert expect.tolist() == pytest.approx([bound, -bound], rel=1e-3)
    bern = offsets_from_values(big, 3.0, "bernoulli", torch.tensor([1.0]))
    assert bern[0].item() == pytest.approx(3.0, abs=1e-4) and bern[1].item() == pytest.approx(
        0.0, abs=1e-4
    )


def test_distributional_head_with_scalar_modes_uses_the_mean():
    atoms = torch.tensor([0.0, 0.5, 1.0])
    pmf = torch.tensor([[0.25, 0.5, 0.25]])  # mean 0.5
    off = offsets_from_values(pmf.log(), 2.0, "bernoulli", atoms)
    assert off.item() == pytest.approx(math.log(0.5 + 0.5 * math.e**2), rel=1e-5)


# --- guided decoding ------------------------------------------------------------------------


def _gen(ref, factory, *, do_sample=True, top_k=0, seed=0):
    return generate(
        ref,
        PROMPTS,
        max_new_tokens=6,
        batch_size=3,
        pad_token_id=PAD,
        eos_token_id=EOS,
        do_sample=do_sample,
        top_k=top_k,
        generator=torch.Generator().manual_seed(seed),
        offset_hook_factory=factory,
    )


@pytest.mark.parametrize("mode", ["bernoulli", "expectation"])
def test_eta_zero_is_the_reference_exactly(mode):
    ref, vm = _reference(), _value_model()
    torch.nn.init.normal_(vm.head.weight, std=1.0)
    plain, guided = _gen(ref, None), _gen(ref, hook_factory(vm, 0.0, mode))
    assert guided.responses == plain.responses
    assert guided.logprobs == plain.logprobs and guided.base_logprobs == plain.base_logprobs


def test_zero_initialised_head_leaves_the_reference_unchanged():
    ref, vm = _reference(), _value_model()
    plain, guided = _gen(ref, None), _gen(ref, hook_factory(vm, 5.0, "bernoulli"))
    assert guided.responses == plain.responses
    for a, b in zip(guided.logprobs, plain.logprobs):
        assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize("mode,atoms", [("bernoulli", 1), ("expectation", 1), ("mle", 5)])
def test_a_certain_token_wins_greedy_decoding(mode, atoms):
    ref, vm = _reference(), _value_model(num_atoms=atoms)
    target = 7
    bias = vm.head.bias.detach().view(V, atoms)
    bias.fill_(-20.0 if atoms == 1 else 0.0)
    if atoms == 1:
        bias[target] = 20.0  # p(target) = 1, every other token p = 0
    else:
        bias[:, 0] = 20.0  # every token: all mass on the lowest atom ...
        bias[target] = torch.tensor([0.0] * (atoms - 1) + [20.0])  # ... the target on the highest
    guided = _gen(ref, hook_factory(vm, 10.0, mode), do_sample=False)
    assert all(r and all(t == target for t in r) for r in guided.responses), guided.responses


def test_one_value_forward_per_step_and_cache_matches_recomputation():
    ref, vm = _reference(), _value_model()
    torch.nn.init.normal_(vm.head.weight, std=1.0)
    forwards = [0]
    vm.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    seen = []

    class Recording(ValueGuidanceHook):
        def __call__(self, step_ids, attention_mask, position_ids, logits):
            off = super().__call__(step_ids, attention_mask, position_ids, logits)
            seen.append((attention_mask.clone(), off.clone()))
            return off

    stats = HookStats()
    out = generate(
        ref,
        PROMPTS,
        max_new_tokens=5,
        batch_size=4,
        pad_token_id=PAD,
        eos_token_id=EOS,
        do_sample=True,
        generator=torch.Generator().manual_seed(3),
        force_full_length=True,
        offset_hook_factory=lambda: Recording(vm, 2.0, "bernoulli", stats),
    )
    assert forwards[0] == stats.forwards == stats.steps == 5  # one batch of 4, 5 steps
    # the cached offsets at the last step equal a full forward of prompt + generated tokens
    order = sorted(range(len(PROMPTS)), key=lambda i: -len(PROMPTS[i]))
    mask, off = seen[-1]
    width = max(map(len, PROMPTS))
    rows = [[PAD] * (width - len(PROMPTS[i])) + PROMPTS[i] + out.responses[i][:4] for i in order]
    x = torch.tensor(rows)
    with torch.no_grad():
        full = vm(x, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).values[
            :, -1
        ]
    want = offsets_from_values(full, 2.0, "bernoulli", vm.atoms)
    assert torch.allclose(off, want, atol=1e-4)


# --- value model --------------------------------------------------------------------------


def test_value_model_save_load_and_warm_start(tmp_path):
    ref = _reference()
    fam = {"name": "tiny", "guide_arch": {"n_layer": 2, "d_model": 32, "n_head": 4}}
    algo = settings(
        ValueGuidedConfig,
        {"loss_type": "mle", "num_atoms": 5, "V_min": -1.0, "V_max": 2.0, "warm_start": True},
    )
    vm = build_value_model(ref, fam, algo, vocab_size=V)
    assert torch.equal(vm.backbone.embed_tokens.weight, ref.model.embed_tokens.weight)
    assert torch.equal(
        vm.backbone.layers[0].mlp.up_proj.weight, ref.model.layers[0].mlp.up_proj.weight
    )
    assert not vm.head.weight.any() and not vm.head.bias.any()  # zero-initialised head
    assert vm.atoms.tolist() == pytest.approx([-1.0, -0.25, 0.5, 1.25, 2.0])
    torch.nn.init.normal_(vm.head.weight)
    vm.save(tmp_path / "value_model")
    loaded = ValueModel.load(tmp_path / "value_model")
    x = torch.tensor([[1, 2, 3, 4]])
    assert torch.allclose(loaded(x).values, vm(x).values, atol=1e-4)  # (sdpa vs eager rounding)
    assert loaded(x).values.shape == (1, 4, V, 5)
    # values_at gathers the same numbers as the full head
    acts = torch.tensor([[2, 3, 4, 5]])
    assert torch.allclose(
        vm.values_at(vm.hidden(x), acts),
        vm(x).values.gather(2, acts[..., None, None].expand(1, 4, 1, 5)).squeeze(2),
        atol=1e-6,
    )
    assert (tmp_path / "value_model" / "model.safetensors").is_file()


def test_warm_start_layers_copies_only_the_bottom_blocks():
    """`warm_start_layers=1` (the bottom half of a 2-block reference) copies embeddings, block
    0 and the final norm; block 1 keeps its own initialisation (issue 15's comparison)."""
    ref = build_tiny_llama(
        V, n_layer=2, d_model=32, n_head=4, pad_token_id=PAD, eos_token_id=EOS, seed=1
    )
    fam = {"name": "tiny", "guide_arch": {"n_layer": 2, "d_model": 32, "n_head": 4}}
    algo = settings(
        ValueGuidedConfig,
        {"loss_type": "bce", "num_atoms": 1, "V_min": 0.0, "V_max": 1.0}
        | {"warm_start": True, "warm_start_layers": 1},
    )
    vm = build_value_model(ref, fam, algo, vocab_size=V)

    def up(layers, i):
        return layers[i].mlp.up_proj.weight

    assert torch.equal(vm.backbone.embed_tokens.weight, ref.model.embed_tokens.weight)
    assert torch.equal(up(vm.backbone.layers, 0), up(ref.model.layers, 0))
    assert not torch.equal(up(vm.backbone.layers, 1), up(ref.model.layers, 1))
    assert torch.equal(vm.backbone.norm.weight, ref.model.norm.weight)


# --- losses -------------------------------------------------------------------------------


def test_losses_on_tiny_tensors():
    logits, y = torch.tensor([0.0, math.log(3.0)]), torch.tensor([1.0, 0.0])
    assert losses.bce_loss(logits, y).item() == pytest.approx(
        (math.log(2) + math.log(4)) / 2, rel=1e-6
    )
    w = torch.tensor([3.0, 1.0])
    assert losses.bce_loss(logits, y, w).item() == pytest.approx(
        (3 * math.log(2) + math.log(4)) / 4, rel=1e-6
    )
    assert losses.mse_loss(logits, y).item() == pytest.approx((0.25 + 0.5625) / 2, rel=1e-6)
    # mle: the atom of r = 0.74 on 5 atoms over [0, 1] is round(2.96) = 3
    hist = losses.atom_histogram(torch.tensor([0.74, -3.0]), 5, 0.0, 1.0)
    assert hist.argmax(-1).tolist() == [3, 0]
    atom_logits = torch.log(torch.tensor([[0.1, 0.1, 0.1, 0.6, 0.1], [0.5, 0.2, 0.1, 0.1, 0.1]]))
    assert losses.mle_loss(atom_logits, hist).item() == pytest.approx(
        -(math.log(0.6) + math.log(0.5)) / 2, rel=1e-5
    )
    # Bradley–Terry: −log σ(a − b), soft preference
    a, b = torch.tensor([2.0]), torch.tensor([1.0])
    assert losses.bradley_terry_loss(a, b).item() == pytest.approx(
        math.log1p(math.exp(-1.0)), rel=1e-6
    )
    assert losses.bradley_terry_loss(a, b, torch.tensor([0.0])).item() == pytest.approx(
        math.log1p(math.exp(1.0)), rel=1e-6
    )


def test_merged_targets_give_the_records_objective():
    """Σ_records BCE over trained positions == Σ_units weight·BCE(mean target) (build_targets)."""
    from pita.algos.value_training import build_targets

    items = [
        ([1, 2], [3, 4, EOS], 0, [1.0], None),
        ([1, 2], [3, 4, EOS], 1, [0.0], None),
        ([1, 2], [3, 5, EOS], 0, [0.0], None),
        ([1], [2, 3, EOS], 2, [1.0], None),
        ([1, 2], [3, 5, EOS], 0, [1.0], None),
    ]
    data = build_targets(items, PAD)
    assert data["unique"] == 3
    torch.manual_seed(0)
    table = torch.randn(64, V)  # a stand-in value function: logit of (hash of prefix, token)

    def logit(seq, t):  # value of seq[t] given seq[:t]
        return table[hash(tuple(seq[:t])) % 64, seq[t]]

    want = sum(
        losses.bce_loss(logit(p + r, len(p) + j)[None], torch.tensor(t)).item()
        for p, r, s, t, _ in items
        for j in range(s, len(r))
    )
    got = 0.0
    for u in range(data["unique"]):
        seq = data["ids"][u].tolist()
        for col in range(data["weight"].shape[1]):
            w = data["weight"][u, col].item()
            if w > 0:
                got += w * losses.bce_loss(logit(seq, col + 1)[None], data["target"][u, col]).item()
    assert got == pytest.approx(want, rel=1e-5)
    assert data["weight"].sum().item() == pytest.approx(sum(len(r) - s for _, r, s, _, _ in items))
