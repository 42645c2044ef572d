"""GRPO baseline (Shao et al. 2024) with TRL's `GRPOTrainer`: the task's verifier as reward
(`train`, algo GRPO) or a proxy Bradley–Terry reward model (`train_hf`, algo GRPO-HF).

Each step samples `num_generations` completions for each of `batch_size / num_generations`
training prompts from the current policy (transformers' `generate`, on the CPU when the
task runs there), scores them, normalises rewards within each group and takes a clipped
policy-gradient step with a KL penalty β towards π_ref. Round k starts from round k−1's
policy; the KL reference stays π_ref in every round (as in evaluation).

The reward adapter (`TaskReward`, `ProxyReward`): TRL calls a reward function with the
prompts and completions as text, plus `completion_ids` and every extra dataset column as
keyword arguments. Our dataset carries the index of each prompt's `Example` (column
`example`), so the adapter maps a batch straight back to Examples and completion token ids
(EOS included when generated) and calls `task.rewards` (or the reward model) once per batch.

Where it departs from the paper / TRL defaults:
- TRL's default loss (`dapo`: token-level normalisation over the batch) and group reward
  scaling; one policy update per generation batch (`num_iterations=1`), so the clipping
  never binds; KL by TRL's k3 estimator on the sampled tokens.
- Token space. TRL generates from `tokenizer(prompt text)`; `TokenGRPOTrainer` instead
  hands generation each prompt's own ids (`_tokenize_prompts`, looked up through the
  `example` column), so prompts are never re-tokenized and completions are ids from the
  start. The `prompt` text column is only what TRL passes to reward functions (ours read
  `example` and `completion_ids`) and its logs.
- Sampling uses `generation.temperature / top_k / top_p`, as evaluation does, through pita's
  own sampler (`pita.models.generation.generate`) with one seed per completion: (stage seed,
  optimizer step, example, its place in the group), not TRL's per-process stream (seed +
  rank), so k ranks sample what one process samples and a checkpoint resumes on any k
  (tests/test_trl_gang.py). vLLM, `min_p`, `repetition_penalty` or `generation_kwargs` keep
  TRL's sampler, with a warning that the ranks then sample otherwise.
- `algos.<NAME>.trl.<field>` sets any other GRPOConfig field (`scale_rewards=false`,
  `loss_type=dr_grpo`, ...). With `algos.<NAME>.peft` (LoRA) TRL computes the KL reference
  by disabling the adapter, so it is the round's start policy: π_ref in round 0, round
  k−1's merged policy after (full fine-tuning keeps π_ref in every round).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pita.core.paths import Artifact
from pita.core.schema import GRPOConfig as GRPOSettings
from pita.runtime.context import StageContext

# What a CUDA worker imports while it waits for its first task (pita.runtime.worker,
# `warm_stage_imports`): TRL's GRPO trainer takes 5-10 s to import.
WARM_IMPORTS = ("trl.trainer.grpo_trainer",)


class TaskReward:
    """TRL reward function: the task's verifier on (Example, completion ids), one batch per call."""

    __name__ = "task_reward"

    def __init__(self, task, examples: Sequence) -> None:
        self.task = task
        self.examples = list(examples)

    def __call__(
        self, prompts: list, completions: list, completion_ids: list, example: list, **kwargs: Any
    ) -> list[float]:
        return self.task.rewards(
            [self.examples[i] for i in example], [list(ids) for ids in completion_ids]
        )


class ProxyReward:
    """TRL reward function: a proxy reward model's score of (prompt ids + completion ids).

    With `task`, the verifier's reward of the same completions is logged beside it as
    `true_reward` (never optimised), so reward hacking shows in the training log.
    """

    __name__ = "proxy_reward"

    def __init__(self, scorer, examples: Sequence, task=None) -> None:
        self.scorer = scorer
        self.examples = list(examples)
        self.task = task

    def __call__(
        self, prompts: list, completions: list, completion_ids: list, example: list, **kwargs: Any
    ) -> list[float]:
        examples = [self.examples[i] for i in example]
        ids = [list(c) for c in completion_ids]
        if self.task is not None and "log_metric" in kwargs:
            true = self.task.rewards(examples, ids)
            kwargs["log_metric"]("true_reward", sum(true) / max(1, len(true)))
        return self.scorer.score([list(e.prompt_ids) for e in examples], ids)


