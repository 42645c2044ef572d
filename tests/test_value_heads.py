"""The V-type value head (candidate appended, scalar read-out) beside the Q-type head
(pita/models/value_model.py, pita/algos/guidance.py), the per-position diagnostics
(pita/algos/value_diagnostics.py) and the official schedule: batched top-k scoring over a
shared, expanded KV cache equals scoring each candidate separately without a cache; the
V-hook's offsets during real decoding equal a no-cache recomputation; training and guided
decoding run end to end with each head on goal-walk."""

from __future__ import annotations

import json
import math
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from pita.algos.guidance import CandidateGuidanceHook, HookStats, hook_factory, offsets_from_values
from pita.models.generation import generate, position_ids_from_mask
from pita.models.tiny import build_tiny_llama, tiny_llama_config
from pita.models.value_model import ValueModel
from tests.conftest import only, run_cli_later, run_dirs

V, PAD, EOS = 12, 10, 11
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3]]


def _sample(ref, prompts, factory, max_new_tokens: int, batch_size: int, **kw):
    """`generate` sampling with the tests' pad and EOS under the hooks `factory` makes."""
    return generate(
        ref,
        prompts,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        pad_token_id=PAD,
        eos_token_id=[EOS],
        do_sample=True,
        offset_hook_factory=factory,
        **kw,
    )


def _v_model(seed: int = 0, num_atoms: int = 1) -> ValueModel:
    from transformers import LlamaModel

    torch.manual_seed(seed)
    config = tiny_llama_config(
        V, n_layer=2, d_model=32, n_head=4, max_position=64, pad_token_id=PAD, eos_token_id=EOS
    )
    vm = ValueModel(LlamaModel(config), V, num_atoms=num_atoms, head_type="v")
    torch.nn.init.normal_(
        vm.head.weight, std=1.0
    )  # a zero head would make every comparison trivial
    torch.nn.init.normal_(vm.head.bias, std=1.0)
    return vm.eval()


def _alone(vm: ValueModel, prefix: list[int], token: int) -> torch.Tensor:
    """The value of `token` after `prefix`, one unpadded sequence, no cache: [M]."""
    with torch.no_grad():
        out = vm(torch.tensor([[*prefix, token]]))
    return out.values[0, -1, 0]


def _left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@pytest.mark.parametrize("num_atoms", [1, 3])
def test_batched_candidates_equal_separate_scoring(num_atoms):
    vm = _v_model(num_atoms=num_atoms)
    ids, mask = _left_pad(PROMPTS)
    cand = torch.tensor([[0, 5, 9], [1, 2, 3], [4, 4, 7], [8, 0, 6]])
    with torch.no_grad():
        out = vm.backbone(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            use_cache=True,
        )
        values, cache = vm.score_candidates(
            out.past_key_values, cand, mask, position_ids_from_mask(mask)[:, -1] + 1
        )
    assert values.shape == (4, 3, num_atoms)
    assert cache.get_seq_length() == ids.shape[1] + 1 and cache.layers[0].keys.shape[0] == 4 * 3
    for b, prompt in enumerate(PROMPTS):
        for j in range(3):
            torch.testing.assert_close(
                values[b, j], _alone(vm, prompt, int(cand[b, j])), atol=1e-5, rtol=1e-5
            )


def test_action_values_read_each_token_at_its_own_position():
    vm = _v_model()
    seq = [1, 2, 3, 4, 5]
    out, alt = vm.action_values(torch.tensor([seq]))
    assert alt is None and out.shape == (1, 4, 1)
    for t in range(4):  # column t = the value of token t+1 after tokens 0..t
        torch.testing.assert_close(
            out[0, t], _alone(vm, seq[: t + 1], seq[t + 1]), atol=1e-5, rtol=1e-5
        )
    with pytest.raises(ValueError, match="value_head=v"):
        vm.action_values(torch.tensor([seq]), alt=torch.zeros(1, 4, dtype=torch.long))


class _Recorder:
    """Wraps the V-hook: records every step's offsets and the prefix it saw."""

    def __init__(self, hook: CandidateGuidanceHook):
        self.hook, self.calls = hook, []
        self.seen: list[list[int]] | None = None

    def __call__(self, step_ids, attention_mask, position_ids, logits):
        rows = [
            [int(t) for t, m in zip(r, mk) if m]
            for r, mk in zip(step_ids.tolist(), attention_mask[:, -step_ids.shape[1] :].tolist())
        ]
        self.seen = rows if self.seen is None else [a + b for a, b in zip(self.seen, rows)]
        off = self.hook(step_ids, attention_mask, position_ids, logits)
        self.calls.append(
            ([list(r) for r in self.seen], logits.topk(self.hook.top_k, dim=-1).indices, off)
        )
        return off


