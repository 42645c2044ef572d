"""YAML alias expansion is bounded in pita's config files (issue 43 item 7,
pita/core/yaml_bound.py): a 500-byte "billion laughs" experiment file held the pre-run
checks for minutes while OmegaConf copied every alias; now it is one line, exit 2, in
seconds, and so is a run's saved config holding one (read on resume)."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli


def bomb(levels: int = 9, header: str = "") -> str:
    """Nine aliases of the level above per level: 9**levels leaves from ~50 bytes a level."""
    lines = [header.rstrip("\n")] if header else []
    lines.append('x0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]')
    for i in range(1, levels):
        lines.append(f"x{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_in_an_experiment_file_is_one_line_in_seconds(tmp_path):
    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    text = bomb(header="# @package _global_\ndefaults:\n  - smoke\n  - _self_\n")
    assert len(text.encode()) < 600
    (conf / "bomb.yaml").write_text(text)
    for dry_run in ("true", "false"):
        proc = run_cli(
            ["--config-dir", str(tmp_path / "conf"), "experiment=bomb", f"dry_run={dry_run}"],
            tmp_path,
            timeout=120,  # minutes before the bound
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(f"error: {conf / 'bomb.yaml'}:") and "alias bomb" in line, line
        assert not (tmp_path / "outputs").exists()


def test_a_saved_config_holding_a_bomb_is_refused_on_resume(tmp_path):
    from pita.core.errors import ConfigError
    from pita.experiment.cli import load_resume_config

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(bomb())
    (run / "plan.json").write_text("{}")
    with pytest.raises(ConfigError) as err:
        load_resume_config(str(run), [])
    [line] = err.value.messages
    assert "saved config unreadable" in line and "alias bomb" in line, line


def test_expanded_size_counts_aliases_and_stops_at_a_cycle():
    import yaml

    from pita.core.yaml_bound import MAX_YAML_NODES, expanded_size

    shared = yaml.compose("a: &x [1, 2]\nb: *x\nc: *x\n")
    assert expanded_size(shared) == 1 + 3 + 3 * 3  # the root, 3 keys, 3 lists of 2 (1 + 2 each)
    assert expanded_size(yaml.compose(bomb(9))) > MAX_YAML_NODES
    cyclic = yaml.compose("&a [*a]")
    assert expanded_size(cyclic) > MAX_YAML_NODES
