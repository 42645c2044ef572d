"""Hub tasks: GSM8K, MATH-500, AIME (verifiable answers) and IMDB, TL;DR (reward model).

Data comes from `datasets.load_dataset`, or from local JSON-lines files so that nothing
downloads (`dataset.path`). Prompts are tokenized with the model family's tokenizer, passed
in by the caller (`build_task(cfg, tokenizer=...)`).

| name    | hub id (config)              | train / test split | reward                         |
|---------|------------------------------|--------------------|--------------------------------|
| gsm8k   | openai/gsm8k (main)          | train / test       | final answer == gold           |
| math500 | HuggingFaceH4/MATH-500       | — / test           | final answer == gold           |
| aime    | AI-MO/aimo-validation-aime   | — / train          | final answer == gold           |
| imdb    | stanfordnlp/imdb             | train / test       | scorer (sentiment reward model)|
| tldr    | trl-lib/tldr                 | train / test       | scorer (summary reward model)  |

MATH-500 and AIME ship a single split, used for evaluation; training on them needs
`dataset.train_path=<file.jsonl>` (e.g. the MATH train set), or `dataset.train_split=<that
split>` to train on the evaluation problems knowingly.

Config keys (all optional but `name`): path, train_path (local files, below); hub_id,
hub_config, train_split (hub overrides); split (the evaluation split: "test", the default,
means the task's own evaluation split from the table; any other name is used as is);
cache_dir; train_size, test_size (a seeded subset, file order kept); seed; max_new_tokens;
max_prompt_tokens (longer prompts lose the start of their content, template kept);
prompt_template; use_chat_template; prompt_words (IMDB only, default 8).

Local files (`dataset.path`): a .jsonl file (used for both splits), or a folder holding
train.jsonl and/or <split>.jsonl (test.jsonl by default); `dataset.train_path` overrides
the train file. Each line is a
JSON object with a prompt field (`question`, `problem`, `prompt` or `text`, first found) and,
for math tasks, `answer` (a bare final answer, a GSM8K "... #### 72" rationale, or text
with \\boxed{...}) and optionally `solution`/`completion` (the reference response).

Prompt: `dataset.prompt_template` with `{prompt}` replaced by the row's prompt; then the
tokenizer's chat template if `dataset.use_chat_template` is true ("auto": when the
tokenizer has one; math tasks default to "auto", IMDB/TL;DR to false since they are
continuation tasks). With the chat template, prompt ids are exactly what it renders (BOS
included if it has one); without it, `tokenizer(text)` with its special tokens (BOS if
the family adds one). Responses are cut at the first end token (EOS, PAD, or a known
end-of-turn token); hub tasks do not require that end token for the reward.

Math answers: the response's final answer is the last `\\boxed{...}`, else the text after
the last `####`, else the last number; answers are compared after `canonical_answer`
(LaTeX/number clean-up; numbers compared exactly as fractions, so 0.5 == \\frac{1}{2}).

Reward-model tasks take a `scorer(prompts: list[str], responses: list[str]) -> list[float]`
(batched): pass it to `build_task(..., scorer=...)` or set `task.scorer`.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from .base import Example, cfg_error, check_int, check_pairs, check_unknown_keys, cut_at_eos

Scorer = Callable[[list[str], list[str]], list[float]]

MATH_TEMPLATE = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class HubSpec:
    hub_id: str
    hub_config: str | None
    train_split: str | None
    test_split: str
    kind: str  # "math" (verifiable answer) or "rm" (reward-model score)
    max_new_tokens: int
    prompt_template: str
    use_chat_template: bool | str


SPECS: dict[str, HubSpec] = {
    "gsm8k": HubSpec("openai/gsm8k", "main", "train", "test", "math", 512, MATH_TEMPLATE, "auto"),
    "math500": HubSpec(
        "HuggingFaceH4/MATH-500", None, None, "test", "math", 1024, MATH_TEMPLATE, "auto"
    ),
    "aime": HubSpec(
        "AI-MO/aimo-validation-aime", None, None, "train", "math", 2048, MATH_TEMPLATE, "auto"
    ),
    "imdb": HubSpec("stanfordnlp/imdb", None, "train", "test", "rm", 48, "{prompt}", False),
    "tldr": HubSpec("trl-lib/tldr", None, "train", "test", "rm", 64, "{prompt}", False),
}

KEYS = {
    "name",
    "path",
    "train_path",
    "hub_id",
    "hub_config",
    "train_split",
    "split",
    "max_prompt_tokens",
    "cache_dir",
    "train_size",
    "test_size",
    "seed",
    "max_new_tokens",
    "prompt_template",
    "use_chat_template",
}
IMDB_KEYS = {"prompt_words"}  # IMDB prompts are the first `prompt_words` words of a review

PROMPT_FIELDS = ("question", "problem", "prompt", "text")
TARGET_FIELDS = ("solution", "completion", "answer")
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "</s>", "<|end|>")


# --- answer extraction ----------------------------------------------------------------


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), nested braces allowed; None if absent.

    Also accepts the brace-less form `\\boxed 5`.
    """
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)", text)]
    for start in reversed(starts):
        rest = text[start:]
        stripped = rest.lstrip()
        if stripped.startswith("{"):
            depth = 0
            i0 = len(rest) - len(stripped)
            for i in range(i0, len(rest)):
                if rest[i] == "{":
                    depth += 1
                elif rest[i] == "}":
                    depth -= 1
                    if depth == 0:
                        return rest[i0 + 1 : i].strip()
            continue  # unbalanced: try an earlier \boxed
        if rest.startswith(" ") and stripped:
            return re.split(r"[\s$]", stripped, maxsplit=1)[0]
    return None


