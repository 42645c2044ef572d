"""DPO baseline (Rafailov et al. 2023) with TRL's `DPOTrainer`; also the pair collector of GRPO-HF.

Round k:
1. `collect` (sharded over the training prompts): sample `samples_per_example` responses per
   prompt from the current policy (round 0: π_ref; round k: round k−1's trained policy),
   score them with the task's verifier in batches and turn each prompt's samples into
   preference pairs (`preference_pairs`), written to `pairs.jsonl` in token space:
   `{"example": i, "prompt": [ids], "chosen": [ids], "rejected": [ids]}` (responses end with
   EOS unless the sampler ran out of tokens).
2. `train`: DPO on the pairs of rounds 0..k (DAgger style), the policy starting from round
   k−1's policy (π_ref in round 0) and the frozen reference always π_ref, so every round
   stays regularised towards the same π_ref that evaluation measures KL against.

Where it departs from the papers / TRL defaults:
- Pairs. Binary reward: a successful sample vs a failed one; when no sample succeeded but
  the example carries a target the verifier accepts, the target is the chosen response (the
  star-graph recipe: chosen = ground-truth path, rejected = π_ref's wrong sample; on that
  task a correct sample *is* the target, token for token). Real rewards: the i-th best
  sample against the i-th worst while the first scores strictly higher. Responses are
  de-duplicated per prompt and at most `algos.<NAME>.pairs_per_example` pairs are kept.
- Token space. TRL 1.16's DPOTrainer has no pre-tokenized input path of its own (it
  always tokenizes `prompt` / `chosen` / `rejected` text); `TokenDPOTrainer` overrides its
  `_prepare_dataset` so that a dataset that already has `prompt_ids` / `chosen_ids` /
  `rejected_ids` columns reaches the collator as is. The ids trained on are exactly the
  ids that were sampled (no decode / re-encode: a byte-level BPE tokenizer does not give
  back sampled ids after a text round trip). EOS is appended to a response that lacks one
  (a sample cut by the token budget), as TRL's text path does; that is the only change.
- The SFT term (RPO, Pang et al. 2024) is TRL's `loss_type=["sigmoid", "sft"]` with
  weights [1, `sft_weight`] (TRL 1.16 has no `rpo_alpha`): an NLL on the chosen responses.
- Constant learning rate, no warmup (trl_common), so a learning-rate sweep means what it says.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pita.core.paths import Artifact
from pita.core.schema import PreferenceConfig, RewardModelMixin
from pita.runtime.context import StageContext

# What a CUDA worker imports while it waits for its first task (pita.runtime.worker).
WARM_IMPORTS = ("trl.trainer.dpo_trainer",)


def training_prompts(ctx: StageContext, task) -> list:
    """The task's training prompts, at most `data_collection.max_examples` (0 = all)."""
    examples = task.train_examples()
    cap = ctx.data_collection.max_examples
    return examples[:cap] if cap else examples


def pair_settings(ctx: StageContext) -> PreferenceConfig | RewardModelMixin:
    """`algos.<NAME>` of an algorithm whose collect writes preference pairs: DPO / RPO, or
    an -HF variant (its proxy reward model's pairs)."""
    algo = ctx.algo
    if not isinstance(algo, (PreferenceConfig, RewardModelMixin)):
        raise TypeError(f"algos.{ctx.task.algo} does not collect preference pairs")
    return algo


def samples_per_example(ctx: StageContext) -> int:
    """`algos.<NAME>.samples_per_example`, else `data_collection.samples_per_example`."""
    return pair_settings(ctx).samples_per_example or ctx.data_collection.samples_per_example


def _unique(responses: Sequence[Sequence[int]]) -> list[list[int]]:
    seen, out = set(), []
    for r in responses:
        key = tuple(r)
        if key not in seen:
            seen.add(key)
            out.append(list(r))
    return out


