"""`results/timeline.png`: what ran where and when, drawn from the journal's task attempts
(pita/results/timeline.py `spans`).

Two steps, so the picture can be tested on data and extended without touching the drawing:
`timeline_model` turns the attempts into `Bar`s and `Marker`s (which row, where, what label),
and `draw_timeline` draws them with matplotlib. What the model says:

- one bar per attempt and contiguous run of its devices: a gang (a k-device task) is one bar
  across its device rows, not k separate bars (devices that are not neighbours: one bar per
  neighbouring run, joined by a line);
- colour by stage; a long bar is labelled with its task (`PITA.goal_walk.tiny.r0.train`, or
  `PITA r0 train` when the full id does not fit): which train is PITA's;
- a failed attempt is hatched with a red edge and a `failed` marker at its end naming the
  failure class (`oom`, `killed`, ...); a retried attempt has a `retry` marker at its start;
  a gang resized (journal `task_resized`, pita/core/elastic.py) has a `resize` marker.
  A new kind of event is a new `Marker.kind` with its entry in `MARKER_STYLE`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LABEL_MIN_SHARE = 0.06  # a bar shorter than this share of the axis carries no label
CHARS_ACROSS = 150  # label characters that fit across the plot at the label font size


@dataclass(frozen=True)
class Bar:
    """One attempt on one run of neighbouring device rows (`rows`: first, last)."""

    task: str
    stage: str
    rows: tuple[int, int]
    start: float
    width: float
    outcome: str  # done | failed | running
    attempt: int = 1
    label: str | None = None
    gang: int = 1  # devices of the whole attempt (a gang: > 1)


@dataclass(frozen=True)
class Marker:
    """A point event on the timeline: `kind` picks its style (MARKER_STYLE)."""

    kind: str  # failed | retry | resize
    task: str
    x: float
    rows: tuple[int, int]
    text: str


@dataclass
class Timeline:
    rows: list[str]  # device labels, top to bottom
    x_max: float
    bars: list[Bar] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    links: list[tuple[float, int, int]] = field(default_factory=list)  # gang joins: x, row, row

    @property
    def stages(self) -> list[str]:
        return sorted({b.stage for b in self.bars})


def device_runs(devices: Sequence[int]) -> list[tuple[int, int]]:
    """[0, 1, 3] -> [(0, 1), (3, 3)]: the neighbouring runs a gang's bar covers."""
    runs: list[list[int]] = []
    for d in sorted(set(devices)):
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return [(a, b) for a, b in runs]


ROUND_PART = re.compile(r"r\d+")


def bar_label(span: Any, width: float, x_max: float) -> str | None:
    """The longest of (task id, `<algo> r<round> <stage>`) that fits in the bar, or None for
    a short bar."""
    if x_max <= 0 or width < LABEL_MIN_SHARE * x_max:
        return None
    fits = int(CHARS_ACROSS * width / x_max)
    parts = span.task.split(".")
    rnd = next((p for p in parts if ROUND_PART.fullmatch(p)), "")  # `r0` of a task id
    short = " ".join(p for p in (parts[0], rnd, span.stage) if p)
    prefix = f"retry {span.attempt}: " if span.attempt > 1 else ""
    for text in (prefix + span.task, prefix + short):
        if len(text) <= fits:
            return text
    return None


def timeline_model(
    spans: Sequence[Any], rows: Sequence[str], resizes: Sequence[tuple[float, str, int]] = ()
) -> Timeline:
    """The bars, labels and markers of the attempts `spans` (timeline.Span) on `rows`, and a
    `resize` marker for each (seconds, task, new k) of `resizes` (timeline.resize_marks)."""
    x_max = max([s.end for s in spans] + [0.0])
    model = Timeline(list(rows), x_max)
    for s in spans:
        width = max(s.seconds, 1e-3)
        runs = device_runs(s.devices) or [(0, 0)]
        label = bar_label(s, width, x_max)
        for i, run in enumerate(runs):
            model.bars.append(
                Bar(
                    s.task,
                    s.stage,
                    run,
                    s.start,
                    width,
                    s.outcome,
                    s.attempt,
                    label if i == 0 else None,
                    len(s.devices),
                )
            )
        for a, b in zip(runs, runs[1:]):
            model.links.append((s.start + width / 2, a[1], b[0]))
        whole = (runs[0][0], runs[-1][1])
        if s.outcome == "failed":
            model.markers.append(Marker("failed", s.task, s.end, whole, s.failure or "failed"))
        if s.attempt > 1:
            model.markers.append(Marker("retry", s.task, s.start, whole, f"attempt {s.attempt}"))
    for at, task, k in resizes:  # on the rows of the attempt that started after it
        after = [s for s in spans if s.task == task and s.start >= at - 1e-6]
        runs = device_runs(after[0].devices) if after and after[0].devices else [(0, 0)]
        model.markers.append(Marker("resize", task, at, (runs[0][0], runs[-1][1]), f"{k} ranks"))
    return model


MARKER_STYLE: dict[str, dict[str, Any]] = {
    "failed": {"marker": "X", "color": "red", "size": 40},
    "retry": {"marker": ">", "color": "black", "size": 30},
    "resize": {"marker": "v", "color": "purple", "size": 30},
}


def draw_timeline(model: Timeline, path: Path) -> None:
    """Draw `model` into `path` (a Gantt: device rows top to bottom, seconds across)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    colour = {st: f"C{i % 10}" for i, st in enumerate(model.stages)}
    fig = Figure(figsize=(11, 1.2 + 0.55 * len(model.rows)), layout="constrained")
    ax = fig.subplots()
    for bar in model.bars:
        lo, hi = bar.rows
        done = bar.outcome == "done"
        ax.broken_barh(
            [(bar.start, bar.width)],
            (lo - 0.4, hi - lo + 0.8),
            facecolors=colour[bar.stage],
            edgecolor="black" if done else "red",
            linewidth=1.2 if bar.gang > 1 else 0.3 if done else 0.8,  # a gang: one framed unit
            hatch=None if done else "//",
        )
        if bar.label:
            ax.text(
                bar.start + bar.width / 2,
                (lo + hi) / 2,
                bar.label,
                ha="center",
                va="center",
                fontsize=6,
                clip_on=True,
            )
    for x, a, b in model.links:
        ax.plot([x, x], [a + 0.4, b - 0.4], color="black", lw=0.8)
    for m in model.markers:
        style = MARKER_STYLE.get(m.kind, {"marker": "o", "color": "grey", "size": 30})
        y = m.rows[0] - 0.45
        ax.scatter([m.x], [y], marker=style["marker"], color=style["color"], s=style["size"])
        ax.annotate(m.text, (m.x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set_yticks(range(len(model.rows)), model.rows)
    ax.set_ylim(-0.8, len(model.rows) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first task started")
    ax.grid(axis="x", alpha=0.3)
    handles: list[Any] = [Patch(color=colour[st], label=st) for st in model.stages]
    for kind in sorted({m.kind for m in model.markers}):
        style = MARKER_STYLE.get(kind, {"marker": "o", "color": "grey"})
        handles.append(
            Line2D([], [], ls="none", marker=style["marker"], color=style["color"], label=kind)
        )
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
