"""The two files every training task leaves in its folder.

- `training_metrics.png`: loss, reward and KL (GRPO), reward margin (DPO), accuracy (when
  the stage recorded one) and step time against the optimizer step; value training with a
  hold-out adds a panel of held-out balanced accuracy by response position
  (`heldout_pos<j>` metrics: where learning stops, pita/algos/value_diagnostics.py).
- `performance_summary.txt`: precision, compile status, gradient checkpointing, the batch
  arithmetic (micro-batch × accumulation × ranks = effective batch), throughput in
  samples/s and tokens/s, peak memory (CUDA allocator peak, or process RSS on the CPU).

`write_training_report` also returns the figures as a dict for the stage's result.json.
Hand-written loops feed it their `TrainStep`; TRL / transformers trainers get the same
figures through `trainer_metrics_callback`.
Matplotlib is used through `Figure` (no pyplot global state: safe in a worker).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pita.training.loop import CompileStatus, TrainingMetrics, TrainStep
from pita.training.precision import Precision

PLOT_NAME = "training_metrics.png"
SUMMARY_NAME = "performance_summary.txt"


def write_training_report(
    out_dir: str | Path,
    source: TrainStep | TrainingMetrics,
    *,
    micro_batch: int,
    accumulation_steps: int,
    world_size: int = 1,
    gradient_checkpointing: bool = False,
    precision: Precision | None = None,
    compile_status: CompileStatus | str | None = None,
    title: str = "",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write `training_metrics.png` and `performance_summary.txt` into `out_dir`; return
    the summary as a JSON-able dict.

    `source`: the stage's `TrainStep` (precision and compile status are read from it), or
    the `TrainingMetrics` a trainer callback filled (pass `precision` / `compile_status`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(source, TrainStep):
        source.flush()  # steps a lazy TrainStep has not read back yet
    metrics = source.metrics if isinstance(source, TrainStep) else source
    if isinstance(source, TrainStep):
        precision = precision or source.precision
        compile_status = compile_status if compile_status is not None else source.compile_status
    summary: dict[str, Any] = {
        "precision": precision.name if precision is not None else "n/a",
        "compile": str(compile_status) if compile_status is not None else "off (eager)",
        "gradient_checkpointing": bool(gradient_checkpointing),
        "micro_batch": micro_batch,
        "accumulation_steps": accumulation_steps,
        "world_size": world_size,
        "effective_batch": micro_batch * accumulation_steps * world_size,
        **metrics.summary(),
        **(extra or {}),
    }
    metrics.close_tracker()
    _plot(out / PLOT_NAME, metrics, title)
    reason = precision.reason if precision is not None else ""
    (out / SUMMARY_NAME).write_text(_summary_text(summary, metrics.device, reason, title))
    return summary


def trainer_metrics_callback(metrics: TrainingMetrics, samples_per_step: int):
    """A transformers `TrainerCallback` (TRL trainers) that fills `metrics` like TrainStep
    does: the time of every optimizer step, its samples, and the logged loss, accuracy
    (`rewards/accuracies` for DPO / reward trainers) and token counts (`num_tokens`)."""
    from transformers import TrainerCallback

    class TrainerMetrics(TrainerCallback):
        t0 = 0.0
        tokens_seen = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            metrics.record(
                step=state.global_step,
                step_time_s=time.perf_counter() - self.t0,
                samples=samples_per_step,
            )

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not metrics.rows or not logs:
                return
            row = metrics.rows[-1]
            for key, name in (
                ("loss", "loss"),
                ("accuracy", "accuracy"),
                ("rewards/accuracies", "accuracy"),
                ("learning_rate", "lr"),
                ("grad_norm", "grad_norm"),
                ("reward", "reward"),
                ("kl", "kl"),
                ("rewards/margins", "reward_margin"),
            ):
                if isinstance(logs.get(key), (int, float)):
                    row[name] = float(logs[key])
            if isinstance(logs.get("num_tokens"), (int, float)):  # cumulative in TRL's logs
                row["tokens"] = float(logs["num_tokens"]) - self.tokens_seen
                self.tokens_seen = float(logs["num_tokens"])

    return TrainerMetrics()


def _fmt(value: Any, unit: str = "") -> str:
    return "n/a" if value is None else f"{value}{unit}"


def _summary_text(s: dict[str, Any], device: Any, reason: str, title: str) -> str:
    first = (
        " (first step excluded: warm-up / compilation)"
        if s["throughput_excludes_first_step"]
        else ""
    )
    lines = [
        f"Training performance summary{': ' + title if title else ''}",
        f"device: {device}",
        f"precision: {s['precision']}" + (f" ({reason})" if reason else ""),
        f"compile: {s['compile']}",
        f"gradient checkpointing: {'on' if s['gradient_checkpointing'] else 'off'}",
        f"batch: micro-batch {s['micro_batch']} x {s['accumulation_steps']} accumulation step(s) x "
        f"{s['world_size']} rank(s) = effective batch {s['effective_batch']}",
        f"steps: {s['steps']}, train time {_fmt(s['train_time_s'], ' s')}, "
        f"mean step time {_fmt(s['mean_step_time_s'], ' s')}",
        f"throughput: {_fmt(s['samples_per_s'], ' samples/s')}, {_fmt(s['tokens_per_s'], ' tokens/s')}{first}",
        f"peak memory: {_fmt(s['peak_memory_mb'], ' MB')} ({s['peak_memory_kind']})",
    ]
    known = {
        "precision",
        "compile",
        "gradient_checkpointing",
        "micro_batch",
        "accumulation_steps",
        "world_size",
        "effective_batch",
        "steps",
        "train_time_s",
        "mean_step_time_s",
        "samples_per_s",
        "tokens_per_s",
        "peak_memory_mb",
        "peak_memory_kind",
        "throughput_excludes_first_step",
    }
    lines += [f"{k}: {v}" for k, v in s.items() if k not in known]
    return "\n".join(lines) + "\n"


def _plot(path: Path, metrics: TrainingMetrics, title: str) -> None:
    from matplotlib.figure import Figure

    panels = [
        ("loss", "loss"),
        ("reward", "reward"),
        ("kl", "KL(π‖π_ref)"),
        ("reward_margin", "reward margin"),
        ("accuracy", "accuracy"),
        ("step_time_s", "step time (s)"),
    ]
    panels = [(k, label) for k, label in panels if metrics.series(k)[0]] or [("loss", "loss")]
    positions = sorted(
        {
            int(k[len("heldout_pos") :])
            for row in metrics.rows
            for k in row
            if k.startswith("heldout_pos")
        }
    )
    n_panels = len(panels) + bool(positions)
    fig = Figure(figsize=(4.2 * n_panels, 3.4), layout="constrained")
    axes = fig.subplots(1, n_panels, squeeze=False)[0]
    for ax, (key, label) in zip(axes, panels):
        xs, ys = metrics.series(key)
        ax.plot(xs, ys, lw=1.2)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if positions:  # one line per response position: where learning stops
        ax = axes[-1]
        for j in positions:
            xs, ys = metrics.series(f"heldout_pos{j}")
            ax.plot(xs, ys, marker="o", ms=3, lw=1.2, label=f"position {j}")
        ax.axhline(0.5, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("held-out balanced accuracy")
        ax.set_ylim(0.3, 1.02)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
