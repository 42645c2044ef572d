"""Code-bearing keys of a shared run are the runner's choice (issue 43 item 5).

Some keys make pita run code: `executor.stage_overrides.<ALGO>.<stage>=pkg.module:function`
(every worker imports and runs it) and `model.trust_remote_code=true` (model repositories run
their own code). In a run shared with a group (`system.trust_group=true`) a teammate's
resume may change any key, and the saved config then carries the teammate's choice into the
owner's next resume, to run in the owner's processes, as the owner.

So every session that runs records the code-bearing values it ran with in a file of its own
(`.code_keys.<uid>.json` in the run folder: the kernel's owner of that file, not its name or
content, says whose choice it is; a teammate can replace it, never forge it). A resume runs
a code-bearing value only when the resuming user states it on the command line, or ran with
it before (their own record holds it); otherwise it is refused in one line naming who set it
(the owner of the record that holds it, or of the saved config for a run from before these
records). What it cannot see: a teammate who removes your record and edits a group-writable
saved config in place (the saved config's hash in the journal names such an edit).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from pita.core.paths import RunPaths, atomic_write_json

RECORD = ".code_keys.{uid}.json"
REMOTE_CODE = "model.trust_remote_code"
OVERRIDES = "executor.stage_overrides"


def code_bearing(cfg: Any) -> dict[str, str]:
    """The config's code-bearing keys that would run code, with their values."""
    out = {
        f"{OVERRIDES}.{algo}.{stage}": str(target)
        for algo, stages in (cfg.executor.stage_overrides or {}).items()
        for stage, target in (stages or {}).items()
    }
    if bool(cfg.model.trust_remote_code):
        out[REMOTE_CODE] = "true"
    return out


def record(cfg: Any, run_dir: Path) -> None:
    """Write this user's record of the code-bearing values this session runs with."""
    path = Path(run_dir) / RECORD.format(uid=os.geteuid())
    atomic_write_json(path, {"keys": code_bearing(cfg)})


def _records(run_dir: Path) -> dict[int, dict[str, str]]:
    """uid (the file's owner) -> the values that user's record holds; records pita may not
    read (a link, a stranger's) are left out."""
    from pita.core.safe_files import UnsafeFile, read_control

    out: dict[int, dict[str, str]] = {}
    for path in sorted(Path(run_dir).glob(RECORD.format(uid="*"))):
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                continue
            data = json.loads(read_control(path, 1 << 20, trust_group=st.st_uid != os.geteuid()))
            keys = data.get("keys") if isinstance(data, dict) else None
        except (OSError, UnsafeFile, ValueError, RecursionError):
            continue
        if isinstance(keys, dict):
            out.setdefault(st.st_uid, {}).update({str(k): str(v) for k, v in keys.items()})
    return out


def _user(uid: int) -> str:
    import pwd

    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def stated_keys(overrides: list[str]) -> set[str]:
    """The keys a command line sets (`+key=value` as `key`)."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}


def foreign_code_errors(cfg: Any, run_dir: Path, stated: set[str]) -> list[str]:
    """One line per code-bearing value this resume would run that the resuming user neither
    states now nor ran with before, naming who set it."""
    me = os.geteuid()
    records = _records(run_dir)
    mine = records.get(me)
    errors = []
    for key, value in code_bearing(cfg).items():
        if key in stated or (mine is not None and mine.get(key) == value):
            continue
        setters = [u for u, keys in records.items() if u != me and keys.get(key) == value]
        if mine is None and not setters:  # a run from before the records: its saved config's
            try:
                owner = os.lstat(RunPaths(run_dir).saved_config).st_uid
            except OSError:
                owner = me
            if owner == me:
                continue
            setters = [owner]
        who = _user(setters[0]) if setters else "someone else (it is not what you ran with)"
        errors.append(
            f"{key}={value}: set by {who}, not by you; it makes your processes run code, so a "
            f"shared run's resume runs it only when you state it again ({key}={value}) or "
            f"give it another value"
        )
    return errors