def preference_pairs(
    responses: Sequence[Sequence[int]],
    rewards: Sequence[float],
    *,
    binary: bool,
    max_pairs: int,
    target: Sequence[int] | None = None,
) -> list[tuple[list[int], list[int]]]:
    """(chosen, rejected) response pairs from one prompt's samples; see the module docstring.

    `target` is a response the verifier accepts (e.g. the star graph's ground-truth path), or
    None. Binary: every distinct failure is paired with a distinct success (cycling through
    the successes; the target when nothing succeeded). Real rewards: best against worst,
    second best against second worst, ... while the first scores strictly higher.
    """
    if binary:
        successes = _unique([r for r, x in zip(responses, rewards) if x >= 1.0])
        failures = _unique([r for r, x in zip(responses, rewards) if x < 1.0])
        if not successes and target is not None:
            successes = [list(target)]
        if not successes:
            return []
        return [(successes[i % len(successes)], f) for i, f in enumerate(failures[:max_pairs])]
    best: dict[tuple, float] = {}
    for r, x in zip(
        responses, rewards
    ):  # one reward per distinct response (the verifier is deterministic)
        best.setdefault(tuple(r), float(x))
    ranked = sorted(best.items(), key=lambda kv: -kv[1])
    pairs: list[tuple[list[int], list[int]]] = []
    for i in range(len(ranked) // 2):
        (hi, r_hi), (lo, r_lo) = ranked[i], ranked[-1 - i]
        if r_hi <= r_lo or len(pairs) == max_pairs:
            break
        pairs.append((list(hi), list(lo)))
    return pairs


def collect(ctx: StageContext) -> dict:
    """Sample k responses per training prompt and keep preference pairs, in token space.

    Reads: π_ref (`ctx.reference_model()`), or round r-1's policy (`guide` input) in later
    rounds; this shard's slice of the task's training prompts; `algos.<NAME>.samples_per_example`
    and `pairs_per_example`, `generation.*`, `data_collection.reward_batch_size`.
    Writes: `pairs.jsonl` (prompt, chosen and rejected response ids; the higher-reward
    response is chosen, ties give no pair). Shared by DPO and GRPO-HF (whose reward model
    learns from the same pairs). Assumes the task's rewards tell responses apart.
    """
    from pita.models.placement import placement_lines

    # The task (its tokenizer and verifier) and the policy that samples this round.
    ref_dir = ctx.reference_model()
    task = ctx.build_task()
    policy_dir = str(ctx.input("guide") / Artifact.MODEL) if ctx.has_input("guide") else ref_dir
    policy = ctx.load_model(policy_dir)
    ctx.logger.info("sampling with %s", policy_dir)

    # This shard's prompts, each repeated k times, sampled in batches.
    all_examples = training_prompts(ctx, task)
    indices = list(range(len(all_examples)))[ctx.shard_slice(len(all_examples))]
    k = samples_per_example(ctx)
    examples = [all_examples[i] for i in indices for _ in range(k)]
    responses = _sample(ctx, policy, task, examples, [(i, s) for i in indices for s in range(k)])
    rewards = _rewards(ctx, task, examples, responses)
    binary = all(r in (0.0, 1.0) for r in rewards)
    # Pairs per prompt, in token space.
    prompts = [(i, all_examples[i]) for i in indices]
    groups = [
        (responses[j * k : (j + 1) * k], rewards[j * k : (j + 1) * k]) for j in range(len(indices))
    ]
    n_pairs, n_with_pairs = _write_pairs(
        ctx.out_dir / Artifact.PAIRS,
        task,
        prompts,
        groups,
        binary,
        pair_settings(ctx).pairs_per_example,
    )
    ctx.logger.info(
        "%d prompts x %d samples: mean reward %.4f (%s), %d pairs from %d prompts",
        len(indices),
        k,
        sum(rewards) / max(1, len(rewards)),
        "binary" if binary else "real-valued",
        n_pairs,
        n_with_pairs,
    )
    return {
        "prompts": len(indices),
        "samples": len(examples),
        "pairs": n_pairs,
        "prompts_with_pairs": n_with_pairs,
        "reward_sum": sum(rewards),
        "run_log_lines": placement_lines(policy, "policy"),
    }


def _sample(
    ctx: StageContext, policy: Any, task: Any, examples: list[Any], keys: list[tuple[int, int]]
) -> list[list[int]]:
    """One sampled response per example (`generation.*`); sample s of prompt i (`keys`) from
    its own stream: the same on any shard (pita/models/seeds.py)."""
    from pita.models.generation import generate
    from pita.models.seeds import example_seed
    from pita.runtime.batching import generation_batch_size

    gen, tok = ctx.generation, task.tokenizer
    prompts = [e.prompt_ids for e in examples]
    max_new = int(gen.max_new_tokens or task.max_new_tokens)
    bs = generation_batch_size(
        ctx, gen.batch_size, model=policy, prompts=prompts, max_new_tokens=max_new
    )
    return generate(
        policy,
        prompts,
        max_new_tokens=max_new,
        batch_size=bs,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        do_sample=True,
        temperature=gen.temperature,
        top_k=gen.top_k,
        top_p=gen.top_p,
        row_seeds=[example_seed(ctx.seed, "sample", i, s) for i, s in keys],
        on_batch=lambda done: ctx.report_progress(done, len(prompts), "prompts", "sampling"),
    ).responses


def _rewards(
    ctx: StageContext, task: Any, examples: list[Any], responses: list[list[int]]
) -> list[float]:
    """Rewards in batches of data_collection.reward_batch_size (one verifier call each)."""
    from pita.runtime.batching import generation_batch_size

    rb = generation_batch_size(ctx, ctx.data_collection.reward_batch_size, fallback=256)
    rewards: list[float] = []
    for start in range(0, len(examples), rb):
        rewards += task.rewards(examples[start : start + rb], responses[start : start + rb])
    return rewards


def _write_pairs(
    path: Path,
    task: Any,
    prompts: list[tuple[int, Any]],
    groups: list[tuple[list, list]],
    binary: bool,
    max_pairs: int,
) -> tuple[int, int]:
    """`pairs.jsonl`: each prompt's preference pairs among its samples (`groups`: their
    responses and rewards); a correct target joins as a chosen response. -> (pairs, prompts
    with a pair)."""
    n_pairs = n_with_pairs = 0
    with open(path, "w") as f:
        for (i, ex), (responses, rewards) in zip(prompts, groups):
            target = None
            if ex.target_ids is not None and task.rewards([ex], [ex.target_ids])[0] >= 1.0:
                target = ex.target_ids
            pairs = preference_pairs(
                responses, rewards, binary=binary, max_pairs=max_pairs, target=target
            )
            for chosen, rejected in pairs:
                row = {"example": i, "prompt": list(ex.prompt_ids), "chosen": chosen}
                f.write(json.dumps({**row, "rejected": rejected}) + "\n")
            n_pairs += len(pairs)
            n_with_pairs += bool(pairs)
    return n_pairs, n_with_pairs


def read_pairs(folders: Sequence[Path]) -> list[dict]:
    """Every record of `pairs.jsonl` in the given collect folders, in order."""
    records = []
    for folder in folders:
        path = Path(folder) / Artifact.PAIRS
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no pairs.jsonl; the collect stage wrote no preference pairs"
            )
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