@pytest.mark.parametrize(
    "mode, generation_top_k",
    [("bernoulli", None), ("expectation_clamped", None), ("bernoulli", 3)],
)
def test_v_hook_offsets_equal_recomputation_during_decoding(mode, generation_top_k):
    """Also with `generation_top_k` (the generator's top-k is known to lie inside the hook's,
    so the hook skips its per-token "was the fed token a candidate?" check)."""
    vm = _v_model()
    ref = build_tiny_llama(
        V, n_layer=1, d_model=32, n_head=4, pad_token_id=PAD, eos_token_id=EOS, seed=1
    )
    stats = HookStats()
    hooks: list[_Recorder] = []

    def factory():
        hook = CandidateGuidanceHook(
            vm, 3.0, mode, top_k=3, stats=stats, generation_top_k=generation_top_k
        )
        hooks.append(_Recorder(hook))
        return hooks[-1]

    gen = torch.Generator().manual_seed(0)
    _sample(ref, PROMPTS, factory, 5, 4, top_k=3, generator=gen, force_full_length=True)
    [rec] = hooks
    assert len(rec.calls) == 5 and stats.steps == 5
    assert (
        stats.forwards == 5 + 1
    )  # one candidate forward per step + the prompt (no fallback: same top-k)
    for prefixes, cand, off in rec.calls:
        for b, prefix in enumerate(prefixes):
            for j in range(3):
                tok = int(cand[b, j])
                want = offsets_from_values(
                    _alone(vm, prefix, tok)[None, None], 3.0, mode, vm.atoms
                )[0, 0]
                assert float(off[b, tok]) == pytest.approx(float(want), abs=1e-4)
            others = torch.ones(off.shape[-1], dtype=torch.bool)
            others[cand[b]] = False
            assert (off[b, others] == 0).all()


def test_v_hook_falls_back_when_the_fed_token_was_not_a_candidate():
    """A generator sampling outside the hook's top-k (top_k 0 here, hook top-k 2) still gets
    exact offsets: the hook re-feeds the token instead of keeping a candidate's row."""
    vm = _v_model()
    ref = build_tiny_llama(
        V, n_layer=1, d_model=32, n_head=4, pad_token_id=PAD, eos_token_id=EOS, seed=1
    )
    hooks: list[_Recorder] = []

    def factory():
        hooks.append(_Recorder(CandidateGuidanceHook(vm, 2.0, "bernoulli", top_k=2)))
        return hooks[-1]

    torch.nn.init.normal_(
        ref.lm_head.weight, std=0.01
    )  # flat π_ref: samples often outside the top-2
    gen = torch.Generator().manual_seed(3)
    _sample(ref, PROMPTS, factory, 4, 4, top_k=0, generator=gen, force_full_length=True)
    [rec] = hooks
    assert rec.hook.stats.forwards > 4 + 1  # some fallbacks happened
    for prefixes, cand, off in rec.calls:
        for b, prefix in enumerate(prefixes):
            tok = int(cand[b, 0])
            want = offsets_from_values(
                _alone(vm, prefix, tok)[None, None], 2.0, "bernoulli", vm.atoms
            )[0, 0]
            assert float(off[b, tok]) == pytest.approx(float(want), abs=1e-4)


def test_factory_picks_the_hook_of_the_head_and_checkpoint_round_trip(tmp_path):
    vm = _v_model()
    assert isinstance(hook_factory(vm, 1.0, "bernoulli", 3)(), CandidateGuidanceHook)
    assert hook_factory(vm, 0.0, "bernoulli", 3)() is None
    vm.save(tmp_path / "vm")
    assert json.loads((tmp_path / "vm" / "config.json").read_text())["head_type"] == "v"
    back = ValueModel.load(tmp_path / "vm")
    assert back.head_type == "v" and back.head.weight.shape == (1, 32)
    x = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(back.action_values(x)[0], vm.action_values(x)[0])


def test_clamped_expectation_offsets_only_suppress():
    logits = torch.tensor([[10.0], [0.0], [-10.0]])  # p ≈ 1, 1/2, ≈ 0
    off = offsets_from_values(logits, 2.0, "expectation_clamped", torch.tensor([1.0]))
    assert off.tolist() == pytest.approx(
        [2 * math.log(0.99), 2 * math.log(0.99), 2 * math.log(0.01)], rel=1e-5
    )
    assert (off < 0).all()


def test_official_schedule():
    from pita.algos.value_training import official_schedule

    p = torch.nn.Parameter(torch.zeros(1))
    optim = torch.optim.AdamW([p], lr=1.0)
    sched = official_schedule(optim, 2000)  # warmup max(100, 10 %) = 200, cosine to 0.1
    lrs = []
    for _ in range(2000):
        lrs.append(optim.param_groups[0]["lr"])
        optim.step()
        sched.step()
    assert lrs[0] == pytest.approx(1 / 200) and lrs[199] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3) and min(lrs[200:]) >= 0.1 - 1e-9


