"""The proxy reward model of the -HF variants (GRPO-HF, QSharp-HF): Bradley–Terry on pairs.

`train_reward_model` (stage `reward_model`) fits r_φ(x, y) with TRL's `RewardTrainer`,
loss −log σ(r_φ(x, y_chosen) − r_φ(x, y_rejected)), on the `pairs.jsonl` records of every
collect folder in `ctx.inputs("data")` (rounds 0..k). The data is handed to TRL already
tokenized (`chosen_ids` / `rejected_ids` = prompt + response ids), so no text round trip.

Model: `AutoModelForSequenceClassification` with one output, warm-started from π_ref's
checkpoint (for the tiny family a `LlamaForSequenceClassification` whose backbone is the
reference's; the scalar head starts random). HF pools a decoder's sequence-classification
logits at the last token that is not `pad_token_id`; TRL's collator pads on the right with
that id and `RewardScorer` pads with it too, so training and scoring read the same
position: the response's last token (its EOS).

Held-out check: the pairs of 10% of the prompts (at least one prompt) are kept out of
training; `heldout_accuracy` in result.json is the fraction of those pairs the model ranks
correctly (ties count half), scored through `load_reward_scorer`'s path (`RewardScorer`).

`load_reward_scorer(ctx, folder)`: the `RewardScorer` of a reward_model task folder (or of
its `reward_model/` subfolder), cached in the worker's model LRU.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pita.core.paths import Artifact
from pita.core.schema import RewardModelMixin
from pita.runtime.context import StageContext

# What a CUDA worker imports while it waits for its first task (pita.runtime.worker).
WARM_IMPORTS = ("trl.trainer.reward_trainer",)

HELDOUT_FRACTION = 0.1


def split_by_prompt(
    records: Sequence[dict], fraction: float, seed: int
) -> tuple[list[dict], list[dict]]:
    """(train, held-out) pairs; held-out prompts (by prompt ids) never appear in training."""
    prompts = sorted({tuple(r["prompt"]) for r in records})
    random.Random(seed).shuffle(prompts)
    n_held = max(1, round(fraction * len(prompts))) if len(prompts) > 1 else 0
    held = set(prompts[:n_held])
    train = [r for r in records if tuple(r["prompt"]) not in held]
    heldout = [r for r in records if tuple(r["prompt"]) in held]
    return train, heldout


def pairwise_accuracy(scorer, records: Sequence[dict]) -> float:
    """Fraction of pairs with r(chosen) > r(rejected); ties count half. nan without pairs."""
    if not records:
        return float("nan")
    prompts = [r["prompt"] for r in records]
    chosen = scorer.score(prompts, [r["chosen"] for r in records])
    rejected = scorer.score(prompts, [r["rejected"] for r in records])
    wins = sum(1.0 if c > r else 0.5 if c == r else 0.0 for c, r in zip(chosen, rejected))
    return wins / len(records)


def _scorer_batch(ctx: StageContext) -> int:
    from pita.runtime.batching import generation_batch_size

    return generation_batch_size(ctx, ctx.data_collection.reward_batch_size, fallback=32)


def load_reward_scorer(ctx: StageContext, folder: Path | str):
    """The RewardScorer of a trained proxy reward model (task folder or its reward_model/)."""
    from pita.models.loading import load_reward_model, load_tokenizer
    from pita.models.reward_scorer import RewardScorer

    folder = Path(folder)
    if (folder / Artifact.REWARD_MODEL).is_dir():
        folder = folder / Artifact.REWARD_MODEL

    def load():
        model = load_reward_model(str(folder), device=ctx.device, attn_impl=ctx.system.attn_impl)
        return RewardScorer(
            model, load_tokenizer(str(folder)), _scorer_batch(ctx), padding_side="right"
        )

    return ctx.models.get(f"rm:{folder}", load)


def train_reward_model(ctx: StageContext) -> dict:
    """Train a Bradley–Terry proxy reward model with TRL's RewardTrainer (the -HF chains).

    Reads: `pairs.jsonl` of the `data` inputs, π_ref (the backbone, with a fresh scalar
    head) and its tokenizer, `algos.<NAME>.*`. Writes: `reward_model/`
    (sequence-classification model + tokenizer), training_metrics.png, and the held-out
    pairwise accuracy in result.json. Holds out 10 % of prompts to measure it. Trains on
    the task's gang when it has one (`run_on_gang`); rank 0 measures the accuracies.
    """
    from pita.algos.trl_common import run_on_gang

    return run_on_gang(ctx, _train_reward_model)


def _train_reward_model(ctx: StageContext, dist: object = None) -> dict:
    """`train_reward_model` on one rank of the task's gang (or alone)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardTrainer

    from pita.algos.trl_common import (
        effective_batch,
        quiet,
        stage_log_callback,
        train_and_save,
        whole_batches,
    )
    from pita.models.loading import load_tokenizer
    from pita.models.reward_scorer import RewardScorer

    # Data: every round's pairs, split by prompt into train / held-out.
    train_pairs, heldout = _split_pairs(ctx.inputs("data"), ctx.seed)
    dataset = Dataset.from_dict(
        {
            "chosen_ids": [r["prompt"] + r["chosen"] for r in train_pairs],
            "rejected_ids": [r["prompt"] + r["rejected"] for r in train_pairs],
        }
    )

    # Model: π_ref's backbone under a fresh scalar head; pooling needs the pad id in the config.
    ref_dir = ctx.reference_model()
    tok = load_tokenizer(ref_dir)
    torch.manual_seed(ctx.seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        ref_dir, num_labels=1, dtype=torch.float32, attn_implementation=ctx.system.attn_impl
    )
    model.config.pad_token_id = tok.pad_token_id

    batch = effective_batch(ctx)  # the global batch: each epoch draws whole ones
    args = _reward_config(ctx, batch)
    trainer = quiet(
        whole_batches(RewardTrainer, batch)(
            model=model,
            args=args,
            train_dataset=dataset,
            processing_class=tok,
            callbacks=[stage_log_callback(ctx)],
        )
    )
    ctx.logger.info(
        "reward model on %d pairs (%d held out) from %d round(s), backbone %s",
        len(train_pairs),
        len(heldout),
        len(ctx.inputs("data")),
        ref_dir,
    )
    model, end = train_and_save(
        ctx, trainer, tok, Artifact.REWARD_MODEL, ("train_loss",), options="reward_trl"
    )
    if not trainer.is_world_process_zero():
        return end  # rank 0's result is the task's
    scorer = RewardScorer(model, tok, _scorer_batch(ctx), padding_side="right")
    return {**_accuracies(scorer, train_pairs, heldout, ctx.logger), **end}


