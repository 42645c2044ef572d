"""Which `conf/dataset/<file>.yaml` the command line selected, and where its `dataset.*`
overrides go (issue 45).

A dataset is named two ways: by its file (`dataset=star_graph_d2_l5`, the names of
`experiment.datasets`) and by its task kind (`dataset.name: star_graph`). Hydra knows the
selected file (`hydra.runtime.choices.dataset`) but hands the run a config without it, so
pita records it in `experiment.dataset_file` where the config is composed (the pre-check in
pita/experiment/cli.py, `run()` under `@hydra.main`) and the run folder's saved config keeps
it for a resume. The planner then gives the selected config, the command line's `dataset.*`
overrides included, to the listed dataset of that file; a listed dataset of another file is
composed from its file alone.

An override of the selected dataset when the selected file is not one of the listed ones
would reach no task: it is refused in one line that says how to set it
(`dataset_override_errors`; tests/test_planner.py::test_dataset_overrides_reach_a_listed_dataset).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict


def record_dataset_file(cfg: DictConfig, choices: Any) -> bool:
    """Store Hydra's selected dataset file in `cfg.experiment.dataset_file` (when Hydra says
    one and the config does not already hold it); True when the config changed."""
    chosen = (choices or {}).get("dataset") if hasattr(choices, "get") else None
    if not chosen or cfg.experiment.get("dataset_file") == chosen:
        return False
    with open_dict(cfg.experiment):
        cfg.experiment.dataset_file = str(chosen)
    return True


def is_selected(cfg: DictConfig, name: str) -> bool:
    """Whether the dataset `name` of the experiment is the selected one (the one that carries
    the command line's overrides). Without a recorded file (a config composed outside pita's
    command line), the task kind decides, as before."""
    chosen = cfg.experiment.get("dataset_file")
    if chosen and name == chosen:
        return True
    if name != cfg.dataset.name:
        return False
    # the kind's own name: the selected one unless the experiment lists files and a file of
    # that stem is not the selected one (dataset=star_graph_d2_l5 experiment.datasets=[star_graph])
    return not chosen or not list(cfg.experiment.datasets)


def changed_keys(selected: dict[str, Any], from_file: dict[str, Any]) -> list[str]:
    """The keys on which the selected dataset differs from its own file: the overrides."""
    keys = sorted(set(selected) | set(from_file))
    return [k for k in keys if selected.get(k) != from_file.get(k)]


def dataset_keys(dataset_cfg: Any) -> dict[str, Any]:
    """The keys a dataset config actually sets (None = not this task's key)."""
    if isinstance(dataset_cfg, DictConfig):
        dataset_cfg = OmegaConf.to_container(dataset_cfg, resolve=True)
    return {k: v for k, v in dict(dataset_cfg).items() if v is not None}


def dataset_override_errors(cfg: DictConfig) -> list[str]:
    """One line when `dataset.*` keys set the selected dataset but `experiment.datasets`
    lists other files only: the keys would reach no task."""
    listed = [str(d) for d in cfg.experiment.datasets]
    chosen = cfg.experiment.get("dataset_file")
    if not listed or not chosen or any(is_selected(cfg, d) for d in listed):
        return []
    from pita.experiment.cli_extras import conf_dir

    path = conf_dir() / "dataset" / f"{chosen}.yaml"
    if not path.is_file():  # a file of --config-dir: nothing to compare with
        return []
    own = dataset_keys(OmegaConf.load(path))
    changed = changed_keys(dataset_keys(cfg.dataset), own)
    if not changed:
        return []
    key = changed[0]
    value = OmegaConf.select(cfg, f"dataset.{key}")
    return [
        f"dataset.{key}={value}: sets the selected dataset {chosen!r}, which "
        f"experiment.datasets={listed} does not run; to set it on a listed one, select it: "
        f"dataset={listed[0]} dataset.{key}={value} (one dataset's keys per command line: "
        f"add experiment.datasets=[{listed[0]}] to run only that one)"
    ]