def extract_hash_answer(text: str) -> str | None:
    """The text after the last `####` (GSM8K style), first line only; None if absent."""
    if "####" not in text:
        return None
    after = text.rsplit("####", 1)[1].strip()
    return after.splitlines()[0].strip() if after else None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_last_number(text: str) -> str | None:
    matches = _NUMBER.findall(text.replace("−", "-"))
    return matches[-1].rstrip(",") if matches else None


def extract_answer(text: str) -> str | None:
    """A response's final answer: last \\boxed{}, else after `####`, else the last number."""
    for extract in (extract_boxed, extract_hash_answer, extract_last_number):
        found = extract(text)
        if found:
            return found
    return None


def gold_answer(answer: str) -> str:
    """Final answer of a reference `answer` field (bare, `#### x` rationale, or \\boxed{x})."""
    return extract_hash_answer(answer) or extract_boxed(answer) or answer.strip()


def _strip_wrappers(s: str) -> str:
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    for junk in (
        "\\left",
        "\\right",
        "\\!",
        "\\,",
        "\\;",
        "\\:",
        "\\$",
        "$",
        "\\%",
        "%",
        "^\\circ",
        "^{\\circ}",
        "\\displaystyle",
    ):
        s = s.replace(junk, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("−", "-")
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)  # \sqrt3 == \sqrt{3}
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    while len(s) >= 2 and s[0] == "{" and s[-1] == "}" and _balanced(s[1:-1]):
        s = s[1:-1]
    return s


def _balanced(s: str) -> bool:
    depth = 0
    for c in s:
        depth += (c == "{") - (c == "}")
        if depth < 0:
            return False
    return depth == 0


def _as_fraction(s: str) -> Fraction | None:
    """Exact value of a plain number, a/b, or \\frac{a}{b} (with optional sign), else None."""
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # thousands separators
        s = s.replace(",", "")
    m = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s) or re.fullmatch(
        r"(-?)\\frac(\d)(\d)", s
    )
    if m:
        num, den = m.group(2), m.group(3)
        sign = -1 if m.group(1) else 1
    elif re.fullmatch(r"-?[\d.]+/-?[\d.]+", s):
        num, den = s.split("/")
        sign = 1
    elif re.fullmatch(r"-?(\d+\.?\d*|\.\d+)", s):
        num, den, sign = s, "1", 1
    else:
        return None
    try:
        value = sign * Fraction(num) / Fraction(den)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def canonical_answer(answer: str | None) -> str:
    """Canonical string of a final answer, "" for none. Numbers become exact fractions
    ("72", "-3/2"), so "1,000" == "1000.0" == "$1000" and "0.5" == "\\frac{1}{2}"."""
    if answer is None:
        return ""
    s = _strip_wrappers(answer)
    value = _as_fraction(s)
    if value is None:
        return s
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )


