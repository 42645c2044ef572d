"""Names vulture reports as unused that are live: read by a library, Hydra, a dotted-path
string or a key, not by a Python reference vulture can see (tests/test_dead_code.py).

Vulture matches names, not objects: an entry here keeps every definition of that name. Keep
it short; each entry says who uses it. `_` stands for any object (vulture's own
`--make-whitelist` format); this file is parsed by vulture, never imported.
"""
# ruff: noqa: B018, F821
# mypy: ignore-errors

# --- called through a "module:function" string (pita/algos/registry.py, bench) -------------
collect_merge  # pita/algos/registry.py: "pita.stages.collect:collect_merge"
device_check  # pita/algos/registry.py: "pita.stages.diagnostic:device_check"
evaluate_shard  # pita/algos/registry.py: "pita.stages.evaluate:evaluate_shard"
evaluate_merge  # pita/algos/registry.py: "pita.stages.evaluate:evaluate_merge"
train_hf  # pita/algos/registry.py: "pita.algos.grpo:train_hf" (GRPO-HF)
train_reward_model  # pita/algos/registry.py: "pita.algos.reward_model:train_reward_model"
timed_stage  # bench/scheduler.py: executor.stage_overrides to "bench.workload:timed_stage"
gang_stage  # bench/scaling.py and bench/growth.py: executor.stage_overrides to "bench.workload:gang_stage"
tiny_model_stage  # bench/worker_start.py: its tasks name "bench.worker_start:tiny_model_stage"

# --- called by Hydra -------------------------------------------------------------------------
AggregateCallback  # conf/config.yaml: hydra.callbacks ... _target_
_.on_multirun_end  # Hydra's Callback hook
_.on_multirun_start  # Hydra's Callback hook (starts the sweep watcher)
LockedRunLog  # conf/hydra/job_logging/pita.yaml: the run.log handler class

# --- called by transformers / TRL / logging / torch ------------------------------------------
_.on_log  # TrainerCallback hooks (pita/training/report.py, tracking.py, algos/trl_common.py)
_.on_save  # TrainerCallback hook (pita/training/checkpoint.py)
_.on_train_begin  # TrainerCallback hook (pita/training/checkpoint.py, tracking.py)
_._initial_global_step  # transformers Trainer's own attribute, reset on resume (checkpoint.py)
_.on_step_begin  # TrainerCallback hook (pita/training/report.py)
_.on_step_end  # TrainerCallback hook (pita/training/report.py, checkpoint.py)
_.on_train_end  # TrainerCallback hook (pita/training/tracking.py)
_.should_save  # TrainerControl flag the Trainer reads after on_step_end
_.should_training_stop  # TrainerControl flag (checkpoint.py stop_callback: stop to grow)
_.should_log  # TrainerControl flag (trl_common.py last_step_logged: the last step is logged)
_._tokenize_prompts  # GRPOTrainer method override (pita/algos/grpo.py)
completions  # TRL passes reward functions completions=... by keyword
_.emit  # logging.Handler.emit (pita/training/ddp.py)
_.HF_HUB_OFFLINE  # huggingface_hub.constants, read by the hub client
_.pre_tokenizer  # tokenizers.Tokenizer reads it (pita/datasets/vocab.py)
_._compiled_call_impl  # torch.nn.Module.compile's attribute, reset to fall back to eager

# --- config keys read by key, not attribute (cfg.get("project"), model["reference_arch"]) ---
project  # logger.project: pita/training/tracking.py
tracking_uri  # logger.tracking_uri: pita/training/tracking.py
reference_arch  # model.reference_arch: pita/stages/pretrain.py, pita/experiment/estimates.py
guide_arch  # model.guide_arch: pita/models/value_model.py, pita/experiment/estimates.py

# --- records: written to files or kept for whoever reads the object ---------------------------
num_shards  # TaskSpec field: serialised with the task (plan.json, the task's record)
FailureClass  # the one list of failure classes (pita/core/errors.py); TaskOutcome.failure holds one
total_bytes  # DevicePlacement: the model's weight bytes (tests: bytes_per_device sums to it)
_.rejected_connections  # WorkerPool: connections dropped unauthenticated (test_pool_faults)

# --- Kept for tests on purpose (decided at the merge of issue 20) ------------------------------
# Ground truth the tests check the tasks and the training loop against; small, and each is
# the task's own definition of what a test would otherwise have to re-derive.
step_time_s  # pita/training/loop.py StepResult: tests/test_training_stack.py reads each step
_.to_text  # pita/datasets/star_graph.py: the official text form, the round-trip tests' oracle
_.graph_of  # pita/datasets/star_graph.py: prompt -> graph, the rendering round-trip tests
_.prompt_length  # pita/datasets/star_graph.py: tests/test_star_graph.py checks prompt shapes
_.reachable  # pita/datasets/goal_walk.py: tests/test_goal_walk.py checks the walk's targets
_.optimal_kl  # pita/datasets/goal_walk.py: tests/test_goal_walk.py checks the optimum's KL
weights_bytes  # pita/runtime/batch_size/search.py MemoryEstimate: the batch-size tests' oracle
# Not reported by vulture (a string, or a name another object uses), dead all the same:
# - pita/training/checkpoint.py: Checkpointer.enabled - never read (AlgoConfig.enabled's name hides it)
# - pita/training/ddp.py: DistContext.backend - never read (other `backend`s hide it)

# --- config keys (pita/core/schema.py fields) read by name ---------------------------------------
trl  # pita/algos/trl_common.py: trl_options(ctx, key) reads algos.<NAME>.<key> by name, key="trl"
reward_trl  # the same, key="reward_trl" (the reward model's TRL options)
dataset_file  # experiment.dataset_file: pita/experiment/dataset_choice.py reads it by name (.get)
_.bounded  # pita/core/schema.py Rule.bounded: tests/test_schema.py checks every numeric key has one
resume_safe_keys  # pita/core/schema.py: tests/test_affects.py ties docs/operations.md's resume sentence to it
describe_keys  # the same: the sentence's text, derived from the fields' `affects`
