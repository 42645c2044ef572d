"""GPUManager: which devices this run may use, how much memory they have, how to pin them.

Discovery uses NVML (`nvidia-ml-py`), never torch: creating a CUDA context in the
orchestrator would cost hundreds of MB on every GPU it touches. Devices come from
`system.devices`:

- `auto`: every NVML GPU, or CPU slots when there is none;
- `cpu`: `executor.cpu_workers` CPU slots (workers get `CUDA_VISIBLE_DEVICES=""`);
- `[0,2]`: those NVML indices (an unknown index is a ConfigError);
- `fake:4` / `fake:[80GB,40GB]`: simulated GPUs. Scheduling, pinning and dry runs
  behave as on a GPU box while workers compute on the CPU; tests use this.

Workers are pinned by UUID with `CUDA_DEVICE_ORDER=PCI_BUS_ID` (indices differ between
NVML and CUDA's default "fastest first" order; UUIDs do not).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

from omegaconf import ListConfig

from pita.core.errors import ConfigError

_DEVICE_MEM_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GB|GiB|MB|MiB)?\s*$", re.IGNORECASE)


MAX_FAKE_DEVICES = 64  # a simulated node: more than any machine pita plans for


def parse_device_memory(text: str) -> int:
    """'80GB' -> MiB. Raises ValueError on anything else."""
    m = _DEVICE_MEM_RE.match(str(text))
    if not m:
        raise ValueError(text)
    value, unit = float(m.group(1)), (m.group(2) or "GB").lower()
    return int(value * 1024) if unit in ("gb", "gib") else int(value)


def validate_devices_spec(spec: Any) -> None:
    """Syntax of system.devices; existence of GPUs is checked by GPUManager."""
    key = "system.devices"
    allowed = "allowed: auto | cpu | [0,2] (GPU indices) | fake:N | fake:[80GB,40GB,...]"
    if isinstance(spec, (list, tuple, ListConfig)):
        items = list(spec)
        if not items or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items
        ):
            raise ConfigError(
                f"{key}={items!r}: GPU indices must be non-negative integers; {allowed}"
            )
        if len(set(items)) != len(items):
            raise ConfigError(f"{key}={items!r}: duplicate GPU index; {allowed}")
        return
    if not isinstance(spec, str):
        raise ConfigError(f"{key}={spec!r}: {allowed}")
    if spec in ("auto", "cpu"):
        return
    if spec.startswith("fake:"):
        body = spec[5:].strip()
        if body.isdigit() and 1 <= int(body) <= MAX_FAKE_DEVICES:
            return
        if body.startswith("[") and body.endswith("]"):
            parts = [p for p in body[1:-1].split(",") if p.strip()]
            try:
                sizes = [parse_device_memory(p) for p in parts]
            except ValueError as exc:
                raise ConfigError(f"{key}={spec!r}: bad memory size {exc}; {allowed}") from None
            if 0 < len(sizes) <= MAX_FAKE_DEVICES and all(s > 0 for s in sizes):
                return
        raise ConfigError(
            f"{key}={spec!r}: fake devices need a count 1..{MAX_FAKE_DEVICES} or up to "
            f"{MAX_FAKE_DEVICES} sizes; {allowed}"
        )
    if spec.startswith("[") or spec.replace(",", "").strip().isdigit():
        raise ConfigError(f"{key}={spec!r}: write indices as a list, e.g. system.devices=[0,2]")
    raise ConfigError(f"{key}={spec!r}: {allowed}")


log = logging.getLogger(__name__)

DEFAULT_FAKE_MB = 80 * 1024


@dataclass
class Device:
    """One schedulable device: an NVML GPU, a simulated GPU, or a CPU slot."""

    index: int  # position in this run's device list (stable for the run)
    kind: str  # "cuda" | "fake" | "cpu"
    name: str
    uuid: str
    total_mb: int
    free_mb: int
    nvml_index: int | None = None
    utilization: int | None = None  # percent, NVML only
    processes: list[dict] = field(default_factory=list)  # [{"pid":..., "used_mb":...}]

    @property
    def label(self) -> str:
        return f"{'GPU' if self.kind != 'cpu' else 'CPU'} {self.index}"


def _nvml():
    """Import and initialise NVML; None when no NVIDIA driver is present."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError
        log.debug("NVML unavailable: %s", exc)
        return None