def is_correct(response_answer: str | None, gold: str) -> bool:
    """Whether an extracted answer matches the gold final answer: equal after
    canonicalisation, else equivalent for math-verify (the maintained grader of
    MATH-500 / AIME answers: `\\frac{\\sqrt{3}}{2}` == `\\sqrt3/2`, intervals, sets, ...)
    when it is installed."""
    pred = canonical_answer(response_answer)
    if pred == "":
        return False
    if pred == canonical_answer(gold):
        return True
    return _math_verify(str(response_answer), str(gold))


@functools.lru_cache(maxsize=65536)
def _math_verify(pred: str, gold: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError:  # the canonical comparison above is the fallback
        return False
    import logging
    import threading

    # math-verify's timeouts are SIGALRM-based: only in the main thread (the task timeout
    # bounds the rest); its warning about that is silenced.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    if timeout is None:
        logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        g = parse(f"${gold}$", parsing_timeout=timeout)
        p = parse(f"${pred}$", parsing_timeout=timeout)
        return bool(g and p and verify(g, p, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - an unparsable answer is simply not correct
        return False


# --- loading --------------------------------------------------------------------------


def _offline_hint(hub_id: str, config: str | None) -> str:
    cfg = f", {config!r}" if config else ""
    return (
        f"cannot download {hub_id} (offline?): pre-download it once with network "
        f"(HF_HUB_OFFLINE=0 python -c \"import datasets; datasets.load_dataset('{hub_id}'{cfg})\"), "
        "or pass dataset.path=<file.jsonl> (one JSON object per line with question/answer), "
        "or run an offline task: experiment=star_graph or the default goal_walk"
    )


def _looks_offline(e: BaseException) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") or os.environ.get(
        "HF_DATASETS_OFFLINE", "0"
    ) not in ("0", ""):
        return True
    text = f"{type(e).__name__} {e}".lower()
    return isinstance(e, (ConnectionError, TimeoutError)) or any(
        w in text
        for w in ("offline", "couldn't reach", "connect", "resolve", "network", "timed out")
    )


def load_hub_rows(
    hub_id: str, config: str | None, split: str, cache_dir: str | None = None
) -> list[dict]:
    """Rows of a hub split via `datasets.load_dataset`; a one-line RuntimeError on failure."""
    try:
        import datasets

        ds = datasets.load_dataset(hub_id, config, split=split, cache_dir=cache_dir)
    except Exception as e:  # reported as one line, the original chained
        if _looks_offline(e):
            raise RuntimeError(_offline_hint(hub_id, config)) from e
        first = (str(e).strip().splitlines() or [""])[0]
        raise RuntimeError(
            f"cannot load {hub_id} (config {config}, split {split}): {type(e).__name__}: {first}"
        ) from e
    return [dict(r) for r in ds]


def load_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSON-lines file (blank lines skipped); errors name the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from e
            if not isinstance(row, dict):
                raise TypeError(f"{path}:{n}: expected a JSON object per line")
            rows.append(row)
    return rows


def _local_file(path: str, split: str) -> Path | None:
    """The file serving `split` under dataset.path (a file serves both splits)."""
    p = Path(path)
    if p.is_dir():
        f = p / f"{split}.jsonl"
        return f if f.exists() else None
    return p


def _first_field(row: Mapping, fields: Sequence[str]) -> str | None:
    for f in fields:
        if row.get(f) not in (None, ""):
            return str(row[f])
    return None


# --- the task -------------------------------------------------------------------------


def validate_cfg(cfg: Mapping) -> list[str]:
    name = cfg.get("name")
    errors: list[str] = []
    check_unknown_keys(cfg, KEYS | (IMDB_KEYS if name == "imdb" else set()), errors)
    check_int(cfg, "train_size", errors, minimum=1, optional=True)
    check_int(cfg, "test_size", errors, minimum=1, optional=True)
    check_int(cfg, "seed", errors)
    check_int(cfg, "max_new_tokens", errors, minimum=1)
    check_int(cfg, "prompt_words", errors, minimum=1)
    for key in ("path", "train_path"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not Path(value).exists():
            errors.append(cfg_error(key, value, "must be an existing .jsonl file or folder"))
        elif key == "train_path" and Path(value).is_dir():
            errors.append(cfg_error(key, value, "must be a .jsonl file"))
        elif Path(value).is_dir() and not any(
            (Path(value) / f"{s}.jsonl").exists() for s in ("train", "test")
        ):
            errors.append(cfg_error(key, value, "folder must hold train.jsonl and/or test.jsonl"))
    check_int(cfg, "max_prompt_tokens", errors, minimum=1)
    for key in ("hub_id", "hub_config", "train_split", "split", "cache_dir"):
        value = cfg.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            errors.append(cfg_error(key, value, "must be a non-empty string or null"))
    template = cfg.get("prompt_template")
    if template is not None and (not isinstance(template, str) or "{prompt}" not in template):
        errors.append(
            cfg_error("prompt_template", template, "must be a string containing {prompt}")
        )
    chat = cfg.get("use_chat_template")  # None: the dataset's own rule
    if chat not in (None, True, False, "auto"):
        errors.append(cfg_error("use_chat_template", chat, "must be true, false or auto"))
    return errors


class HubTask:
    """A hub (or local-file) task; see the module docstring."""

    def __init__(
        self,
        name: str,
        tokenizer: Any,
        *,
        scorer: Scorer | None = None,
        path: str | None = None,
        train_path: str | None = None,
        hub_id: str | None = None,
        hub_config: str | None = None,
        train_split: str | None = None,
        split: str | None = None,
        cache_dir: str | None = None,
        train_size: int | None = None,
        test_size: int | None = None,
        seed: int = 0,
        max_new_tokens: int | None = None,
        max_prompt_tokens: int | None = None,
        prompt_template: str | None = None,
        use_chat_template: bool | str | None = None,
        prompt_words: int = 8,
    ):
        if name not in SPECS:
            raise ValueError(cfg_error("name", name, f"hub tasks are {', '.join(SPECS)}"))
        if tokenizer is None:
            raise ValueError(
                f"dataset {name} needs the model family's tokenizer: "
                "build_task(dataset_cfg, tokenizer=<tokenizer or its path>)"
            )
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        spec = SPECS[name]
        self.name = name
        self.kind = spec.kind
        self.scorer = scorer
        self.path, self.train_path, self.cache_dir = path, train_path, cache_dir
        self.hub_id = hub_id or spec.hub_id
        self.hub_config = hub_config if hub_config is not None else spec.hub_config
        self.train_split = train_split if train_split is not None else spec.train_split
        # dataset.split names the evaluation split; "test" means this task's own evaluation
        # split (AIME's hub copy calls it "train"), any other name is used as is.
        self.split = split or "test"
        self.test_split = spec.test_split if self.split == "test" else self.split
        self.max_prompt_tokens = max_prompt_tokens
        self.train_size, self.test_size, self.seed = train_size, test_size, seed
        self.max_new_tokens = max_new_tokens or spec.max_new_tokens
        self.prompt_template = prompt_template or spec.prompt_template
        chat = spec.use_chat_template if use_chat_template is None else use_chat_template
        if chat == "auto":
            chat = bool(getattr(tokenizer, "chat_template", None))
        if chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                cfg_error("use_chat_template", True, "the tokenizer has no chat template")
            )
        self.use_chat_template = bool(chat)
        self.prompt_words = prompt_words

        # The interface promises left padding and a pad token.
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        vocab = tokenizer.get_vocab()
        ends = {tokenizer.eos_token_id, tokenizer.pad_token_id}
        ends |= {vocab[t] for t in END_TOKENS if t in vocab}
        self.end_ids = sorted(i for i in ends if i is not None)
        self._cache: dict[str, list[Example]] = {}

    # --- data ---------------------------------------------------------------------------

    def _rows(self, split: str) -> list[dict]:
        """Raw rows of 'train' or 'test', from local files or the hub."""
        if split == "train" and self.train_path:
            return load_jsonl(self.train_path)
        if self.path:
            file_split = "train" if split == "train" else self.split
            f = _local_file(self.path, file_split)
            if f is None:
                raise FileNotFoundError(
                    f"dataset.path={self.path}: no {file_split}.jsonl in that folder"
                )
            return load_jsonl(f)
        hub_split = self.train_split if split == "train" else self.test_split
        if hub_split is None:
            raise ValueError(
                f"dataset {self.name}: {self.hub_id} has no training split; pass "
                f"dataset.train_path=<file.jsonl> or dataset.train_split=<split> "
                f"(dataset.train_split={self.test_split} trains on the evaluation problems)"
            )
        return load_hub_rows(self.hub_id, self.hub_config, hub_split, self.cache_dir)

    def _prompt_content(self, row: Mapping) -> str:
        """The row's prompt text, before the template (IMDB: its first `prompt_words` words)."""
        text = _first_field(row, PROMPT_FIELDS)
        if text is None:
            raise ValueError(
                f"dataset {self.name}: a row has none of the fields {PROMPT_FIELDS}: {row}"
            )
        if self.name == "imdb":
            text = " ".join(text.replace("<br />", " ").split()[: self.prompt_words])
        return text

    def _fit_prompt(self, content: str, ids: list[int]) -> tuple[str, list[int]]:
        """Cut the prompt content from the left until the whole prompt fits max_prompt_tokens.

        The template, the chat markup and a BOS stay intact; the end of the content (the
        question itself, TL;DR's closing "TL;DR:") is kept.
        """
        limit = self.max_prompt_tokens
        assert limit is not None and len(ids) > limit, "only called on over-long prompts"
        content_ids = self.tokenizer(content, add_special_tokens=False)["input_ids"]
        overhead = len(ids) - len(content_ids)
        keep = limit - overhead
        for _ in range(3):  # re-tokenising the cut text can shift the count by a token or two
            if keep <= 0:
                raise ValueError(
                    f"dataset.max_prompt_tokens={limit}: the prompt template alone takes "
                    f"{overhead} tokens; raise it"
                )
            content = self.tokenizer.decode(content_ids[-keep:], skip_special_tokens=True)
            text = self.prompt_template.replace("{prompt}", content)
            ids = self.encode_prompts([text])[0]
            if len(ids) <= limit:
                return text, ids
            keep -= len(ids) - limit
        raise ValueError(f"dataset.max_prompt_tokens={limit}: could not fit a prompt; raise it")

    def encode_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        tok = self.tokenizer
        if self.use_chat_template:
            texts = [
                tok.apply_chat_template(
                    [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
                )
                for t in texts
            ]
            return tok(list(texts), add_special_tokens=False)["input_ids"]
        return tok(list(texts))["input_ids"]

    def _examples(self, split: str) -> list[Example]:
        if split in self._cache:
            return self._cache[split]
        rows = self._rows(split)
        size = self.train_size if split == "train" else self.test_size
        if size is not None and size < len(rows):  # a seeded subset, original order kept
            keep = sorted(random.Random(f"{self.seed}/{split}").sample(range(len(rows)), size))
            rows = [rows[i] for i in keep]
        contents = [self._prompt_content(r) for r in rows]
        prompts = [self.prompt_template.replace("{prompt}", c) for c in contents]
        prompt_ids = self.encode_prompts(prompts)
        if self.max_prompt_tokens is not None:
            for i, ids in enumerate(prompt_ids):
                if len(ids) > self.max_prompt_tokens:
                    prompts[i], prompt_ids[i] = self._fit_prompt(contents[i], ids)
        targets = [_first_field(r, TARGET_FIELDS) for r in rows]
        target_ids: list[list[int] | None] = [None] * len(rows)
        with_target = [i for i, t in enumerate(targets) if t is not None]
        if with_target:
            enc = self.tokenizer([targets[i] for i in with_target], add_special_tokens=False)
            for i, ids in zip(with_target, enc["input_ids"]):
                target_ids[i] = [*ids, self.eos_id]
        examples = []
        for i, row in enumerate(rows):
            meta: dict[str, Any] = {"prompt": prompts[i], "index": i}
            if self.kind == "math":
                answer = row.get("answer")
                if answer in (None, ""):
                    source = _first_field(row, ("solution",))
                    answer = extract_boxed(source) if source else None
                if answer in (None, ""):
                    raise ValueError(f"dataset {self.name}: row {i} has no answer: {row}")
                meta["answer"] = gold_answer(str(answer))
            elif "label" in row:
                meta["label"] = row["label"]
            examples.append(Example(prompt_ids[i], target_ids[i], meta))
        self._cache[split] = examples
        return examples

    def train_examples(self) -> list[Example]:
        return list(self._examples("train"))

    def test_examples(self) -> list[Example]:
        return list(self._examples("test"))

    def pretrain_batch(
        self, rng: random.Random, batch_size: int
    ) -> list[tuple[list[int], list[int]]]:
        """Training prompts with their reference responses (SFT pairs), drawn with `rng`."""
        pool = [
            (e.prompt_ids, e.target_ids) for e in self.train_examples() if e.target_ids is not None
        ]
        if not pool:
            raise ValueError(
                f"dataset {self.name} has no reference responses to train on; the reference "
                "policy of a hub task is the pretrained model itself"
            )
        return [(list(p), list(t)) for p, t in rng.choices(pool, k=batch_size)]

    # --- verifier -----------------------------------------------------------------------

    def decode_responses(self, responses: Sequence[Sequence[int]]) -> list[str]:
        """Response texts, cut at the first end token, special tokens skipped."""
        cut = [cut_at_eos(r, self.end_ids)[0] for r in responses]
        return self.tokenizer.batch_decode(cut, skip_special_tokens=True)

    def rewards(
        self, examples: Sequence[Example], responses: Sequence[Sequence[int]]
    ) -> list[float]:
        """Math: 1.0 iff the final answer matches the gold one. IMDB/TL;DR: scorer output."""
        check_pairs(examples, responses)
        texts = self.decode_responses(responses)
        if self.kind == "math":
            return [
                float(is_correct(extract_answer(t), ex.meta["answer"]))
                for ex, t in zip(examples, texts)
            ]
        if self.scorer is None:
            raise RuntimeError(
                f"dataset {self.name} is scored by a reward model: pass "
                "build_task(cfg, tokenizer=..., scorer=fn) or set task.scorer, with "
                "fn(prompts: list[str], responses: list[str]) -> list[float]"
            )
        scores = self.scorer([ex.meta["prompt"] for ex in examples], texts)
        if len(scores) != len(texts):
            raise RuntimeError(f"scorer returned {len(scores)} scores for {len(texts)} responses")
        return [float(s) for s in scores]

    def answers(self, examples: Sequence[Example], responses: Sequence[Sequence[int]]) -> list[str]:
        """Math: canonical final answer ("" if none). IMDB/TL;DR: the stripped response text."""
        check_pairs(examples, responses)
        texts = self.decode_responses(responses)
        if self.kind == "math":
            return [canonical_answer(extract_answer(t)) for t in texts]
        return [t.strip() for t in texts]

    def extra_metrics(
        self, examples: Sequence[Example], responses: Sequence[Sequence[int]]
    ) -> dict[str, float]:
        """Math: has_answer (fraction of responses with an extractable answer)."""
        check_pairs(examples, responses)
        if self.kind != "math" or not responses:
            return {}
        found = sum(a != "" for a in self.answers(examples, responses))
        return {"has_answer": found / len(responses)}

    def save_tokenizer(self, path: str) -> None:
        self.tokenizer.save_pretrained(path)


def build(cfg: Mapping, tokenizer: Any = None, scorer: Scorer | None = None) -> HubTask:
    kwargs = {k: v for k, v in cfg.items() if k != "name" and not str(k).startswith("_")}
    return HubTask(cfg["name"], tokenizer, scorer=scorer, **kwargs)
