"""Rank 0's host memory during a checkpoint save: gathered (FullState) vs sharded (DCP).

    python bench/checkpoint_memory.py [--layers 12] [--hidden 1024] [--vocab 32000] [--ranks 2]

A Llama built from its config in code (nothing downloads; the defaults: 12 layers, width
1024, a 32k vocabulary, untied: ~220 M parameters, the size of a local family's model) is
sharded with FSDP2 over `--ranks` gloo ranks (`fake:2` on CPU), trained one AdamW step (so
the optimizer holds its two moments), then checkpointed once through pita's
`Checkpointer` as a training loop does (`CheckpointPlan.objects`), in a fresh gang per
mode:

- `gathered`: `FullState` (every shard gathered; rank 0 holds the full model and optimizer
  state on the host, encodes it and writes `tensors.safetensors`);
- `sharded`: `ShardedState` (each rank writes the shards it holds through DCP's
  safetensors storage; rank 0 writes its own shards and the JSON).

How rank 0's peak is measured: its resident set size (RSS) just before the save, then the
kernel's high-water mark of the RSS over the save, reset right before it (writing 5 to
/proc/self/clear_refs resets `VmHWM`; read from /proc/self/status after). The figure is
the peak minus the RSS before: what the save itself added (the model and optimizer,
resident in both modes, are not counted). A sampler thread reading /proc/self/statm every
5 ms gives a second figure (it can miss a short peak; the high-water mark cannot). Each
mode runs in a fresh gang, so memory freed by one save is never reused by the other.

Prints ONE JSON object: per mode, rank 0's `peak_mb` (the high-water mark) and
`peak_added_mb` (both methods), the RSS before, the save's wall time and the checkpoint's
bytes and files on disk; `state_mb` (the full model + optimizer state, what a gathered save
holds at least), and the target check: `sharded_over_state_per_rank` = the sharded save's
added peak / (`state_mb` / k), target <= 1.10 (and the same over the gathered save's
measured added peak / k: `sharded_over_gathered_per_rank`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MB = 1 << 20


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _rss() -> int:
    """This process's resident set size in bytes (/proc/self/statm)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Sampler:
    """The largest RSS seen every 5 ms while running (a second method beside VmHWM)."""

    def __init__(self):
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _build(args: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args["vocab"],
        hidden_size=args["hidden"],
        intermediate_size=args["hidden"] * 11 // 4,
        num_hidden_layers=args["layers"],
        num_attention_heads=args["hidden"] // 64,
        num_key_value_heads=args["hidden"] // 64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _rank(dist, mode: str, args: dict, folder: str) -> dict:
    """One rank: FSDP2 model, one AdamW step, one checkpoint save measured on rank 0."""
    import torch

    from pita.core.parallel import Gang, Strategy
    from pita.training.checkpoint import CheckpointPlan
    from pita.training.ddp import apply_gang

    dist.gang = Gang(Strategy.FSDP, dist.world_size)
    model = _build(args)
    params = sum(p.numel() for p in model.parameters())
    apply_gang(model, dist)  # fp32 on the CPU
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args["vocab"], (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    plan = CheckpointPlan(Path(folder), every_steps=1, by_name=True, sharded=mode == "sharded")
    ckpt = plan.checkpointer(writer=dist.is_main, collective=True)
    saved_model, saved_optim = plan.objects(model, optim)
    dist.barrier()
    before = _rss()
    hwm = Path("/proc/self/clear_refs")
    try:
        hwm.write_text("5")  # reset VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    t0 = time.perf_counter()
    with _Sampler() as sampler:
        ckpt.maybe_save(1, lambda: {"model": saved_model, "optimizer": saved_optim})
    wall = time.perf_counter() - t0
    peak = _status_kb("VmHWM") * 1024 if reset else None
    dist.barrier()
    return {
        "parameters": params,
        "rss_before_mb": round(before / MB, 1),
        "peak_mb": round(peak / MB, 1) if peak is not None else None,
        "peak_added_mb": round((peak - before) / MB, 1) if peak is not None else None,
        "peak_added_mb_sampled": round((sampler.peak - before) / MB, 1),
        "save_s": round(wall, 2),
    }


def _mode(mode: str, args: dict, k: int) -> dict:
    from pita.training.ddp import launch_ranks

    with tempfile.TemporaryDirectory(prefix="pita-ckpt-mem-") as tmp:
        from bench.checkpoint_memory import _rank as entry  # importable by the ranks

        results = launch_ranks(entry, k, (mode, args, tmp), device_type="cpu")
        files = [p for p in Path(tmp).rglob("*") if p.is_file()]
        return {
            **results[0],
            "disk_mb": round(sum(p.stat().st_size for p in files) / MB, 1),
            "files": len(files),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ranks", type=int, default=2)
    ns = parser.parse_args()
    args = {"layers": ns.layers, "hidden": ns.hidden, "vocab": ns.vocab}
    modes = {m: _mode(m, args, ns.ranks) for m in ("sharded", "gathered")}
    params = modes["sharded"]["parameters"]
    state_mb = params * 4 * 3 / MB  # fp32 weights + AdamW's two moments
    sharded = modes["sharded"]["peak_added_mb"]
    out = {
        "model": {**args, "parameters": params},
        "ranks": ns.ranks,
        "state_mb": round(state_mb, 1),
        "modes": modes,
        # the target: sharded <= 1/k of the gathered state + 10 %
        "sharded_over_state_per_rank": round(sharded / (state_mb / ns.ranks), 3),
        "sharded_over_gathered_per_rank": round(
            sharded / (modes["gathered"]["peak_added_mb"] / ns.ranks), 3
        ),
        "target": "<= 1.10",
        "load": os.getloadavg()[0],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
