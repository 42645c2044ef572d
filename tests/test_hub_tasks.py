"""Hub tasks without the hub: answer extraction, local jsonl files, scorers, offline errors."""

import json
import os
import subprocess
import sys

import pytest

from pita.datasets import Task, build_task, validate_dataset_cfg
from pita.datasets.hub import (
    MATH_TEMPLATE,
    canonical_answer,
    extract_answer,
    extract_boxed,
    extract_hash_answer,
    gold_answer,
    is_correct,
)
from pita.datasets.vocab import build_tokenizer

GSM_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more . How many ?", "answer": "3 + 4 = 7 #### 7"},
    {"question": "A car costs 1,200 dollars . Two cars ?", "answer": "2 * 1200 = 2400 #### 2,400"},
    {"question": "What is 5 minus 8 ?", "answer": "5 - 8 = -3 #### -3"},
]
RESPONSE_WORDS = ["so", "the", "answer", "is", "####", "7", "-3", "2400", "2,400", "8", "."]
RESPONSE_WORDS += ["\\boxed{7}", "\\boxed{2400}"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def word_tokenizer(rows, extra=()):
    """A word-level tokenizer covering every word of the rows, the template and `extra`."""
    words = set(MATH_TEMPLATE.replace("{prompt}", "").split()) | set(extra)
    for r in rows:
        for v in r.values():
            words |= set(str(v).split())
    return build_tokenizer(sorted(words))


# --- extraction ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{{a}_{b}^{2}}", "{a}_{b}^{2}"),
        ("$\\boxed{\\text{(B)}}$", "\\text{(B)}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 5$ end", "5"),
        ("\\boxed{2} and broken \\boxed{3", "2"),
        ("no box here", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("3 + 4 = 7\n#### 7", "7"),
        ("#### 1,234\nextra line", "1,234"),
        ("a #### 1 b #### -5", "-5"),
        ("####", None),
        ("no hashes", None),
    ],
)
def test_extract_hash_answer(text, expected):
    assert extract_hash_answer(text) == expected


@pytest.mark.parametrize(
    "a,b",
    [
        ("1,234", "1234"),
        ("$1,234.00", "1234"),
        ("72.0", "72"),
        ("-3", "−3"),
        ("0.5", "\\frac{1}{2}"),
        ("\\dfrac{1}{2}", "1/2"),
        ("-\\frac12", "-0.5"),
        ("3.14", "3.140"),
        ("50\\%", "50"),
        ("\\text{(B)}", "(B)"),
        ("{x^2+1}", "x^2 + 1"),
        ("(1,2)", "( 1, 2 )"),
    ],
)
def test_canonical_answers_match(a, b):
    assert canonical_answer(a) == canonical_answer(b)
    assert is_correct(a, b)


@pytest.mark.parametrize("a,b", [("1,234", "1.234"), ("-3", "3"), ("0.5", "0.05"), ("(1,2)", "12")])
def test_canonical_answers_differ(a, b):
    assert not is_correct(a, b)


