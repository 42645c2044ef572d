"""The value / preference model of value-guided decoding (Q#, PITA, Q#-HF).

A causal backbone (the family's guide: a tiny Llama for `model=tiny`, a hub base model
otherwise) and a linear head, of one of two types (`algos.<NAME>.value_head`):

- `q` (Q-type, the default): at every position t, one value *per vocabulary entry*: the
  value of appending token a to the prefix s_t, Q(s, a) = w_a·h(s) + b_a. One forward of
  the prefix scores every candidate of the next step; the candidate never enters the
  backbone, so judging a token means planning *backwards* from the prefix.
- `v` (V-type, the official Q# star-graph classifier): the candidate token is appended and
  a scalar head reads the value at the candidate's own position, V(s, a) = w·h(s + a) + b.
  Judging the first step of a star graph then becomes forward verification from the
  candidate (follow its edges to the goal), the lookup the reference already learned.
  Guided decoding scores π_ref's top-k candidates in one batched forward over the prefix's
  KV cache expanded k times (pita/algos/guidance.py, `score_candidates` here).

Training reads both the same way (`action_values`): column t of the result is the value
of token t+1 in the state of tokens 0..t, so the losses and targets do not care which
head produced it.

Head outputs of the Q-type head, shape [B, T, V, M] (the V-type head: [B, T, 1, M], the
value of the token at each position):

- M = 1 (losses `bce`, `mse`, `bradley_terry`): a logit; p = σ(logit) is P(correct | s, a)
  for Q# and P(continuation ≻ reference | s, a) for PITA;
- M = num_atoms (loss `mle`): logits of a pmf over the atoms z_1..z_M, evenly spaced on
  [V_min, V_max] (the distributional value of Q#).

The head is zero-initialised: every candidate gets the same value, so an untrained guide
adds the same offset to every token and leaves π_ref unchanged (PITA's round 0).

Memory: the Q-type head has d·V·M weights and the per-step output is [B, V, M]. That is
nothing for the offline tasks (V ≈ 25) and fine for M = 1 on hub vocabularies (gpt2:
768·50k ≈ 39M weights), but an `mle` head over a 128k vocabulary is billions of weights:
use the V-type head there (d·M weights; per step a [B·k, 1] forward over the shared cache).

Where it starts (`algos.<NAME>.init`, `value_init`): `reference` (tiny family: the
reference's token embeddings, its blocks and final norm copied into the guide backbone
when the widths match; the prototype only learned the goal-walk value function within the
CPU budget that way, docs/ALGORITHMS.md; hub/local families: π_ref's own weights),
`base` (the family's guide checkpoint with a fresh head: the official Q# star-graph
classifier is text-pretrained GPT-2, not π_ref) or `scratch` (random weights). Unset, the
old `warm_start` key decides for the tiny family and hub families load their guide.

Checkpoints: `value_model/model.safetensors` (state dict) + `value_model/config.json`
(backbone config + head settings); no pickle anywhere.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pita.core.schema import VALUE_HEADS as HEAD_TYPES
from pita.core.schema import VALUE_INITS as INITS  # where a value model starts (one list)
from pita.core.schema import ValueGuidedConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class ValueOutput:
    values: torch.Tensor
    """[B, T, V, M] head outputs (logits; atom logits when M > 1)."""
    past_key_values: Any = None


SMALL_HEAD = 4096  # V·M at or below which values_at runs the dense head


class ValueModel(nn.Module):
    """Backbone (any HF base model returning `last_hidden_state`) + a Q-type (per-vocabulary)
    or V-type (scalar, read at the candidate's position) head; see the module docstring."""

    def __init__(
        self,
        backbone: nn.Module,
        vocab_size: int,
        *,
        num_atoms: int = 1,
        v_min: float = 0.0,
        v_max: float = 1.0,
        loss_type: str = "bce",
        head_type: str = "q",
    ):
        super().__init__()
        if head_type not in HEAD_TYPES:
            raise ValueError(f"value_head={head_type!r}: allowed: {' | '.join(HEAD_TYPES)}")
        self.backbone = backbone
        self.vocab_size = int(vocab_size)
        self.num_outputs = int(num_atoms)
        self.v_min, self.v_max, self.loss_type = float(v_min), float(v_max), loss_type
        self.head_type = head_type
        hidden = backbone.config.hidden_size
        width = self.vocab_size if head_type == "q" else 1
        self.head = nn.Linear(hidden, width * self.num_outputs)
        nn.init.zeros_(self.head.weight)  # untrained guide = no guidance (see module docstring)
        nn.init.zeros_(self.head.bias)

    @property
    def atoms(self) -> torch.Tensor:
        """z_1..z_M evenly spaced on [V_min, V_max] (M = 1: the single value V_max)."""
        device = self.head.weight.device
        if self.num_outputs == 1:
            return torch.tensor([self.v_max], device=device)
        return torch.linspace(self.v_min, self.v_max, self.num_outputs, device=device)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = False,
        last_only: bool = False,
    ) -> ValueOutput:
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state
        if last_only:  # decoding: only the newest position is scored
            hidden = hidden[:, -1:]
        width = self.vocab_size if self.head_type == "q" else 1
        values = self.head(hidden).view(*hidden.shape[:2], width, self.num_outputs)
        return ValueOutput(values, out.past_key_values if use_cache else None)

    def action_values(
        self,
        ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        alt: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Training read-out: ([B, T−1, M] value of token t+1 in state ids[:, :t+1], the same
        for the competing tokens `alt` [B, T−1] or None). Q-type: one forward of ids[:, :-1],
        rows of the head gathered; V-type: one forward of ids, the head read at positions
        1..T−1 (each token's own position). V-type cannot score `alt` tokens without a
        forward per alternative: it refuses them (config validation says so earlier)."""
        if self.head_type == "q":
            mask = attention_mask[:, :-1] if attention_mask is not None else None
            hidden = self.hidden(ids[:, :-1], mask)
            return self.values_at(hidden, ids[:, 1:]), (
                self.values_at(hidden, alt) if alt is not None else None
            )
        if alt is not None:
            raise ValueError(
                "value_head=v cannot score competing tokens (loss_type=bradley_terry): use value_head=q"
            )
        hidden = self.hidden(ids, attention_mask)[:, 1:]
        return self.head(hidden).view(*hidden.shape[:2], self.num_outputs), None

    def score_candidates(
        self,
        cache: Any,
        candidates: torch.Tensor,
        attention_mask: torch.Tensor,
        next_position: torch.Tensor,
    ) -> tuple[torch.Tensor, Any]:
        """V-type decoding: the values [B, k, M] of k candidate tokens per row, appended to
        each row's prefix, in ONE batched forward of [B·k, 1] tokens over the prefix's KV
        cache repeated k times (row b's candidates are rows b·k..b·k+k−1).

        `cache`: the prefix's cache, B rows (consumed: it is expanded in place);
        `attention_mask`: [B, prefix_len] (0 on left padding); `next_position`: [B], the
        position id of the candidates. Returns the values and the expanded cache, whose
        row b·k+j ends with candidate j (guidance keeps the sampled one's row)."""
        b, k = candidates.shape
        cache.batch_repeat_interleave(k)
        mask = torch.cat(
            [attention_mask, attention_mask.new_ones((b, 1))], dim=-1
        ).repeat_interleave(k, dim=0)
        out = self.backbone(
            input_ids=candidates.reshape(b * k, 1),
            attention_mask=mask,
            position_ids=next_position.reshape(b, 1).repeat_interleave(k, dim=0),
            past_key_values=cache,
            use_cache=True,
        )
        values = self.head(out.last_hidden_state[:, -1]).view(b, k, self.num_outputs)
        return values, out.past_key_values

    def hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The backbone's last hidden states [B, T, d] (training; no cache)."""
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def values_at(self, hidden: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """[B, T, M]: the head's output at each position t for the one token actions[b, t]
        only. Hub vocabularies: gathers those rows of the head instead of materialising
        [B, T, V, M]. Small task vocabularies (V·M <= SMALL_HEAD): the dense head and a gather
        of its output, one GEMM instead of a gather of B·T·M·d weights and its scatter-add
        backward."""
        if (
            self.vocab_size * self.num_outputs <= SMALL_HEAD
        ):  # task vocabularies: one matmul, then pick
            every = self.head(hidden).view(
                *hidden.shape[:2], self.vocab_size, self.num_outputs
            )  # [B, T, V, M]
            index = actions[..., None, None].expand(*actions.shape, 1, self.num_outputs)
            return every.gather(2, index).squeeze(2)
        weight = self.head.weight.view(self.vocab_size, self.num_outputs, -1)[
            actions
        ]  # [B, T, M, d]
        bias = self.head.bias.view(self.vocab_size, self.num_outputs)[actions]  # [B, T, M]
        return torch.einsum("btd,btmd->btm", hidden, weight) + bias

    # --- checkpoints ---------------------------------------------------------------------

    def config_dict(self) -> dict:
        return {
            "format": "pita-value-model/1",
            "backbone": self.backbone.config.to_dict(),
            "vocab_size": self.vocab_size,
            "num_atoms": self.num_outputs,
            "V_min": self.v_min,
            "V_max": self.v_max,
            "loss_type": self.loss_type,
            "head_type": self.head_type,
        }

    def save(self, folder: str | Path, state: dict[str, torch.Tensor] | None = None) -> Path:
        """Weights and config into `folder`; `state`: the full state dict when this model's
        own is sharded (FSDP2 gathers it on every rank: `pita.training.ddp.full_state_dict`)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {
            k: v.detach().contiguous().cpu()
            for k, v in (self.state_dict() if state is None else state).items()
        }
        save_file(state, str(folder / WEIGHTS_NAME))
        return self.save_config(folder)

    def save_config(self, folder: str | Path) -> Path:
        """The config beside weights written elsewhere (`pita.training.shards.save_consolidated`)."""
        folder = Path(folder)
        (folder / CONFIG_NAME).write_text(json.dumps(self.config_dict(), indent=2))
        return folder

    @classmethod
    def load(
        cls, folder: str | Path, device: str | torch.device = "cpu", attn_impl: str | None = None
    ) -> ValueModel:
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / WEIGHTS_NAME).is_file():
            raise FileNotFoundError(f"{folder}: no {WEIGHTS_NAME}; not a value-model checkpoint")
        model = cls.from_config(json.loads((folder / CONFIG_NAME).read_text()), attn_impl=attn_impl)
        model.load_state_dict(load_file(str(folder / WEIGHTS_NAME)))
        return model.to(device).eval()

    @classmethod
    def from_config(cls, cfg: dict, attn_impl: str | None = None) -> ValueModel:
        from transformers import AutoConfig, AutoModel

        bb = dict(cfg["backbone"])
        config = AutoConfig.for_model(bb.pop("model_type"), **bb)
        if attn_impl is not None:
            config._attn_implementation = attn_impl
        backbone = AutoModel.from_config(config).to(torch.float32)
        return cls(
            backbone,
            cfg["vocab_size"],
            num_atoms=cfg["num_atoms"],
            v_min=cfg["V_min"],
            v_max=cfg["V_max"],
            loss_type=cfg.get("loss_type", "bce"),
            head_type=cfg.get("head_type", "q"),
        )


def head_atoms(loss_type: str, num_atoms: int) -> int:
    """Outputs per vocabulary entry: num_atoms for `mle`, else one logit."""
    return int(num_atoms) if loss_type == "mle" else 1


def value_init(algo_cfg: ValueGuidedConfig, family_cfg: Mapping[str, Any]) -> str:
    """Where a fresh value model starts (`algos.<NAME>.init`): `reference` (a copy of π_ref),
    `base` (the family's guide checkpoint with a fresh head, the official Q# classifier) or
    `scratch` (random weights). Unset: the old keys' meaning, unchanged: the tiny family
    follows `warm_start` (true: reference, false: scratch), hub and local families load
    their guide (base)."""
    from pita.models.catalog import resolve_family

    init = algo_cfg.init
    if init:
        if init not in INITS:
            raise ValueError(f"init={init!r}: allowed: {' | '.join(INITS)}")
        return str(init)
    family = resolve_family(family_cfg["name"], family_cfg)
    if family.is_builtin:
        return "reference" if algo_cfg.warm_start else "scratch"
    return "base"


def build_value_model(
    reference: nn.Module,
    family_cfg: Mapping[str, Any],
    algo_cfg: ValueGuidedConfig,
    *,
    vocab_size: int,
    seed: int = 0,
    attn_impl: str = "eager",
    logger: Any = None,
) -> ValueModel:
    """A fresh value model, started as `value_init` says: the tiny family builds a Llama of
    `guide_arch` sizes (a copy of the reference's blocks for `reference`); hub and local
    families load the base model of `family_cfg['guide']` (`base`), π_ref's own weights
    (`reference`: the fine-tuned checkpoint on offline tasks) or the guide's architecture
    with random weights (`scratch`). `base` on the tiny family needs `model.guide=<folder>`
    (e.g. a π_ref pretrained on another task with the same vocabulary)."""
    from pita.models.catalog import BUILTIN, resolve_family

    family = resolve_family(family_cfg["name"], family_cfg)
    init = value_init(algo_cfg, family_cfg)
    n_out = head_atoms(algo_cfg.loss_type, algo_cfg.num_atoms)
    kw: dict[str, Any] = dict(
        num_atoms=n_out,
        v_min=algo_cfg.V_min,
        v_max=algo_cfg.V_max,
        loss_type=algo_cfg.loss_type,
        head_type=algo_cfg.value_head,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if family.is_builtin and init != "base":
            vm = ValueModel(
                _tiny_backbone(reference, family_cfg, vocab_size, attn_impl), vocab_size, **kw
            )
            if init == "reference":
                copied = warm_start_from(vm, reference, layers=algo_cfg.warm_start_layers)
                if logger is not None:
                    logger.info(
                        "value model warm-started from the reference: %s",
                        copied or "nothing (widths differ)",
                    )
        elif family.is_builtin and family.guide == BUILTIN:
            raise ValueError(
                "init=base: the tiny family has no pretrained guide checkpoint; set "
                "model.guide=<a save_pretrained folder sharing the task's vocabulary> or use "
                "init=reference | scratch"
            )
        else:
            vm = ValueModel(_loaded_backbone(reference, family, init, attn_impl), vocab_size, **kw)
            if logger is not None:
                source = {"base": family.guide, "reference": "π_ref", "scratch": "random weights"}
                logger.info("value model init=%s: backbone from %s", init, source[init])
    return vm


def _tiny_backbone(
    reference: nn.Module, family_cfg: Mapping[str, Any], vocab_size: int, attn_impl: str
):
    """A fresh Llama of the tiny family's `guide_arch` sizes (random weights)."""
    from transformers import LlamaModel

    from pita.models.tiny import tiny_llama_config

    arch = family_cfg["guide_arch"]
    ref_cfg = reference.config
    config = tiny_llama_config(
        vocab_size,
        n_layer=arch["n_layer"],
        d_model=arch["d_model"],
        n_head=arch["n_head"],
        max_position=ref_cfg.max_position_embeddings,
        pad_token_id=ref_cfg.pad_token_id,
        eos_token_id=ref_cfg.eos_token_id,
        attn_impl=attn_impl,
    )
    return LlamaModel(config).to(torch.float32)


def _loaded_backbone(reference: nn.Module, family: Any, init: str, attn_impl: str) -> nn.Module:
    """The base model (no LM head) for `init`, in fp32: the guide checkpoint (`base`), the
    reference's checkpoint (`reference`, re-read from its folder, so a quantized or
    half-precision π_ref does not leak into training) or the guide's config (`scratch`)."""
    from transformers import AutoConfig, AutoModel

    from pita.models.loading import check_shared_vocab, load_tokenizer

    remote = family.trust_remote_code
    if init == "reference":
        source = getattr(reference, "name_or_path", "") or family.reference
        return AutoModel.from_pretrained(
            source, dtype=torch.float32, trust_remote_code=remote, attn_implementation=attn_impl
        )
    # offsets are added id by id: guide and reference must share the tokenizer
    check_shared_vocab(
        load_tokenizer(family.guide, trust_remote_code=remote),
        load_tokenizer(
            getattr(reference, "name_or_path", "") or family.reference, trust_remote_code=remote
        ),
        f"model.guide {family.guide} vs the reference",
    )
    if init == "base":
        return AutoModel.from_pretrained(
            family.guide,
            dtype=torch.float32,
            trust_remote_code=remote,
            attn_implementation=attn_impl,
        )
    config = AutoConfig.from_pretrained(family.guide, trust_remote_code=remote)
    config._attn_implementation = attn_impl
    return AutoModel.from_config(config, trust_remote_code=remote).to(torch.float32)


def warm_start_from(vm: ValueModel, reference: nn.Module, *, layers: int = -1) -> list[str]:
    """Copy the reference's embeddings, its bottom `layers` blocks (-1: all of them) and
    final norm into `vm`'s backbone where the shapes match; returns what was copied.

    Why a choice: issue 15 compares a full copy of π_ref (its edge-lookup heads are what the
    V-type head reuses) with a bottom-half copy (generic token features without π_ref's
    top-layer "Clever Hans" read-out) and scratch (`warm_start: false`)."""
    ref_base = getattr(reference, "model", reference)
    bb = vm.backbone
    copied = []

    def copy(dst: nn.Module, src: nn.Module, name: str) -> None:
        dst_state, src_state = dst.state_dict(), src.state_dict()
        if dst_state.keys() == src_state.keys() and all(
            dst_state[k].shape == src_state[k].shape for k in dst_state
        ):
            dst.load_state_dict(src_state)
            copied.append(name)

    copy(bb.embed_tokens, ref_base.embed_tokens, "embed_tokens")
    n_blocks = min(len(bb.layers), len(ref_base.layers))
    for i in range(n_blocks if layers < 0 else min(layers, n_blocks)):
        copy(bb.layers[i], ref_base.layers[i], f"layers.{i}")
    copy(bb.norm, ref_base.norm, "norm")
    return copied
