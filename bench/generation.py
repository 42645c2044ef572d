"""Batched generation vs one prompt at a time, same prompts, same run.

    python bench/generation.py [--device cpu] [--batch-size 64] [--n-prompts 256] [--quick]

Prints one JSON object: tokens per second (best of ``--repeats`` interleaved runs each) for
the batched engine (``pita.models.generate`` with ``--batch-size``) and for the loop
baseline (the same engine with batch size 1, i.e. one prompt at a time with a KV cache),
their ratio, and whether both produced the same greedy tokens. The model is a random tiny Llama (built in code, nothing downloads) and
the prompts have mixed lengths, so left padding and length sorting are exercised.

Guided decoding (pita/algos/guidance.py) is timed in the same run at the same batch size:
the same engine with a value-model offset hook (a random value model of `--value-n-layer`
layers, 64 dims, per-vocabulary head, mode `bernoulli`, η = 5, top-k = 2). `guided_ratio` =
guided / unguided tokens per second (target >= 0.5: one extra value forward per step, KV
cache kept; with a value model as large as the reference that extra forward costs as much
as the reference's, so ~0.5 is the ceiling there; the hub families pair a small guide with
a large reference, e.g. 1B with 8B), and
`value_forwards_per_token` = value-model forwards (counted by a forward hook on the module)
per decoding step of a batch (target exactly 1.0).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pita.algos.guidance import hook_factory
from pita.models.generation import generate
from pita.models.tiny import build_tiny_llama, tiny_llama_config
from pita.models.value_model import ValueModel

PAD, BOS, EOS = 0, 1, 2


def _timed(model, prompts, *, batch_size, max_new_tokens, device, hook=None, top_k=0):
    start = time.perf_counter()
    out = generate(
        model,
        prompts,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        pad_token_id=PAD,
        eos_token_id=EOS,
        do_sample=False,
        top_k=top_k,
        offset_hook_factory=hook,
    )
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return out, seconds, sum(len(r) for r in out.responses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--n-prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=40)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--value-n-layer", type=int, default=2, help="value model depth (64 dims)")
    parser.add_argument("--quick", action="store_true", help="64 prompts, 8 new tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="best of N for both (noise)")
    args = parser.parse_args()
    if args.quick:
        args.n_prompts, args.max_new_tokens = min(args.n_prompts, 64), min(args.max_new_tokens, 8)
        args.repeats = 1

    rng = random.Random(args.seed)
    prompts = [
        [BOS] + [rng.randrange(3, args.vocab_size) for _ in range(rng.randrange(4, 32))]
        for _ in range(args.n_prompts)
    ]
    model = build_tiny_llama(
        args.vocab_size,
        n_layer=args.n_layer,
        d_model=args.d_model,
        max_position=64,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        seed=args.seed,
    ).to(args.device)

    # A value model like the tiny family's guide (2 layers, 64 dims by default), random head.
    vconf = tiny_llama_config(
        args.vocab_size,
        n_layer=args.value_n_layer,
        d_model=64,
        n_head=4,
        max_position=64,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    torch.manual_seed(args.seed)
    from transformers import LlamaModel

    value = ValueModel(LlamaModel(vconf), args.vocab_size).to(args.device).eval()
    torch.nn.init.normal_(value.head.weight, std=0.5)
    # The V-type head (candidate appended, scalar read-out): top-k scored per step in one
    # forward over the prefix cache expanded k times.
    torch.manual_seed(args.seed)
    v_value = ValueModel(LlamaModel(vconf), args.vocab_size, head_type="v").to(args.device).eval()
    torch.nn.init.normal_(v_value.head.weight, std=0.5)
    value_forwards = [0]
    value.register_forward_pre_hook(lambda *_: value_forwards.__setitem__(0, value_forwards[0] + 1))

    kw = {"max_new_tokens": args.max_new_tokens, "device": args.device}
    _timed(model, prompts[:4], batch_size=4, **kw)  # warm-up (allocator, kernels)
    # Interleaved repeats, best time of each: both suffer the same background load.
    runs_b, runs_l, runs_u, runs_g, runs_v = [], [], [], [], []
    guided_factory = v_factory = None
    for _ in range(max(1, args.repeats)):
        runs_b.append(_timed(model, prompts, batch_size=args.batch_size, **kw))
        runs_l.append(_timed(model, prompts, batch_size=1, **kw))
        # unguided vs guided at the same batch size and the same top-k
        runs_u.append(_timed(model, prompts, batch_size=args.batch_size, top_k=2, **kw))
        guided_factory = hook_factory(value, 5.0, "bernoulli")
        value_forwards[0] = 0
        runs_g.append(
            _timed(model, prompts, batch_size=args.batch_size, top_k=2, hook=guided_factory, **kw)
        )
        v_factory = hook_factory(v_value, 5.0, "bernoulli", 2)
        runs_v.append(
            _timed(model, prompts, batch_size=args.batch_size, top_k=2, hook=v_factory, **kw)
        )
    batched, batched_s, batched_tokens = min(runs_b, key=lambda r: r[1])
    loop, loop_s, loop_tokens = min(runs_l, key=lambda r: r[1])
    _, unguided_s, unguided_tokens = min(runs_u, key=lambda r: r[1])
    _, guided_s, guided_tokens = min(runs_g, key=lambda r: r[1])
    _, v_s, v_tokens = min(runs_v, key=lambda r: r[1])
    guided_tps, unguided_tps = guided_tokens / guided_s, unguided_tokens / unguided_s

    batched_tps = batched_tokens / batched_s
    loop_tps = loop_tokens / loop_s
    result = {
        "bench": "generation",
        "device": str(args.device),
        "torch_threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "n_prompts": args.n_prompts,
        "prompt_len_min": min(map(len, prompts)),
        "prompt_len_max": max(map(len, prompts)),
        "max_new_tokens": args.max_new_tokens,
        "repeats": max(1, args.repeats),
        "model_params": sum(p.numel() for p in model.parameters()),
        "model": f"tiny llama {args.n_layer}x{args.d_model}, vocab {args.vocab_size}",
        "batched_tokens": batched_tokens,
        "batched_s": round(batched_s, 4),
        "batched_tokens_per_s": round(batched_tps, 1),
        "loop_tokens": loop_tokens,
        "loop_s": round(loop_s, 4),
        "loop_tokens_per_s": round(loop_tps, 1),
        "speedup": round(batched_tps / loop_tps, 2),
        "outputs_match": batched.responses == loop.responses,
        "unguided_tokens_per_s": round(unguided_tps, 1),
        "guided_tokens_per_s": round(guided_tps, 1),
        "guided_ratio": round(guided_tps / unguided_tps, 3),
        "value_forwards_per_token": round(value_forwards[0] / guided_factory.stats.steps, 4),
        "value_model": f"tiny llama {args.value_n_layer}x64 + per-vocabulary head (bernoulli, eta 5, top-k 2)",
        "guided_v_tokens_per_s": round(v_tokens / v_s, 1),
        "guided_v_ratio": round(v_tokens / v_s / unguided_tps, 3),
        # per step: one candidate forward ([B·k, 1] over the expanded cache) + the prompt once
        "v_value_forwards_per_token": round(v_factory.stats.forwards / v_factory.stats.steps, 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
