"""The one place that builds paths inside a run folder (docs/DESIGN.md §4), and atomic writes."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


class Artifact:
    """The names of the files and folders inside a task folder, in one place.

    Stages write them under `ctx.out_dir` and read their inputs' (`ctx.input(name) /
    Artifact.MODEL`); the report and resume read them here too.
    """

    MANIFEST = "manifest.json"  # written last by TaskPaths.commit: the folder is complete
    LOG = "log.txt"  # the task's own log
    RESULT = "result.json"  # what the stage function returned, + task_id, wall_s, attempt
    ERROR = "error.json"  # a failed attempt's class and message
    MODEL = "model"  # a save_pretrained causal LM + tokenizer (pretrain, DPO, GRPO)
    VALUE_MODEL = "value_model"  # a value model (PITA, Q#, Q#-HF train)
    REWARD_MODEL = "reward_model"  # a sequence-classification proxy reward (-HF chains)
    RECORDS = "records.jsonl"  # roll-outs of a value-guided collect, token ids
    PAIRS = "pairs.jsonl"  # preference pairs (DPO, -HF collect), token ids
    SAMPLES = "samples.jsonl"  # one evaluate shard's samples
    METRICS = "metrics.json"  # evaluate_merge: the results rows of one chain and round
    STATS = "stats.json"  # collect_merge: summed shard statistics
    TRAIN_LOG = "train_log.jsonl"  # a TRL trainer's logged metrics
    TRAINER_SCRATCH = "trainer"  # TRL's output_dir (nothing is saved there)


MANIFEST = Artifact.MANIFEST


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder + os.replace: never half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


class RunPaths:
    """Run-level files: config, plan, journal, monitor, results."""

    def __init__(self, run_dir: Path | str):
        self.root = Path(run_dir)

    @property
    def saved_config(self) -> Path:
        return self.root / ".hydra" / "config.yaml"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def journal(self) -> Path:
        return self.root / "journal.jsonl"

    @property
    def run_log(self) -> Path:
        return self.root / "run.log"

    @property
    def workers(self) -> Path:
        return self.root / "workers"

    @property
    def gpu_monitor(self) -> Path:
        return self.root / "gpu_monitor.jsonl"

    @property
    def tasks(self) -> Path:
        return self.root / "tasks"

    @property
    def results(self) -> Path:
        return self.root / "results"

    @property
    def plots(self) -> Path:
        return self.root / "results" / "plots"

    def task(self, task_id: str) -> TaskPaths:
        return TaskPaths(self.root, task_id)


class TaskPaths:
    """Paths of one task. A task writes into `tmp(pid)` and `commit()`s it atomically."""

    def __init__(self, run_dir: Path | str, task_id: str):
        self.run_dir = Path(run_dir)
        self.task_id = task_id
        self.final = self.run_dir / "tasks" / task_id

    def tmp(self, pid: int) -> Path:
        return self.run_dir / "tasks" / f".tmp-{self.task_id}-{pid}"

    def failed(self, attempt: int) -> Path:
        return self.run_dir / "tasks" / f"{self.task_id}.attempt{attempt}.failed"

    @property
    def log(self) -> Path:
        return self.final / Artifact.LOG

    @property
    def result(self) -> Path:
        return self.final / Artifact.RESULT

    @property
    def manifest(self) -> Path:
        return self.final / MANIFEST

    def commit(self, tmp_dir: Path) -> None:
        """Write the manifest into `tmp_dir`, then rename it to the final folder.

        The manifest is written last, so a folder with a valid manifest is complete; a
        leftover final folder (from an attempt that died after committing) is replaced.
        """
        files = {
            str(p.relative_to(tmp_dir)): p.stat().st_size
            for p in sorted(tmp_dir.rglob("*"))
            if p.is_file() and p.name != MANIFEST
        }
        atomic_write_json(tmp_dir / MANIFEST, {"task_id": self.task_id, "files": files})
        if self.final.exists():
            shutil.rmtree(self.final)
        os.replace(tmp_dir, self.final)

    def is_complete(self) -> bool:
        """True iff the folder has a manifest and every listed file has its size."""
        try:
            manifest = json.loads(self.manifest.read_text())
        except (OSError, ValueError):
            return False
        if manifest.get("task_id") != self.task_id:
            return False
        for rel, size in manifest.get("files", {}).items():
            p = self.final / rel
            if not p.is_file() or p.stat().st_size != size:
                return False
        return True