def _reward_config(ctx: StageContext, batch: int) -> Any:
    """RewardConfig from `algos.<NAME>.reward_*` (dropout off: the resume on any k draws no
    random numbers) and `algos.<NAME>.reward_trl`."""
    from trl import RewardConfig

    from pita.algos.trl_common import training_args, trl_options

    algo = ctx.algo_as(RewardModelMixin)
    return training_args(
        ctx,
        RewardConfig,
        batch_size=batch,
        lr=float(algo.reward_lr),
        epochs=int(algo.reward_epochs),
        max_length=None,
        disable_dropout=True,
        options=trl_options(ctx, "reward_trl"),
    )


def _split_pairs(folders: Any, seed: int) -> tuple[list[dict], list[dict]]:
    """Every round's pairs (`read_pairs`), split by prompt into (train, held-out); too few
    to train on is an error."""
    from pita.algos.dpo import read_pairs

    records = read_pairs(folders)
    train_pairs, heldout = split_by_prompt(records, HELDOUT_FRACTION, seed)
    if not train_pairs:
        raise RuntimeError(
            f"{len(records)} preference pairs: too few to train a reward model; raise "
            "data_collection.samples_per_example or the number of training prompts"
        )
    return train_pairs, heldout


def _accuracies(scorer: Any, train_pairs: list[dict], heldout: list[dict], logger: Any) -> dict:
    """The reward model's pairwise accuracy on (the first 2000) training and the held-out
    pairs, logged; with the pair counts, for the result."""
    result = {
        "pairs": len(train_pairs),
        "heldout_pairs": len(heldout),
        "train_accuracy": pairwise_accuracy(scorer, train_pairs[:2000]),
        "heldout_accuracy": pairwise_accuracy(scorer, heldout),
    }
    logger.info(
        "pairwise accuracy: train %.3f, held-out %.3f",
        result["train_accuracy"],
        result["heldout_accuracy"],
    )
    return result
