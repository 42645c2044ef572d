"""Shared helpers: run the real command line in a subprocess, in a temporary folder."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from pita.algos.registry import ALGO_NAMES
from pita.core.paths import pythonpath_with
from pita.core.tasks import TASK_STAGES, TaskSpec

ROOT = Path(__file__).resolve().parents[1]
ALGOS = ALGO_NAMES  # the registry table
STAGES = TASK_STAGES  # every stage a task can have


def task_spec(id: str, **fields) -> TaskSpec:
    """A TaskSpec for a unit test: a round-0 QSharp train task on goal_walk / tiny with a
    function nobody runs, unless `fields` says otherwise. Its `algo_schema` is the
    algorithm's registry row's, as the planner sets it, so a context built on it reads
    `ctx.algo` as that schema (`algo_as` works)."""
    from pita.algos.registry import ALGORITHMS

    defaults = dict(algo="QSharp", dataset="goal_walk", family="tiny", round=0, stage="train")
    spec = {**defaults, "fn": "x:y", **fields}
    row = ALGORITHMS.get(spec["algo"])
    spec.setdefault("algo_schema", row.schema_path if row is not None else "")
    return TaskSpec(id=id, **spec)


def sleep_overrides(
    fn: str = "tests.fault_stages:sleep_stage", preimport: bool = False
) -> list[str]:
    """Replace every stage with a test stage (the orchestrator is what is under test). A test
    stage needs no torch, so workers do not import it (executor.preimport=false; `preimport`:
    they do, and on CPU and fake devices they fork from the forkserver that imported it:
    pita/core/forked_worker.py), and its timeline is not drawn (executor.timeline_plot=false:
    matplotlib, a second a run; drawn by tests/test_timeline.py and the smoke run)."""
    return [f"+executor.stage_overrides.any.{s}={fn}" for s in STAGES] + [
        f"executor.preimport={str(preimport).lower()}",
        "executor.timeline_plot=false",
    ]


def only(*algos: str) -> list[str]:
    """Overrides enabling exactly these algorithms (the default experiment enables all)."""
    return [f"algos.{a}.enabled={'true' if a in algos else 'false'}" for a in ALGOS]


def pythonpath_with_root() -> str:
    """This checkout first, then whatever PYTHONPATH already holds (`pythonpath_with`)."""
    return pythonpath_with(ROOT, os.environ.get("PYTHONPATH"))


def run_cli(
    args: list[str],
    cwd: Path,
    env: dict | None = None,
    timeout: float = 180,
    script: str = "run_parallel.py",
) -> subprocess.CompletedProcess:
    """The command line run to its end; `env` adds to this process's environment (a value
    of None removes that variable)."""
    merged = {**os.environ, "PYTHONPATH": pythonpath_with_root(), **(env or {})}
    full_env = {k: v for k, v in merged.items() if v is not None}
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_cli(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """The command line started in the background (stdout and stderr in one pipe): a run to
    kill, interrupt or watch while it goes."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "run_parallel.py"), *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": pythonpath_with_root(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Ctrl-C reaches a run started from a terminal, whose SIGINT is the default; a pytest
        # started in the background (`cmd &`, nohup) ignores SIGINT and its children would too
        preexec_fn=_sigint_default,
    )


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def slow_env(markers: Path, task_id: str, seconds: float) -> dict[str, str]:
    """The environment that makes `tests.fault_stages` write `<markers>/<task>.started` and
    hold `task_id` for `seconds` (a task to kill, interrupt or outlive mid-run)."""
    return {
        "PITA_TEST_MARKERS": str(markers),
        "PITA_TEST_SLOW_TASK": task_id,
        "PITA_TEST_SLOW_S": str(seconds),
    }


