"""The per-user caches under $PITA_CACHE_DIR (pita/core/user_cache.py): each hostile file is
planted for real (a link to /dev/zero, a FIFO, a huge file, garbage, the wrong shape, another
user's file) and every reader of a cache (durations, peaks, batch sizes) ignores it with one
WARNING, never a traceback, a hang or a read of /dev/zero."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest

from pita.core import user_cache
from pita.experiment.durations import load_history, record_durations
from pita.experiment.estimates import PeakEstimator
from pita.runtime.batch_size.cache import BatchSizeCache
from pita.runtime.batch_size.search import SearchResult


def _huge(path):
    with open(path, "wb") as f:  # sparse: no disk used, but st_size over the cap
        f.truncate(user_cache.MAX_CACHE_BYTES + 1)


def _as_nobody(path):
    import pwd

    nobody = pwd.getpwnam("nobody")
    os.chown(path, nobody.pw_uid, nobody.pw_gid)


def _valid(kind: str) -> str:
    return {
        "durations": json.dumps({"k": {"wall_s": 3.0, "run": "r"}}),
        "peaks": json.dumps({"k": {"peak_mb": 100.0, "task": "t"}}),
        "batch size": json.dumps({"version": 1, "entries": {}}),
    }[kind]


HOSTILE = {
    "link to /dev/zero": lambda p, kind: p.symlink_to("/dev/zero"),
    "fifo": lambda p, kind: os.mkfifo(p),
    "huge file": lambda p, kind: _huge(p),
    "garbage": lambda p, kind: p.write_bytes(b"\x00\xff{not json"),
    "a list": lambda p, kind: p.write_text("[1, 2, 3]"),
    "folder": lambda p, kind: p.mkdir(),
    # 400 KB of nesting: json's parser raised RecursionError in every run until removed
    "nested 400 KB": lambda p, kind: p.write_text('{"k": ' + "[" * 200_000 + "]" * 200_000 + "}"),
}
if os.geteuid() == 0:  # root can make another user's file
    HOSTILE["another user's"] = lambda p, kind: (p.write_text(_valid(kind)), _as_nobody(p))


def _read(kind: str, path):
    if kind == "durations":
        return load_history(path).exact
    if kind == "peaks":
        return PeakEstimator({}, path).peaks
    return BatchSizeCache(path)._read()


def _in_thread(fn, *args):
    """Run fn in a thread and fail (rather than hang the suite) when it blocks, e.g. on a FIFO."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("v", fn(*args)), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "reading the cache blocked"
    return out["v"]


