"""Preflight against the models' and datasets' own files (issue 34 item 2): what every
task would hit is one line and exit 2 before any folder or process exists. Real files:
a config.json, a safetensors header, an empty or filled Hugging Face cache."""

from __future__ import annotations

import json
import struct

import pytest

from pita.experiment import cli
from tests.conftest import only


def _model(folder, positions=256, names=("model.layers.0.self_attn.q_proj.weight",)):
    """A model folder as `save_pretrained` leaves it, minus the tensors' bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "n_positions": positions})
    )
    header = json.dumps({n: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]} for n in names})
    (folder / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header.encode() + b"\0" * 4
    )
    return folder


def _family(folder) -> list[str]:
    return ["model.name=mine", f"model.reference={folder}", f"model.guide={folder}"]


def _data(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    return f"dataset.path={tmp_path / 'data.jsonl'}"


def _exit_2(args, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2, err
    assert len(err) == 1, err
    return err[0]


def test_model_with_fewer_positions_than_the_budget(tmp_path, capsys, monkeypatch):
    """GPT-2 of 256 positions with gsm8k's 512-token responses: every task ended in a bare
    `IndexError: index out of range in self`."""
    monkeypatch.chdir(tmp_path)
    model = _model(tmp_path / "gpt2-256")
    base = ["dataset=gsm8k", _data(tmp_path), *_family(model), *only("reference")]
    line = _exit_2(base, capsys)
    assert line == (
        f"error: dataset.max_new_tokens=512: model.reference='{model}' embeds 256 positions, "
        "fewer than dataset=gsm8k's prompt + response budget (512 + 512); set "
        "dataset.max_prompt_tokens and dataset.max_new_tokens to sum to at most 256"
    )
    line = _exit_2([*base, "dataset.max_new_tokens=64", "dataset.max_prompt_tokens=200"], capsys)
    assert "(200 + 64)" in line
    assert not (tmp_path / "outputs").exists()
    followed = [*base, "dataset.max_new_tokens=56", "dataset.max_prompt_tokens=200"]
    cli.preflight(cli.compose_config(followed), followed)  # the advice, followed: no error


def test_lora_target_modules_that_match_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = _model(
        tmp_path / "llama",
        positions=4096,
        names=("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"),
    )
    base = ["dataset=gsm8k", _data(tmp_path), *_family(model), *only("DPO")]
    line = _exit_2([*base, "+algos.DPO.peft={r: 4, target_modules: [q_proj, c_attn]}"], capsys)
    assert line.startswith(
        "error: algos.DPO.peft.target_modules=['q_proj', 'c_attn']: c_attn matches no module of "
        f"model.reference='{model}'; its modules end in: q_proj, up_proj"
    )
    built_in = ["system.devices=cpu", *only("DPO"), "+algos.DPO.peft={target_modules: [c_attn]}"]
    assert "model.reference='<built in the run>'" in _exit_2(built_in, capsys)
    for followed in (  # the advice, followed: an existing module, or all-linear
        [*base, "+algos.DPO.peft={r: 4, target_modules: [q_proj, up_proj]}"],
        [*base, "+algos.DPO.peft={r: 4, target_modules: all-linear}"],
    ):
        cli.preflight(cli.compose_config(followed), followed)


def test_lora_targets_that_exist_pass(tmp_path):
    from omegaconf import OmegaConf

    from pita.experiment.preflight_models import lora_target_errors
    from pita.models.catalog import Family

    model = _model(tmp_path / "m", names=("transformer.h.0.attn.c_attn.weight",))
    cfg = OmegaConf.create(
        {"algos": {"DPO": {"enabled": True, "peft": {"target_modules": ["c_attn", "attn.c_attn"]}}}}
    )
    fam = Family(reference=str(model), guide=str(model))
    assert lora_target_errors(cfg, [("model.name", "mine", fam)]) == []


def _hub_gsm8k(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in (
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_DATASETS_CACHE",
        "HF_DATASETS_OFFLINE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    model = _model(tmp_path / "m", positions=4096)
    return ["dataset=gsm8k", *_family(model), *only("reference")]


def test_hub_dataset_not_cached_while_offline(tmp_path, capsys, monkeypatch):
    """Each of 13 tasks waited ~23 s for the hub, then failed."""
    args = _hub_gsm8k(tmp_path, monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = _exit_2(args, capsys)
    assert line == (
        "error: dataset=gsm8k: openai/gsm8k is not in the local cache and HF_HUB_OFFLINE is set; "
        "download it once (hf download openai/gsm8k --repo-type dataset) or set dataset.path to "
        "local .jsonl files"
    )
    snapshot = tmp_path / "hf" / "hub" / "datasets--openai--gsm8k" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text("cached\n")
    cli.preflight(cli.compose_config(args), args)  # cached: no error


def test_hub_dataset_not_cached_while_the_hub_cannot_be_reached(tmp_path, capsys, monkeypatch):
    """A hub that does not answer (a host that does not resolve: a real probe, which fails)."""
    from pita.experiment import preflight

    args = _hub_gsm8k(tmp_path, monkeypatch)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(preflight, "HUB_HOST", "hub.invalid")
    line = _exit_2(args, capsys)
    assert "openai/gsm8k is not in the local cache and huggingface.co cannot be reached" in line


def test_preflight_reads_a_bounded_part_of_a_huge_dataset_file(tmp_path):
    """A 1 GB dataset file without a newline (sparse: no disk used) is not read whole:
    the first lines' check stops at MAX_LINE_CHARS and leaves the record to the task."""
    from omegaconf import OmegaConf

    from pita.experiment.preflight import MAX_LINE_CHARS, _jsonl_errors

    huge = tmp_path / "huge.jsonl"
    with open(huge, "wb") as f:
        f.truncate(2**30)
    assert MAX_LINE_CHARS < 2**30
    assert _jsonl_errors(OmegaConf.create({"dataset": {"path": str(huge)}})) == []
    blank_first = tmp_path / "blank.jsonl"
    blank_first.write_text("\n" * 1000 + '{"question": "q", "answer": "1"}\n')
    assert _jsonl_errors(OmegaConf.create({"dataset": {"path": str(blank_first)}})) == []
