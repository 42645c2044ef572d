"""Opening a run folder's control files without trusting whoever else can write there.

A run folder may sit in a shared place (a group's project folder, `/tmp`), and its
control files (`.lock`, `journal.jsonl`, manifests, the saved plan) steer what pita
writes and what resume trusts. So every open here:

- refuses a symbolic link (`O_NOFOLLOW`): a planted `.lock -> ~/important.txt` must not
  make pita overwrite that file;
- refuses anything but a regular file (a FIFO or `/dev/zero` must not hang or fill RAM);
- refuses a file owned by another user unless the run is shared with the caller's group
  on purpose (`trust_group`);
- reads at most `MAX_CONTROL_BYTES`: no manifest or journal line of pita's comes near it.

Failures are `UnsafeFile` (a ConfigError: the run exits 2 with one line saying why).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from pita.core.errors import ConfigError

MAX_CONTROL_BYTES = 16 * 2**20  # a manifest, plan or saved config of 16 MB is absurd
MAX_JOURNAL_BYTES = 256 * 2**20  # one event per task state change: a run of 10k tasks is ~5 MB


class UnsafeFile(ConfigError):
    """A control file pita will not open: a link, not a regular file, foreign or too big."""


def _caller_groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}


_GROUP_SHARED = [False]  # this process runs a run shared with its group (system.trust_group)


_UMASK_BEFORE: list[int] = []  # the process umask before sharing cleared its group bits


def share_with_group(on: bool) -> None:
    """Make `trust_group` the default of every check in this process: the orchestrator of a
    run with `system.trust_group=true` reads the saved config, plan, journal, lock and
    manifests its teammates wrote, without each reader passing the flag along.

    And what this process creates from now on is the group's to write too: the umask's group
    bits are cleared (022 -> 002), so the worker logs, run.log, journal, task folders and
    results a teammate's resume appends to or replaces are group-writable (issue 43: a
    teammate's resume died on the owner's 0644 worker logs). Workers inherit it. `on=False`
    restores the umask this process had."""
    _GROUP_SHARED[0] = bool(on)
    if on and not _UMASK_BEFORE:
        before = os.umask(0o022)
        _UMASK_BEFORE.append(before)
        os.umask(before & ~0o070)
    elif not on and _UMASK_BEFORE:
        os.umask(_UMASK_BEFORE.pop())


def group_shared() -> bool:
    return _GROUP_SHARED[0]


def owner_problem(st: os.stat_result, trust_group: bool = False) -> str | None:
    """Why a file or folder with this stat may not steer pita, or None when it may.

    Yours: fine unless anybody may write it. Another user's: only when `trust_group` and
    it belongs to one of your groups (the shared-run story), never when world-writable.
    """
    if st.st_mode & stat.S_IWOTH:
        return "writable by every user"
    if st.st_uid == os.geteuid():
        return None
    if (trust_group or _GROUP_SHARED[0]) and st.st_gid in _caller_groups():
        return None
    return f"owned by uid {st.st_uid}, not by you (uid {os.geteuid()})"


def open_control(path: Path | str, flags: int, mode: int = 0o600, trust_group: bool = False) -> int:
    """`os.open` a control file: no symlink, a regular file, owned by the caller (see
    `owner_problem`). Returns the descriptor; raises UnsafeFile (or FileNotFoundError
    when the file is absent and `flags` has no O_CREAT)."""
    path = Path(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(
                f"{path} is a symbolic link; pita does not follow links in a run folder"
            ) from None
        if exc.errno in (errno.EISDIR, errno.ENXIO):
            raise UnsafeFile(f"{path} is not a regular file; move it away") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{path} is not a regular file; move it away")
        why = owner_problem(st, trust_group)
        if why:
            hint = " (a run shared with your group needs system.trust_group=true)" * ("uid" in why)
            raise UnsafeFile(f"{path} is {why}; refusing to use it{hint}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_control(
    path: Path | str, limit: int = MAX_CONTROL_BYTES, trust_group: bool = False
) -> bytes:
    """The whole content of a control file, refusing one over `limit` bytes."""
    fd = open_control(path, os.O_RDONLY, trust_group=trust_group)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UnsafeFile(f"{path} is {size} bytes (limit {limit}); not a file pita wrote")
        chunks, left = [], limit + 1
        while left > 0 and (block := os.read(fd, min(left, 1 << 20))):
            chunks.append(block)
            left -= len(block)
        data = b"".join(chunks)
        if len(data) > limit:
            raise UnsafeFile(f"{path} grew past {limit} bytes while read; not a file pita wrote")
        return data
    finally:
        os.close(fd)


def read_control_text(
    path: Path | str, limit: int = MAX_CONTROL_BYTES, trust_group: bool = False
) -> str:
    """`read_control` decoded as UTF-8 (undecodable bytes become U+FFFD, never a crash)."""
    return read_control(path, limit, trust_group).decode("utf-8", errors="replace")


def check_folder(path: Path | str, trust_group: bool = False) -> None:
    """Refuse a run, tasks or checkpoint folder that is a link, or owned / writable by
    others (see `owner_problem`). An absent folder is fine: pita will create it."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        # a link to the folder is the user's own choice only at the top of a run folder;
        # inside it, a link redirects pita's writes
        raise UnsafeFile(f"{path} is a symbolic link; pita does not follow links in a run folder")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFile(f"{path} is not a folder; move it away")
    why = owner_problem(st, trust_group)
    if why:
        hint = (
            " (a run shared with your group needs system.trust_group=true)" if "uid" in why else ""
        )
        raise UnsafeFile(f"run folder {path} is {why}; refusing to use it{hint}")