def test_extract_answer_fallbacks():
    assert extract_answer("so #### 7") == "7"
    assert extract_answer("first \\boxed{8} then #### 7") == "8"  # boxed wins
    assert extract_answer("The total is 1,000,000, I think.") == "1,000,000"
    assert extract_answer("it is -2.5") == "-2.5"
    assert extract_answer("no answer") is None
    assert not is_correct(None, "7") and not is_correct("", "")
    assert gold_answer("3 + 4 = 7 #### 7") == "7"
    assert gold_answer("so \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert gold_answer(" 42 ") == "42"


# --- local files -----------------------------------------------------------------------


def test_local_jsonl_gsm8k(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
    tok = word_tokenizer(GSM_ROWS, RESPONSE_WORDS)
    task = build_task({"name": "gsm8k", "path": path}, tokenizer=tok)
    test = task.test_examples()
    assert isinstance(task, Task)
    assert len(test) == 3 and len(task.train_examples()) == 3  # one file serves both splits
    assert [e.meta["answer"] for e in test] == ["7", "2,400", "-3"]
    assert tok.decode(test[0].prompt_ids).startswith("Tom has 3 apples")
    assert "\\boxed{}." in tok.decode(test[0].prompt_ids)
    assert test[0].target_ids[-1] == tok.eos_token_id
    assert tok.decode(test[0].target_ids, skip_special_tokens=True) == GSM_ROWS[0]["answer"]

    def ids(text):
        return tok(text)["input_ids"]

    eos, pad = tok.eos_token_id, tok.pad_token_id
    examples = [test[0], test[0], test[0], test[1], test[1], test[2], test[2]]
    responses = [
        ids("so the answer is #### 7") + [eos],
        ids("so \\boxed{7}") + [eos, pad],
        ids("the answer is 8 .") + [eos] + ids("7"),  # tokens after EOS are ignored
        ids("so #### 2400"),  # no EOS needed on hub tasks
        ids("\\boxed{2400}") + [eos],
        ids("the answer is -3 .") + [eos],
        ids("the answer is") + [eos],
    ]
    assert task.rewards(examples, responses) == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert task.answers(examples, responses) == ["7", "7", "8", "2400", "2400", "-3", ""]
    assert task.extra_metrics(examples, responses) == {"has_answer": pytest.approx(6 / 7)}
    pairs = task.pretrain_batch(__import__("random").Random(0), 4)
    assert len(pairs) == 4 and all(t[-1] == eos for _, t in pairs)
    task.save_tokenizer(str(tmp_path / "tok"))
    assert (tmp_path / "tok" / "tokenizer.json").exists()


def test_local_folder_splits_sizes_and_chat_template(tmp_path):
    rows = [{"prompt": f"q{i} ?", "answer": f"\\boxed{{{i}}}"} for i in range(10)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "test.jsonl", rows[:4])
    tok = word_tokenizer(rows, ["USER:", "ASSISTANT:"])
    tok.chat_template = (
        "{% for m in messages %}USER: {{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %} ASSISTANT:{% endif %}"
    )
    cfg = {
        "name": "math500",
        "path": str(tmp_path),
        "train_size": 5,
        "seed": 1,
        "prompt_template": "{prompt}",
    }
    task = build_task(cfg, tokenizer=tok)
    assert task.use_chat_template  # "auto" and the tokenizer has one
    train = task.train_examples()
    assert len(train) == 5 and len(task.test_examples()) == 4
    assert [e.meta["answer"] for e in task.test_examples()] == ["0", "1", "2", "3"]
    idx = [int(e.meta["answer"]) for e in train]
    assert idx == sorted(idx), "a seeded subset keeps file order"
    assert idx == [int(e.meta["answer"]) for e in build_task(cfg, tokenizer=tok).train_examples()]
    assert tok.decode(train[0].prompt_ids) == f"USER: q{idx[0]} ? ASSISTANT:"
    assert tok.padding_side == "left"


def test_split_names_and_max_prompt_tokens(tmp_path):
    long_q = " ".join(f"w{i}" for i in range(30)) + " what is 2 + 2 ?"
    rows = [{"question": long_q, "answer": "4"}, {"question": "what is 2 + 2 ?", "answer": "4"}]
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "validation.jsonl", rows[1:])
    tok = word_tokenizer(rows)
    cfg = {"name": "gsm8k", "path": str(tmp_path), "split": "validation", "max_prompt_tokens": 20}
    task = build_task(cfg, tokenizer=tok)
    assert len(task.test_examples()) == 1, "split=validation reads validation.jsonl"
    train = task.train_examples()
    assert [len(e.prompt_ids) for e in train] == [20, len(train[1].prompt_ids)]
    text = tok.decode(train[0].prompt_ids)
    instruction = MATH_TEMPLATE.split("\n", 1)[1]  # 12 words: 8 are left for the content
    assert text == "w28 w29 what is 2 + 2 ? " + instruction
    with pytest.raises(ValueError, match="dataset.max_prompt_tokens=3"):
        build_task({**cfg, "max_prompt_tokens": 3}, tokenizer=tok).train_examples()


def test_lead_config_files_validate():
    """Every conf/dataset/*.yaml passes validation (no network, no tokenizer needed)."""
    from pathlib import Path

    from omegaconf import OmegaConf

    files = sorted((Path(__file__).resolve().parents[1] / "conf" / "dataset").glob("*.yaml"))
    for f in files:
        validate_dataset_cfg(OmegaConf.load(f))
    with_nones = {"name": "goal_walk", "degree": None, "path": None, "split": None, "seed": 0}
    validate_dataset_cfg(with_nones)  # None = not set (the config schema's other-task keys)


def test_math500_has_no_train_split_by_default(tmp_path):
    tok = word_tokenizer([])
    task = build_task({"name": "math500"}, tokenizer=tok)
    with pytest.raises(ValueError, match="dataset.train_path"):
        task.train_examples()


def test_hub_tasks_need_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        build_task({"name": "gsm8k"})


def test_imdb_needs_a_scorer(tmp_path):
    rows = [
        {"text": "This film was<br />a total delight from start to end", "label": 1},
        {"text": "Dull and far too long", "label": 0},
    ]
    path = write_jsonl(tmp_path / "imdb.jsonl", rows)
    tok = word_tokenizer(rows, ["This", "film", "was", "a", "great", "bad"])
    task = build_task({"name": "imdb", "path": path, "prompt_words": 4}, tokenizer=tok)
    test = task.test_examples()
    assert [e.meta["prompt"] for e in test] == ["This film was a", "Dull and far too"]
    assert test[0].target_ids is None and test[0].meta["label"] == 1
    responses = [tok("great")["input_ids"] + [tok.eos_token_id], tok("bad bad")["input_ids"]]
    with pytest.raises(RuntimeError, match="scorer"):
        task.rewards(test, responses)
    calls = []

    def scorer(prompts, texts):
        calls.append((prompts, texts))
        return [float(len(t.split())) for t in texts]

    task.scorer = scorer
    assert task.rewards(test, responses) == [1.0, 2.0]
    assert calls == [(["This film was a", "Dull and far too"], ["great", "bad bad"])], "one call"
    assert task.answers(test, responses) == ["great", "bad bad"]
    with pytest.raises(ValueError, match="no reference responses"):
        task.pretrain_batch(__import__("random").Random(0), 2)


# --- validation and offline errors ------------------------------------------------------


@pytest.mark.parametrize(
    "cfg,key",
    [
        ({"name": "gsm8k", "path": "/no/such/file.jsonl"}, "path"),
        ({"name": "gsm8k", "use_chat_template": "yes"}, "use_chat_template"),
        ({"name": "gsm8k", "prompt_template": "Q: {question}"}, "prompt_template"),
        ({"name": "gsm8k", "prompt_words": 8}, "prompt_words"),  # an IMDB-only key
        ({"name": "imdb", "prompt_words": 0}, "prompt_words"),
        ({"name": "aime", "test_size": 0}, "test_size"),
        ({"name": "tldr", "max_new_tokens": -1}, "max_new_tokens"),
        ({"name": "gsm8k", "hub_id": ""}, "hub_id"),
    ],
)
def test_validation_names_the_key(cfg, key):
    with pytest.raises(ValueError) as e:
        validate_dataset_cfg(cfg)
    assert str(e.value).startswith(f"dataset.{key}=") and "\n" not in str(e.value)


def test_offline_error_is_one_clear_line(tmp_path):
    code = (
        "from pita.datasets.hub import load_hub_rows\n"
        "try:\n"
        f"    load_hub_rows('openai/gsm8k', 'main', 'test', cache_dir={str(tmp_path / 'c')!r})\n"
        "except RuntimeError as e:\n"
        "    print('RuntimeError:' + str(e))\n"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=60,
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("RuntimeError:cannot download openai/gsm8k"), out
    assert "offline" in lines[0] and "dataset.path=" in lines[0] and "star_graph" in lines[0]


@pytest.mark.parametrize(
    "a,b",
    [
        ("\\sqrt3", "\\sqrt{3}"),
        ("\\frac{\\sqrt{3}}{2}", "\\sqrt3/2"),
        ("2\\sqrt{3}", "\\sqrt{12}"),
        ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt2}{2}"),
    ],
)
def test_math_answers_equal_in_value_are_correct(a, b):
    assert is_correct(a, b) and is_correct(b, a)


def test_sqrt_without_braces_is_canonical_without_math_verify():
    assert canonical_answer("\\sqrt3") == canonical_answer("\\sqrt{3}") == "\\sqrt{3}"
    assert canonical_answer("2\\sqrt5+1") == "2\\sqrt{5}+1"
