"""bench/scaling.py's profiles: each durations file measures every task the planner builds."""

from __future__ import annotations

import pytest

from bench.scaling import PROFILES, config, durations_for, elastic_plan, measured_seconds
from pita.experiment.run import make_gpu_manager


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_durations_cover_its_plan(name):
    """On fake:8 (collect / evaluate sharded 8 ways) every task of the profile's DAG gets a
    measured duration (a shard its stage's share), none the work-unit fallback: a planner
    change of task ids would otherwise turn the bench's figures into guesses unseen."""
    profile = PROFILES[name]
    cfg = config(8, 8, profile)
    plan = elastic_plan(cfg, make_gpu_manager(cfg), elastic=True)
    measured, _ = measured_seconds(None, profile)
    seconds, unmatched = durations_for(plan, measured, 1.0)
    assert unmatched == 0
    assert len(seconds) == len(plan.tasks)
    assert sum(seconds.values()) == pytest.approx(sum(measured.values()), rel=1e-3)
    assert sum(t.elastic for t in plan.tasks.values()) > 0
