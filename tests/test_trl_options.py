"""`algos.<NAME>.trl.<field>` (any TRL config field) and `algos.<NAME>.peft` (LoRA): checked in
the parent before anything starts (pita/experiment/trl_options.py), passed to the trainers
(pita/algos/trl_common.py), and a LoRA adapter merged into `model/` and evaluated like a
full model."""

from __future__ import annotations

import csv
import dataclasses
import json
import math

import pytest

from tests.conftest import ALGOS, only, run_cli, run_dirs, run_ok, task_spec

# --- the parent-side check (fast, no torch) ---------------------------------------------------


@pytest.mark.parametrize(
    ("module", "name"),
    [("dpo_config", "DPOConfig"), ("grpo_config", "GRPOConfig"), ("reward_config", "RewardConfig")],
)
def test_fields_read_from_source_are_the_dataclass_fields(module, name):
    """The ast reading of TRL's source gives exactly the installed config's init fields."""
    import trl

    from pita.experiment.trl_options import trl_fields

    real = {f.name for f in dataclasses.fields(getattr(trl, name)) if f.init}
    assert set(trl_fields(module, name)) == real


def _errors(**algos):
    from pita.experiment.trl_options import trl_option_errors

    return trl_option_errors(algos)


def test_typo_names_the_nearest_field():
    [line] = _errors(DPO={"trl": {"los_type": "ipo"}})
    assert line == "algos.DPO.trl.los_type: not a field of TRL's DPOConfig; did you mean loss_type?"
    [line] = _errors(GRPO={"trl": {"scale_reward": False}})
    assert "did you mean scale_rewards?" in line


def test_pita_keys_win_and_are_named():
    [lr] = _errors(GRPO={"trl": {"learning_rate": 0.1}})
    assert lr == "algos.GRPO.trl.learning_rate=0.1: set by pita from algos.GRPO.lr; use that"
    [temp] = _errors(GRPO={"trl": {"temperature": 0.5}})
    assert "generation.temperature" in temp
    [beta] = _errors(DPO={"trl": {"beta": 0.5}})
    assert "algos.DPO.beta" in beta
    [sft] = _errors(RPO={"sft_weight": 1.0, "trl": {"loss_type": "ipo"}})
    assert "algos.RPO.sft_weight" in sft
    assert _errors(DPO={"sft_weight": 0.0, "trl": {"loss_type": "ipo"}}) == []


def test_types_checked_where_cheap_and_passthrough_values_accepted():
    [bad] = _errors(GRPO={"trl": {"epsilon": "wide"}})
    assert bad == "algos.GRPO.trl.epsilon='wide': must be float"
    assert (
        _errors(
            GRPO={
                "trl": {"scale_rewards": False, "loss_type": "dr_grpo", "num_iterations": 2},
            },
            DPO={"trl": {"lr_scheduler_type": "constant", "warmup_steps": 2, "max_length": None}},
        )
        == []
    )


def test_peft_rules():
    assert _errors(DPO={"peft": None}) == []
    assert _errors(GRPO={"peft": {"r": 4, "alpha": 8, "target_modules": ["q_proj"]}}) == []
    assert _errors(GRPO={"peft": {"target_modules": "all-linear", "dropout": 0.1}}) == []
    got = _errors(
        DPO={"peft": {"r": 0, "alpha": 0, "dropout": 1.0, "target_modules": [], "rank": 2}}
    )
    assert got == [
        "algos.DPO.peft.r=0: an integer >= 1",
        "algos.DPO.peft.alpha=0: a number > 0",
        "algos.DPO.peft.dropout=1.0: a number in [0, 1)",
        "algos.DPO.peft.target_modules=[]: all-linear or a non-empty list of module names",
        "algos.DPO.peft.rank: unknown LoRA key; allowed: r, alpha, dropout, target_modules",
    ]


def test_reward_model_options_of_the_hf_variants():
    """-HF: reward_trl is checked against RewardConfig, with reward_lr / reward_epochs as
    pita's keys; QSharp-HF has it too (its reward model is TRL's), but no trl / peft."""
    assert _errors(**{"GRPO-HF": {"reward_trl": {"center_rewards_coefficient": 0.01}}}) == []
    [typo] = _errors(**{"QSharp-HF": {"reward_trl": {"center_reward_coefficient": 0.1}}})
    assert typo.startswith("algos.QSharp-HF.reward_trl.center_reward_coefficient: not a field")
    assert "did you mean center_rewards_coefficient?" in typo
    [lr] = _errors(**{"GRPO-HF": {"reward_trl": {"learning_rate": 0.1}}})
    assert "algos.GRPO-HF.reward_lr" in lr
    assert _errors(**{"QSharp-HF": {"trl": {"nonsense": 1}, "peft": {"r": 0}}}) == []