def prompt_dataset(examples: Sequence, tokenizer):
    """A `datasets.Dataset` of {"prompt": text, "example": index}. The text is for TRL's
    bookkeeping only; generation starts from the example's prompt ids (`token_grpo_trainer`)."""
    from datasets import Dataset

    texts = [
        tokenizer.decode(
            e.prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        for e in examples
    ]
    return Dataset.from_dict({"prompt": texts, "example": list(range(len(examples)))})


def token_grpo_trainer(prompt_ids: Sequence[Sequence[int]], seed: int):
    """A `GRPOTrainer` class whose generation starts from `prompt_ids[example]` for each
    row of a batch (the dataset's `example` column), not from re-tokenized prompt text, and
    samples each completion from its own seed (`_row_seeds`), so k ranks sample what one
    process samples."""
    from trl import GRPOTrainer

    table = [list(ids) for ids in prompt_ids]

    class TokenGRPOTrainer(GRPOTrainer):
        _batch_examples: list[int] = []

        def _generate_and_score_completions(self, inputs):
            self._batch_examples = [int(x["example"]) for x in inputs]
            return super()._generate_and_score_completions(inputs)

        def _tokenize_prompts(self, prompts: list):
            if len(prompts) != len(self._batch_examples):
                raise RuntimeError(
                    f"GRPO: {len(prompts)} prompts for a batch of {len(self._batch_examples)} rows"
                )
            return [list(table[i]) for i in self._batch_examples], None, {}

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *a):
            if not _row_seeded(self) or images or multimodal_fields:
                return super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, *a
                )
            return _seeded_completions(self, prompt_ids, _row_seeds(self, seed, num_generations))

    return TokenGRPOTrainer


def _row_seeded(trainer) -> bool:
    """Whether pita samples this trainer's completions (`_seeded_completions`): TRL's plain
    `generate` path with the sampling knobs pita's sampler has. vLLM, continuous batching,
    `min_p`, `repetition_penalty` or `generation_kwargs` (set through `algos.<NAME>.trl`)
    keep TRL's own per-process sampler, and a log line says k ranks then sample otherwise."""
    args = trainer.args
    plain = not (trainer.use_vllm or trainer.use_transformers_continuous_batching)
    knobs = trainer.min_p is None and trainer.repetition_penalty == 1.0
    ours = plain and knobs and not args.generation_kwargs
    if not ours and not getattr(trainer, "_said_per_rank", False):
        trainer._said_per_rank = True
        logging.getLogger(__name__).warning(
            "GRPO: TRL samples the completions (vLLM, continuous batching, min_p, "
            "repetition_penalty or generation_kwargs): each rank draws from its own seed, so "
            "another number of ranks samples other completions"
        )
    return ours


def _row_seeds(trainer, seed: int, num_generations: int) -> list[int]:
    """One seed per row of this rank's batch: (stage seed, optimizer step, example,
    completion j of its group). TRL lays a generation batch out over the ranks in order
    (rank r holds rows r·n … r·n + n − 1 of it, as its own advantage slice assumes) and a
    group's `num_generations` rows next to each other, so the row's place in the global
    batch gives j, the same on any k."""
    from pita.models.seeds import example_seed

    local = trainer._batch_examples
    first = trainer.accelerator.process_index * len(local)
    step = int(trainer.state.global_step)
    return [
        example_seed(seed, "grpo", step, example, (first + i) % num_generations)
        for i, example in enumerate(local)
    ]


def _seeded_completions(trainer, prompt_ids: list, row_seeds: list[int]):
    """TRL's `_generate_single_turn` on the plain path, with pita's sampler
    (pita.models.generation.generate with `row_seeds`: the same top-k, temperature and
    top-p rule as TRL's warpers and as evaluation): (completion ids cut after EOS, EOS
    included; None: no sampling log-probs, as TRL's own path)."""
    import torch
    from trl.models import unwrap_model_for_generation

    from pita.models.generation import generate

    with (
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as model,
        torch.no_grad(),
        trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False),
    ):
        out = generate(
            model,
            [list(p) for p in prompt_ids],
            max_new_tokens=int(trainer.max_completion_length),
            batch_size=max(1, len(prompt_ids)),
            pad_token_id=trainer._tokenizer.pad_token_id,
            eos_token_id=list(trainer.eos_token_ids),
            do_sample=True,
            temperature=float(trainer.temperature),
            top_k=int(trainer.top_k or 0),
            top_p=float(trainer.top_p if trainer.top_p is not None else 1.0),
            row_seeds=row_seeds,
        )
    return out.responses, None


# what a GRPO task's result keeps of TRL's last logs
_GRPO_METRICS = (
    "train_loss",
    "reward",
    "reward_std",
    "kl",
    "entropy",
    "frac_reward_zero_std",
    "true_reward",
)


def _grpo_config(ctx: StageContext, batch: int, group: int, max_completion: int) -> Any:
    """GRPOConfig from `algos.<NAME>.*` and `generation.*` (sampling), dropout off."""
    from trl import GRPOConfig

    from pita.algos.trl_common import training_args, trl_options

    algo, gen = ctx.algo_as(GRPOSettings), ctx.generation
    return training_args(
        ctx,
        GRPOConfig,
        batch_size=batch,
        lr=float(algo.lr),
        epochs=int(algo.epochs),
        steps=int(algo.steps),
        beta=float(algo.beta),
        num_generations=group,
        max_completion_length=max_completion,
        temperature=float(gen.temperature),
        top_k=int(gen.top_k),
        top_p=float(gen.top_p),
        disable_dropout=True,
        log_completions=False,
        options=trl_options(ctx),
    )


