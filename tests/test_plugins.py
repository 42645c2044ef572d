"""Plugins fail alone (issue 43 item 4, pita/core/plugins.py): an installed package whose
`pita_algorithms` or `pita_datasets` entry point does not load is one WARNING naming the
package and the error and is skipped; the commands that do not need it work; a run that
selects it exits 2 with one line. Each case plants a real distribution (a `.dist-info`
folder with its `entry_points.txt`, as `pip install` writes it) on a temporary path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli

BROKEN = "raise RuntimeError('no driver for this plugin')\n"
TOP_LEVEL_TASK = """
DEFAULTS = {"size": 3}

def validate_cfg(cfg):
    return [] if cfg.get("size", 3) > 0 else ["dataset.size: must be > 0"]

def build(cfg, tokenizer=None, scorer=None):
    return ("task", cfg.get("size", 3))
"""


def plant(site: Path, dist: str, groups: dict[str, dict[str, str]], modules: dict[str, str]):
    """Install `dist` into `site` as pip would: its metadata, its entry points, its modules."""
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    text = "".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
        for group, eps in groups.items()
    )
    (info / "entry_points.txt").write_text(text)
    for name, code in modules.items():
        (site / f"{name}.py").write_text(code)


@pytest.fixture
def broken_site(tmp_path) -> Path:
    site = tmp_path / "site"
    plant(
        site,
        "broken-plugin",
        {
            "pita_algorithms": {"boom": "broken_algo:ROWS", "odd": "odd_rows:ROWS"},
            "pita_datasets": {"brokends": "broken_task"},
        },
        {"broken_algo": BROKEN, "odd_rows": "ROWS = 42\n", "broken_task": BROKEN},
    )
    return site


def _cli(args: list[str], cwd: Path, site: Path, script: str = "run_parallel.py"):
    return run_cli(args, cwd, env={"PYTHONPATH": f"{ROOT}:{site}"}, script=script)


def _no_traceback(proc) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr


def test_a_broken_plugin_is_one_warning_and_the_run_goes_on(tmp_path, broken_site):
    proc = _cli(["dry_run=true", "algos=[QSharp]"], tmp_path, broken_site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _no_traceback(proc)
    warned = [ln for ln in proc.stderr.splitlines() if "broken-plugin" in ln]
    # one line per entry point that failed (the dataset's too once its schema is read at start)
    for entry in ("boom", "odd", "brokends"):
        assert len([ln for ln in warned if f"entry point {entry} =" in ln]) <= 1, proc.stderr
    boom = next(ln for ln in warned if "boom" in ln)
    assert "RuntimeError: no driver for this plugin" in boom and "skipped" in boom
    assert "must give Algorithm rows" in next(ln for ln in warned if "odd" in ln)


def test_help_and_aggregate_work_beside_a_broken_plugin(tmp_path, broken_site):
    help_ = _cli(["--help"], tmp_path, broken_site)
    assert help_.returncode == 0 and "algos." in help_.stdout, help_.stderr
    _no_traceback(help_)
    (tmp_path / "empty").mkdir()
    agg = _cli([str(tmp_path / "empty")], tmp_path, broken_site, "pita/results/aggregate.py")
    assert agg.returncode == 1, agg.stdout + agg.stderr  # 1: no summary there, not a crash
    _no_traceback(agg)


def test_a_run_that_selects_a_broken_plugin_exits_2_in_one_line(tmp_path, broken_site):
    for args, start in (
        (["algos=[Boom]"], "error: algos=[Boom]: unknown algorithm 'Boom'"),
        (["dataset.name=brokends", "algos=[QSharp]"], "error: dataset.name='brokends': plugin"),
    ):
        proc = _cli([*args, "dry_run=true"], tmp_path, broken_site)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        _no_traceback(proc)
        [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert line.startswith(start), line
        assert "broken-plugin" in line and "RuntimeError: no driver for this plugin" in line


def test_a_dataset_plugin_may_name_a_top_level_module(tmp_path, monkeypatch):
    """`name = module` (no package): imported as written, not as pita.datasets.<module>."""
    import pita.datasets as ds

    site = tmp_path / "site"
    plant(
        site,
        "top-task",
        {"pita_datasets": {"toptask": "top_task_mod"}},
        {"top_task_mod": TOP_LEVEL_TASK},
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(ds, "REGISTRY", dict(ds.REGISTRY))
    monkeypatch.setattr(ds, "PLUGINS", dict(ds.PLUGINS))
    ds.read_plugins()
    ds.validate_dataset_cfg({"name": "toptask"})
    assert ds.build_task({"name": "toptask"}) == ("task", 3)
    assert ds.with_defaults({"name": "toptask"})["size"] == 3
    sys.modules.pop("top_task_mod", None)


def test_a_dataset_plugin_without_its_functions_is_one_line(tmp_path, monkeypatch):
    import pita.datasets as ds

    site = tmp_path / "site"
    plant(site, "empty-task", {"pita_datasets": {"hollow": "hollow_mod"}}, {"hollow_mod": ""})
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(ds, "REGISTRY", dict(ds.REGISTRY))
    monkeypatch.setattr(ds, "PLUGINS", dict(ds.PLUGINS))
    ds.read_plugins()
    with pytest.raises(ValueError) as err:
        ds.validate_dataset_cfg({"name": "hollow"})
    assert str(err.value).startswith("dataset.name='hollow': plugin empty-task")
    assert "no validate_cfg and no build" in str(err.value) and "\n" not in str(err.value)
    sys.modules.pop("hollow_mod", None)


def test_an_off_plugin_algorithm_that_is_gone_is_no_error():
    """`algos=[...]` writes `algos.<plugin>.enabled=false` for an installed plugin the config
    lacks: the saved config still resumes once the plugin is uninstalled; an enabled one, or
    one with keys of its own, is still an unknown algorithm."""
    from pita.experiment.config import algo_errors

    assert algo_errors({"Gone": {"enabled": False}}) == []
    [line] = algo_errors({"Gone": {"enabled": True}})
    assert line.startswith("algos.Gone: unknown algorithm")
    assert algo_errors({"Gone": {"enabled": False, "beta": 1}})
