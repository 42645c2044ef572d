"""Where value-model training learns and where it stops: per-position held-out accuracy and a
frozen-backbone linear probe (issue 15).

Why: on the star graph the value loss can sit at ln 2 for a whole run (the *plateau*): the
easy labels are equality tests (is this node the goal?) that get no first-order BCE
gradient unless the starting features already expose them, and the decisive label (the
first step) needs several edge lookups. A mean loss hides which positions learned;
accuracy *by response position* shows the ladder (on G(d, l) position j is l − 1 − j
edges from the goal; position 1 is the first decision). And a linear probe on the frozen
starting backbone, a few seconds long, predicts the outcome. Calibration so far (CPU,
G(2,5,20), 2×64 reference copied into the value model): in the issue-15 study, probes
≈ 0.50 at every position → every variant stayed flat, a probe of ≈ 0.87 → escaped within
160 steps; in the run of the README's star-graph section, the best probe position (Q-type
head: position 4 at 0.57; V-type head: position 3 at 0.55) was exactly the one position
that learned (→ 0.997 within 300 steps), and every position probed ≤ 0.51 stayed at
chance for 1,500 steps. Hence the warning below 0.54 at every position, and the log line
names the probe's best positions, which is where learning will start.

The metric is *balanced* accuracy (the mean of the true-positive and true-negative
rates, over targets rounded to 0/1; merged targets of exactly 0.5 are skipped), so chance
is 0.5 whatever the label balance of a position (goal-walk's labels are mostly 0).

The hold-out is by prompt (`holdout_fraction` of the distinct prompts), so held-out
accuracy measures generalisation to unseen graphs, not memorisation.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

# Positions with fewer held-out targets than this are not judged (too noisy).
MIN_TARGETS = 20
# A probe whose best position is below this balanced accuracy predicts the plateau.
PLATEAU_PROBE_ACC = 0.54


def split_holdout(
    items: Sequence[tuple], fraction: float, seed: int
) -> tuple[list[tuple], list[tuple]]:
    """(train, held-out) items, held out by distinct prompt (item[0]); at least one prompt
    stays on each side when there are two or more."""
    if fraction <= 0:
        return list(items), []
    prompts = sorted({tuple(it[0]) for it in items})
    if len(prompts) < 2:
        return list(items), []
    random.Random(seed).shuffle(prompts)
    n_held = min(len(prompts) - 1, max(1, math.ceil(fraction * len(prompts))))
    held = set(prompts[:n_held])
    return [it for it in items if tuple(it[0]) not in held], [
        it for it in items if tuple(it[0]) in held
    ]


def balanced_accuracy_by_position(
    pred: Any, target: Any, weight: Any, position: Any
) -> dict[int, float]:
    """{response position: balanced accuracy} from flat tensors (pred: bool, target in
    [0, 1], weight, position); positions with < MIN_TARGETS decided targets are left out."""

    keep = (weight > 0) & ((target - 0.5).abs() > 1e-6)
    pred, hard, weight, position = pred[keep], target[keep] > 0.5, weight[keep], position[keep]
    out = {}
    for j in sorted(set(position.tolist())):
        at = position == j
        if int(at.sum()) < MIN_TARGETS:
            continue
        rates = []
        for cls in (True, False):
            sel = at & (hard == cls)
            if bool(sel.any()):
                w = weight[sel]
                rates.append(float((w * (pred[sel] == cls).float()).sum() / w.sum()))
        out[int(j)] = round(sum(rates) / len(rates), 4) if rates else math.nan
    return {j: a for j, a in out.items() if not math.isnan(a)}


def _flat_positions(data: dict, n: int) -> Any:
    """[n, T−1] response position of each target column (column t scores token t+1)."""
    import torch

    cols = torch.arange(data["ids"].shape[1] - 1)
    return cols[None, :] + 1 - data["prompt_len"][:n, None]


def _predictions(values: Any) -> Any:
    """Predicted label (value > 0.5) from head outputs [..., M]: logit > 0 for one output,
    the pmf's mean above the middle of the atoms otherwise."""
    if values.shape[-1] == 1:
        return values[..., 0] > 0
    pmf = values.softmax(-1)
    mean = (pmf * (values.new_tensor(range(values.shape[-1])) / (values.shape[-1] - 1))).sum(-1)
    return mean > 0.5


def _targets(target: Any) -> Any:
    """Target in [0, 1]: the scalar target, or the atom histogram's mean."""
    if target.shape[-1] == 1:
        return target[..., 0]
    return (target * (target.new_tensor(range(target.shape[-1])) / (target.shape[-1] - 1))).sum(-1)


