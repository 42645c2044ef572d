"""Attacks on in-task checkpoints (issue 21): whoever can write a run folder plants a
checkpoint; pita must never run code from it, never adopt one that is not the task's own,
never fail for ever on a broken one, and the task must end like an uninterrupted run with
a WARNING naming what it moved aside.

Planted in the checkpoint folder of a real task: a pickle that writes a marker file when
unpickled, a checkpoint copied from a run with another seed, one with a flipped byte, one
truncated, one past the last step. Pretrain (pita's own checkpoints) runs in-process, so a
test takes seconds; the TRL stage (GRPO) runs the real orchestrator and resumes a run.

The foreign / flipped / truncated / future checkpoints are made by the code under test
itself (a second run whose checkpoint folder is copied), so the tests mean the same on a
pita that wrote `step-N.pt` pickles: each fails there.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pita.training.checkpoint import COMPLETE
from tests.conftest import run_cli, run_dirs, start_cli, task_spec

PRETRAIN = "pretrain.goal_walk.tiny"
STEPS = 6


class _Marker:
    """Unpickling this creates the marker file: code from the run folder ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def plant_pickle(path: Path, marker: Path) -> None:
    """A torch checkpoint file (`torch.save`'s zip) whose unpickling opens `marker`."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": _Marker(marker), "train_step": 2}, path)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record):
        self.lines.append((record.levelno, record.getMessage()))

    def warnings(self) -> str:
        return "\n".join(m for lvl, m in self.lines if lvl >= logging.WARNING)


def _pretrain(
    run_dir: Path,
    seed: int = 0,
    steps: int = STEPS,
    every: int = 2,
    trust_group: bool = False,
    strategy: str = "none",
    ranks: int = 1,
) -> tuple[dict, _Records]:
    """Run the pretrain stage in-process (checkpoint every 2 steps) into `run_dir`, on
    `ranks` gloo ranks under `strategy` (fsdp: sharded checkpoints); -> (its trained
    weights, its log records). Its checkpoint folder stays (the worker would remove it on
    commit)."""
    from safetensors.torch import load_file

    from pita.experiment.config import PitaConfig
    from pita.runtime.context import StageContext
    from pita.stages.pretrain import pretrain

    cfg = OmegaConf.structured(PitaConfig)
    cfg.experiment.seed = seed
    cfg.pretrain.steps, cfg.pretrain.batch_size, cfg.pretrain.warmup_steps = steps, 16, 1
    cfg.training.checkpoint_every = every
    cfg.system.trust_group = trust_group
    cfg.training.parallel_strategy = strategy
    if every == 0:
        cfg.training.checkpoint_every_minutes = 0.0
    task = task_spec(
        id=PRETRAIN,
        algo="*",
        stage="pretrain",
        fn="pita.stages.pretrain:pretrain",
        dataset_cfg={"name": "goal_walk", "num_nodes": 8},
        family_cfg={"reference_arch": {"n_layer": 1, "d_model": 32, "n_head": 2}},
        gpus=ranks,
    )
    task.strategy = strategy  # the gang the planner gives a training stage
    out = run_dir / "tasks" / f".tmp-{PRETRAIN}-1"
    out.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"test.hostile.{random.random()}")
    logger.setLevel(logging.DEBUG)
    records = _Records()
    logger.addHandler(records)
    ctx = StageContext(task=task, cfg=cfg, run_dir=run_dir, out_dir=out, logger=logger)
    pretrain(ctx)
    return load_file(str(out / "model" / "model.safetensors")), records


def _checkpoints(run_dir: Path) -> Path:
    return run_dir / "tasks" / f"{PRETRAIN}.checkpoints"


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[dict, Path]:
    """An uninterrupted run: (its weights, its run folder with its last checkpoint)."""
    run = tmp_path_factory.mktemp("clean")
    weights, _ = _pretrain(run)
    return weights, run


def _copy_checkpoints(source: Path, run_dir: Path) -> list[Path]:
    """Copy a run's checkpoint folder into `run_dir`; -> the copied checkpoints."""
    target = _checkpoints(run_dir)
    shutil.copytree(_checkpoints(source), target)
    found = [p for p in target.iterdir() if p.name.startswith("step-")]
    assert found, "the source run left no checkpoint"
    return found