def _as_str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def query_nvml_devices() -> list[Device]:
    """Every GPU NVML sees, with memory, utilisation and processes. [] without NVML."""
    nv = _nvml()
    if nv is None:
        return []
    devices = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        try:
            util = int(nv.nvmlDeviceGetUtilizationRates(h).gpu)
        except Exception:
            util = None
        try:
            procs = [
                {"pid": p.pid, "used_mb": int((p.usedGpuMemory or 0) / 2**20)}
                for p in nv.nvmlDeviceGetComputeRunningProcesses(h)
            ]
        except Exception:
            procs = []
        devices.append(
            Device(
                index=i,
                kind="cuda",
                name=_as_str(nv.nvmlDeviceGetName(h)),
                uuid=_as_str(nv.nvmlDeviceGetUUID(h)),
                total_mb=int(mem.total / 2**20),
                free_mb=int(mem.free / 2**20),
                nvml_index=i,
                utilization=util,
                processes=procs,
            )
        )
    return devices


def visible_devices(found: list[Device], visible: str | None) -> list[Device]:
    """The NVML GPUs this process may use: all of them, or those `CUDA_VISIBLE_DEVICES`
    names (a SLURM job's GPUs: SLURM sets it to the job's devices). NVML ignores the
    variable, so `system.devices=auto` applies it here. Entries are UUIDs (`GPU-...`) or
    indices; when NVML sees exactly as many GPUs as are named (a job whose cgroup hides the
    node's other GPUs, where the indices are renumbered) they are all the job's. Indices are
    NVML's (PCI bus) order, which is how SLURM numbers a node's GPUs. Unset: every GPU;
    empty: none (CPU slots), as CUDA itself reads it."""
    if visible is None or not found:
        return found
    names = [v.strip() for v in visible.split(",") if v.strip()]
    if not names or names == ["-1"]:
        return []
    if len(found) == len(names):
        return list(found)
    by_name = {d.uuid: d for d in found} | {str(d.nvml_index): d for d in found}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ConfigError(
            f"CUDA_VISIBLE_DEVICES={visible!r}: names GPUs NVML does not see ({missing}); fix "
            "the variable or set system.devices=[...]"
        )
    chosen = [by_name[n] for n in names]
    for pos, d in enumerate(chosen):
        d.index = pos
    return chosen


