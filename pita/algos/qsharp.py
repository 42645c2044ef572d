"""Q#: value-guided decoding with a (distributional) value model of π_ref.

Implements docs/ALGORITHMS.md "Q#": round k rolls in with π^k (π_ref in round 0, else π_ref
guided by round k−1's value model), cuts at h ~ U{1..|y|−1}, rolls out with π_ref, and
trains the value model on the roll-out tokens against the sequence reward (`bce` for
binary rewards, `mse`, or `mle` over `num_atoms` atoms on [V_min, V_max]); the records
of rounds 0..k are aggregated (DAgger). Guidance: π_ref's top-k logits + offsets
(pita/algos/guidance.py), also used for the guided roll-ins.

Where this departs from the paper / reference code:
- In round 0 the roll-in *is* π_ref, so every response token is a π_ref roll-out token
  and carries an unbiased label of Q^{π_ref}(s_t, y_t): all of them are trained (later
  rounds train only the roll-out part, from the cut on).
- Records that share a (state, action) are merged into one soft target (the mean label,
  or the atom histogram for `mle`) weighted by their count, and training batches draw
  *unique sequences*. For these losses (linear in the target) this is the same objective
  as the sum over records; each step just sees far less label noise, which is what lets
  a tiny value model learn goal-walk within a CPU minute.
- Guidance is restricted to π_ref's top-k tokens (k = out-degree on goal-walk), as in
  evaluation.

Options that reproduce the official star-graph recipe (issue 15; `experiment=star_graph_paper`
sets them) and where even they depart from it:
- `value_head: v`: the official classifier's V-type read-out (candidate appended, scalar
  head at its position; pita/models/value_model.py) instead of the Q-type head; scored
  over π_ref's top-k in one batched forward with the prefix cache shared.
- `data_collection.recipe: ground_truth_vs_first_wrong`: per graph the ground truth
  (label 1) and π_ref's first wrong sample (label 0), every target token trained. The
  official loader concatenates each pair into the same batch; here batches draw unique
  sequences at random (balanced in expectation, not per batch), and the pair's shared
  prefix (the source node) is merged into one 0.5 target, the same BCE objective.
- `lr_schedule: official`, `weight_decay: 0.1`, lr 2.5e-4: the official optimiser.
- Initialisation: the official classifier starts from text-pretrained GPT-2 (generic
  copy / induction heads); offline, the closest is a full copy of π_ref (`warm_start` with
  `guide_arch` = `reference_arch`), which is what the paper config does.
- `holdout_fraction` / `probe_steps`: per-position held-out accuracy and a frozen-backbone
  probe (pita/algos/value_diagnostics.py) that warns before a run that will sit on the
  plateau; not in the official code.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from pita.algos.collector import collect_shard, read_jsonl, write_jsonl
from pita.core.paths import Artifact
from pita.runtime.batching import training_micro_batch
from pita.runtime.context import StageContext


def collect(ctx: StageContext) -> dict:
    """Q#'s roll-in / cut / roll-out (pita/algos/collector.py): records with rewards.

    Reads: π_ref, round r-1's value model (`guide` input) for the roll-in, this shard's
    training prompts, `data_collection.*`, `algos.QSharp.*`. Writes: `records.jsonl`
    (prompt, prefix and roll-out token ids, reward, roll-in origin).
    """
    records, stats = collect_shard(ctx, pairs=False)
    write_jsonl(ctx.out_dir / Artifact.RECORDS, records)
    return stats


def reward_targets(rewards: Sequence[float], algo: Any, name: str = "QSharp") -> list[list[float]]:
    """Per-record targets: [r mapped to [0, 1]] for bce/mse, the atom one-hot for mle."""
    import torch

    from pita.algos.losses import atom_histogram

    r = torch.tensor([float(x) for x in rewards])
    if algo.loss_type == "mle":
        return atom_histogram(r, int(algo.num_atoms), float(algo.V_min), float(algo.V_max)).tolist()
    if algo.loss_type not in ("bce", "mse"):
        raise ValueError(
            f"algos.{name}.loss_type={algo.loss_type!r}: Q# trains bce | mse | mle "
            "(bradley_terry needs preference pairs: PITA)"
        )
    return ((r - algo.V_min) / (algo.V_max - algo.V_min)).clamp(0, 1)[:, None].tolist()


def training_items(records: Sequence[dict], targets: Sequence[list[float]]) -> list[tuple]:
    """(prompt, response, first trained response index, target, None) per record; the
    response is prefix + roll-out, exactly the ids that were scored."""
    return [
        (
            r["prompt"],
            r["prefix"] + r["rollout"],
            0 if r.get("roll_in") == "reference" else len(r["prefix"]),
            t,
            None,
        )
        for r, t in zip(records, targets)
    ]


def build_targets(items: Sequence[tuple], pad_id: int) -> dict:
    """Merge records sharing a (state, action) into soft targets over unique sequences.

    An item is (prompt, response, start, target, alt): response positions >= start are
    trained; `alt` (Bradley–Terry pairs only) is the competing action at the last position.
    A trie numbers every prefix (prompts of different lengths never share a node); each
    trained position adds its item's target to the key (node of state + action, alt).
    Every unique (sequence, alt) then carries, at each position whose key was trained,
    the key's mean target with weight count / (units through the key), so the weights of
    a key sum to its record count: the objective of the records, exactly. Tensors are
    aligned with hidden states: column t scores token t + 1 (and alt[:, t]).
    """
    import torch

    trie: dict[tuple[int, int], int] = {}
    sums: dict[tuple, list[float]] = {}
    counts: dict[tuple, int] = {}
    units: dict[tuple, tuple[list[int], int, Any]] = {}

    def keys(prompt: Sequence[int], response: Sequence[int], alt: Any) -> list[tuple]:
        node = -1 - len(
            prompt
        )  # one root per prompt length: the prompt/response boundary is part of the key
        out = []
        for i, tok in enumerate([*prompt, *response]):
            node = trie.setdefault((node, int(tok)), len(trie))
            if i >= len(prompt):
                out.append((node, None))
        if out and alt is not None:
            out[-1] = (out[-1][0], int(alt))
        return out

    for prompt, response, start, target, alt in items:
        ks = keys(prompt, response, alt)
        for key in ks[start:]:
            if key in sums:
                sums[key] = [a + b for a, b in zip(sums[key], target)]
                counts[key] += 1
            else:
                sums[key], counts[key] = list(target), 1
        if ks:
            units.setdefault(ks[-1], ([*prompt, *response], len(prompt), alt))
    seqs = list(units.values())
    through: dict[tuple, int] = {}
    paths = []
    for seq, p, alt in seqs:
        ks = keys(seq[:p], seq[p:], alt)
        paths.append(ks)
        for key in set(ks):
            through[key] = through.get(key, 0) + 1
    width = max(len(s) for s, _, _ in seqs)
    k = len(items[0][3])
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    prompt_len = torch.tensor([p for _, p, _ in seqs], dtype=torch.long)
    alts = torch.zeros((len(seqs), width - 1), dtype=torch.long)
    target = torch.zeros((len(seqs), width - 1, k))
    weight = torch.zeros((len(seqs), width - 1))
    for u, ((seq, p, _), ks) in enumerate(zip(seqs, paths)):
        ids[u, : len(seq)] = torch.tensor(seq)
        for j, key in enumerate(ks):
            if key in counts:
                target[u, p + j - 1] = torch.tensor(sums[key]) / counts[key]
                weight[u, p + j - 1] = counts[key] / through[key]
                alts[u, p + j - 1] = key[1] if key[1] is not None else 0
    return {
        "ids": ids,
        "alt": alts,
        "target": target,
        "weight": weight,
        "prompt_len": prompt_len,
        "records": len(items),
        "unique": len(seqs),
        "states": len(counts),
    }


def _to_device(t, device):
    """A CPU tensor on `device`: pinned and copied asynchronously when that is CUDA."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _hits(score, target, w):
    """Weighted share of positions where σ(score) and the target fall on the same side of
    1/2, as a device tensor (read back with the window's other figures)."""
    hit = ((score > 0) == (target > 0.5)).float()
    return (hit * w).sum() / w.sum().clamp_min(1e-12)