def _kl_reference(trainer: Any, beta: float, lora: bool, start_dir: str) -> str:
    """What the KL term regularises towards, for the log: TRL loads a reference model
    exactly when beta > 0 without LoRA (with LoRA: the policy with its adapter disabled)."""
    ref_model = getattr(trainer, "ref_model", None)
    assert (ref_model is None) == (beta == 0.0 or lora), (
        "TRL loads a KL reference exactly when beta > 0 (without LoRA)"
    )
    if beta == 0.0:
        return "none (beta=0)"
    if ref_model is None:
        return f"{start_dir} (LoRA: the policy with its adapter disabled)"
    return trainer.accelerator.unwrap_model(ref_model).config._name_or_path


def run_grpo(ctx: StageContext, task, examples: Sequence, reward_fn) -> dict:
    """GRPO from the round's starting policy against π_ref; saves the policy to out_dir/model."""

    from pita.algos.trl_common import (
        effective_batch,
        load_trainable_lm,
        lora_config,
        policy_start_dir,
        quiet,
        stage_log_callback,
        train_and_save,
    )
    from pita.models.loading import load_tokenizer

    algo = ctx.algo_as(GRPOSettings)
    batch, group = effective_batch(ctx), int(algo.num_generations)
    if batch % group:
        raise ValueError(
            f"algos.{ctx.task.algo}.batch_size={batch}: must be a multiple of "
            f"algos.{ctx.task.algo}.num_generations={group} (a batch holds whole groups)"
        )
    ref_dir, start_dir = ctx.reference_model(), policy_start_dir(ctx)
    tok = load_tokenizer(ref_dir)
    dataset = prompt_dataset(examples, tok)
    policy = load_trainable_lm(ctx, start_dir)
    # TRL builds the KL reference from the policy's `_name_or_path`: point it at π_ref, so a
    # round-k policy (started from round k−1's) is still regularised towards π_ref.
    policy.config._name_or_path = ref_dir

    args = _grpo_config(ctx, batch, group, int(algo.max_completion_length or task.max_new_tokens))
    lora = lora_config(ctx)
    trainer_cls = token_grpo_trainer([e.prompt_ids for e in examples], ctx.seed)
    trainer = quiet(
        trainer_cls(
            model=policy,
            reward_funcs=reward_fn,
            args=args,
            train_dataset=dataset,
            processing_class=tok,
            callbacks=[stage_log_callback(ctx)],
            peft_config=lora,
        )
    )
    kl_ref = _kl_reference(trainer, float(algo.beta), lora is not None, start_dir)
    ctx.logger.info(
        "GRPO on %d prompts, groups of %d; policy from %s, KL reference %s",
        len(examples),
        group,
        start_dir,
        kl_ref,
    )
    _, end = train_and_save(ctx, trainer, tok, Artifact.MODEL, _GRPO_METRICS)
    first: dict[str, Any] = next((r for r in trainer.state.log_history if "reward" in r), {})
    return {
        "prompts": len(examples),
        "start": start_dir,
        "first_reward": first.get("reward"),
        **end,
    }


def train(ctx: StageContext) -> dict:
    """Train the policy with TRL's GRPOTrainer against the task's own verifier / reward.

    Reads: the task's training prompts, the start policy (round r-1's `model/` or π_ref),
    `algos.GRPO.*`, `training.*`. Writes: `model/`, training_metrics.png, performance_summary.txt
    (reward and KL are in result.json). Assumes the task has a reward for any response.
    """
    from pita.algos.trl_common import run_on_gang

    return run_on_gang(ctx, _train)


def _train(ctx: StageContext, dist: object = None) -> dict:
    """`train` on one rank of the task's gang (or alone)."""
    from pita.algos.dpo import training_prompts

    task = ctx.build_task()
    examples = training_prompts(ctx, task)
    return run_grpo(ctx, task, examples, TaskReward(task, examples))


def train_hf(ctx: StageContext) -> dict:
    """GRPO against the proxy reward model of this round (GRPO-HF): as `train`, but the
    reward is `reward_model/` of the `reward_model` input; the task's true reward is only
    logged (`true_reward`), never optimised. Writes what `train` writes.
    """
    from pita.algos.trl_common import run_on_gang

    return run_on_gang(ctx, _train_hf)


def _train_hf(ctx: StageContext, dist: object = None) -> dict:
    """`train_hf` on one rank of the task's gang (or alone)."""
    from pita.algos.dpo import training_prompts
    from pita.algos.reward_model import load_reward_scorer

    task = ctx.build_task()
    examples = training_prompts(ctx, task)
    scorer = load_reward_scorer(ctx, ctx.input("reward_model"))
    result = run_grpo(ctx, task, examples, ProxyReward(scorer, examples, task))
    return {**result, "reward_model": str(ctx.input("reward_model"))}
