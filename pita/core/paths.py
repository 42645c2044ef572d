"""The one place that builds paths inside a run folder (docs/DESIGN.md §4), and atomic writes.

A committed task folder proves its own completion: its manifest, written last, lists
every file with its size and sha256, and `TaskPaths.verify` checks them all plus the
files every task and its stage must have (`result.json`, `log.txt`, the stage's declared
outputs). Files are created with the user's umask, so teammates can read or resume a run.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pita.core.safe_files import UnsafeFile, read_control_text


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
MANIFEST_VERSION = 2  # 1: sizes only (not trusted any more: such folders are redone)
ALWAYS_REQUIRED = (Artifact.RESULT, Artifact.LOG)  # what every committed task folder holds


def pita_cache_dir() -> Path:
    """Per-user caches of measurements (batch sizes, task peaks, task durations):
    `$PITA_CACHE_DIR`, else `~/.cache/pita`."""
    return Path(os.environ.get("PITA_CACHE_DIR", Path.home() / ".cache" / "pita"))


def pythonpath_with(root: Path | str, current: str | None) -> str:
    """A PYTHONPATH with `root` (a pita checkout) first, then `current` (what the environment
    already holds: packages installed with `pip --target`, another checkout), so a child
    process imports this checkout's pita and still finds those packages."""
    return os.pathsep.join(p for p in (str(root), current) if p)


def current_umask() -> int:
    """The process umask, without the set-and-restore race of os.umask where possible."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder + os.replace: never half a file.

    mkstemp creates its file 0600; it gets the mode a plain open() would give (0666 minus
    the umask) so a run is as readable as any other file the user creates.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def follow_umask(folder: Path) -> None:
    """Give every file and folder under `folder` the mode a plain open() / mkdir() would:
    libraries that write 0600 (safetensors, tempfile) would lock a teammate out of a
    shared run's resume. Links are left alone (never followed)."""
    mask = current_umask()
    for p in [folder, *folder.rglob("*")]:
        if p.is_symlink():
            continue
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def nan_numbers(obj: Any, where: str = "result") -> list[str]:
    """Paths like `result['rows'][0]['pass@1']` of every NaN float in a JSON-like value.
    An infinity is a value, not a bug: a row's `kl` is +inf when a sample leaves π_ref's
    support under the row's rule (docs/ALGORITHMS.md, "KL: the three columns")."""
    if isinstance(obj, float):
        return [f"{where}={obj}"] if math.isnan(obj) else []
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in nan_numbers(v, f"{where}[{k!r}]")]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in nan_numbers(v, f"{where}[{i}]")]
    return []


