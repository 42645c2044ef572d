"""A *local* model family, built the way a new user would bring their own checkpoints.

`build_local_family(root)` writes, with nothing downloaded:

- `data/gsm8k/{train,test}.jsonl`: GSM8K-format rows (`question`, `answer` ending in
  "#### <n>"), and `data/imdb/{train,test}.jsonl`: IMDB-format rows (`text`, `label`);
- a byte-level BPE tokenizer trained with `tokenizers` on that text (BOS added by the
  post-processor, as Llama's does; decode -> encode is *not* the identity for sampled ids,
  which is what broke DPO);
- `reference/`, `guide/`: random-weight Llamas (`LlamaConfig`, `save_pretrained`) sharing
  the tokenizer; `reward/`: a one-output `LlamaForSequenceClassification` (the family's
  reward model, the scorer of the IMDB-format task).

Use it as `model=local model.reference=<reference> model.guide=<guide>
model.reward=<reward> dataset=gsm8k dataset.path=<data/gsm8k>` (`LocalFamily.overrides`).
Sizes are tiny so that a CPU end-to-end run of every algorithm takes about a minute.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SPECIALS = ("<s>", "</s>", "<pad>")
WORDS = ("apples", "pears", "books", "coins", "cats", "boxes", "pens", "cups")
NAMES = ("Ann", "Bob", "Cleo", "Dan", "Eve", "Finn")
GOOD = ("great", "wonderful", "moving", "brilliant", "funny", "beautiful")
BAD = ("boring", "awful", "dull", "terrible", "slow", "messy")


@dataclass(frozen=True)
class LocalFamily:
    root: Path
    reference: Path
    guide: Path
    reward: Path
    gsm8k: Path  # folder with train.jsonl / test.jsonl
    imdb: Path

    def overrides(self, dataset: str = "gsm8k", max_new_tokens: int = 12) -> list[str]:
        """Command-line overrides selecting this family and one of its datasets."""
        path = self.gsm8k if dataset == "gsm8k" else self.imdb
        return [
            "model=local",
            f"model.reference={self.reference}",
            f"model.guide={self.guide}",
            f"model.reward={self.reward}",
            f"dataset={dataset}",
            f"dataset.path={path}",
            f"dataset.max_new_tokens={max_new_tokens}",
            "dataset.max_prompt_tokens=128",
        ]


def gsm8k_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        name, word = rng.choice(NAMES), rng.choice(WORDS)
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        rows.append(
            {
                "question": f"{name} has {a} {word} and buys {b} more. How many {word} does {name} have now?",
                "answer": f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {word}.\n#### {a + b}",
            }
        )
    return rows


def imdb_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.randint(0, 1)
        adj = GOOD if label else BAD
        text = (
            f"This film was {rng.choice(adj)} and the acting was {rng.choice(adj)}.<br /><br />"
            f"I found the story {rng.choice(adj)} from start to end."
        )
        rows.append({"text": text, "label": label})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def train_tokenizer(texts: list[str], vocab_size: int = 384):
    """A byte-level BPE `PreTrainedTokenizerFast` (BOS added, EOS/pad special) trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def _llama_config(tokenizer, *, hidden: int, layers: int):
    from tests.archs import llama

    ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    shape = dict(max_position_embeddings=256, tie_word_embeddings=False, **ids)
    return llama(len(tokenizer), hidden, 2 * hidden, layers, 4, 2, **shape)


def build_local_family(
    root: Path,
    *,
    n_train: int = 12,
    n_test: int = 4,
    hidden: int = 32,
    layers: int | None = None,
    seed: int = 0,
) -> LocalFamily:
    """Write the data, tokenizer and the three checkpoints under `root` (see the module
    docstring). `layers`: every model's depth (default: reference 2, guide and reward 1)."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    root = Path(root)
    gsm8k, imdb = root / "data" / "gsm8k", root / "data" / "imdb"
    splits = {"train": (n_train, seed), "test": (n_test, seed + 1)}
    texts: list[str] = []
    for split, (n, s) in splits.items():
        g, i = gsm8k_rows(n, s), imdb_rows(n, s)
        _write_jsonl(gsm8k / f"{split}.jsonl", g)
        _write_jsonl(imdb / f"{split}.jsonl", i)
        texts += [r["question"] + "\n" + r["answer"] for r in g] + [r["text"] for r in i]
    # the corpus the tokenizer learns from: the data plus a few more of the same kind
    texts += [r["question"] + "\n" + r["answer"] for r in gsm8k_rows(200, seed + 7)]
    texts += [r["text"] for r in imdb_rows(200, seed + 7)]
    tokenizer = train_tokenizer(texts)

    torch.manual_seed(seed)
    folders = {"reference": root / "reference", "guide": root / "guide", "reward": root / "reward"}
    LlamaForCausalLM(_llama_config(tokenizer, hidden=hidden, layers=layers or 2)).save_pretrained(
        folders["reference"]
    )
    LlamaForCausalLM(_llama_config(tokenizer, hidden=hidden, layers=layers or 1)).save_pretrained(
        folders["guide"]
    )
    rm_config = _llama_config(tokenizer, hidden=hidden, layers=layers or 1)
    rm_config.num_labels = 1
    LlamaForSequenceClassification(rm_config).save_pretrained(folders["reward"])
    for folder in folders.values():
        tokenizer.save_pretrained(folder)
    return LocalFamily(root=root, gsm8k=gsm8k, imdb=imdb, **folders)


# --- a GPT-2-architecture local family for the offline tasks (issue 23) --------------------


@dataclass(frozen=True)
class Gpt2Family:
    """`reference/` and `guide/`: random-weight GPT-2s (different seeds, one tokenizer)."""

    root: Path
    reference: Path
    guide: Path

    def overrides(self) -> list[str]:
        return ["model=local", f"model.reference={self.reference}", f"model.guide={self.guide}"]


def graph_texts(n: int, seed: int, num_nodes: int = 20) -> list[str]:
    """Star-graph and goal-walk texts in the official format, the tokenizer's corpus."""
    from pita.datasets.star_graph import generate_graph

    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        texts.append(generate_graph(rng, 2, 4, num_nodes).to_text())
        s, g = rng.randrange(num_nodes), rng.randrange(num_nodes)
        walk = ",".join(str(rng.randrange(num_nodes)) for _ in range(3))
        texts.append(f"START {s} GOAL {g}={walk}")
    return texts


def train_gpt2_tokenizer(texts: list[str], vocab_size: int = 300):
    """A GPT-2-style byte-level BPE (`<|endoftext|>` as EOS, no BOS, no pad) trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )


def build_gpt2_family(
    root: Path, *, n_embd: int = 32, layers: int = 2, seed: int = 0
) -> Gpt2Family:
    """Write the tokenizer and two random-weight `GPT2LMHeadModel`s under `root`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    root = Path(root)
    tokenizer = train_gpt2_tokenizer(graph_texts(300, seed))
    folders = {"reference": root / "reference", "guide": root / "guide"}
    for i, folder in enumerate(folders.values()):
        torch.manual_seed(1000 + seed + i)  # not the seeds a run draws from
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=128,
            n_embd=n_embd,
            n_layer=layers,
            n_head=4,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        GPT2LMHeadModel(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return Gpt2Family(root=root, **folders)
