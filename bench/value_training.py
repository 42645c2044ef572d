"""Value-model training throughput: the real `train_value` loop, sequences per second.

    python bench/value_training.py [--size paper|cpu] [--steps 60] [--device auto|cpu|cuda]

Runs `pita.algos.value_training.train_value` (the Q# / PITA value-model training stage) in this
process on star-graph training pairs: `--size paper` is the published setting
(`experiment=star_graph_paper`: G(2,5), N = 50, 6×384 guide warm-started from a 6×384
reference, batch 256; the issue measured 22 steps/s = 5,632 sequences/s on an H100 before
this work), `--size cpu` the CPU experiment's (`experiment=star_graph`, 2×64 models).
Models are built and saved in a temporary folder (nothing downloads). Prints one JSON
object: steps, batch, sequences/s and steps/s over the steps after the first (the
training report's `samples_per_s`), the precision, the device and the wall time.
Run it with PYTHONPATH set to another checkout to compare two versions of the loop.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # PYTHONPATH (another checkout) wins


def prepare(
    run_dir: Path,
    size: str = "cpu",
    steps: int = 60,
    device: str = "cpu",
    n_items: int = 8192,
    overrides: tuple[str, ...] = (),
    gpus: int = 1,
):
    """(a StageContext of a Q# train task in `run_dir` with a saved reference, its items)."""
    from omegaconf import OmegaConf

    from pita.algos.registry import ALGORITHMS
    from pita.core.tasks import TaskSpec
    from pita.datasets import build_task
    from pita.experiment.cli import compose_config
    from pita.experiment.plan import _group_cfg
    from pita.models.tiny import build_tiny_llama
    from pita.runtime.context import ModelCache, StageContext

    experiment, dataset = (
        ("star_graph_paper", "star_graph_d2_l5")
        if size == "paper"
        else ("star_graph", "star_graph")
    )
    cfg = compose_config(
        [
            f"experiment={experiment}",
            f"algos.QSharp.steps={steps}",
            "algos.QSharp.enabled=true",
            *overrides,
        ]
    )
    ds_cfg = _group_cfg(cfg, "dataset", dataset)
    fam_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    task = build_task(ds_cfg)
    tok = task.tokenizer
    rng = random.Random(0)
    examples = task.train_examples()
    items = []
    for i in range(n_items):
        ex = examples[i % len(examples)]
        items.append(
            (list(ex.prompt_ids), list(ex.target_ids), 0, [float(rng.random() < 0.5)], None)
        )

    ref_dir = run_dir / "tasks" / "pretrain" / "model"
    arch = fam_cfg["reference_arch"]
    longest = max(len(p) + len(t) for p, t, *_ in items)
    ref = build_tiny_llama(
        len(tok),
        n_layer=arch["n_layer"],
        d_model=arch["d_model"],
        n_head=arch["n_head"],
        max_position=max(64, 2 * longest),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        seed=0,
    )
    if not (ref_dir / "config.json").is_file():
        ref.save_pretrained(ref_dir)
    task.save_tokenizer(str(ref_dir))
    spec = TaskSpec(
        id="QSharp.bench.tiny.r0.train",
        algo="QSharp",
        algo_schema=ALGORITHMS["QSharp"].schema_path,
        dataset=dataset,
        family="tiny",
        round=0,
        stage="train",
        fn="pita.algos.qsharp:train",
        inputs={"reference": "pretrain"},
        dataset_cfg=ds_cfg,
        family_cfg=fam_cfg,
        gpus=gpus,
    )
    key = str(cfg.training.parallel_strategy)
    if key != "auto":  # the gang the planner gives a training stage
        spec.strategy = key
    out = run_dir / f"out-{gpus}-{time.monotonic_ns()}"
    out.mkdir()
    logger = logging.getLogger("bench.value_training")
    ctx = StageContext(
        task=spec,
        cfg=cfg,
        run_dir=run_dir,
        out_dir=out,
        logger=logger,
        device=device,
        models=ModelCache(2),
    )
    return ctx, items


def run(size: str = "cpu", steps: int = 60, device: str = "auto", n_items: int = 8192) -> dict:
    import torch

    from pita.algos.value_training import train_value

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        ctx, items = prepare(Path(tmp), size, steps, device, n_items)
        t0 = time.perf_counter()
        result = train_value(ctx, items)
        wall = time.perf_counter() - t0
    sps = result.get("samples_per_s")
    return {
        "size": size,
        "device": device,
        "steps": result["steps"],
        "batch": result["batch_size"],
        "unique_sequences": result["unique_sequences"],
        "sequences_per_s": sps,
        "steps_per_s": round(sps / result["batch_size"], 2) if sps else None,
        "precision": result.get("precision"),
        "train_s": result.get("train_s"),
        "wall_s": round(wall, 2),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("paper", "cpu"), default="cpu")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--items", type=int, default=8192)
    args = ap.parse_args()
    print(json.dumps(run(args.size, args.steps, args.device, args.items)))


if __name__ == "__main__":
    main()