def run_ok(args: list[str], cwd: Path, name: str, **kwargs) -> Path:
    """Run the command line (`run_cli`), check it exits 0 (the output's tails otherwise) and
    return the run folder of `experiment.name=<name>`, the only one."""
    proc = run_cli(args, cwd, **kwargs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [run_dir] = run_dirs(cwd, name)
    return run_dir


def run_cli_later(args: list[str], cwd: Path, **kwargs) -> Future[subprocess.CompletedProcess]:
    """`run_cli` in a thread of its own: a run that does not depend on what the test does
    meanwhile (the uninterrupted reference beside a run being killed, another backend's run)
    goes on beside it. One run keeps about one core of this 2-core machine busy, so two at
    once take the wall time of the longer one. `.result()` is the CompletedProcess."""
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(run_cli, args, cwd, **kwargs)
    pool.shutdown(wait=False)
    return future


def run_dirs(cwd: Path, name: str) -> list[Path]:
    return sorted(p for p in (cwd / "outputs" / name).glob("*") if p.is_dir())


def journal(run_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for line in (run_dir / "journal.jsonl").read_text().splitlines()
        if line.strip()
    ]


@pytest.fixture
def markers(tmp_path: Path) -> Path:
    folder = tmp_path / "markers"
    folder.mkdir()
    return folder


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models on a busy 2-core machine run far faster on one intra-op thread."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def local_family(tmp_path_factory):
    """A local model family (byte-level BPE tokenizer trained here, random-weight Llamas,
    GSM8K- and IMDB-format jsonl), built once per session: see tests/local_family.py."""
    from tests.local_family import build_local_family

    return build_local_family(tmp_path_factory.mktemp("local_family"))


@dataclass(frozen=True)
class SmokeRun:
    """One finished `experiment=smoke` run (real training), shared by the tests that only read
    what a run leaves behind: the folder, the summary, the ETA line, the time table, run_info."""

    cwd: Path
    args: list[str]
    env: dict[str, str]
    proc: subprocess.CompletedProcess
    run_dir: Path


# `algos=[..]` names exactly the smoke experiment's seven (the run is the same) so run_info's
# command can be checked as typed, before the CLI expands the shortcut.
SMOKE_ARGS = [
    "experiment=smoke",
    "algos=[reference,PITA,QSharp,QSharp-HF,DPO,GRPO,GRPO-HF]",
    "system.devices=fake:2",
    "executor.progress=false",
    # what tests/test_tracking.py reads back (one run under tensorboard fewer to start)
    "logger=tensorboard",
    "logger.tags=[smoke_test,ci]",
]


_SESSION_DIR_ENV = "PITA_TEST_SESSION_DIR"  # the session's folder, shared by its xdist workers


def _session_dir() -> Path:
    return Path(os.environ[_SESSION_DIR_ENV])


_HELD: set[str] = set()  # the session locks this process holds


@contextmanager
def session_lock(name: str) -> Iterator[None]:
    """Held by one process of this pytest session at a time (pytest-xdist runs test files
    in several): for what two tests must not do at once on one machine. Re-entrant: a test
    inside a module fixture that holds it goes on."""
    if name in _HELD:
        yield
        return
    with open(_session_dir() / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        _HELD.add(name)
        try:
            yield
        finally:
            _HELD.discard(name)


@pytest.fixture
def one_ray_cluster_at_a_time() -> Iterator[None]:
    """For a test that starts a Ray cluster or looks for one: Ray's `auto` address finds
    any cluster running on the machine (it looks for their processes), so one started by
    another worker's test must not be running meanwhile (tests/test_ray_*.py)."""
    with session_lock("ray"):
        yield


def _start_smoke_run(config: pytest.Config) -> None:
    """Start the session's one smoke run, unless a process of this session already did.

    Under pytest-xdist every worker collects the same tests and may want it: the first to
    create `smoke-claimed` in the session's folder runs it (in a thread; this process ends after
    it), then writes `smoke-result.json` (exit code and output) whole; a reader waits for that."""
    folder = _session_dir()
    try:
        os.close(os.open(folder / "smoke-claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # another worker started it
    runner = threading.Thread(target=_run_smoke, args=(folder,), name="smoke-run")
    runner.start()
    config.add_cleanup(runner.join)


def _run_smoke(folder: Path) -> None:
    from pita.core.paths import atomic_write_text

    cwd = folder / "smoke"
    cwd.mkdir()
    try:
        proc = run_cli(SMOKE_ARGS, cwd, env=_smoke_env(cwd), timeout=900)
        record = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
    except subprocess.TimeoutExpired as error:
        record = {"returncode": None, "stdout": "", "stderr": f"did not finish: {error}"}
    # the run's folder, taken now: a reader's dry run may add one under outputs/smoke later
    record["run_dirs"] = [str(d) for d in run_dirs(cwd, "smoke")]
    atomic_write_text(folder / "smoke-result.json", json.dumps(record))


def _smoke_result(timeout: float = 1000) -> tuple[subprocess.CompletedProcess, list[Path]]:
    """The smoke run's outcome and run folders, once `smoke-result.json` is there (whichever
    worker ran it)."""
    path = _session_dir() / "smoke-result.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path} after {timeout:.0f} s"
        time.sleep(0.5)
    record = json.loads(path.read_text())
    folders = [Path(d) for d in record.pop("run_dirs")]
    return subprocess.CompletedProcess(SMOKE_ARGS, **record), folders


def _smoke_env(cwd: Path) -> dict[str, str]:
    return {"PITA_CACHE_DIR": str(cwd / "cache")}  # its own duration cache


def _temp_folder(config: pytest.Config, prefix: str) -> Path:
    """A folder of this process, removed when its session ends."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    return folder


def pytest_configure(config: pytest.Config) -> None:
    """Every run a test starts measures into a cache of this process, never the user's
    (`~/.cache/pita`: the suite wrote thousands of entries there, and a learned speedup
    from an earlier test's run changed the ranks a later test's run was given). Each
    pytest-xdist worker has its own, so what one learns never reaches another's runs. A
    test that needs a fresh cache passes its own `PITA_CACHE_DIR`.

    The session (the controller, under xdist) also makes its folder here (the smoke run,
    the locks of `session_lock`) before any worker starts: workers inherit its path, and
    it is removed after the last."""
    os.environ["PITA_CACHE_DIR"] = str(_temp_folder(config, "pita-test-cache-"))
    # the same for the host's load: a run's sizing reads other processes' runnable threads
    # off the host (pita.core.host_share.outside_load), and under the suite those are
    # the other worker's tests: a gang a test expects was refused when they ran beside it
    os.environ.setdefault("PITA_OUTSIDE_LOAD", "0")
    # The suite's processes cache the bytecode they compile: a module scripts/setup.sh did
    # not compile (Ray's agents, a tracker's store) is compiled once per session instead of
    # in every run, worker and Ray process that imports it, as it was where
    # PYTHONDONTWRITEBYTECODE is set (this project's CI machines). xdist's workers start
    # after this, with the environment it leaves.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    if not hasattr(config, "workerinput"):
        os.environ[_SESSION_DIR_ENV] = str(_temp_folder(config, "pita-test-session-"))


def _reads_smoke_run(item: pytest.Item) -> bool:
    return "smoke_run" in getattr(item, "fixturenames", ())


def pytest_collection_finish(session: pytest.Session) -> None:
    """When a selected test reads the smoke run, start it as soon as collection ends: it
    goes on beside the tests before its first reader (a run keeps about one of the two
    cores busy) instead of holding that reader up. Under pytest-xdist the first worker to
    finish collecting starts it (every worker collects every test)."""
    if session.config.option.collectonly:
        return  # nothing to run
    if any(_reads_smoke_run(item) for item in session.items):
        _start_smoke_run(session.config)


@pytest.fixture(scope="session")
def smoke_run(pytestconfig) -> SmokeRun:
    """The session's one smoke run: every algorithm's chain trained for real on two fake
    devices, with its own duration cache so the ETA starts from work units. Started when
    collection ended (`pytest_collection_finish`), by this process or another worker of the
    session; a test that changes the folder (a resume) must leave what the others read in
    place."""
    _start_smoke_run(pytestconfig)  # a no-op once started
    proc, folders = _smoke_result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cwd = _session_dir() / "smoke"
    [run_dir] = folders
    return SmokeRun(cwd, list(SMOKE_ARGS), _smoke_env(cwd), proc, run_dir)


@pytest.fixture(autouse=True)
def _one_smoke_reader_at_a_time(request):
    """The smoke run's readers never run at once (pytest-xdist puts their files in
    different workers): one resumes the run, which rewrites its report, and one starts a
    dry run in its folder, while another reads the report's files."""
    if "smoke_run" not in request.fixturenames:
        yield
        return
    with session_lock("smoke-readers"):
        yield
