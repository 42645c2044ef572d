"""Copycat's one stage: a plain function of the StageContext (as pita's own stages)."""

import shutil

from pita.core.paths import Artifact
from pita.runtime.context import StageContext


def copy_reference(ctx: StageContext) -> dict:
    """Save π_ref (the run's pretrained model folder) as this round's policy: evaluate then
    samples it like any trained policy, so Copycat's rows must match the reference's."""
    shutil.copytree(ctx.reference_model(), ctx.out_dir / Artifact.MODEL)
    ctx.logger.info("copied %s", ctx.reference_model())
    return {"copied_from": ctx.reference_model()}