def test_values_trl_checks_only_at_trainer_start_are_refused_before_the_run():
    """Issue 34: choices read from TRL's source (metadata, enums, enumerating help texts),
    with the nearest allowed value; a value TRL's help names is accepted."""
    [loss] = _errors(GRPO={"trl": {"loss_type": "dr_grpoo"}})
    assert loss.startswith("algos.GRPO.trl.loss_type='dr_grpoo': not a value TRL's GRPOConfig")
    assert loss.endswith("did you mean dr_grpo?")
    [dpo] = _errors(DPO={"trl": {"loss_type": ["sigmoid", "ipoo"]}})
    assert "'ipoo'" in dpo and "did you mean ipo?" in dpo
    [sched] = _errors(DPO={"trl": {"lr_scheduler_type": "cosin"}})
    assert "did you mean cosine?" in sched
    assert (
        _errors(
            GRPO={"trl": {"loss_type": "cispo", "scale_rewards": "batch", "optim": "adamw_torch"}},
            DPO={"trl": {"loss_type": ["sigmoid", "sft"], "debug": "underflow_overflow"}},
        )
        == []
    )


def test_every_number_passed_through_has_a_ceiling():
    """issue 45: `dataset_num_proc=100000` asked `datasets` for 100,000 processes and
    `max_length=1000000000` passed; each number TRL gets from `trl` / `reward_trl` has a
    ceiling by what it counts (pita/experiment/trl_values.py `CEILINGS`), one line each."""
    from pita.experiment.trl_options import REWARD_CONFIG, TRL_CONFIGS, trl_fields
    from pita.experiment.trl_values import CEILINGS, OTHER_CEILING, ceiling_error

    procs, length = _errors(DPO={"trl": {"dataset_num_proc": 100000, "max_length": 10**9}})
    assert (
        procs
        == "algos.DPO.trl.dataset_num_proc=100000: at most 1,024 (processes); pita passes it to TRL"
    )
    assert length.startswith("algos.DPO.trl.max_length=1000000000: at most 131,072 (tokens)")
    [steps] = _errors(GRPO={"trl": {"logging_steps": 1e12}})
    assert "at most 10,000,000 (a count or size)" in steps
    [coef] = _errors(GRPO={"trl": {"epsilon": 1e300}})
    assert coef.startswith("algos.GRPO.trl.epsilon=1e+300: at most 1,000,000 in magnitude")
    [rm] = _errors(**{"GRPO-HF": {"reward_trl": {"dataset_num_proc": 5000}}})
    assert rm.startswith("algos.GRPO-HF.reward_trl.dataset_num_proc=5000: at most 1,024")
    ok = {"dataset_num_proc": 8, "max_length": 4096, "logging_steps": 4, "label_smoothing": 0.1}
    assert _errors(DPO={"trl": ok}) == []
    for config in [*TRL_CONFIGS.values(), REWARD_CONFIG]:  # every numeric field: some ceiling
        for field, kinds in trl_fields(*config).items():
            if kinds & {"int", "float"}:
                ceiling = next((c for p, c, _ in CEILINGS if p.search(field)), OTHER_CEILING)
                assert ceiling_error(field, field, ceiling * 10) is not None, field
                assert ceiling_error(field, field, ceiling) is None, field


@pytest.mark.parametrize(
    ("option", "package"),
    [({"optim": "adamw_bnb_8bit"}, "bitsandbytes"), ({"deepspeed": "/x/ds.json"}, "deepspeed")],
)
def test_an_optimizer_or_backend_whose_package_is_missing(option, package):
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    [line] = _errors(DPO={"trl": option})
    assert (
        f"needs the {package} package, which is not installed here; pip install {package}" in line
    )


