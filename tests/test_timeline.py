"""results/timeline.png names what it shows (issue 28): the model behind the picture — long
bars labelled with their task (which train is PITA's), a gang drawn as one bar across its
device rows, failed attempts marked with their failure class, retries marked — tested on
data from a journal, not on pixels (pita/results/timeline_plot.py)."""

from __future__ import annotations

from pita.core.dag import Plan
from pita.core.tasks import TaskSpec

PITA_TRAIN = "PITA.goal_walk.tiny.r0.train"
QS_TRAIN = "QSharp.goal_walk.tiny.r0.train"
EVAL = "PITA.goal_walk.tiny.r0.evaluate.s00"


def _plan() -> Plan:
    plan = Plan()
    for tid, algo, stage in (
        (PITA_TRAIN, "PITA", "train"),
        (QS_TRAIN, "QSharp", "train"),
        (EVAL, "PITA", "evaluate"),
    ):
        plan.add(
            TaskSpec(
                id=tid, algo=algo, dataset="goal_walk", family="tiny", round=0, stage=stage, fn="-"
            )
        )
    return plan


EVENTS = [
    {"ts": 0.0, "event": "run_started"},
    # PITA's train: a gang on devices 0-1, 60 s
    {"ts": 0.0, "event": "task_running", "task": PITA_TRAIN, "devices": [0, 1], "attempt": 1},
    # Q#'s train on device 3: OOM after 10 s, retried as a gang on devices 2 and 3 (89 s)
    {"ts": 0.0, "event": "task_running", "task": QS_TRAIN, "devices": [3], "attempt": 1},
    {"ts": 10.0, "event": "task_failed", "task": QS_TRAIN, "failure": "oom", "attempt": 1},
    {"ts": 10.0, "event": "task_retry", "task": QS_TRAIN, "attempt": 2},
    {"ts": 11.0, "event": "task_running", "task": QS_TRAIN, "devices": [2, 3], "attempt": 2},
    {"ts": 60.0, "event": "task_done", "task": PITA_TRAIN, "wall_s": 60.0},
    {"ts": 60.0, "event": "task_running", "task": EVAL, "devices": [1], "attempt": 1},
    {"ts": 62.0, "event": "task_done", "task": EVAL, "wall_s": 2.0},
    {"ts": 100.0, "event": "task_done", "task": QS_TRAIN, "wall_s": 89.0},
    {"ts": 100.0, "event": "run_finished"},
]
ROWS = ["GPU 0", "GPU 1", "GPU 2", "GPU 3"]


def _model():
    from pita.results.timeline import spans
    from pita.results.timeline_plot import timeline_model

    all_spans, _ = spans(EVENTS, _plan().tasks)
    return timeline_model(all_spans, ROWS)


def test_long_bars_name_their_task_and_short_ones_stay_quiet():
    model = _model()
    by_task = {}
    for bar in model.bars:
        by_task.setdefault(bar.task, []).append(bar)
    [pita] = by_task[PITA_TRAIN]
    assert pita.label == PITA_TRAIN and pita.stage == "train"  # which train is PITA's
    [evaluate] = by_task[EVAL]
    assert evaluate.label is None  # 2 s of a 100 s run: no room
    retried = [b for b in by_task[QS_TRAIN] if b.attempt == 2]
    assert retried[0].label == f"retry 2: {QS_TRAIN}"
    first = [b for b in by_task[QS_TRAIN] if b.attempt == 1]
    assert first[0].label == "QSharp r0 train"  # 10 s: the full id does not fit, the short one does


def test_a_gang_is_one_bar_across_its_device_rows():
    model = _model()
    [pita] = [b for b in model.bars if b.task == PITA_TRAIN]
    assert pita.rows == (0, 1) and pita.gang == 2 and pita.width == 60.0
    [retry] = [b for b in model.bars if b.task == QS_TRAIN and b.attempt == 2]
    assert retry.rows == (2, 3) and retry.gang == 2 and model.links == []


def test_a_gang_on_devices_that_are_not_neighbours_is_joined_by_a_line():
    from pita.results.timeline import Span
    from pita.results.timeline_plot import device_runs, timeline_model

    assert device_runs([3, 0, 1]) == [(0, 1), (3, 3)]
    span = Span(PITA_TRAIN, "train", "PITA.goal_walk.tiny", [0, 1, 3], 0.0, 50.0, "done")
    model = timeline_model([span], ROWS)
    assert [b.rows for b in model.bars] == [(0, 1), (3, 3)] and all(b.gang == 3 for b in model.bars)
    assert [b.label for b in model.bars] == [PITA_TRAIN, None]  # one label per attempt
    assert model.links == [(25.0, 1, 3)]


def test_failed_and_retried_attempts_are_marked():
    model = _model()
    kinds = {(m.kind, m.task, m.x, m.rows, m.text) for m in model.markers}
    assert kinds == {
        ("failed", QS_TRAIN, 10.0, (3, 3), "oom"),
        ("retry", QS_TRAIN, 11.0, (2, 3), "attempt 2"),
    }
    [failed] = [b for b in model.bars if b.task == QS_TRAIN and b.attempt == 1]
    assert failed.outcome == "failed"


def test_the_model_draws(tmp_path):
    from pita.results.timeline_plot import draw_timeline

    draw_timeline(_model(), tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 1000