def test_balanced_accuracy_and_holdout_split():
    from pita.algos.value_diagnostics import (
        balanced_accuracy_by_position,
        plateau_warning,
        split_holdout,
    )

    items = [([p], [1], 0, [1.0], None) for p in range(10) for _ in range(3)]
    train, held = split_holdout(items, 0.2, seed=0)
    assert len(held) == 6 and not {tuple(i[0]) for i in train} & {tuple(i[0]) for i in held}
    # position 0: all predicted 1 on 30 positives + 10 negatives -> balanced 0.5; position 1: perfect
    pred = torch.tensor([True] * 40 + [True] * 20 + [False] * 20)
    target = torch.tensor([1.0] * 30 + [0.0] * 10 + [1.0] * 20 + [0.0] * 20)
    pos = torch.tensor([0] * 40 + [1] * 40)
    acc = balanced_accuracy_by_position(pred, target, torch.ones(80), pos)
    assert acc == {0: 0.5, 1: 1.0}
    assert plateau_warning({0: 0.5, 1: 0.52}) is not None and plateau_warning(acc) is None


def _head_args(head: str) -> list[str]:
    """Q# with `head` on goal-walk. The V head's run is large enough for guidance to beat
    π_ref (the test's one check of learning); the Q head's checks what is logged and
    evaluated, which the smoke sizes show."""
    learn = [
        "pretrain.steps=200",
        "dataset.test_size=100",
        "evaluation.max_prompts=100",
        "algos.QSharp.steps=400",
        "algos.QSharp.samples_per_example=64",
    ]
    return [
        "experiment=smoke",
        f"experiment.name=vhead_{head}",
        "executor.progress=false",
        "executor.cpu_workers=1",  # one worker importing torch, not one per core
        *only("reference", "QSharp"),
        *(learn if head == "v" else []),
        "evaluation.etas=[0,10]",
        f"algos.QSharp.value_head={head}",
        "algos.QSharp.holdout_fraction=0.1",
        "algos.QSharp.probe_steps=30",
        "algos.QSharp.lr_schedule=official",
        "algos.QSharp.weight_decay=0.1",
    ]


@pytest.fixture(scope="module")
def head_runs(tmp_path_factory) -> dict[str, tuple[Path, Future]]:
    """Both heads' runs, started together: {head: (cwd, the finished run's future)}."""
    runs = {}
    for head in ("q", "v"):
        cwd = tmp_path_factory.mktemp(f"vhead_{head}")
        runs[head] = (cwd, run_cli_later(_head_args(head), cwd, timeout=600))
    return runs


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("head", ["q", "v"])
def test_training_and_guided_decoding_end_to_end(head_runs, head):
    """Q# with each head on goal-walk at toy size, through run_parallel.py: the value model
    trains (held-out per-position accuracy and the probe are logged and plotted), guided
    decoding runs at η > 0, and the V-head's guided pass@1 beats π_ref's."""
    cwd, future = head_runs[head]
    proc = future.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [run_dir] = run_dirs(cwd, f"vhead_{head}")
    train_dir = next((run_dir / "tasks").glob("QSharp.*.r0.train"))
    result = json.loads((train_dir / "result.json").read_text())
    assert result["value_head"] == head and result["heldout_acc"] and "probe_heldout_acc" in result
    assert (train_dir / "training_metrics.png").is_file()
    log = (train_dir / "log.txt").read_text()
    assert "held-out balanced accuracy by response position" in log and "linear probe" in log
    import csv

    with open(run_dir / "results" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    q = {float(r["eta"]): float(r["pass@1"]) for r in rows if r["algo"] == "QSharp"}
    assert set(q) == {0.0, 10.0}
    if head == "v":
        assert q[10.0] > q[0.0] + 0.1, q


def test_v_hook_with_finished_rows_stays_one_forward_per_step_and_exact_on_live_rows():
    """Rows that hit EOS are fed pad afterwards: the hook does not advance them (no extra
    forward), and the rows still decoding keep exact offsets."""
    vm = _v_model()
    ref = build_tiny_llama(
        V, n_layer=1, d_model=32, n_head=4, pad_token_id=PAD, eos_token_id=EOS, seed=2
    )
    with torch.no_grad():
        ref.lm_head.weight[EOS] += (
            2.0 * ref.lm_head.weight.std()
        )  # EOS often in the top-3: varied lengths
    hooks: list[_Recorder] = []

    def factory():
        hooks.append(_Recorder(CandidateGuidanceHook(vm, 3.0, "bernoulli", top_k=3)))
        return hooks[-1]

    prompts = PROMPTS * 4
    gen = torch.Generator().manual_seed(0)
    out = _sample(ref, prompts, factory, 6, 16, top_k=3, generator=gen)
    lengths = [len(r) for r in out.responses]
    assert min(lengths) < max(lengths)  # some rows finished early
    [rec] = hooks
    assert rec.hook.stats.forwards == rec.hook.stats.steps + 1
    checked = 0
    for prefixes, cand, off in rec.calls:
        for b, prefix in enumerate(prefixes):
            if EOS in prefix[len(prompts[b]) :] or PAD in prefix:
                continue  # finished: its offsets are not used
            tok = int(cand[b, 1])
            want = offsets_from_values(
                _alone(vm, prefix, tok)[None, None], 3.0, "bernoulli", vm.atoms
            )[0, 0]
            assert float(off[b, tok]) == pytest.approx(float(want), abs=1e-4)
            checked += 1
    assert checked > len(prompts)
