"""Periodic device samples (`gpu_monitor.jsonl`) and the seed guide's summaries in run.log
(docs/guides/gpu_execution.txt).

Every `executor.monitor_interval_s` the orchestrator writes one JSON line per device
(NVML memory and utilisation for real GPUs, the workers' own torch allocator figures from
their heartbeats, worker RSS on CPU) and logs:

    GPU Memory Summary:
      GPU 0: 45.23 GB allocated, 48.50 GB reserved, 80.00 GB total
    GPU utilization: GPU 0: 87%, GPU 1: 91%

On CPU slots the block is `Worker Memory Summary:` with each worker's RSS instead.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("pita.monitor")


def _per_device_worker_stats(
    workers: list[dict[str, Any]], n_devices: int
) -> list[dict[str, float]]:
    """Sum the CUDA allocator figures the workers report, per run device."""
    per = [
        {"allocated_mb": 0.0, "reserved_mb": 0.0, "rss_mb": 0.0, "workers": 0}
        for _ in range(n_devices)
    ]
    for w in workers:
        cuda = w.get("cuda") or []
        for local, dev in enumerate(w.get("devices", [])):
            if dev >= n_devices:
                continue
            per[dev]["workers"] += 1
            per[dev]["rss_mb"] += float(w.get("rss_mb", 0.0)) / max(1, len(w["devices"]))
            if local < len(cuda):
                per[dev]["allocated_mb"] += cuda[local]["allocated_mb"]
                per[dev]["reserved_mb"] += cuda[local]["reserved_mb"]
    return per


def summary_lines(
    gpu_manager, workers: list[dict[str, Any]], reservations: list[int] | None = None
) -> list[str]:
    devices = gpu_manager.devices
    per = _per_device_worker_stats(workers, len(devices))
    if gpu_manager.kind == "cpu":
        lines = ["Worker Memory Summary:"]
        for d, s in zip(devices, per):
            lines.append(
                f"  CPU {d.index}: {s['rss_mb'] / 1024:.2f} GB worker RSS ({s['workers']} worker(s))"
            )
        return lines
    lines = ["GPU Memory Summary:"]
    for i, (d, s) in enumerate(zip(devices, per)):
        allocated, reserved = s["allocated_mb"], s["reserved_mb"]
        note = ""
        if d.kind == "fake":
            reserved = float((reservations or [0] * len(devices))[i])
            note = " (simulated device: reserved = running tasks' estimates)"
        lines.append(
            f"  GPU {d.index}: {allocated / 1024:.2f} GB allocated, {reserved / 1024:.2f} GB reserved, "
            f"{d.total_mb / 1024:.2f} GB total{note}"
        )
    utils = [
        f"GPU {d.index}: {d.utilization}%" if d.utilization is not None else f"GPU {d.index}: n/a"
        for d in devices
    ]
    lines.append("GPU utilization: " + ", ".join(utils))
    return lines


class Monitor:
    """A daemon thread sampling devices and workers until `stop()`."""

    def __init__(self, gpu_manager, pool, path: Path, interval_s: float = 30.0, reservations=None):
        self.gpu = gpu_manager
        self.pool = pool
        self.path = Path(path)
        self.interval_s = interval_s
        self.reservations = reservations or (lambda: None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pita-monitor", daemon=True)

    def start(self) -> Monitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def sample(self, log_summary: bool = True) -> list[dict[str, Any]]:
        self.gpu.refresh()
        workers = self.pool.workers()
        per = _per_device_worker_stats(workers, len(self.gpu.devices))
        now = round(time.time(), 3)
        records = []
        for d, s in zip(self.gpu.devices, per):
            records.append(
                {
                    "ts": now,
                    "device": d.index,
                    "kind": d.kind,
                    "name": d.name,
                    "total_mb": d.total_mb,
                    "free_mb": d.free_mb if d.kind == "cuda" else None,
                    "utilization": d.utilization,
                    "allocated_mb": s["allocated_mb"],
                    "reserved_mb": s["reserved_mb"],
                    "worker_rss_mb": round(s["rss_mb"], 1),
                    "workers": s["workers"],
                }
            )
        with open(self.path, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        if log_summary:
            for line in summary_lines(self.gpu, workers, self.reservations()):
                log.info(line)
        return records

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as exc:  # the monitor must never take the run down
                log.debug("monitor sample failed: %s", exc)