def _listed(files: Iterable[str], required: str) -> bool:
    """A declared output is a file, or a folder with at least one file in it."""
    return any(f == required or f.startswith(required.rstrip("/") + "/") for f in files)


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
    def lock(self) -> Path:
        return self.root / ".lock"  # flock of the orchestrator running the folder (run_lock.py)

    @property
    def run_log(self) -> Path:
        return self.root / "run.log"

    @property
    def saved_overrides(self) -> Path:
        return self.root / ".hydra" / "overrides.yaml"

    @property
    def run_info(self) -> Path:
        """Git commit, package versions, devices, command (pita/experiment/run_info.py)."""
        return self.root / "run_info.json"

    @property
    def logs(self) -> Path:
        """Experiment-tracking output, one folder per `logger.backend` (pita/training/tracking.py)."""
        return self.root / "logs"

    @property
    def summary_csv(self) -> Path:
        return self.root / "results" / "summary.csv"

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

    def stopped(self, attempt: int, step: int) -> Path:
        """An attempt asked to stop (a resize) at the checkpoint of `step`: its log, kept."""
        return self.run_dir / "tasks" / f"{self.task_id}.attempt{attempt}.stopped-at-{step}"

    @property
    def checkpoints(self) -> Path:
        """In-task training checkpoints: beside the attempts' folders, so a retry of the
        task (whose dead attempt became `<id>.attemptN.failed/`) finds them; removed once
        the task is committed."""
        return self.run_dir / "tasks" / f"{self.task_id}.checkpoints"

    @property
    def stop_request(self) -> Path:
        """Written by the orchestrator to ask the running task to checkpoint and stop at
        its next optimizer step (pita/core/growth.py); removed by it before each dispatch."""
        return self.run_dir / "tasks" / f"{self.task_id}.stop-request"

    @property
    def log(self) -> Path:
        return self.final / Artifact.LOG

    @property
    def result(self) -> Path:
        return self.final / Artifact.RESULT

    @property
    def manifest(self) -> Path:
        return self.final / MANIFEST

    def commit(
        self, tmp_dir: Path, required: Iterable[str] = (), reads: dict[str, Any] | None = None
    ) -> None:
        """Write the manifest into `tmp_dir`, then rename it to the final folder.

        Raises ValueError (the task fails, nothing is committed) when a required output is
        missing. The manifest is written last, so a folder with a valid manifest is
        complete; a leftover final folder (from an attempt that died after committing) is
        replaced. `reads`: the config keys the stage read, with their values
        (`schema.recording_reads`), recorded as the manifest's `reads` for resume.
        """
        follow_umask(tmp_dir)
        files = {
            str(p.relative_to(tmp_dir)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
            for p in sorted(tmp_dir.rglob("*"))
            if p.is_file() and p.name != MANIFEST
        }
        missing = [r for r in (*ALWAYS_REQUIRED, *required) if not _listed(files, r)]
        if missing:
            raise ValueError(f"stage did not write its declared output(s): {', '.join(missing)}")
        atomic_write_json(
            tmp_dir / MANIFEST,
            {
                "task_id": self.task_id,
                "version": MANIFEST_VERSION,
                "files": files,
                **({} if reads is None else {"reads": dict(sorted(reads.items()))}),
            },
        )
        if self.final.exists():
            shutil.rmtree(self.final)
        os.replace(tmp_dir, self.final)

    def verify(self, required: Iterable[str] = ()) -> str | None:
        """Why the committed folder does not prove completion, or None when it does.

        Every listed file must have its size and sha256 (a same-size edit or bit flip is
        caught), and the manifest must list `result.json`, `log.txt` and the stage's
        declared outputs (a manifest edited to drop a file, or `"files": {}`, is caught).
        """
        try:
            manifest = json.loads(read_control_text(self.manifest))
        except UnsafeFile as exc:
            return f"manifest not trusted ({exc})"
        except (OSError, ValueError):
            return "no readable manifest"
        if not isinstance(manifest, dict) or manifest.get("task_id") != self.task_id:
            return "manifest names another task"
        files = manifest.get("files")
        if manifest.get("version") != MANIFEST_VERSION or not isinstance(files, dict):
            return "manifest without checksums (older pita)"
        missing = [r for r in (*ALWAYS_REQUIRED, *required) if not _listed(files, r)]
        if missing:
            return f"manifest lacks {', '.join(missing)}"
        for rel, entry in files.items():  # sizes first: cheap, and most damage shows there
            p = self.final / rel
            if (
                not isinstance(entry, dict)
                or not p.is_file()
                or p.stat().st_size != entry.get("size")
            ):
                return f"{rel} is missing or has the wrong size"
        for rel, entry in files.items():
            if file_sha256(self.final / rel) != entry.get("sha256"):
                return f"{rel} does not match its sha256"
        return None


# What pita adds below a run folder: a task's folder name is its id plus at most this
# (`.tmp-<id>-<pid>`, `<id>.attempt<N>.stopped-at-<step>`), and no path pita writes inside a
# run folder is longer than the folder's own path plus RUN_PATH_EXTRA bytes (task folder,
# checkpoint shards, model files).
TASK_NAME_EXTRA = 48
RUN_PATH_EXTRA = 1024


def _limits(path: Path) -> tuple[int, int]:
    """(longest name, longest path) in bytes on the file system that will hold `path`."""
    probe = path
    while not os.path.exists(probe) and probe != probe.parent:  # never raises ENAMETOOLONG
        probe = probe.parent
    try:
        return os.pathconf(probe, "PC_NAME_MAX"), os.pathconf(probe, "PC_PATH_MAX")
    except (OSError, ValueError):
        return 255, 4096


def _short(text: str, keep: int = 40) -> str:
    return text if len(text) <= 2 * keep + 3 else f"{text[:keep]}...{text[-keep:]}"


def path_length_errors(run_dir: Path | str, task_ids: Iterable[str] = ()) -> list[str]:
    """Why this run folder, or a task folder inside it, is too long a name or path for its
    file system (the kernel's ENAMETOOLONG, as one line before anything is created)."""
    folder = Path(run_dir).absolute()
    name_max, path_max = _limits(folder)
    errors = [
        f"run folder {_short(str(folder))}: the name {_short(part, 20)!r} is "
        f"{len(part.encode())} bytes, over the file system's {name_max} per name; shorten "
        f"experiment.name or hydra.run.dir"
        for part in folder.parts
        if len(part.encode()) > name_max
    ]
    size = len(str(folder).encode())
    if not errors and size + RUN_PATH_EXTRA > path_max:
        errors.append(
            f"run folder {_short(str(folder))}: its path is {size} bytes; with what pita writes "
            f"inside (up to {RUN_PATH_EXTRA} bytes more) it passes the file system's {path_max}"
            f"-byte limit; choose a shorter folder"
        )
    long_ids = [t for t in task_ids if len(t.encode()) + TASK_NAME_EXTRA > name_max]
    if long_ids:
        errors.append(
            f"task {_short(long_ids[0])}: its folder name would pass the file system's "
            f"{name_max} bytes per name ({len(long_ids)} task(s)); shorten the names task ids "
            f"are made of (model.name, dataset.name, the algorithm's)"
        )
    return errors


def writable_log(path: Path) -> Path:
    """`path`, or `<stem>.uid<N><suffix>` beside it when `path` exists and this user may not
    append to it (a teammate's log in a shared run from before its modes were the group's):
    a log file is never a reason for a worker or a resume to die."""
    if os.path.lexists(path) and not os.access(path, os.W_OK):
        return path.with_name(f"{path.stem}.uid{os.geteuid()}{path.suffix}")
    return path