def test_secrets_and_remote_code_refused_without_echoing_the_value():
    token = "hf_" + "a1B2c3D4e5" * 4
    lines = _errors(
        DPO={"trl": {"hub_token": token, "trust_remote_code": True}},
        GRPO={"trl": {"model_init_kwargs": {"trust_remote_code": True}, "hub_model_id": token}},
    )
    assert len(lines) == 4 and not any(token in line for line in lines)
    assert lines[0].startswith("algos.DPO.trl.hub_token: looks like a secret; refused")
    assert lines[1].startswith("algos.DPO.trl.trust_remote_code: remote code is switched by")
    assert "set model.trust_remote_code=true instead" in lines[1]
    assert lines[2].startswith("algos.GRPO.trl.model_init_kwargs.trust_remote_code:")
    assert lines[3].startswith("algos.GRPO.trl.hub_model_id: looks like a secret")
    assert _errors(DPO={"trl": {"average_tokens_across_devices": True, "pad_token": "<pad>"}}) == []


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("algos.DPO.trl.hub_token={token}", "algos.DPO.trl.hub_token"),
        ("algos.GRPO-HF.reward_trl.hub_token={token}", "algos.GRPO-HF.reward_trl.hub_token"),
        ("logger.tracking_uri=https://bob:{token}@mlflow.example.com", "logger.tracking_uri"),
        ("dataset.hub_id={token}", "dataset.hub_id"),
    ],
)
def test_a_secret_on_the_command_line_is_refused_and_never_echoed(
    override, key, tmp_path, capsys, monkeypatch
):
    from pita.experiment import cli

    monkeypatch.chdir(tmp_path)
    token = "hf_" + "PlantedSecret0" * 3
    with pytest.raises(SystemExit) as exit_info:
        cli.main([override.format(token=token)])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert token not in out + err
    assert any(line.startswith(f"error: {key}") for line in err.splitlines()), err
    assert not (tmp_path / "outputs").exists()


def test_option_files_are_read_like_control_files(tmp_path):
    from pita.experiment.trl_values import option_file_error as check

    good = tmp_path / "accel.json"
    good.write_text('{"split_batches": false}')
    assert check("k", str(good)) is None
    assert "an absolute path" in check("k", "accel.json")
    assert check("k", str(tmp_path / "none.json")).endswith("no such file")
    link = tmp_path / "link.json"
    link.symlink_to(good)
    assert "symbolic link" in check("k", str(link))
    good.chmod(0o666)
    assert "writable by every user" in check("k", str(good))
    good.chmod(0o600)
    (tmp_path / "bad.json").write_text("{nope")
    assert "not a JSON file" in check("k", str(tmp_path / "bad.json"))
    assert "not a regular file" in check("k", "/dev/zero")
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (2**20 + 1))
    assert "limit" in check("k", str(big))
    [line] = _errors(DPO={"trl": {"accelerator_config": str(link)}})
    assert line.startswith(f"algos.DPO.trl.accelerator_config='{link}':")


def test_value_guided_algorithms_have_no_trl_keys():
    assert _errors(QSharp={"trl": {"nonsense": 1}}) == []  # the schema walker refuses the key