def pairs_as_ids(records: Sequence[dict], eos_id: int) -> dict[str, list[list[int]]]:
    """TRL's tokenized preference columns from our records: `prompt_ids`, and the responses
    with EOS appended where the sampler ran out of tokens before emitting it."""

    def with_eos(ids):
        return list(ids) if ids and ids[-1] == eos_id else [*ids, eos_id]

    return {
        "prompt_ids": [list(r["prompt"]) for r in records],
        "chosen_ids": [with_eos(r["chosen"]) for r in records],
        "rejected_ids": [with_eos(r["rejected"]) for r in records],
    }


TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def token_dpo_trainer():
    """`DPOTrainer` that takes a dataset already in token space (TOKEN_COLUMNS) as is.

    TRL's `_prepare_dataset` would extract / EOS-terminate / tokenize text columns; with
    the id columns present there is nothing left for it to do but the `max_length` filter
    of prompts that fill the whole budget, kept here. Any other dataset goes through TRL.
    """
    from trl import DPOTrainer

    class TokenDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if not set(TOKEN_COLUMNS) <= set(dataset.column_names or ()):
                return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
            if args.max_length is not None and args.truncation_mode == "keep_start":
                dataset = dataset.filter(lambda ex: len(ex["prompt_ids"]) < args.max_length)
            return dataset

    return TokenDPOTrainer


def check_token_dataset(dataset, ids: dict[str, list[list[int]]]) -> None:
    """Raise unless the trainer's dataset holds exactly our ids (guards against a TRL
    version that re-tokenizes behind `TokenDPOTrainer`'s back)."""
    for column, want in ids.items():
        got = [list(x) for x in dataset[column]]
        if got != want:
            bad = (
                next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                if len(got) == len(want)
                else len(got)
            )
            raise RuntimeError(
                f"DPO: the trainer's {column} differ from the collected token ids (row {bad}); "
                "TRL no longer takes pre-tokenized pairs as is"
            )


