"""The task DAG: `Plan` holds TaskSpecs in topological (insertion) order.

Built by the planner (pita/experiment/plan.py), saved as the run folder's `plan.json`,
read back on resume, and walked by the scheduler (pita/core/parallel_executor.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pita.core.tasks import TaskSpec


@dataclass
class Plan:
    tasks: dict[str, TaskSpec] = field(default_factory=dict)  # insertion order is topological

    def add(self, task: TaskSpec) -> TaskSpec:
        if task.id in self.tasks:
            raise ValueError(f"duplicate task id {task.id}")
        missing = [d for d in task.deps if d not in self.tasks]
        assert not missing, f"{task.id} depends on unplanned {missing}"
        self.tasks[task.id] = task
        return task

    def dependants(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {tid: [] for tid in self.tasks}
        for t in self.tasks.values():
            for d in t.deps:
                out[d].append(t.id)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"tasks": [t.to_dict() for t in self.tasks.values()]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        plan = cls()
        for d in data["tasks"]:
            plan.add(TaskSpec.from_dict(d))
        return plan

    @classmethod
    def load(cls, path: Path) -> Plan:
        """The plan a run saved; a file pita did not write is a ConfigError (exit 2)."""
        from pita.core.errors import ConfigError
        from pita.core.safe_files import read_control_text

        try:
            return cls.from_json(json.loads(read_control_text(path)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"{path}: not a plan pita wrote ({type(exc).__name__}: {exc})"
            ) from None


def critical_path_priorities(plan: Plan) -> None:
    """priority = the longest chain of work from a task to the end of the DAG."""
    dependants = plan.dependants()
    for tid in reversed(list(plan.tasks)):
        t = plan.tasks[tid]
        t.priority = t.work + max((plan.tasks[d].priority for d in dependants[tid]), default=0.0)
