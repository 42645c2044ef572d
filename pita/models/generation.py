"""Batched generation in token space, with a hook for guided decoding.

Written by hand because ``transformers.generate`` does not give what the experiments need
in one pass: a per-step hook that sees the fed tokens, masks and raw logits (the value
model keeps its own KV cache alongside), the log-prob of each sampled token under *both*
the distribution actually sampled from and the model's own distribution (so KL(π‖π_ref)
costs nothing extra), and no full-vocabulary scores kept across steps.

How a batch is decoded:

- prompts are sorted by length (longest first, so an out-of-memory shows up in the first
  batch), cut into batches of ``batch_size`` and left-padded; results come back in input
  order;
- position ids are computed from the attention mask (``cumsum - 1``), so a left-padded row
  sees exactly the positions it would see alone; the KV cache is the model's own
  (``use_cache=True``) and only the newest token is fed after the first step;
- each step turns the raw next-token logits ℓ into a token in this order (docs/ALGORITHMS.md,
  "Guided decoding"):

  1. candidates: the ``top_k`` largest raw logits (all tokens when ``top_k == 0``);
  2. guidance: ``ℓ + offsets`` from the offset hook (added on the candidates only, *before*
     temperature, so the effective guidance strength is η / T);
  3. temperature: divide by ``temperature``;
  4. nucleus: keep the smallest set of tokens whose probability reaches ``top_p``;
  5. sample (inverse CDF on one uniform draw per row), or argmax when greedy; the draws
     come from ``generator`` (one stream for the whole call) or, with ``row_seeds``, from
     each row's own stream (``row_uniforms``): a row's tokens then depend only on its
     prompt and seed, never on which other prompts share the call or its batch (how a
     sharded stage's results stay the same on any number of devices, pita/models/seeds.py);

- a row that emits EOS is finished: it receives ``pad_token_id`` afterwards, its response
  is cut after the EOS (EOS included), and the loop stops once every row is finished
  (checked every ``EOS_CHECK_EVERY`` steps on an accelerator) or ``max_new_tokens`` is
  reached (``force_full_length`` ignores EOS, for worst-case memory
  probes).

Per step only the sampled token's two log-probs are kept, never a [B, V] tensor.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch


@dataclass
class GenerationOutput:
    """What :func:`generate` returns, one entry per prompt, in input order."""

    responses: list[list[int]]
    """Generated ids, cut after the first EOS (EOS included) unless ``force_full_length``."""
    logprobs: list[list[float]]
    """log π(y_t | s_t) under the distribution actually sampled from (top-k, offsets,
    temperature, top-p applied). For greedy decoding: that distribution's log-prob of the
    argmax token (the greedy policy itself is a point mass)."""
    base_logprobs: list[list[float]]
    """log π_model(y_t | s_t) under the model's unmodified distribution (raw logits,
    temperature 1, no filtering)."""

    def kl(self) -> list[float]:
        """Per-sequence Monte-Carlo KL(π‖π_model) = Σ_t [logprobs - base_logprobs]."""
        return [sum(a) - sum(b) for a, b in zip(self.logprobs, self.base_logprobs)]

    def put(self, rows: Sequence[int], tokens: Any, lps: Any, blps: Any, lengths: Any) -> None:
        """A batch's outputs (in batch order) into the prompts' `rows`, each cut to its
        length."""
        for b, i in enumerate(rows):
            length = lengths[b]
            self.responses[i] = tokens[b][:length]
            self.logprobs[i] = lps[b][:length]
            self.base_logprobs[i] = blps[b][:length]


class OffsetHook(Protocol):
    """Additive logit offsets for guided decoding; one instance per batch (it may keep its
    own KV cache across the steps of that batch).

    Called once per step for the whole batch, finished rows included (their tokens are
    replaced by pad afterwards):

    - ``step_ids``: the ids fed to the model at this step: the left-padded prompts
      ``[B, prompt_len]`` on the first call, then ``[B, 1]``;
    - ``attention_mask``: ``[B, total_len_so_far]`` (0 on left padding);
    - ``position_ids``: as fed to the model, same shape as ``step_ids``;
    - ``logits``: the model's raw next-token logits ``[B, V]`` in fp32.

    Returns offsets ``[B, V]`` added to the logits (only the top-k candidates matter when
    ``top_k > 0``; those are ``torch.topk(logits, top_k)``), or None for no offset.
    """

    def __call__(
        self,
        step_ids: torch.LongTensor,
        attention_mask: torch.LongTensor,
        position_ids: torch.LongTensor,
        logits: torch.FloatTensor,
    ) -> torch.FloatTensor | None: ...


# --- helpers shared with sequence scoring -------------------------------------------------


def model_device(model: torch.nn.Module) -> torch.device:
    """The device inputs go to (the first parameter's for device-mapped models)."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - exotic wrappers
        return False


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over the real tokens of each row; padding gets 0 (it is masked anyway)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def _check_prompts(
    prompts: Sequence[Sequence[int]], row_seeds: Sequence[int] | None = None, generator: Any = None
) -> None:
    """No empty prompt; `row_seeds`, when given, one per prompt and no `generator` beside."""
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; a prompt needs at least one token (e.g. BOS)")
    n = len(prompts)
    if row_seeds is not None and (generator is not None or len(row_seeds) != n):
        raise ValueError(
            f"row_seeds: one seed per prompt ({len(row_seeds)} for {n}), and no generator"
        )


# --- token selection ----------------------------------------------------------------------


def _top_p_mask(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """True for tokens outside the nucleus: the smallest set whose probability >= top_p."""
    sorted_scores, sorted_idx = scores.sort(dim=-1, descending=True)
    probs = sorted_scores.softmax(dim=-1)
    # Remove a token when the mass strictly before it already reaches top_p; the most
    # likely token always survives (mass before it is 0).
    remove_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
    return remove_sorted.scatter(-1, sorted_idx, remove_sorted)


def row_uniforms(seeds: Sequence[int], steps: int, device: torch.device) -> torch.Tensor:
    """[B, steps] float64 uniforms in [0, 1), row b drawn from its own CPU generator seeded
    with ``seeds[b]``: step t of a row uses column t whatever else is in its batch. Drawn
    once per batch and moved to ``device`` in one copy."""
    out = torch.empty(len(seeds), steps, dtype=torch.float64)
    gen = torch.Generator(device="cpu")
    for b, seed in enumerate(seeds):
        gen.manual_seed(int(seed))
        torch.rand(steps, generator=gen, dtype=torch.float64, out=out[b])
    crosses = device.type == "cuda"
    return (out.pin_memory() if crosses else out).to(device, non_blocking=crosses)


def _sample(
    probs: torch.Tensor, generator: torch.Generator | None, u: torch.Tensor | None = None
) -> torch.Tensor:
    """One draw per row by inverse CDF, on the uniforms ``u`` [B, 1] when given, else from
    ``generator``; the generator may live on another device than ``probs`` (only B
    uniforms cross), which keeps a CPU generator reproducible on GPU."""
    if u is None:
        rand_device = generator.device if generator is not None else probs.device
        crosses = rand_device.type == "cpu" and probs.device.type == "cuda"
        # a pinned source lets the copy run asynchronously: no host round trip per token
        u = torch.rand(
            probs.shape[0],
            1,
            generator=generator,
            device=rand_device,
            dtype=torch.float64,
            pin_memory=crosses,
        ).to(probs.device, non_blocking=crosses)
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    # u < 1, but u * total may round up to total; stay strictly below so the draw lands on
    # a token with positive probability (cdf jumps there).
    v = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    tok = torch.searchsorted(cdf, v, right=True).squeeze(1)
    return tok.clamp_(max=probs.shape[-1] - 1)


def rule_scores(
    logits: torch.Tensor,
    offsets: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Raw logits [..., V] -> the scores the sampling rule draws from (steps 1-4 of the
    module docstring: top-k candidates, offsets, temperature, nucleus); -inf off the support."""
    scores = logits
    if 0 < top_k < logits.shape[-1]:
        cand = logits.topk(top_k, dim=-1).indices
        scores = torch.full_like(logits, float("-inf")).scatter(-1, cand, logits.gather(-1, cand))
    if offsets is not None:
        scores = scores + offsets.to(device=scores.device, dtype=scores.dtype)
    if temperature != 1.0:
        scores = scores / temperature
    if top_p < 1.0:
        scores = scores.masked_fill(_top_p_mask(scores, top_p), float("-inf"))
    return scores


def select_tokens(
    logits: torch.Tensor,
    offsets: torch.Tensor | None,
    *,
    do_sample: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, log-prob under the processed distribution, log-prob under raw logits), each
    [B], from raw fp32 logits [B, V]; see the module docstring for the order of steps.
    ``uniforms`` [B, 1]: this step's draw per row (instead of ``generator``)."""
    base_logp = logits.log_softmax(dim=-1)
    scores = rule_scores(logits, offsets, temperature=temperature, top_k=top_k, top_p=top_p)
    logp = scores.log_softmax(dim=-1)
    tok = _sample(logp.exp(), generator, uniforms) if do_sample else scores.argmax(dim=-1)
    idx = tok.unsqueeze(-1)
    return tok, logp.gather(-1, idx).squeeze(-1), base_logp.gather(-1, idx).squeeze(-1)


# --- generation ---------------------------------------------------------------------------


EOS_CHECK_EVERY = 8
"""On an accelerator the decode loop reads "is every row finished?" back only every this
many steps: each read stalls the host until the device has drained its queue, so reading
per token serialises kernel launches with execution (tiny models are launch-bound). The
price is at most EOS_CHECK_EVERY - 1 wasted steps per batch, whose tokens are padding and
are cut by the row lengths. On CPU the read is free and the loop stops at once, so CPU
outputs (and the generator's stream) are exactly as with a per-token check."""


def eos_check_every(device: torch.device) -> int:
    """Steps between reads of "is every row finished?" (see EOS_CHECK_EVERY)."""
    return 1 if device.type == "cpu" else EOS_CHECK_EVERY


def _pad(
    rows: Sequence[Sequence[int]], pad_token_id: int, device: torch.device, left: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ids and their attention mask: left-padded (prompts, so every row's next token
    is the last column) or right-padded (responses after their prompts)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        if len(r):
            cols = slice(width - len(r), width) if left else slice(0, len(r))
            ids[b, cols] = torch.as_tensor(r, dtype=torch.long)
            mask[b, cols] = 1
    return ids.to(device), mask.to(device)


def _check_sampling(
    batch_size: int, max_new_tokens: int, temperature: float, top_k: int, top_p: float
) -> None:
    """One clear ValueError for a sampling setting `generate` cannot honour."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: must be > 0 (use do_sample=False)")
    if top_k < 0:
        raise ValueError(f"top_k={top_k}: must be >= 0 (0 disables it)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p}: must be in (0, 1]")


def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    batch_size: int,
    pad_token_id: int,
    eos_token_id: int | Sequence[int],
    do_sample: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    row_seeds: Sequence[int] | None = None,
    offset_hook_factory: Callable[[], OffsetHook] | None = None,
    force_full_length: bool = False,
    on_batch: Callable[[int], None] | None = None,
) -> GenerationOutput:
    """Generate a continuation for every prompt (token ids in, token ids out).

    ``eos_token_id`` may be a list (e.g. Llama 3's several end tokens). Sampling draws
    from ``generator`` (seed it for reproducible samples), or with ``row_seeds`` (one per
    prompt) from each prompt's own stream, so a prompt's sample does not depend on the
    other prompts of the call (:func:`row_uniforms`). ``offset_hook_factory`` is
    called once per batch; see :class:`OffsetHook`. ``on_batch(done)`` is called after
    each batch with the number of prompts done (a stage's progress report).
    """
    n = len(prompts)
    _check_sampling(batch_size, max_new_tokens, temperature, top_k, top_p)
    _check_prompts(prompts, row_seeds, generator)
    out = GenerationOutput([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)])
    if n == 0 or max_new_tokens == 0:
        return out
    device = model_device(model)
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    one_batch = partial(
        _generate_batch,
        model,
        keep={"logits_to_keep": 1} if _accepts_logits_to_keep(model) else {},
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
        eos=torch.as_tensor(eos_ids, device=device),
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
        force_full_length=force_full_length,
    )
    order = sorted(range(n), key=lambda i: -len(prompts[i]))
    with _eval_mode(model), torch.inference_mode():
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            hook = offset_hook_factory() if offset_hook_factory is not None else None
            seeds = [row_seeds[i] for i in idx] if row_seeds is not None and do_sample else None
            uniforms = row_uniforms(seeds, max_new_tokens, device) if seeds is not None else None
            out.put(idx, *one_batch([prompts[i] for i in idx], hook=hook, uniforms=uniforms))
            if on_batch is not None:
                on_batch(min(n, start + batch_size))
    return out


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode for the body, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _generate_batch(
    model: torch.nn.Module,
    rows: list[list[int]],
    *,
    hook: OffsetHook | None,
    keep: dict[str, int],
    max_new_tokens: int,
    pad_token_id: int,
    eos: torch.Tensor,
    do_sample: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
    uniforms: torch.Tensor | None,
    force_full_length: bool,
) -> tuple[list[list[int]], list[list[float]], list[list[float]], list[int]]:
    """Decode one left-padded batch; returns per-row tokens, log-probs and lengths.
    ``uniforms`` [B, max_new_tokens]: the rows' own draws (column t at step t)."""
    device = eos.device
    check_every = eos_check_every(device)
    step_ids, attn = _pad(rows, pad_token_id, device)
    pos = position_ids_from_mask(attn)
    n_rows = len(rows)
    finished = torch.zeros(n_rows, dtype=torch.bool, device=device)
    lengths = torch.full((n_rows,), max_new_tokens, dtype=torch.long, device=device)
    pad = torch.full((n_rows,), pad_token_id, dtype=torch.long, device=device)
    ones = torch.ones((n_rows, 1), dtype=attn.dtype, device=device)
    tokens, lps, blps = [], [], []
    cache = None
    select = partial(
        select_tokens,
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
    )
    for t in range(max_new_tokens):
        logits, cache = _last_logits(model, step_ids, attn, pos, cache, keep)
        offsets = hook(step_ids, attn, pos, logits) if hook is not None else None
        draws = uniforms[:, t : t + 1] if uniforms is not None else None
        tok, lp, blp = select(logits, offsets, uniforms=draws)
        tok = torch.where(finished, pad, tok)
        tokens.append(tok)
        lps.append(lp)
        blps.append(blp)
        if not force_full_length:
            hit = ~finished & torch.isin(tok, eos)
            lengths = torch.where(hit, t + 1, lengths)
            finished |= hit
            if (t + 1) % check_every == 0 and bool(finished.all()):
                break
        if t + 1 < max_new_tokens:
            step_ids = tok.unsqueeze(-1)
            attn = torch.cat([attn, ones], dim=-1)
            pos = pos[:, -1:] + 1
    tokens, lps, blps = (torch.stack(x, dim=1).tolist() for x in (tokens, lps, blps))
    return tokens, lps, blps, lengths.tolist()


def _last_logits(
    model: torch.nn.Module,
    step_ids: torch.Tensor,
    attn: torch.Tensor,
    pos: torch.Tensor,
    cache: Any,
    keep: dict[str, int],
) -> tuple[torch.Tensor, Any]:
    """One decoding step's forward: the last position's logits (fp32) and the KV cache."""
    fwd = model(
        input_ids=step_ids,
        attention_mask=attn,
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        **keep,
    )
    return fwd.logits[:, -1, :].float(), fwd.past_key_values


def forced_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    batch_size: int,
    pad_token_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[list[list[float]], list[list[float]]]:
    """Teacher-forced (log-probs under the sampling rule, the model's own log-probs) of
    every response token: the evaluation's two KL references (π_ref under the row's rule,
    π_ref untruncated) from one pass.

    One forward per batch of ``batch_size`` pairs. Each row is laid out as
    ``[pad…][prompt][response][pad…]`` with the prompts' ends aligned, exactly as
    :func:`generate` feeds them, so both give the same numbers up to float rounding.
    ``temperature`` / ``top_k`` / ``top_p``: the log-probs of the model *under that sampling
    rule* (what :func:`generate` reports as ``logprobs`` for the same rule without offsets);
    a token outside the rule's support gets -inf. The defaults give the model's own log-probs.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    _check_prompts(prompts)
    n = len(prompts)
    result: list[list[float]] = [[] for _ in range(n)]
    raw: list[list[float]] = [[] for _ in range(n)]
    device = model_device(model)
    supports_keep = _accepts_logits_to_keep(model)
    order = sorted(range(n), key=lambda i: -len(prompts[i]))
    rule = partial(rule_scores, temperature=temperature, top_k=top_k, top_p=top_p)
    with _eval_mode(model), torch.inference_mode():
        for start in range(0, n, batch_size):
            idx = [i for i in order[start : start + batch_size] if len(responses[i])]
            if not idx:
                continue
            r_max = max(len(responses[i]) for i in idx)
            ids, mask, resp_ids = _joined(prompts, responses, idx, pad_token_id, device)
            # Logits at columns P-1 .. P+R-2 predict the R response tokens.
            extra = {"logits_to_keep": r_max + 1} if supports_keep else {}
            logits = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=position_ids_from_mask(mask),
                use_cache=False,
                **extra,
            ).logits[:, -(r_max + 1) : -1]
            for b, i in enumerate(idx):  # fp32 log-softmax one row at a time: bounded memory
                length, targets = len(responses[i]), resp_ids[b, : len(responses[i]), None]
                row_logits = logits[b, :length].float()
                row = rule(row_logits).log_softmax(dim=-1)
                result[i] = row.gather(-1, targets).squeeze(-1).tolist()
                raw[i] = row_logits.log_softmax(dim=-1).gather(-1, targets).squeeze(-1).tolist()
            del logits
    return result, raw


def _joined(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    idx: list[int],
    pad_token_id: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, response ids) of rows `idx`: each prompt left-padded, then its
    response right-padded, so every response starts in the same column."""
    prompt_ids, prompt_mask = _pad([prompts[i] for i in idx], pad_token_id, device)
    resp_ids, resp_mask = _pad([responses[i] for i in idx], pad_token_id, device, left=False)
    ids = torch.cat([prompt_ids, resp_ids], dim=1)
    return ids, torch.cat([prompt_mask, resp_mask], dim=1), resp_ids