def _fused_adamw(device) -> dict:
    """AdamW's fused CUDA kernel (one launch per step instead of one per parameter)."""
    return {"fused": True} if device.type == "cuda" else {}


def train(ctx: StageContext) -> dict:
    """Fit Q#'s distributional value model on every round's records so far.

    Reads: `records.jsonl` of the `data` inputs, round r-1's `value_model/` (`previous`,
    warm start), `algos.QSharp.*`, `training.*`. Writes: `value_model/`,
    training_metrics.png, performance_summary.txt. Assumes rewards in [V_min, V_max].
    """
    records = read_jsonl(ctx.input("data"), Artifact.RECORDS)
    targets = reward_targets([r["reward"] for r in records], ctx.algo_cfg, ctx.task.algo)
    return train_value(ctx, training_items(records, targets))


def official_schedule(optim: Any, steps: int) -> Any:
    """The Q# star-graph classifier's schedule: linear warmup over max(100, 10 %) of the
    steps (at most all of them), then cosine decay to 0.1·lr."""
    import torch

    warmup = min(steps, max(100, steps // 10))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optim, factor)


def train_value(ctx: StageContext, items: Sequence[tuple]) -> dict:
    """Fit the value model on merged (state, action) targets and save `value_model/`.

    Model: round 0 builds the family's guide (warm-started from π_ref when `warm_start`);
    round k loads round k−1's checkpoint (input "previous"). Steps of
    `algos.<NAME>.batch_size` unique sequences (or `epochs` passes when `steps` is 0),
    AdamW with warmup + cosine decay; `pita.training.TrainStep` does the accumulation over
    micro-batches (`micro_batch_plan`: the whole batch, halved by each OOM retry), clipping and the
    precision (bf16/fp16 autocast on CUDA only, fp32 on CPU).
    """
    import torch
    from transformers import get_cosine_schedule_with_warmup

    from pita.algos import losses, value_diagnostics
    from pita.models.value_model import ValueModel, build_value_model, head_atoms, value_init
    from pita.training.checkpoint import Checkpointer
    from pita.training.loop import (
        TrainStep,
        accumulation_plan,
        enable_gradient_checkpointing,
        micro_batch_plan,
    )
    from pita.training.precision import training_device
    from pita.training.report import write_training_report

    t0 = time.perf_counter()
    algo, tr = ctx.algo_cfg, ctx.cfg.training
    if not items:
        raise ValueError(f"{ctx.task.id}: no training records in {ctx.input('data')}")
    torch.manual_seed(ctx.seed)
    device = torch.device(training_device(ctx.cfg.system.gpu_mode, ctx.device).device)
    reference = ctx.load_model(ctx.reference_model())
    pad_id = int(reference.config.pad_token_id if reference.config.pad_token_id is not None else 0)
    items, held_items = value_diagnostics.split_holdout(
        items, float(algo.get("holdout_fraction", 0.0)), ctx.seed
    )
    data = build_targets(items, pad_id)
    held = build_targets(held_items, pad_id) if held_items else None
    ctx.logger.info(
        "training data: %d records -> %d unique sequences, %d (state, action) targets%s",
        data["records"],
        data["unique"],
        data["states"],
        f"; held out: {held['records']} records of distinct prompts" if held else "",
    )

    # The model: round k−1's checkpoint, else a fresh guide (warm-started from π_ref).
    if ctx.has_input("previous"):
        prev = ctx.input("previous") / Artifact.VALUE_MODEL
        model = ValueModel.load(prev, device="cpu", attn_impl=ctx.cfg.system.attn_impl)
        ctx.logger.info("warm start from the previous round's checkpoint %s", prev)
        init = f"previous:{ctx.input('previous').name}"
    else:
        model = build_value_model(
            reference,
            ctx.cfg.model,
            algo,
            vocab_size=reference.config.vocab_size,
            seed=ctx.seed,
            attn_impl=ctx.cfg.system.attn_impl,
            logger=ctx.logger,
        )
        init = value_init(algo, ctx.cfg.model)  # issue 23: reference | base | scratch
    if model.num_outputs != head_atoms(algo.loss_type, algo.num_atoms):
        raise ValueError(
            f"{ctx.task.id}: checkpoint has {model.num_outputs} outputs per token but "
            f"loss_type={algo.loss_type} needs {head_atoms(algo.loss_type, algo.num_atoms)}"
        )
    if model.head_type != str(algo.get("value_head", "q")):
        raise ValueError(
            f"{ctx.task.id}: checkpoint has value_head={model.head_type}, config says "
            f"{algo.get('value_head', 'q')}"
        )
    model.to(device).train()
    diagnostics: dict = {}
    if held is not None and int(algo.get("probe_steps", 0)) > 0:  # before any training step
        probe = value_diagnostics.linear_probe(
            model, data, held, device, steps=int(algo.probe_steps), seed=ctx.seed
        )
        diagnostics["probe_heldout_acc"] = probe
        ctx.logger.info(
            "frozen-backbone linear probe (%d steps), held-out balanced accuracy by response "
            "position: %s",
            int(algo.probe_steps),
            value_diagnostics.format_positions(probe),
        )
        warning = value_diagnostics.plateau_warning(probe)
        if warning:
            ctx.logger.warning(warning)
    checkpointing = enable_gradient_checkpointing(
        model.backbone, tr.gradient_checkpointing, ctx.logger
    )

    # Batch (unique sequences), micro-batch, steps.
    n = data["unique"]
    auto = not isinstance(algo.batch_size, int)  # auto: the probe picks the micro-batch
    batch = min(n, 256 if auto else int(algo.batch_size))
    scale = ctx.task.batch_scale
    micro, _ = micro_batch_plan(batch, tr, scale, whole_batch=True)
    loss_type = str(algo.loss_type)
    # The whole training set lives on the device (pre-tensorised, copied once): a step only
    # indexes it, so there is no per-step collation and no host<->device copy in the loop.
    on_device = [_to_device(data[k], device) for k in ("ids", "alt", "target", "weight")]
    ids, alts, target, weight = on_device

    def loss_fn(m: torch.Tensor):
        """The weighted mean loss of micro-batch m (indices into the unique sequences).
        Untrained positions have weight 0 and drop out of the weighted means: no boolean
        indexing (it would wait for the device to count the selected positions). The head
        (Q- or V-type) is read through `action_values`: column t = the value of token t+1."""
        x, w, y = ids[m], weight[m].reshape(-1), target[m]
        bt = loss_type == "bradley_terry"
        out, alt = model.action_values(x, alt=alts[m] if bt else None)  # [b, T-1, M]
        out = out.float()
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1, y.shape[-1])
        if bt:  # P(y' ≻ y) = σ(v(s, a') − v(s, a)), a the competing token
            alt = alt.float().reshape(-1, out.shape[-1])
            diff = out[:, 0] - alt[:, 0]
            return losses.bradley_terry_loss(out[:, 0], alt[:, 0], y[:, 0], w), {
                "accuracy": _hits(diff, y[:, 0], w)
            }
        if loss_type == "mle":
            hit = (out.argmax(-1) == y.argmax(-1)).float()
            return losses.mle_loss(out, y, w), {
                "accuracy": (hit * w).sum() / w.sum().clamp_min(1e-12)
            }
        fn = losses.bce_loss if loss_type == "bce" else losses.mse_loss
        return fn(out[:, 0], y[:, 0], w), {"accuracy": _hits(out[:, 0], y[:, 0], w)}

    if auto:  # worst case: the longest sequences, >= 2 optimizer steps, before the real optimizer
        micro = training_micro_batch(
            ctx,
            model=model,
            batch=batch,
            seq_tokens=int(ids.shape[1]),
            make_batch=lambda b: {"m": torch.arange(b, device=device) % n},
            loss_fn=lambda _model, mb: loss_fn(mb["m"])[0],
            fallback=micro,
        )
    micro, n_micro = accumulation_plan(batch, micro, tr.accumulation_steps)
    steps = int(algo.steps) or int(algo.epochs) * math.ceil(n / batch)
    wd = tr.weight_decay if algo.get("weight_decay") is None else float(algo.weight_decay)
    optim = torch.optim.AdamW(
        model.parameters(), lr=float(algo.lr), weight_decay=wd, **_fused_adamw(device)
    )
    if (
        str(algo.get("lr_schedule", "cosine")) == "official"
    ):  # the Q# star-graph classifier's schedule
        sched = official_schedule(optim, steps)
    else:
        sched = get_cosine_schedule_with_warmup(optim, min(100, steps // 10), steps)
    log_every = max(1, steps // 10)
    # figures are read back once per logging window, not every step (no host sync per step)
    trainer = TrainStep.from_context(
        ctx, model, optim, scheduler=sched, device=device, sync_every=min(log_every, 50)
    )

    gen = torch.Generator().manual_seed(ctx.seed)
    order, cursor = torch.randperm(n, generator=gen).to(device), 0
    ctx.logger.info(
        "training %s: %d steps, batch %d = micro %d x %d, lr %g, %s, init %s",
        loss_type,
        steps,
        batch,
        micro,
        n_micro,
        algo.lr,
        trainer.precision.name,
        init,
    )
    ckpt = Checkpointer.from_context(ctx)  # training.checkpoint_every: a retry continues from here
    start, extra = ckpt.restore(model=model, optimizer=optim, scheduler=sched, step=trainer)
    if extra:
        order, cursor = extra["order"].to(device), extra["cursor"]
        gen.set_state(extra["gen"])
    for step in range(start, steps):
        if cursor + batch > n:  # the next epoch, freshly shuffled
            order, cursor = torch.randperm(n, generator=gen).to(device), 0
        idx = order[cursor : cursor + batch]
        cursor += batch
        parts = list(idx.split(micro))
        # each micro-batch's weighted mean, weighted by its share of the batch's weight (device tensors)
        shares = [1.0] if len(parts) == 1 else [weight[m].sum() / weight[idx].sum() for m in parts]
        trainer.run(parts, loss_fn, weights=shares, samples=len(idx))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            recent = trainer.metrics_rows()[-log_every:]
            mean_loss = sum(r["loss"] for r in recent) / len(recent)
            mean_acc = sum(r.get("accuracy", 0.0) for r in recent) / len(recent)
            ctx.logger.info(
                "step %d/%d (epoch %.1f) loss %.4f acc %.3f lr %.2e",
                step + 1,
                steps,
                (step + 1) * batch / n,
                mean_loss,
                mean_acc,
                trainer.lr(),
            )
            if (
                held is not None
            ):  # where learning stops: held-out balanced accuracy by response position
                acc = value_diagnostics.heldout_accuracy(model, held, device)
                diagnostics["heldout_acc"] = acc
                recent[-1].update({f"heldout_pos{j}": a for j, a in acc.items()})
                ctx.logger.info(
                    "held-out balanced accuracy by response position: %s",
                    value_diagnostics.format_positions(acc),
                )
            ctx.heartbeat(f"step {step + 1}/{steps} loss {recent[-1]['loss']:.4f}")
        ckpt.maybe_save(
            step + 1,
            lambda: {"model": model, "optimizer": optim, "scheduler": sched},
            step=trainer,
            extra=lambda o=order, c=cursor: {"order": o.cpu(), "cursor": c, "gen": gen.get_state()},
        )
    recent = trainer.metrics_rows()[
        -log_every:
    ]  # the rows survive a resume (they are in the checkpoint)
    mean_loss = sum(r["loss"] for r in recent) / len(recent)
    mean_acc = sum(r.get("accuracy", 0.0) for r in recent) / len(recent)
    model.eval().save(ctx.out_dir / Artifact.VALUE_MODEL)
    perf = write_training_report(
        ctx.out_dir,
        trainer,
        micro_batch=micro,
        accumulation_steps=n_micro,
        gradient_checkpointing=checkpointing,
        title=ctx.task.id,
    )
    return {
        "steps": steps,
        "batch_size": batch,
        "micro_batch_size": micro,
        "records": data["records"],
        "unique_sequences": n,
        "targets": data["states"],
        "final_loss": round(mean_loss, 5),
        "final_acc": round(mean_acc, 4),
        "init": init,
        "train_s": round(time.perf_counter() - t0, 2),
        "value_head": model.head_type,
        **diagnostics,
        **{k: perf[k] for k in ("precision", "samples_per_s", "peak_memory_mb")},
    }
