"""Loading hub / local checkpoints: dtype choice, quantization, one-line errors.

Thin wrappers over ``transformers.Auto*.from_pretrained``. What they add: ``dtype="auto"``
picks bf16 / fp16 / fp32 from the device (not from the checkpoint), a missing or offline
model becomes one ``RuntimeError`` line saying how to run offline, and quantized aliases
are refused clearly where bitsandbytes cannot run.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

_OFFLINE_HINT = (
    "to run offline, pre-download it into the HF cache (`hf download {name}`) and set "
    "HF_HUB_OFFLINE=1, or use the offline family model=tiny"
)


def _is_cuda(device: str | torch.device | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """``"auto"`` -> bf16 on CUDA with compute capability >= 8.0, fp16 on older CUDA, fp32
    elsewhere; names such as ``"bf16"`` / ``"float32"`` and ``torch.dtype`` pass through."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key == "auto":
        if _is_cuda(device) and torch.cuda.is_available():
            major, _ = torch.cuda.get_device_capability(torch.device(device))
            return torch.bfloat16 if major >= 8 else torch.float16
        return torch.float32
    if key not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def _quantization_config(quantization: str, device: str, compute_dtype: torch.dtype) -> Any:
    """A bitsandbytes config (nf4 + double quantization for 4bit), or a clear RuntimeError."""
    if quantization not in ("8bit", "4bit"):
        raise ValueError(f"quantization={quantization!r}: expected '8bit', '4bit' or None")
    if not (_is_cuda(device) and torch.cuda.is_available()):
        why = "CUDA is not available" if not torch.cuda.is_available() else f"device={device}"
        raise RuntimeError(
            f"model alias ...-{quantization} needs CUDA + bitsandbytes ({why}); drop the "
            f"-{quantization} suffix to load full precision, or use model=tiny on CPU"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeError(
            f"model alias ...-{quantization} needs CUDA + bitsandbytes (bitsandbytes is not "
            f"installed: pip install bitsandbytes); or drop the -{quantization} suffix"
        )
    from transformers import BitsAndBytesConfig

    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def _load_error(what: str, name: str, err: Exception) -> RuntimeError:
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return RuntimeError(
        f"could not load {what} {name!r} ({reason}); " + _OFFLINE_HINT.format(name=name)
    )


def _load_errors() -> tuple[type[Exception], ...]:
    errors: list[type[Exception]] = [OSError]
    try:  # hub validation / HTTP errors are OSError or ValueError depending on the version
        from huggingface_hub.errors import HfHubHTTPError, HFValidationError

        errors += [HFValidationError, HfHubHTTPError]
    except ImportError:  # pragma: no cover - very old huggingface_hub
        pass
    return tuple(errors)


def _from_pretrained(auto_cls: Any, what: str, name: str, **kwargs: Any) -> Any:
    try:
        return auto_cls.from_pretrained(name, **kwargs)
    except _load_errors() as err:
        raise _load_error(what, name, err) from err


def load_causal_lm(
    name_or_path: str,
    *,
    dtype: str | torch.dtype = "auto",
    attn_impl: str = "eager",
    device: str = "cpu",
    device_map: str | dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    quantization: str | None = None,
) -> torch.nn.Module:
    """A causal LM from the hub or a local folder, on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    return _load_model(
        AutoModelForCausalLM,
        "model",
        name_or_path,
        dtype=dtype,
        attn_impl=attn_impl,
        device=device,
        device_map=device_map,
        trust_remote_code=trust_remote_code,
        quantization=quantization,
    )


def load_reward_model(
    name_or_path: str,
    *,
    dtype: str | torch.dtype = "auto",
    attn_impl: str | None = None,
    device: str = "cpu",
    device_map: str | dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    quantization: str | None = None,
) -> torch.nn.Module:
    """A sequence-classification (reward) model, on ``device``, in eval mode.

    ``attn_impl=None`` keeps the architecture's default (not every encoder supports eager).
    """
    from transformers import AutoModelForSequenceClassification

    return _load_model(
        AutoModelForSequenceClassification,
        "reward model",
        name_or_path,
        dtype=dtype,
        attn_impl=attn_impl,
        device=device,
        device_map=device_map,
        trust_remote_code=trust_remote_code,
        quantization=quantization,
    )


def _load_model(
    auto_cls: Any,
    what: str,
    name: str,
    *,
    dtype: str | torch.dtype,
    attn_impl: str | None,
    device: str,
    device_map: str | dict[str, Any] | None,
    trust_remote_code: bool,
    quantization: str | None,
) -> torch.nn.Module:
    torch_dtype = resolve_dtype(dtype, device)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if attn_impl is not None:
        kwargs["attn_implementation"] = attn_impl
    if quantization is not None:
        kwargs["quantization_config"] = _quantization_config(quantization, device, torch_dtype)
        device_map = device_map if device_map is not None else {"": torch.device(device)}
    if device_map is not None:
        kwargs["device_map"] = device_map
    model = _from_pretrained(auto_cls, what, name, **kwargs)
    if device_map is None:
        model = model.to(device)
    model.eval()
    return model


def load_tokenizer(
    name_or_path: str,
    *,
    trust_remote_code: bool = False,
    padding_side: str = "left",
) -> Any:
    """A tokenizer; when it has no pad token, EOS doubles as pad.

    Generation works on id lists and takes ``pad_token_id`` explicitly, so pad == EOS is
    harmless there (padding is tracked by attention masks, never by the pad id).
    """
    from transformers import AutoTokenizer

    tok = _from_pretrained(
        AutoTokenizer, "tokenizer", name_or_path, trust_remote_code=trust_remote_code
    )
    if tok.pad_token_id is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok


def check_shared_vocab(tok_a: Any, tok_b: Any, what: str) -> None:
    """Raise ValueError unless the two tokenizers map the same strings to the same ids.

    Guided decoding adds the guide's offsets to the reference's logits id by id, so guide
    and reference must share a tokenizer. (Their embedding matrices may still be padded to
    different widths; compare logits on ``len(tokenizer)`` entries.)
    """
    vocab_a, vocab_b = tok_a.get_vocab(), tok_b.get_vocab()
    if vocab_a == vocab_b:
        return
    differing = sum(1 for t in vocab_a.keys() | vocab_b.keys() if vocab_a.get(t) != vocab_b.get(t))
    raise ValueError(
        f"{what}: the tokenizers differ (vocabulary sizes {len(vocab_a)} vs {len(vocab_b)}, "
        f"{differing} tokens mapped differently); guide and reference must share a tokenizer, "
        "pick a family whose checkpoints share one"
    )