def cpu_slot_count(cpu_workers: Any, threads_per_worker: int) -> int:
    """`executor.cpu_workers`: auto = usable cores / threads per worker (at least 1)."""
    if cpu_workers != "auto":
        return int(cpu_workers)
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    return max(1, cores // max(1, threads_per_worker))


def _cpu_slots(n: int) -> list[Device]:
    try:
        import psutil

        avail_mb = int(psutil.virtual_memory().available / 2**20)
    except Exception:
        avail_mb = 8 * 1024
    per = max(1, avail_mb // n)
    return [
        Device(index=i, kind="cpu", name="cpu", uuid=f"cpu-{i}", total_mb=per, free_mb=per)
        for i in range(n)
    ]


def _fake_devices(body: str) -> list[Device]:
    body = body.strip()
    if body.isdigit():
        sizes = [DEFAULT_FAKE_MB] * int(body)
    else:
        sizes = [parse_device_memory(p) for p in body.strip("[]").split(",") if p.strip()]
    return [
        Device(
            index=i,
            kind="fake",
            name=f"Fake GPU ({mb / 1024:.0f} GB)",
            uuid=f"GPU-fake-{i:02d}",
            total_mb=mb,
            free_mb=mb,
        )
        for i, mb in enumerate(sizes)
    ]


class GPUManager:
    """The run's devices, their memory, work splitting and pinning environments."""

    def __init__(
        self, spec: Any = "auto", *, cpu_workers: Any = "auto", threads_per_worker: int = 1
    ):
        if hasattr(spec, "_content") or isinstance(spec, (list, tuple)):
            spec = list(spec)
        validate_devices_spec(spec)
        self.threads_per_worker = threads_per_worker
        self.devices: list[Device] = self._discover(spec, cpu_workers, threads_per_worker)
        # the most devices one task may hold at once (every device: on Ray a gang spans nodes)
        self.largest_gang: int = len(self.devices)

    # ---- discovery ---------------------------------------------------------------------
    @staticmethod
    def _discover(spec: Any, cpu_workers: Any, threads: int) -> list[Device]:
        if isinstance(spec, list):
            found = query_nvml_devices()
            if not found:
                raise ConfigError(
                    f"system.devices={spec}: no NVIDIA GPU found (NVML unavailable); "
                    "use system.devices=cpu or fake:N"
                )
            by_index = {d.nvml_index: d for d in found}
            missing = [i for i in spec if i not in by_index]
            if missing:
                raise ConfigError(
                    f"system.devices={spec}: no GPU with index {missing}; this machine has "
                    f"indices {sorted(i for i in by_index if i is not None)}"
                )
            chosen = [by_index[i] for i in spec]
            for pos, d in enumerate(chosen):
                d.index = pos
            return chosen
        if spec.startswith("fake:"):
            return _fake_devices(spec[5:])
        if spec == "auto":
            found = visible_devices(query_nvml_devices(), os.environ.get("CUDA_VISIBLE_DEVICES"))
            if found:
                return found
        return _cpu_slots(cpu_slot_count(cpu_workers, threads))

    @property
    def kind(self) -> str:
        return self.devices[0].kind

    @property
    def is_gpu(self) -> bool:
        """True for real and simulated GPUs (the scheduler treats both alike)."""
        return self.kind in ("cuda", "fake")

    def refresh(self) -> list[Device]:
        """Re-read free memory, utilisation and processes (NVML GPUs only)."""
        if self.kind != "cuda":
            return self.devices
        current = {d.uuid: d for d in query_nvml_devices()}
        for d in self.devices:
            now = current.get(d.uuid)
            if now is not None:
                d.free_mb, d.utilization, d.processes = now.free_mb, now.utilization, now.processes
        return self.devices

    # ---- pinning ---------------------------------------------------------------------------
    def worker_env(
        self, device_indices: list[int], base: dict[str, str] | None = None
    ) -> dict[str, str]:
        """The explicit environment of a worker pinned to `device_indices`."""
        env = dict(os.environ if base is None else base)
        # A worker owns its W&B service: one inherited from this process (set once it logged
        # a multirun job's results) outlives a killed worker, holding its run id, and the
        # retry's tracker then fails with "run ID is in use" (tests/test_tracking.py).
        env.pop("WANDB_SERVICE", None)
        devs = [self.devices[i] for i in device_indices]
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        if self.kind == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(d.uuid for d in devs)
        elif self.kind == "fake":
            # A UUID no driver knows: on a real GPU box the worker sees no GPU and computes
            # on the CPU, exactly as on a CPU-only machine.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(d.uuid for d in devs)
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
        env["PITA_DEVICE_KIND"] = self.kind
        env["PITA_DEVICE_INDICES"] = ",".join(str(d.index) for d in devs)
        threads = str(self.threads_per_worker)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PITA_TORCH_THREADS"):
            env[var] = threads
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")  # as Worker._setup_torch sets it
        env.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        # pita's trackers log TRL's metrics themselves (report_to="none",
        # pita/training/tracking.py), so transformers' MLflow integration is never used; but
        # with mlflow installed, importing a TRL trainer imports mlflow for it (trl.extras.
        # profiling): about 1 s of CPU in every worker that runs DPO or GRPO.
        env.setdefault("DISABLE_MLFLOW_INTEGRATION", "TRUE")
        return env

    # ---- work splitting ------------------------------------------------------------------
    def capacities(self) -> list[float]:
        """Relative capacity of each device (memory for GPUs, equal for CPU slots)."""
        if self.kind == "cpu":
            return [1.0] * len(self.devices)
        return [float(d.total_mb) for d in self.devices]

    def distribute_work(self, n_items: int, n_parts: int | None = None) -> list[tuple[int, int]]:
        """Split `n_items` into contiguous [start, end) ranges weighted by device capacity.

        Part i is meant for device i (the scheduler prefers it there). Ranges cover every
        item exactly once; empty ranges are dropped when items are fewer than devices.
        """
        caps = self.capacities()
        if n_parts is not None:
            caps = (caps * (n_parts // len(caps) + 1))[:n_parts]
        total = sum(caps)
        bounds, acc = [0], 0.0
        for c in caps:
            acc += c
            bounds.append(round(n_items * acc / total))
        ranges = [(bounds[i], bounds[i + 1]) for i in range(len(caps))]
        return [r for r in ranges if r[1] > r[0]] or [(0, n_items)]

    # ---- reporting -----------------------------------------------------------------------
    def describe(self) -> list[str]:
        return [
            f"{d.label}: {d.name} [{d.uuid}] {d.total_mb / 1024:.2f} GB total, {d.free_mb / 1024:.2f} GB free"
            for d in self.devices
        ]
