"""Family catalog, loading (dtype, quantization, offline errors), tiny models, reward scoring."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from pita.models.catalog import BUILTIN, FAMILIES, known_aliases, parse_alias, resolve_family
from pita.models.loading import (
    check_shared_vocab,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    resolve_dtype,
)
from pita.models.reward_scorer import RewardScorer, _label_index
from pita.models.tiny import build_tiny_llama, tiny_llama_config

PAD, BOS, EOS = 0, 1, 2

# --- catalog ------------------------------------------------------------------------------


def test_parse_alias():
    assert parse_alias("llama3.2-1b") == ("llama3.2-1b", None)
    assert parse_alias("llama3.2-1b-4bit") == ("llama3.2-1b", "4bit")
    assert parse_alias("qwen2.5-1.5b-8bit") == ("qwen2.5-1.5b", "8bit")
    assert parse_alias("tiny") == ("tiny", None)


def test_resolve_family_catalog_and_overrides():
    fam = resolve_family("llama3.2-1b")
    assert fam.guide == "meta-llama/Llama-3.2-1B-Instruct"
    assert fam.reference == "meta-llama/Llama-3.1-8B-Instruct"
    assert fam.reward == "Skywork/Skywork-Reward-Llama-3.1-8B-v0.2"
    assert fam.quantization is None
    assert resolve_family("llama3.2-1b-4bit").quantization == "4bit"
    assert resolve_family("qwen2.5-1.5b").guide == "Qwen/Qwen2.5-1.5B-Instruct"
    assert resolve_family("gpt2").reward == "lvwerra/distilbert-imdb"
    tiny = resolve_family("tiny")
    assert tiny.is_builtin and tiny.reference == tiny.guide == BUILTIN
    # Explicit ids win; None means "keep the catalog's"; the rest of a model config is ignored.
    fam = resolve_family(
        "gpt2",
        {"reference": "/models/ref", "reward": None, "dtype": "bfloat16", "memory_gb": 3},
    )
    assert (fam.reference, fam.guide, fam.reward, fam.dtype) == (
        "/models/ref",
        "gpt2",
        "lvwerra/distilbert-imdb",
        "bfloat16",
    )
    custom = resolve_family("mine-8bit", {"reference": "a/ref", "guide": "a/guide"})
    assert (custom.reference, custom.guide, custom.quantization) == ("a/ref", "a/guide", "8bit")


def test_unknown_alias_names_the_key_and_lists_aliases():
    with pytest.raises(ValueError) as err:
        resolve_family("llama9-70b")
    msg = str(err.value)
    assert "model.name='llama9-70b'" in msg
    for alias in FAMILIES:
        assert alias in msg
    assert "llama3.2-1b-4bit" in known_aliases()
    with pytest.raises(ValueError, match="cannot be quantized"):
        resolve_family("tiny-4bit")


def test_importing_pita_models_does_not_import_torch():
    code = "import sys, pita.models; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- loading ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model = build_tiny_llama(24, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, seed=3)
    model.save_pretrained(path)
    return path, model


def test_tiny_model_round_trip(tiny_dir):
    path, model = tiny_dir
    loaded = load_causal_lm(str(path))
    assert not loaded.training
    assert loaded.dtype == torch.float32
    assert loaded.config._attn_implementation == "eager"
    ids = torch.tensor([[BOS, 5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_tiny_builder_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_llama(16, pad_token_id=PAD, eos_token_id=EOS, seed=7)
    after = torch.rand(1)
    b = build_tiny_llama(16, pad_token_id=PAD, eos_token_id=EOS, seed=7)
    assert before == after
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_dtype_auto_is_float32_on_cpu(tiny_dir):
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bf16") == torch.bfloat16
    assert resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int3")
    path, _ = tiny_dir
    assert load_causal_lm(str(path), dtype="auto").dtype == torch.float32
    assert load_causal_lm(str(path), dtype="bfloat16").dtype == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
@pytest.mark.parametrize("quant", ["8bit", "4bit"])
def test_quantized_alias_on_cpu_gives_a_clear_error(tiny_dir, quant):
    path, _ = tiny_dir
    with pytest.raises(RuntimeError, match=f"-{quant} needs CUDA \\+ bitsandbytes"):
        load_causal_lm(str(path), quantization=quant)


def test_missing_model_is_one_clear_line(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(RuntimeError) as err:
        load_causal_lm(missing)
    msg = str(err.value)
    assert "\n" not in msg
    assert missing in msg and "HF_HUB_OFFLINE=1" in msg and "model=tiny" in msg
    with pytest.raises(RuntimeError, match="could not load tokenizer"):
        load_tokenizer(missing)


def _word_tokenizer(words):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", *words])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_tokenizer_round_trip_and_pad_fallback(tmp_path):
    _word_tokenizer(["a", "b", "c"]).save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.pad_token_id == tok.eos_token_id == 1  # no pad token: EOS doubles as pad
    assert tok.padding_side == "left"
    assert tok("a c b")["input_ids"] == [2, 4, 3]


def test_shared_vocab_check():
    a, b = _word_tokenizer(["x", "y"]), _word_tokenizer(["x", "y"])
    check_shared_vocab(a, b, "model=test")
    with pytest.raises(ValueError, match="model=test: the tokenizers differ"):
        check_shared_vocab(a, _word_tokenizer(["y", "x"]), "model=test")
    with pytest.raises(ValueError, match="vocabulary sizes 4 vs 5"):
        check_shared_vocab(a, _word_tokenizer(["x", "y", "z"]), "model=test")


# --- reward scoring -----------------------------------------------------------------------


def build_tiny_reward_model(
    vocab_size: int,
    *,
    pad_token_id: int,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    seed: int = 0,
    initializer_range: float = 0.02,
) -> torch.nn.Module:
    """A random fp32 ``LlamaForSequenceClassification`` with one output (a scalar reward),
    pooled by HF at the last token that is not ``pad_token_id``."""
    from transformers import LlamaForSequenceClassification

    config = tiny_llama_config(
        vocab_size,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        initializer_range=initializer_range,
        num_labels=1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
    return model.to(torch.float32).eval()


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm")
    rm = build_tiny_reward_model(
        24, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, seed=1, initializer_range=0.3
    )
    rm.save_pretrained(path)
    return load_reward_model(str(path))


PAIRS_PROMPTS = [[BOS, 5], [BOS, 7, 8, 9, 10], [BOS], [BOS, 3, 4], [BOS, 11, 12, 13], [BOS, 6]]
PAIRS_RESPONSES = [[4, EOS], [6], [20, 21, 22, 23, EOS], [], [9, 9], [14, 15, 16]]


def _one_pair_score(model, prompt, response):
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([prompt + response])).logits[0, 0])


def _score_counting(scorer, model):
    """The scorer's scores of the PAIRS, and the model's forward passes (one list item each)."""
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        return scorer.score(PAIRS_PROMPTS, PAIRS_RESPONSES), calls
    finally:
        handle.remove()


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_reward_scorer_one_forward_and_per_pair_scores(reward_model, padding_side):
    scorer = RewardScorer(reward_model, PAD, batch_size=8, padding_side=padding_side)
    scores, calls = _score_counting(scorer, reward_model)
    assert len(calls) == 1
    want = [_one_pair_score(reward_model, p, r) for p, r in zip(PAIRS_PROMPTS, PAIRS_RESPONSES)]
    assert scores == pytest.approx(want, abs=1e-5)
    assert len({round(s, 4) for s in scores}) > 1  # a real signal, not a constant


def test_reward_scorer_chunks_by_batch_size(reward_model):
    scorer = RewardScorer(reward_model, PAD, batch_size=4)
    scores, calls = _score_counting(scorer, reward_model)
    assert len(calls) == 2
    assert scores == pytest.approx(
        RewardScorer(reward_model, PAD, 64).score(PAIRS_PROMPTS, PAIRS_RESPONSES), abs=1e-5
    )


def test_reward_scorer_sets_missing_pad_id():
    rm = build_tiny_reward_model(24, pad_token_id=PAD, seed=1)
    rm.config.pad_token_id = None
    scorer = RewardScorer(rm, SimpleNamespace(pad_token_id=None, eos_token_id=EOS), 4)
    assert scorer.pad_token_id == EOS and rm.config.pad_token_id == EOS
    with pytest.raises(ValueError, match="3 responses"):
        scorer.score([[BOS]], [[5], [6], [7]])


def test_reward_label_index():
    assert _label_index(SimpleNamespace(num_labels=1), None) == 0
    imdb = SimpleNamespace(num_labels=2, id2label={0: "NEGATIVE", 1: "POSITIVE"})
    assert _label_index(imdb, None) == 1
    with pytest.raises(ValueError, match="label_index"):
        _label_index(SimpleNamespace(num_labels=3, id2label={0: "a", 1: "b", 2: "c"}), None)