def test_typo_on_the_command_line_is_one_line_exit_2_and_starts_nothing(tmp_path):
    proc = run_cli(
        [*only("DPO"), "experiment.name=typo", "algos.DPO.trl.los_type=ipo"], tmp_path, timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "algos.DPO.trl.los_type" in line and "did you mean loss_type?" in line
    assert run_dirs(tmp_path, "typo") == []


def test_conflict_on_the_command_line_is_exit_2(tmp_path):
    proc = run_cli(
        [*only("GRPO"), "experiment.name=conflict", "algos.GRPO.trl.num_generations=4"],
        tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "algos.GRPO.num_generations" in line
    assert run_dirs(tmp_path, "conflict") == []


# --- end to end on the local family ------------------------------------------------------------


def _state(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.long
@pytest.mark.slow
def test_trl_options_and_lora_reach_the_trainers(local_family, tmp_path):
    """DPO with trl.loss_type=ipo trained as a LoRA adapter on q_proj / v_proj, GRPO with
    trl.scale_rewards=false and trl.loss_type=dr_grpo, GRPO-HF's reward model with
    reward_trl.center_rewards_coefficient: the built TRL configs hold the values
    (result.json), only the adapted modules' weights moved, the merged `model/` and the
    adapter are saved, and the policies are evaluated."""
    assert {"DPO", "GRPO", "GRPO-HF"} <= set(ALGOS)
    args = [
        *local_family.overrides("gsm8k"),
        *only("DPO", "GRPO", "GRPO-HF"),
        "evaluation.num_samples=2",
        "data_collection.samples_per_example=4",
        "data_collection.max_examples=8",
        "executor.progress=false",
        "executor.cpu_workers=1",  # one worker importing torch, not one per core
        "experiment.name=trlopt",
        "algos.DPO.samples_per_example=4",
        "algos.DPO.epochs=1",
        "algos.DPO.batch_size=8",
        "algos.DPO.lr=0.05",
        "algos.DPO.trl.loss_type=ipo",
        "algos.DPO.peft={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}",
        "algos.GRPO.steps=2",
        "algos.GRPO.batch_size=8",
        "algos.GRPO.num_generations=4",
        "algos.GRPO.trl.scale_rewards=false",
        "algos.GRPO.trl.loss_type=dr_grpo",
        "algos.GRPO-HF.samples_per_example=4",
        "algos.GRPO-HF.steps=1",
        "algos.GRPO-HF.batch_size=4",
        "algos.GRPO-HF.num_generations=4",
        "algos.GRPO-HF.reward_epochs=1",
        "algos.GRPO-HF.reward_trl.center_rewards_coefficient=0.01",
    ]
    run_dir = run_ok(args, tmp_path, "trlopt", timeout=600)
    tasks = run_dir / "tasks"

    dpo = json.loads((tasks / "DPO.gsm8k.local.r0.train" / "result.json").read_text())
    assert dpo["trl"] == {"loss_type": ["ipo"]}
    assert dpo["peft"] == {
        "r": 4,
        "alpha": 8.0,
        "dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
    }
    grpo = json.loads((tasks / "GRPO.gsm8k.local.r0.train" / "result.json").read_text())
    assert grpo["trl"] == {"scale_rewards": "none", "loss_type": "dr_grpo"} and "peft" not in grpo

    reward = json.loads((tasks / "GRPO-HF.gsm8k.local.r0.reward_model" / "result.json").read_text())
    assert reward["reward_trl"] == {"center_rewards_coefficient": 0.01}

    train_dir = tasks / "DPO.gsm8k.local.r0.train"
    assert (train_dir / "adapter" / "adapter_config.json").is_file()
    before, after = _state(local_family.reference), _state(train_dir / "model")
    assert before.keys() == after.keys()  # a plain checkpoint: no lora_ names left
    moved = {k for k in before if not (before[k] == after[k]).all()}
    assert moved and all(".q_proj." in k or ".v_proj." in k for k in moved), moved

    with open(run_dir / "results" / "summary.csv") as f:
        rows = {r["algo"]: r for r in csv.DictReader(f)}
    for algo in ("DPO", "GRPO", "GRPO-HF"):
        assert math.isfinite(float(rows[algo]["pass@1"])), rows[algo]


# --- at the built TRL config (no run) ---------------------------------------------------------


def _stage_ctx(tmp_path, algo: str, stage: str, overrides: list[str]):
    """A StageContext for one of `algo`'s TRL stages, composed from the real config."""
    import logging

    from pita.experiment.cli import compose_config
    from pita.runtime.context import StageContext

    cfg = compose_config([f"algos.{algo}.enabled=true", *overrides])
    task = task_spec(
        f"{algo}.{stage}", algo=algo, stage=stage, fn="-", inputs={"reference": "pretrain"}
    )
    out = tmp_path / "tasks" / task.id
    out.mkdir(parents=True)
    logger = logging.getLogger(f"test.trl_options.{task.id}")
    return StageContext(task=task, cfg=cfg, run_dir=tmp_path, out_dir=out, logger=logger)


@pytest.mark.parametrize(
    ("algo", "stage", "config", "key", "overrides", "recorded"),
    [
        (
            "DPO",
            "train",
            "DPOConfig",
            "trl",
            [
                "algos.DPO.trl.loss_type=ipo",
                "algos.DPO.peft={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}",
            ],
            {
                "trl": {"loss_type": ["ipo"]},
                "peft": {
                    "r": 4,
                    "alpha": 8.0,
                    "dropout": 0.0,
                    "target_modules": ["q_proj", "v_proj"],
                },
            },
        ),
        (
            "GRPO",
            "train",
            "GRPOConfig",
            "trl",
            ["algos.GRPO.trl.scale_rewards=false", "algos.GRPO.trl.loss_type=dr_grpo"],
            {"trl": {"scale_rewards": "none", "loss_type": "dr_grpo"}},
        ),
        (
            "GRPO-HF",
            "reward_model",
            "RewardConfig",
            "reward_trl",
            ["algos.GRPO-HF.reward_trl.center_rewards_coefficient=0.01"],
            {"reward_trl": {"center_rewards_coefficient": 0.01}},
        ),
    ],
)
def test_trl_options_reach_the_built_trl_config(
    tmp_path, algo, stage, config, key, overrides, recorded
):
    """What the stages hand TRL, without a run: `training_args` builds the TRL config with the
    options last (after TRL's own `__post_init__`), and `applied_options` records for
    result.json what that config holds, with the LoRA spec of the trained policy. (The e2e
    test_trl_options_and_lora_reach_the_trainers trains with them and checks the weights.)"""
    import trl

    from pita.algos.trl_common import applied_options, training_args, trl_options

    ctx = _stage_ctx(tmp_path, algo, stage, overrides)
    options = trl_options(ctx, key)
    extra = {"num_generations": 4} if config == "GRPOConfig" else {}
    args = training_args(
        ctx, getattr(trl, config), batch_size=8, lr=1e-3, steps=2, options=options, **extra
    )
    assert applied_options(args, ctx, key) == recorded
    # pita's own settings are still there beside the options
    assert args.learning_rate == 1e-3 and args.max_steps == 2 and args.report_to == []