def heldout_accuracy(
    model: Any, data: dict, device: Any, *, max_seqs: int = 2048, batch: int = 256
) -> dict[int, float]:
    """Balanced accuracy of `model` by response position on held-out targets `data`
    (`build_targets` output), at most `max_seqs` sequences."""
    import torch

    n = min(max_seqs, int(data["ids"].shape[0]))
    preds = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for s in range(0, n, batch):
            out, _ = model.action_values(data["ids"][s : s + batch].to(device))
            preds.append(_predictions(out.float()).cpu())
    model.train(was_training)
    pred = torch.cat(preds)
    return balanced_accuracy_by_position(
        pred.flatten(),
        _targets(data["target"][:n]).flatten(),
        data["weight"][:n].flatten(),
        _flat_positions(data, n).flatten(),
    )


def _features(model: Any, data: dict, device: Any, max_seqs: int, batch: int = 256) -> dict:
    """Frozen-backbone features of the trained targets: flat [N, d] hidden states (Q-type:
    the prefix state; V-type: the candidate's own position), tokens, targets, weights,
    positions."""
    import torch

    n = min(max_seqs, int(data["ids"].shape[0]))
    feats, toks = [], []
    with torch.no_grad():
        for s in range(0, n, batch):
            x = data["ids"][s : s + batch].to(device)
            h = model.hidden(x[:, :-1]) if model.head_type == "q" else model.hidden(x)[:, 1:]
            feats.append(h.float().cpu())
            toks.append(x[:, 1:].cpu())
    w = data["weight"][:n]
    sel = w > 0
    return {
        "h": torch.cat(feats)[sel],
        "tok": torch.cat(toks)[sel],
        "y": _targets(data["target"][:n])[sel],
        "w": w[sel],
        "pos": _flat_positions(data, n)[sel],
    }


def linear_probe(
    model: Any,
    train: dict,
    held: dict,
    device: Any,
    *,
    steps: int,
    seed: int = 0,
    max_seqs: int = 2048,
) -> dict[int, float]:
    """Fit a fresh linear head (same type as `model`'s) on the frozen backbone's features of
    `train` for `steps` full-batch Adam steps; its held-out balanced accuracy by position.
    Only for single-output heads (bce / mse); returns {} otherwise."""
    import torch

    if model.num_outputs != 1:
        return {}
    was_training = model.training
    model.eval()
    tr, ho = _features(model, train, device, max_seqs), _features(model, held, device, max_seqs)
    model.train(was_training)
    d = tr["h"].shape[-1]
    width = model.vocab_size if model.head_type == "q" else 1
    gen = torch.Generator().manual_seed(seed)
    weight = torch.zeros(width, d).normal_(0, 0.01, generator=gen).requires_grad_(True)
    bias = torch.zeros(width, requires_grad=True)
    optim = torch.optim.Adam([weight, bias], lr=1e-2)

    def logits(f: dict) -> torch.Tensor:
        idx = f["tok"] if width > 1 else torch.zeros_like(f["tok"])
        return (f["h"] * weight[idx]).sum(-1) + bias[idx]

    for _ in range(steps):
        loss = (
            torch.nn.functional.binary_cross_entropy_with_logits(
                logits(tr), tr["y"], reduction="none"
            )
            * tr["w"]
        ).sum() / tr["w"].sum()
        optim.zero_grad()
        loss.backward()
        optim.step()
    with torch.no_grad():
        pred = logits(ho) > 0
    return balanced_accuracy_by_position(pred, ho["y"], ho["w"], ho["pos"])


def plateau_warning(probe: dict[int, float]) -> str | None:
    """The warning to log when the probe predicts a flat run, else None."""
    if not probe:
        return None
    best = max(probe.values())
    if best >= PLATEAU_PROBE_ACC:
        return None
    return (
        f"frozen-backbone linear probe: held-out balanced accuracy <= {best:.3f} at every response position "
        f"(chance 0.5, threshold {PLATEAU_PROBE_ACC}): the starting features expose no label linearly; runs "
        "like this sat on the plateau (value loss ≈ ln 2) on CPU — expect no learning; change the "
        "initialisation (init: reference | base | scratch, guide_arch), the head (value_head), the data "
        "recipe or the optimiser"
    )


def format_positions(acc: dict[int, float]) -> str:
    return " ".join(f"a{j}={a:.3f}" for j, a in sorted(acc.items())) or "n/a"
