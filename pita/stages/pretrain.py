"""pretrain: train the reference policy π_ref from scratch on an offline task.

Teacher forcing on the target tokens only (the prompt positions carry label -100), AdamW
with linear warmup then cosine decay, fresh examples every step from the task's
`pretrain_batch` (goal-walk: random walks that ignore the goal; star graph: the true
path). One pretrain task per (dataset, family) is shared by every chain using them. The
model and its tokenizer are written with `save_pretrained` into `model/`.
"""

from __future__ import annotations

import random

from pita.core.stage import StageContext


def pad_right(rows: list[list[int]], labels: list[list[int]], pad_id: int):
    """Right-padded input ids, attention mask and labels (-100 where no loss)."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (r, y) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        lab[i, : len(y)] = torch.tensor(y)
    return ids, mask, lab


def teacher_forcing_batch(pairs: list[tuple[list[int], list[int]]], pad_id: int):
    """(prompt, target) pairs -> tensors whose loss covers the target tokens only."""
    rows = [p + t for p, t in pairs]
    labels = [[-100] * len(p) + t for p, t in pairs]
    return pad_right(rows, labels, pad_id)


def pretrain(ctx: StageContext) -> dict:
    import torch
    from transformers import get_cosine_schedule_with_warmup

    from pita.datasets import build_task
    from pita.models.tiny import build_tiny_llama

    task = build_task(ctx.task.dataset_cfg)
    tok = task.tokenizer
    arch = ctx.task.family_cfg["reference_arch"]
    pcfg = ctx.cfg.pretrain
    torch.manual_seed(ctx.seed)
    rng = random.Random(ctx.seed)
    sample = task.pretrain_batch(random.Random(0), 1)[0]
    model = build_tiny_llama(len(tok), n_layer=arch["n_layer"], d_model=arch["d_model"], n_head=arch["n_head"],
                             max_position=max(64, 2 * (len(sample[0]) + task.max_new_tokens)),
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=ctx.seed,
                             attn_impl=ctx.cfg.system.attn_impl)
    device = torch.device(ctx.device)
    model.to(device).train()
    optim = torch.optim.AdamW(model.parameters(), lr=pcfg.lr, weight_decay=ctx.cfg.training.weight_decay)
    sched = get_cosine_schedule_with_warmup(optim, pcfg.warmup_steps, pcfg.steps)
    losses = []
    for step in range(pcfg.steps):
        ids, mask, labels = teacher_forcing_batch(task.pretrain_batch(rng, pcfg.batch_size), tok.pad_token_id)
        loss = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        if ctx.cfg.training.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), ctx.cfg.training.max_grad_norm)
        optim.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == pcfg.steps - 1:
            ctx.logger.info("step %d/%d loss %.4f lr %.2e", step + 1, pcfg.steps, losses[-1], sched.get_last_lr()[0])
            ctx.heartbeat(f"step {step + 1}/{pcfg.steps}")
    model.eval()
    model.save_pretrained(ctx.out_dir / "model")
    task.save_tokenizer(str(ctx.out_dir / "model"))
    tail = losses[-20:]
    return {"steps": pcfg.steps, "final_loss": sum(tail) / len(tail),
            "parameters": sum(p.numel() for p in model.parameters())}
