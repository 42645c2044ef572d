"""Over-long names and paths (issue 43 item 7): a run folder whose name passes the file
system's 255 bytes per name, or whose path leaves no room under its 4 KB limit for what pita
writes inside, and task folder names that would pass it, are one line and exit 2 before
anything is created (the kernel's ENAMETOOLONG was an OSError traceback mid-run)."""

from __future__ import annotations

import pytest

from pita.core.paths import RUN_PATH_EXTRA, TASK_NAME_EXTRA, path_length_errors
from pita.experiment import cli


def _folders(tmp_path):
    return {
        "a name over 255 bytes": (tmp_path / ("n" * 256) / "run", "bytes, over the file system's"),
        "a 4-byte character name": (tmp_path / ("é" * 128), "256 bytes, over"),  # 128 chars
        "a path near 4 KB": (
            tmp_path.joinpath(*["p" * 200] * (4096 // 201)),
            "-byte limit; choose a shorter folder",
        ),
    }


@pytest.mark.parametrize("dry_run", ["true", "false"])
@pytest.mark.parametrize(
    "case", ["a name over 255 bytes", "a 4-byte character name", "a path near 4 KB"]
)
def test_a_too_long_run_folder_is_one_line_and_nothing_is_created(
    case, dry_run, tmp_path, monkeypatch, capsys
):
    folder, expected = _folders(tmp_path)[case]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_hydra_main", lambda: pytest.fail("reached Hydra"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["experiment=smoke", f"dry_run={dry_run}", f"hydra.run.dir={folder}"])
    assert exit_info.value.code == 2
    [line] = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert line.startswith("error: run folder ") and expected in line, line
    assert list(tmp_path.iterdir()) == []


def test_task_folder_names_that_would_be_too_long(tmp_path):
    ok = "a" * (255 - TASK_NAME_EXTRA)
    assert path_length_errors(tmp_path, [ok]) == []
    [line] = path_length_errors(tmp_path, [ok, ok + "b", "short"])
    assert line.startswith("task aaaa") and "(1 task(s))" in line
    assert RUN_PATH_EXTRA < 4096