def _biggest_file(checkpoint: Path) -> Path:
    files = [checkpoint] if checkpoint.is_file() else [p for p in checkpoint.rglob("*")]
    return max((p for p in files if p.is_file()), key=lambda p: p.stat().st_size)


def _rejected(run_dir: Path, records: _Records, name: str) -> None:
    """A WARNING names the checkpoint, which was moved aside and not restored."""
    assert name in records.warnings(), records.lines
    assert (_checkpoints(run_dir) / f"{name}.rejected").exists()  # kept for a look, never read
    assert not any("resumed from checkpoint" in m for _, m in records.lines), records.lines


def test_a_planted_pickle_never_runs_and_the_task_ends_like_an_uninterrupted_run(tmp_path, clean):
    marker = tmp_path / "PWNED"
    run = tmp_path / "run"
    plant_pickle(_checkpoints(run) / "step-2.pt", marker)
    weights, records = _pretrain(run)
    assert not marker.exists(), "a pickle planted in the run folder ran code"
    assert _same(weights, clean[0])
    _rejected(run, records, "step-2.pt")


def test_a_checkpoint_from_a_run_with_another_seed_is_moved_aside(tmp_path, clean):
    foreign = tmp_path / "foreign"
    _pretrain(foreign, seed=1, steps=STEPS)
    run = tmp_path / "run"
    (planted,) = _copy_checkpoints(foreign, run)
    weights, records = _pretrain(run)
    assert _same(weights, clean[0])
    _rejected(run, records, planted.name)