def train(ctx: StageContext) -> dict:
    """Train the policy with TRL's DPOTrainer on every round's pairs so far, on the task's
    gang when it has one (`run_on_gang`: each rank takes its share of every batch).

    Reads: `pairs.jsonl` of the `data` inputs, the start policy (round r-1's `model/` or
    π_ref), `algos.DPO.*` (beta, lr, epochs, sft_weight), `training.*`.
    Writes: `model/` (save_pretrained policy + tokenizer), training_metrics.png,
    performance_summary.txt, `train_log.jsonl`. Assumes the pairs' token ids are what
    the policy sampled (TRL gets them as ids).
    """
    from pita.algos.trl_common import run_on_gang

    return run_on_gang(ctx, _train)


def _train(ctx: StageContext, dist: object = None) -> dict:
    """`train` on one rank (or alone): the TRL Trainer finds the gang through accelerate."""
    import torch
    from datasets import Dataset

    from pita.algos.trl_common import (
        effective_batch,
        load_trainable_lm,
        lora_config,
        policy_start_dir,
        quiet,
        stage_log_callback,
        train_and_save,
        whole_batches,
    )
    from pita.models.loading import load_tokenizer

    # Data first (fail before loading models): the pairs of every round so far, shuffled.
    records = _shuffled_pairs(ctx.inputs("data"), ctx.seed)

    # Models: the policy starts from the previous round (else π_ref); the frozen reference is π_ref.
    ref_dir, start_dir = ctx.reference_model(), policy_start_dir(ctx)
    tok = load_tokenizer(ref_dir)
    policy = load_trainable_lm(ctx, start_dir)
    ref_model = load_trainable_lm(ctx, ref_dir)
    ref_model.requires_grad_(False)
    torch.manual_seed(ctx.seed)

    batch = effective_batch(ctx)  # the global batch: each epoch draws whole ones
    args = _dpo_config(ctx, batch)
    ids = pairs_as_ids(records, tok.eos_token_id)
    trainer = quiet(
        whole_batches(token_dpo_trainer(), batch)(
            model=policy,
            ref_model=ref_model,
            args=args,
            train_dataset=Dataset.from_dict(ids),
            processing_class=tok,
            callbacks=[stage_log_callback(ctx)],
            peft_config=lora_config(ctx),  # LoRA: the frozen reference stays ref_model (π_ref)
        )
    )
    check_token_dataset(trainer.train_dataset, ids)
    ctx.logger.info(
        "DPO on %d pairs from %d round(s); policy from %s, reference %s",
        len(records),
        len(ctx.inputs("data")),
        start_dir,
        ref_dir,
    )

    _, end = train_and_save(ctx, trainer, tok, Artifact.MODEL, _DPO_METRICS)
    return {"pairs": len(records), "start": start_dir, **end}


# what a DPO task's result keeps of TRL's last logs
_DPO_METRICS = (
    "train_loss",
    "rewards/accuracies",
    "rewards/margins",
    "rewards/chosen",
    "rewards/rejected",
    "logps/chosen",
    "logps/rejected",
)


def _shuffled_pairs(folders: Sequence[Path], seed: int) -> list[dict]:
    """The pairs of every round so far (`read_pairs`), shuffled by the task's seed; none is
    an error (every prompt's samples were all right or all wrong)."""
    records = read_pairs(folders)
    if not records:
        raise RuntimeError(
            "no preference pairs were collected (every prompt's samples were all right or all "
            "wrong); raise data_collection.samples_per_example"
        )
    random.Random(seed).shuffle(records)
    return records


def _dpo_config(ctx: StageContext, batch: int) -> Any:
    """DPOConfig from `algos.<NAME>.*`: sigmoid loss, plus TRL's SFT term on the chosen
    responses when `sft_weight` > 0 (RPO)."""
    from trl import DPOConfig

    from pita.algos.trl_common import training_args, trl_options

    algo = ctx.algo_as(PreferenceConfig)
    sft = float(algo.sft_weight)
    loss: dict[str, Any] = {"loss_type": ["sigmoid"]}
    if sft > 0:
        loss = {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, sft]}
    return training_args(
        ctx,
        DPOConfig,
        batch_size=batch,
        lr=float(algo.lr),
        epochs=int(algo.epochs),
        steps=int(algo.steps),
        beta=float(algo.beta),
        max_length=None,
        options=trl_options(ctx),
        **loss,
    )
