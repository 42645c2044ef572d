"""No secret through any key or path (issue 43 item 3). pita writes its config, the command
line and the run folder's path into the run folder (`.hydra/*.yaml`, `run_info.json`,
`run.log`) and its per-user caches, so a token is refused wherever it would come in: any
override (pita's keys, `+`-added keys, Hydra's own `hydra.*`), Hydra's settings in a config
file, and the run folder's path. `hydra.job.env_set` is not a way to pass a secret (Hydra
writes it into `.hydra/`): a secret-named variable there is refused whatever its value,
and the line says to set it in the environment of the command instead (docs/operations.md).
Each refusal is one line, exit 2, the value never shown, dry run and real run alike, and
nothing is written."""

from __future__ import annotations

import pytest

from pita.core.errors import ConfigError
from pita.experiment import cli
from tests.conftest import run_cli

TOKEN = "hf_" + "PlantedSecret0" * 3  # token-shaped, planted where a user would put it

ON_THE_COMMAND_LINE = [
    (f"+hydra.job.env_set.HF_TOKEN={TOKEN}", "hydra.job.env_set.HF_TOKEN: looks like a secret"),
    ("+hydra.job.env_set.HF_TOKEN=${oc.env:HF_TOKEN}", "hydra.job.env_set.HF_TOKEN: looks like"),
    (f"hydra.job.name={TOKEN}", "hydra.job.name: looks like a secret"),
    (f"hydra.run.dir=/tmp/{TOKEN}/run", "hydra.run.dir: looks like a secret"),
    (f"hydra.sweep.dir=/tmp/x-{TOKEN}", "hydra.sweep.dir: looks like a secret"),
    (f"+experiment.note={TOKEN}", "experiment.note: looks like a secret"),
    (f"experiment.name={TOKEN}", "experiment.name: looks like a secret"),
    (f"+{TOKEN}=1", "<secret>: looks like a secret"),
    (f"resume_from=/tmp/{TOKEN}", "resume_from: looks like a secret"),
]


@pytest.mark.parametrize("dry_run", ["true", "false"])
@pytest.mark.parametrize("override, expected", ON_THE_COMMAND_LINE)
def test_a_secret_in_any_override_is_one_line(
    override, expected, dry_run, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_hydra_main", lambda: pytest.fail("reached Hydra"))
    monkeypatch.setattr("pita.experiment.run.run", lambda *a, **k: pytest.fail("reached run"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main([override, f"dry_run={dry_run}"])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    [line] = err.strip().splitlines()
    assert line.startswith(f"error: {expected}"), line
    assert "in the environment" in line
    assert TOKEN not in out + err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_hydra_settings_in_a_config_file_are_checked(tmp_path):
    """An experiment file of the user's (`--config-dir`) setting Hydra's env_set or job name."""
    folder = tmp_path / "conf" / "experiment"
    folder.mkdir(parents=True)
    (folder / "leaky.yaml").write_text(
        "# @package _global_\n"
        "defaults:\n  - smoke\n  - _self_\n"
        f"hydra:\n  job:\n    name: {TOKEN}\n    env_set:\n      WANDB_API_KEY: not-a-token-shape\n"
    )
    with pytest.raises(ConfigError) as err:
        cli.compose_config(["experiment=leaky"], None, str(tmp_path / "conf"))
    lines = err.value.messages
    assert [ln.split(":")[0] for ln in lines] == [
        "hydra.job.name",
        "hydra.job.env_set.WANDB_API_KEY",
    ]
    assert TOKEN not in " ".join(lines)


@pytest.mark.parametrize("dry_run", ["true", "false"])
def test_a_run_folder_whose_path_holds_a_token_is_refused(dry_run, tmp_path):
    """The default run folder under a working folder whose path holds a token: one line with
    the token masked, exit 2, nothing written (the real run as the dry run)."""
    cwd = tmp_path / f"home-{TOKEN}"
    cwd.mkdir()
    proc = run_cli(["experiment=smoke", f"dry_run={dry_run}"], cwd)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: run folder ") and "<secret>" in line, line
    assert TOKEN not in proc.stdout + proc.stderr
    assert list(cwd.iterdir()) == []


def test_run_itself_refuses_such_a_folder(tmp_path):
    """`run()` checks too: a launcher's job, whose folder Hydra resolved elsewhere."""
    from pita.experiment.run import run

    cfg = cli.compose_config(["experiment=smoke", "dry_run=true"])
    with pytest.raises(ConfigError) as err:
        run(cfg, tmp_path / TOKEN / "run")
    assert "<secret>" in err.value.messages[0] and TOKEN not in err.value.messages[0]