@pytest.mark.parametrize("kind", ["durations", "peaks", "batch size"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_cache_is_one_warning_and_ignored(tmp_path, caplog, kind, case):
    path = tmp_path / "cache.json"
    HOSTILE[case](path, kind)
    user_cache._warned.clear()
    with caplog.at_level(logging.WARNING, logger="pita.cache"):
        assert _in_thread(_read, kind, path) == {}
        assert _in_thread(_read, kind, path) == {}  # read again: still one line
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"ignoring the {kind} cache {path}" in warnings[0]


def test_entries_of_the_wrong_shape_are_skipped_the_rest_kept(tmp_path, caplog):
    path = tmp_path / "task_durations.json"
    path.write_text(json.dumps({"a": {"wall_s": 2.5}, "b": {"wall": 1}, "c": "x", "d": None}))
    user_cache._warned.clear()
    with caplog.at_level(logging.WARNING, logger="pita.cache"):
        assert load_history(path).exact == {"a": 2.5}
    assert ["3 entries of the wrong shape" in r.getMessage() for r in caplog.records] == [True]


def test_non_finite_and_overlong_numbers_drop_their_entry_the_rest_kept(tmp_path, caplog):
    """Issue 43: `wall_s: Infinity` in the durations cache raised OverflowError in every dry
    run. Python's json reads Infinity, NaN and 1e999; a cache reads them as None, so the
    entry fails its shape check (one WARNING) and the others are kept, on disk too."""
    path = tmp_path / "task_durations.json"
    text = (
        '{"a": {"wall_s": 2.5}, "b": {"wall_s": Infinity}, "c": {"wall_s": 1e999}, '
        '"d": {"wall_s": NaN}, "e": {"wall_s": -Infinity}, "f": {"wall_s": 1' + "0" * 400 + "}}"
    )
    path.write_text(text)
    user_cache._warned.clear()
    with caplog.at_level(logging.WARNING, logger="pita.cache"):
        assert load_history(path).exact == {"a": 2.5}
        assert PeakEstimator({}, path).peaks == {}  # the same file read as peaks: no crash
    messages = [r.getMessage() for r in caplog.records]
    assert any("5 entries of the wrong shape" in m for m in messages), messages
    assert path.read_text() == text  # reading changes nothing


def test_a_write_replaces_a_planted_link_and_never_writes_through_it(tmp_path):
    """The peaks cache linked to a file of the user's: the update replaces the link with a
    fresh cache (atomically, under the lock) and the link's target is untouched."""
    target = tmp_path / "important.txt"
    target.write_text("keep me")
    path = tmp_path / "task_peaks.json"
    path.symlink_to(target)
    (tmp_path / "task_peaks.json.lock").symlink_to(tmp_path / "other.txt")
    peaks = PeakEstimator({}, path)
    peaks._save("k", 123.0, "t")  # the lock is a link: one WARNING, nothing written
    assert not (tmp_path / "other.txt").exists()
    (tmp_path / "task_peaks.json.lock").unlink()
    peaks._save("k", 123.0, "t")
    assert target.read_text() == "keep me"
    assert not path.is_symlink()
    assert json.loads(path.read_text()) == {"k": {"peak_mb": 123.0, "task": "t"}}


def test_concurrent_updates_under_the_lock_lose_nothing(tmp_path):
    path = tmp_path / "c.json"

    def add(i: int) -> None:
        user_cache.update_json(path, "test", lambda data: data.update({str(i): i}))

    threads = [threading.Thread(target=add, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert json.loads(path.read_text()) == {str(i): i for i in range(8)}


def test_a_batch_size_store_over_a_garbage_cache_heals_it(tmp_path):
    path = tmp_path / "batch_sizes.json"
    path.write_text("garbage")
    cache = BatchSizeCache(path)
    result = SearchResult(batch_size=8, found=9, probes=2, trace=[], method="fit", budget_bytes=2.0)
    cache.store({"a": 1}, result, free_bytes=10.0, safety_margin=0.1, cap=64)
    hit = cache.lookup({"a": 1}, free_bytes=10.0, safety_margin=0.1, cap=64)
    assert hit is not None and hit["batch_size"] == 8


def test_record_durations_over_a_fifo_does_not_hang(tmp_path):
    """The run's end records durations into a cache that is a FIFO: replaced, not blocked on."""
    from tests.test_eta import _task

    (tmp_path / "journal.jsonl").write_text(
        json.dumps({"event": "task_done", "task": "a", "wall_s": 1.5}) + "\n"
    )
    cache = tmp_path / "task_durations.json"
    os.mkfifo(cache)
    n = _in_thread(record_durations, tmp_path, {"a": _task("a")}, lambda t: t.id, cache)
    assert n == 1 and load_history(cache).exact == {"a": 1.5}


def test_a_dry_run_with_hostile_caches_finishes_with_one_warning_each(tmp_path):
    """The issue's report: durations linked to /dev/zero (OOM before), peaks a FIFO (hang)."""
    from tests.conftest import run_cli

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "task_durations.json").symlink_to("/dev/zero")
    os.mkfifo(cache / "task_peaks.json")
    env = {"PITA_CACHE_DIR": str(cache)}
    proc = run_cli(["experiment=smoke", "dry_run=true"], tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out
    assert out.count("ignoring the durations cache") == 1, out[-3000:]
    assert out.count("ignoring the peaks cache") == 1, out[-3000:]
    assert "Estimated wall time" in proc.stdout


def test_a_dry_run_with_nested_and_non_finite_caches_finishes(tmp_path):
    """The issue's report: a 400 KB nested peaks cache (RecursionError) and `wall_s:
    Infinity` in the durations (OverflowError) broke every run: now a WARNING each."""
    from tests.conftest import run_cli

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "task_durations.json").write_text('{"x": {"wall_s": Infinity, "run": "r"}}')
    (cache / "task_peaks.json").write_text('{"k": ' + "[" * 200_000 + "]" * 200_000 + "}")
    proc = run_cli(
        ["experiment=smoke", "dry_run=true"], tmp_path, env={"PITA_CACHE_DIR": str(cache)}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out
    assert out.count("ignoring the durations cache") == 1, out[-3000:]
    assert out.count("ignoring the peaks cache") == 1, out[-3000:]