def test_a_bit_flipped_checkpoint_is_moved_aside(tmp_path, clean):
    run = tmp_path / "run"
    (planted,) = _copy_checkpoints(clean[1], run)
    victim = _biggest_file(planted)
    data = bytearray(victim.read_bytes())
    data[len(data) * 3 // 4] ^= 0x10  # inside the tensors, past any header
    victim.write_bytes(bytes(data))
    weights, records = _pretrain(run)
    assert _same(weights, clean[0])
    _rejected(run, records, planted.name)


def test_a_truncated_checkpoint_is_moved_aside_and_never_fails_the_task(tmp_path, clean):
    run = tmp_path / "run"
    (planted,) = _copy_checkpoints(clean[1], run)
    victim = _biggest_file(planted)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    weights, records = _pretrain(run)  # a resume after this one finds nothing in the way
    assert _same(weights, clean[0])
    _rejected(run, records, planted.name)
    weights_again, _ = _pretrain(run)
    assert _same(weights_again, clean[0])


def test_a_checkpoint_past_the_last_step_is_moved_aside(tmp_path, clean):
    longer = tmp_path / "longer"
    _pretrain(longer, steps=STEPS + 2)  # the same task with a longer schedule: step 8 > 6
    run = tmp_path / "run"
    (planted,) = _copy_checkpoints(longer, run)
    weights, records = _pretrain(run)
    assert _same(weights, clean[0])
    _rejected(run, records, planted.name)


def test_a_linked_checkpoint_folder_is_moved_aside_not_followed(tmp_path, clean):
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(_checkpoints(clean[1]), elsewhere)
    run = tmp_path / "run"
    _checkpoints(run).parent.mkdir(parents=True)
    _checkpoints(run).symlink_to(elsewhere)
    before = sorted(p.name for p in elsewhere.iterdir())
    weights, records = _pretrain(run)
    assert _same(weights, clean[0])
    assert f"{PRETRAIN}.checkpoints" in records.warnings()
    assert sorted(p.name for p in elsewhere.iterdir()) == before  # nothing written through it
    assert not _checkpoints(run).is_symlink()


def test_a_checkpoint_folder_writable_by_every_user_is_moved_aside(tmp_path, clean):
    run = tmp_path / "run"
    (planted,) = _copy_checkpoints(clean[1], run)
    planted.chmod(0o777)  # anybody could have swapped its files
    weights, records = _pretrain(run)
    assert _same(weights, clean[0])
    _rejected(run, records, planted.name)
    assert "writable by every user" in records.warnings()


def test_a_forged_proof_on_a_checkpoint_that_does_not_fit_fails_one_attempt_only(tmp_path, clean):
    """A proof forged for a checkpoint holding another model's tensors: the attempt that
    meets it fails (its tensors do not fit) and moves it aside; the next one starts over."""
    import torch
    from safetensors.torch import load_file, save_file

    from pita.training.checkpoint import MANIFEST, TENSORS, write_manifest

    run = tmp_path / "run"
    (planted,) = _copy_checkpoints(clean[1], run)
    tensors = load_file(str(planted / TENSORS))
    biggest = max(tensors, key=lambda k: tensors[k].numel())
    tensors[biggest] = torch.zeros(3)
    save_file(tensors, str(planted / TENSORS))
    manifest = json.loads((planted / MANIFEST).read_text())
    (planted / MANIFEST).unlink()
    identity = {k: manifest[k] for k in ("task_id", "config_sha256", "inputs_sha256")}
    write_manifest(planted, MANIFEST, STEPS, identity)
    with pytest.raises(RuntimeError, match="moved aside"):
        _pretrain(run)
    assert (_checkpoints(run) / f"{planted.name}.rejected").is_dir()
    weights, _ = _pretrain(run)
    assert _same(weights, clean[0])


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's needs root")
def test_a_checkpoint_of_another_user_is_moved_aside_unless_the_run_is_shared(tmp_path, clean):
    for trust_group in (False, True):
        run = tmp_path / f"run-{trust_group}"
        (planted,) = _copy_checkpoints(clean[1], run)
        for p in [planted, *planted.rglob("*")]:
            os.lchown(p, 54321, os.getegid())  # a teammate's, in your group
        weights, records = _pretrain(run, trust_group=trust_group)
        assert _same(weights, clean[0])
        if trust_group:  # system.trust_group=true: the group's checkpoints count as yours
            assert any("resumed from checkpoint" in m for _, m in records.lines)
        else:
            _rejected(run, records, planted.name)
            assert "owned by uid 54321" in records.warnings()


def test_nothing_is_restored_while_checkpointing_is_off(tmp_path, clean):
    marker = tmp_path / "PWNED"
    run = tmp_path / "run"
    plant_pickle(_checkpoints(run) / "step-2.pt", marker)
    weights, records = _pretrain(run, every=0)
    assert not marker.exists()
    assert _same(weights, clean[0])
    assert not any("resumed from checkpoint" in m for _, m in records.lines)


# --- a TRL stage's checkpoints (GRPO, the real orchestrator) --------------------------------

GRPO_TASK = "GRPO.goal_walk.tiny.r0.train"
GRPO_ARGS = [
    "experiment=smoke",
    "algos=[GRPO]",
    "algos.GRPO.steps=4",
    # checkpointed every step too: a short one, but long enough that GRPO's groups hold both
    # rewards (at 20 steps every sample failed: zero advantage, the weights never moved)
    "pretrain.steps=40",
    "training.checkpoint_every=1",
    "executor.progress=false",
    # one CPU worker (not one per core: each imports torch) and 8 test prompts: what is
    # checked is the train task's checkpoints, not the evaluation
    "executor.cpu_workers=1",
    "dataset.test_size=8",
]


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    return start_cli(args, cwd)


def _runs_with_snapshots(jobs: list[tuple[list[str], Path, int, Path, bool]]) -> None:
    """Run each (args, cwd, step, snapshot, finish) at once; when its GRPO task commits the
    Trainer checkpoint of `step`, stop the worker (SIGSTOP), copy the checkpoint to
    `snapshot`, let it go on. The runs go on unharmed: to the end, or, without `finish`,
    until Ctrl-C (SIGINT) stops the run once its snapshot is taken."""
    procs = [(_start(args, cwd), cwd, step, snap, fin) for args, cwd, step, snap, fin in jobs]
    deadline = time.time() + 420
    while any(p.poll() is None for p, *_ in procs) and time.time() < deadline:
        for proc, cwd, step, snap, finish in procs:
            pattern = f"outputs/smoke/*/tasks/{GRPO_TASK}.checkpoints/checkpoint-{step}/{COMPLETE}"
            for marker in [] if snap.exists() else cwd.glob(pattern):
                (tmp,) = marker.parents[2].glob(f".tmp-{GRPO_TASK}-*")
                pid = int(tmp.name.rsplit("-", 1)[1])
                os.kill(pid, signal.SIGSTOP)
                try:
                    shutil.copytree(marker.parent, snap)
                finally:
                    os.kill(pid, signal.SIGCONT)
                if not finish:
                    proc.send_signal(signal.SIGINT)
        time.sleep(0.005)
    for proc, cwd, _, snap, finish in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == (0 if finish else 130), out[-3000:]
        assert snap.is_dir(), f"no checkpoint was seen in {cwd}"


def _forge(source: Path, target: Path, step: int, edit=None) -> None:
    """Copy a real checkpoint to `target`, change it (`edit`), and write it a proof that
    verifies for `step` (the source's, with this step and the new files' sha256), as
    anybody who can read the run folder could."""
    import hashlib

    shutil.copytree(source, target)
    if edit is not None:
        edit(target)
    manifest = json.loads((source / COMPLETE).read_text())
    manifest["step"] = step
    manifest["files"] = {
        p.relative_to(target).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(target.rglob("*"))
        if p.is_file() and p.name != COMPLETE
    }
    (target / COMPLETE).write_text(json.dumps(manifest))


def _committed(run: Path) -> dict:
    """What the GRPO chain committed: trained weights and results (clocks and paths out)."""
    from safetensors.torch import load_file

    keep = {}
    for p in (run / "tasks").iterdir():
        if p.name.startswith("GRPO") and (p / "result.json").is_file():
            result = json.loads((p / "result.json").read_text())
            keep[p.name] = {
                k: v
                for k, v in result.items()
                if k not in ("wall_s", "cpu_s", "first_step_s", "performance", "attempt", "start")
            }
            for row in keep[p.name].get("rows", []):
                row.pop("eval_wall_s", None)
    weights = load_file(str(run / "tasks" / GRPO_TASK / "model" / "model.safetensors"))
    return {"results": keep, "weights": {k: v.tolist() for k, v in weights.items()}}


@pytest.mark.long
@pytest.mark.slow
def test_trl_checkpoints_foreign_flipped_truncated_future_or_pickled_are_all_moved_aside(
    tmp_path,
):
    """A GRPO task resumes with five planted Trainer checkpoints, newest first: one past
    the last step (6 > 4), one whose rng_state.pth is a pickle that writes a marker, one
    from a run with another seed, one with a flipped byte, one truncated. The last four
    carry a proof forged to verify except for what was done to them. Each is moved aside
    with a WARNING naming it, nothing runs, and the task trains from step 0 to exactly
    what the uninterrupted run committed."""
    own, other = tmp_path / "own", tmp_path / "other"
    own.mkdir()
    other.mkdir()
    snaps = tmp_path / "snapshots"
    _runs_with_snapshots(
        [
            (GRPO_ARGS, own, 2, snaps / "own-2", True),
            ([*GRPO_ARGS, "experiment.seed=1"], other, 3, snaps / "other-3", False),
        ]
    )
    run = run_dirs(own, "smoke")[0]
    uninterrupted = _committed(run)

    marker = tmp_path / "PWNED"
    ckpts = run / "tasks" / f"{GRPO_TASK}.checkpoints"
    ckpts.mkdir()

    def future(folder: Path) -> None:
        state = json.loads((folder / "trainer_state.json").read_text())
        state["global_step"] = 6
        (folder / "trainer_state.json").write_text(json.dumps(state))

    def flip(folder: Path) -> None:
        data = bytearray((folder / "model.safetensors").read_bytes())
        data[len(data) * 3 // 4] ^= 0x10
        (folder / "model.safetensors").write_bytes(bytes(data))

    _forge(snaps / "own-2", ckpts / "checkpoint-6", 6, edit=future)
    _forge(
        snaps / "own-2",
        ckpts / "checkpoint-4",
        4,
        edit=lambda f: plant_pickle(f / "rng_state.pth", marker),
    )
    shutil.copytree(snaps / "other-3", ckpts / "checkpoint-3")  # its own, genuine proof
    shutil.copytree(snaps / "own-2", ckpts / "checkpoint-2")
    flip(ckpts / "checkpoint-2")
    _forge(snaps / "own-2", ckpts / "checkpoint-1", 1)
    model = ckpts / "checkpoint-1" / "model.safetensors"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])

    for p in (run / "tasks").iterdir():  # the chain from its train stage on is redone
        if p.name.startswith("GRPO") and p.is_dir() and not p.name.endswith(".checkpoints"):
            shutil.rmtree(p)
    done = run_cli([f"resume_from={run}"], cwd=own, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    assert not marker.exists(), "a pickle planted in a Trainer checkpoint ran code"
    log = (run / "tasks" / GRPO_TASK / "log.txt").read_text()
    warnings = [line for line in log.splitlines() if "WARNING" in line]
    for name, why in (
        ("checkpoint-6", "past the schedule"),
        ("checkpoint-4", "rng_state.pth does not load"),
        ("checkpoint-3", "another task or config"),
        ("checkpoint-2", "sha256"),
        ("checkpoint-1", "sha256"),
    ):
        assert any(f"{name}:" in w and why in w for w in warnings), (name, log[-3000:])
    assert "resumed from checkpoint" not in log
    assert _committed(run) == uninterrupted


# --- sharded checkpoints (FSDP2: each rank's safetensors, pita/training/shards.py) ----------

# 2 FSDP2 ranks vs one process: float reduction order only (tests/test_gang_training.py)
TOL = 1e-5


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(float((a[k] - b[k]).abs().max()) <= TOL for k in a)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[dict, Path]:
    """An uninterrupted FSDP2 run on 2 gloo ranks: (its weights, its run folder with its
    last checkpoint: one shard file per rank)."""
    run = tmp_path_factory.mktemp("sharded")
    weights, _ = _pretrain(run, strategy="fsdp", ranks=2)
    return weights, run


def _shard_files(checkpoint: Path) -> list[Path]:
    return sorted((checkpoint / "shards").glob("*.safetensors"))


def _resume_on_one(run: Path) -> tuple[dict, _Records]:
    """The task again, on one process (a 2-rank checkpoint resumes on any k)."""
    return _pretrain(run, strategy="fsdp", ranks=1)


def test_a_sharded_checkpoint_is_safetensors_and_json_only_and_resumes_on_one_rank(
    tmp_path, sharded
):
    run = tmp_path / "run"
    (planted,) = _copy_checkpoints(sharded[1], run)
    names = sorted(p.relative_to(planted).as_posix() for p in planted.rglob("*") if p.is_file())
    assert len(_shard_files(planted)) == 2, names
    assert all(n.endswith((".safetensors", ".json")) for n in names), names  # no .metadata
    manifest = json.loads((planted / "manifest.json").read_text())
    assert manifest["format"] == "pita-checkpoint-3-sharded"
    assert set(manifest["files"]) == set(names) - {"manifest.json"}  # sha256 of every file
    weights, records = _resume_on_one(run)
    assert any("resumed from checkpoint" in m for _, m in records.lines), records.lines
    assert _close(weights, sharded[0])


def _flip(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[len(data) * 3 // 4] ^= 0x10
    shard.write_bytes(bytes(data))


def _foreign(tmp_path: Path) -> Path:
    """The first shard of the same task's checkpoint in a run with another seed."""
    other = tmp_path / "other"
    _pretrain(other, seed=1, strategy="fsdp", ranks=1)
    (checkpoint,) = [p for p in _checkpoints(other).iterdir() if p.name.startswith("step-")]
    return _shard_files(checkpoint)[0]


@pytest.mark.parametrize("attack", ["flipped byte", "missing shard", "extra file", "foreign shard"])
def test_a_tampered_shard_is_refused_and_the_task_starts_over(tmp_path, sharded, attack):
    run = tmp_path / "run"
    (planted,) = _copy_checkpoints(sharded[1], run)
    first, second = _shard_files(planted)
    if attack == "flipped byte":
        _flip(second)
    elif attack == "missing shard":
        second.unlink()
    elif attack == "extra file":
        shutil.copyfile(second, second.with_name("shard-00003-model-00001-of-00001.safetensors"))
    else:
        shutil.copyfile(_foreign(tmp_path), first)
    weights, records = _resume_on_one(run)
    _rejected(run, records, planted.name)
    assert _close(weights, sharded[0])  # from scratch, like the uninterrupted run


def _rewrite_header(shard: Path, edit) -> None:
    """`edit(header)` on a shard's safetensors header, the data section kept."""
    import struct

    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _tensors(header: dict) -> list[str]:
    """A header's tensors, in the order of their bytes."""
    keys = [k for k in header if k != "__metadata__"]
    return sorted(keys, key=lambda k: header[k]["data_offsets"][0])


def _bytes_overlap(header: dict) -> None:
    a, b = _tensors(header)[:2]
    header[b]["data_offsets"] = [x - 4 for x in header[b]["data_offsets"]]


def _bytes_past_the_file(header: dict) -> None:
    last = _tensors(header)[-1]
    header[last]["data_offsets"] = [x + 64 for x in header[last]["data_offsets"]]


def _placed(header: dict, move) -> None:
    """Change the shard placement (DCP_SHARDING_INFO) of the header's largest tensor."""
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    key = max(
        _tensors(header), key=lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0]
    )
    info[key]["saved_offsets"] = move(info[key]["saved_offsets"])
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)


HEADERS = {
    "bytes that overlap": (_bytes_overlap, "overlap"),
    "bytes past the file": (_bytes_past_the_file, "run past the file"),
    "a shard over the other": (lambda h: _placed(h, lambda o: [0] * len(o)), "overlap"),
    "a shard past its tensor": (lambda h: _placed(h, lambda o: [o[0] + 1000, *o[1:]]), "past"),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_a_forged_shard_header_is_refused_before_torch_reads_it(tmp_path, sharded, case):
    """The header of rank 1's shard rewritten and the proof forged to match (whoever can
    write the manifest): the shards' own layout is checked, and refused."""
    from pita.training.checkpoint import MANIFEST, Checkpointer, write_manifest

    edit, why = HEADERS[case]
    run = tmp_path / "run"
    (planted,) = _copy_checkpoints(sharded[1], run)
    _rewrite_header(_shard_files(planted)[1], edit)
    manifest = json.loads((planted / MANIFEST).read_text())
    (planted / MANIFEST).unlink()
    identity = {k: manifest[k] for k in ("task_id", "config_sha256", "inputs_sha256")}
    write_manifest(planted, MANIFEST, STEPS, identity, format=manifest["format"])
    records = _Records()
    logger = logging.getLogger(f"test.hostile.{random.random()}")
    logger.addHandler(records)
    ckpt = Checkpointer(_checkpoints(run), 2, logger=logger, identity=identity)
    assert ckpt.latest(STEPS) is None
    assert why in records.warnings(), records.warnings()
    if case == "a shard past its tensor":  # one end-to-end: the task starts over, unharmed
        shutil.rmtree(_checkpoints(run))
        (planted,) = _copy_checkpoints(sharded[1], run)
        _rewrite_header(_shard_files(planted)[1], edit)
        (planted / MANIFEST).unlink()
        write_manifest(planted, MANIFEST, STEPS, identity, format=manifest["format"])
        weights, records = _resume_on_one(run)
        _rejected(run, records, planted.name)
        assert _close(weights, sharded[0])


def test_a_trainer_checkpoint_holding_dcp_files_is_refused_never_unpickled(tmp_path):
    """accelerate's FSDP `SHARDED_STATE_DICT` writes DCP's `.metadata`, a pickle DCP reads
    with `pickle.load`: pita's TRL stages save FSDP's full state instead, and a Trainer
    checkpoint holding DCP files (planted, with a proof forged to verify) is moved aside
    before the Trainer sees it; the pickle never runs."""
    import pickle

    from pita.training.checkpoint import last_trl_checkpoint, write_manifest

    marker = tmp_path / "PWNED"
    ckpts = tmp_path / "checkpoints"
    planted = ckpts / "checkpoint-2"
    (planted / "pytorch_model_fsdp_0").mkdir(parents=True)
    (planted / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    (planted / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"\0" * 64)
    (planted / "trainer_state.json").write_text("{}")
    identity = {"task_id": "t", "config_sha256": "c", "inputs_sha256": "i"}
    write_manifest(planted, COMPLETE, 2, identity)
    records = _Records()
    logger = logging.getLogger(f"test.hostile.{random.random()}")
    logger.addHandler(records)
    assert last_trl_checkpoint(ckpts, identity, 4, logger) is None
    assert not marker.exists()
    assert "torch.distributed.checkpoint file" in records.warnings()
    assert (ckpts / "checkpoint-2.rejected").is_dir()
