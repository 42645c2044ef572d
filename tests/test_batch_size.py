"""Auto batch size: the search on simulated memory curves, the cache, the CPU path, the logs,
and the CUDA adapter's workloads run on a tiny model on the CPU."""

from __future__ import annotations

import json
import logging
import math
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pita.runtime import batch_size as bs
from pita.runtime.batch_size import (
    BatchSizeCache,
    MemoryEstimate,
    ProbeSetup,
    estimate_from_config,
    is_auto,
    power_binary_search,
    resolve_batch_size,
    search_batch_size,
)
from pita.runtime.batch_size import cache as bs_cache
from pita.runtime.batch_size import resolve as bs_resolve

GiB = float(1 << 30)
FREE = 80 * GiB
MARGIN = 0.9
BUDGET = MARGIN * FREE


class SimulatedGPU:
    """``measure`` for a memory curve: true bytes × (1 ± noise), and a real
    ``torch.OutOfMemoryError`` past the device's free memory, as the CUDA adapter sees."""

    def __init__(
        self,
        curve: Callable[[int], float],
        *,
        noise: float = 0.0,
        seed: int = 0,
        free: float = FREE,
    ) -> None:
        self.curve, self.noise, self.free = curve, noise, free
        self.rng = random.Random(seed)
        self.calls: list[int] = []

    def __call__(self, b: int) -> float:
        self.calls.append(b)
        used = self.curve(b) * (1 + self.rng.uniform(-self.noise, self.noise))
        if used > self.free:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {used / GiB:.2f} GiB. GPU 0 has a total "
                f"capacity of 79.19 GiB of which {self.free / GiB:.2f} GiB is free."
            )
        return used


def true_max(curve: Callable[[int], float], budget: float = BUDGET, cap: int = 2048) -> int:
    b = 0
    while b < cap and curve(b + 1) <= budget:
        b += 1
    return b


# (curve, true per-sample bytes, true fixed bytes): the analytic estimate is built from these
# with an error factor, as a real one is off by tens of percent.
SMOOTH = {
    "linear": (lambda b: 0.25 * GiB * b, 0.25 * GiB, 0.0),
    "fixed_overhead": (lambda b: 20 * GiB + 0.1 * GiB * b, 0.1 * GiB, 20 * GiB),
    "quadratic": (lambda b: 2 * GiB + 0.1 * GiB * b + 0.0002 * GiB * b * b, 0.1 * GiB, 2 * GiB),
}
NOISY = (lambda b: 20 * GiB + 0.1 * GiB * b, 0.1 * GiB, 20 * GiB)


# An allocator block change: +10 GiB from batch 420 on. The line through probes below the
# step predicts ~438, which uses 14% of the target more than predicted, so the search must
# fall back; the right answer is 419.
def STEP(b: int) -> float:
    return 4 * GiB + 0.15 * GiB * b + (10 * GiB if b >= 420 else 0.0)


def estimate(per_sample: float, fixed: float, factor: float) -> MemoryEstimate:
    return MemoryEstimate(per_sample_bytes=per_sample * factor, fixed_bytes=fixed)


def check_choice(result: bs.SearchResult, curve: Callable[[int], float]) -> float:
    """The chosen batch never exceeds the target; returns its utilisation of the target."""
    assert result.batch_size >= 1
    used = curve(result.batch_size)
    assert used <= BUDGET, f"batch {result.batch_size} uses {used / GiB:.2f} GiB > target"
    assert result.found <= true_max(curve) + 1  # noise may admit one past the true edge
    return used / BUDGET


# ---------------------------------------------------------------------------- the search


@pytest.mark.parametrize("name", sorted(SMOOTH))
@pytest.mark.parametrize("factor", [0.6, 1.0, 1.5])
def test_smooth_curves_converge_within_four_probes(name: str, factor: float) -> None:
    curve, per_sample, fixed = SMOOTH[name]
    gpu = SimulatedGPU(curve)
    result = search_batch_size(gpu, BUDGET, estimate=estimate(per_sample, fixed, factor))
    assert result.method == "fit"
    assert result.probes <= 4 and len(gpu.calls) == result.probes
    assert check_choice(result, curve) >= 0.85
    assert result.batch_size == max(1, int(result.found * 0.95))


@pytest.mark.parametrize("seed", range(10))
def test_noisy_curve_converges_within_four_probes(seed: int) -> None:
    curve, per_sample, fixed = NOISY
    gpu = SimulatedGPU(curve, noise=0.02, seed=seed)
    factor = (0.6, 1.0, 1.5)[seed % 3]
    result = search_batch_size(gpu, BUDGET, estimate=estimate(per_sample, fixed, factor))
    assert result.probes <= 4
    assert check_choice(result, curve) >= 0.85


def test_fit_beats_power_binary_search() -> None:
    curve, per_sample, fixed = SMOOTH["fixed_overhead"]
    ours = search_batch_size(SimulatedGPU(curve), BUDGET, estimate=estimate(per_sample, fixed, 1))
    baseline = power_binary_search(SimulatedGPU(curve), BUDGET)
    assert baseline.found == true_max(curve)  # the guide's search is exact ...
    assert baseline.probes >= 2 * math.floor(math.log2(baseline.found))  # ... and slow
    assert ours.probes <= 4 < baseline.probes


def test_step_curve_falls_back_and_is_still_correct(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=bs.__name__)
    result = search_batch_size(
        SimulatedGPU(STEP), BUDGET, estimate=MemoryEstimate(0.15 * GiB, 4 * GiB)
    )
    assert result.method == "fallback"
    assert any(t.phase in {"power", "binary"} for t in result.trace)
    assert "Binary phase - Trial" in caplog.text
    assert check_choice(result, STEP) >= 0.85
    assert true_max(STEP) == 419 and 419 - 419 // 32 <= result.found <= 419


def test_without_an_estimate_it_still_converges() -> None:
    for name, (curve, _, _) in SMOOTH.items():
        result = search_batch_size(SimulatedGPU(curve), BUDGET)
        assert check_choice(result, curve) >= 0.85, name
        assert result.probes <= 10, name


def test_estimate_far_too_low_recovers_from_oom() -> None:
    curve, per_sample, fixed = SMOOTH["linear"]
    gpu = SimulatedGPU(curve)  # the estimate says 8x more fits than does
    result = search_batch_size(gpu, BUDGET, estimate=estimate(per_sample, fixed, 1 / 8))
    assert math.isinf(result.trace[0].bytes)  # the first probe ran out of memory
    assert check_choice(result, curve) >= 0.85


def test_the_cap_bounds_the_search() -> None:
    curve, per_sample, fixed = SMOOTH["linear"]
    result = search_batch_size(
        SimulatedGPU(curve), BUDGET, cap=100, estimate=estimate(per_sample, fixed, 1.0)
    )
    assert result.found == 100
    assert result.batch_size == 100  # capped with memory to spare: no reduction needed
    assert result.probes <= 4


def test_nothing_fits_returns_one_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    result = search_batch_size(SimulatedGPU(lambda b: 100 * GiB * b), BUDGET)
    assert (result.found, result.batch_size) == (0, 1)
    assert "Even batch size 1 does not fit" in caplog.text


@pytest.mark.parametrize("signal", ["cublas", "inf", "none"])
def test_other_out_of_memory_signals(signal: str) -> None:
    curve = SMOOTH["linear"][0]

    def measure(b: int) -> float | None:
        if curve(b) <= FREE:
            return curve(b)
        if signal == "cublas":
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")
        return math.inf if signal == "inf" else None

    result = search_batch_size(measure, BUDGET)  # type: ignore[arg-type]
    assert check_choice(result, curve) >= 0.85


def test_a_real_error_is_not_swallowed() -> None:
    def measure(b: int) -> float:
        raise ValueError("bad prompt")

    with pytest.raises(ValueError, match="bad prompt"):
        search_batch_size(measure, BUDGET)


# ---------------------------------------------------------------------------- logs


def test_log_lines_match_the_guide(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    result = power_binary_search(SimulatedGPU(lambda b: 2.25 * GiB * b), BUDGET)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "Power phase - Trial 1: Testing batch size 1"
    assert re.fullmatch(r"Batch size 1 uses 2\.25 GiB .*", lines[1])
    assert "Found optimal batch size: 32, using 30 for safety" in lines  # the guide's example
    assert result.batch_size == 30


def test_fit_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    curve, per_sample, fixed = SMOOTH["linear"]
    result = search_batch_size(
        SimulatedGPU(curve), BUDGET, estimate=estimate(per_sample, fixed, 1.0)
    )
    trials = [r.getMessage() for r in caplog.records if "Testing batch size" in r.getMessage()]
    assert len(trials) == result.probes
    for i, line in enumerate(trials, 1):
        assert re.fullmatch(rf"Fit phase - Trial {i}: Testing batch size \d+", line)
    found = re.search(r"Found optimal batch size: (\d+), using (\d+) for safety", caplog.text)
    assert found and int(found[1]) == result.found and int(found[2]) == result.batch_size


# ---------------------------------------------------------------------------- resolve + CPU


def test_is_auto() -> None:
    assert is_auto("auto") and is_auto("auto_batch_size") and is_auto(" AUTO ")
    assert not is_auto(32) and not is_auto("32") and not is_auto(None)


def test_int_passes_through_and_bad_values_raise() -> None:
    kw = {
        "stage_kind": "generate",
        "fallback": 4,
        "measure_fn_factory": None,
        "cache_path": None,
        "cache_key": {},
    }
    assert resolve_batch_size(32, **kw) == 32  # type: ignore[arg-type]
    for bad in (0, -1, True, "big", 2.5):
        with pytest.raises(ValueError, match="batch size"):
            resolve_batch_size(bad, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lower is safer"):
        resolve_batch_size("auto", safety_margin=1.5, **kw)  # type: ignore[arg-type]


def test_cpu_returns_the_fallback_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=bs.__name__)
    got = resolve_batch_size(
        "auto_batch_size",
        stage_kind="evaluate",
        fallback=8,
        measure_fn_factory=None,
        cache_path=None,
        cache_key={},
    )
    assert got == 8
    assert len(caplog.records) == 1
    assert "nothing to measure" in caplog.text and "fallback batch size 8" in caplog.text


def test_cpu_model_factory_returns_the_fallback(tiny_model, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger=bs.__name__)
    factory = bs.generation_probe(tiny_model, [1, 2, 3], 4, {"do_sample": False})
    assert factory() is None  # no CUDA here, or the model is on the CPU
    got = resolve_batch_size(
        "auto",
        stage_kind="generate",
        fallback=3,
        measure_fn_factory=factory,
        cache_path=None,
        cache_key={},
    )
    assert got == 3 and len(caplog.records) == 1


# ---------------------------------------------------------------------------- cache


DEVICE = {"devices": [{"name": "NVIDIA H100 80GB HBM3", "total_bytes": 85_520_809_984}]}


def make_factory(gpu: SimulatedGPU, free: float = FREE, device: dict | None = None):  # type: ignore[no-untyped-def]
    def factory() -> ProbeSetup:
        return ProbeSetup(
            measure=gpu,
            free_bytes=free,
            key=dict(device or DEVICE),
            estimate=MemoryEstimate(0.1 * GiB, 20 * GiB),
        )

    return factory


def resolve(
    gpu: SimulatedGPU,
    path: Path,
    *,
    free: float = FREE,
    device: dict | None = None,
    margin: float = MARGIN,
    **key: object,
) -> int:
    cache_key = {
        "model": "llama-1b",
        "dtype": "torch.bfloat16",
        "prompt_tokens": 512,
        "new_tokens": 256,
        **key,
    }
    return resolve_batch_size(
        "auto",
        stage_kind="generate",
        fallback=1,
        measure_fn_factory=make_factory(gpu, free, device),
        cache_path=path,
        cache_key=cache_key,
        safety_margin=margin,
        cap=2048,
    )


def test_cache_hit_and_miss_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cache" / "batch_size.json"
    gpu = SimulatedGPU(SMOOTH["fixed_overhead"][0])
    first = resolve(gpu, path)
    assert gpu.calls and path.exists()
    data = json.loads(path.read_text())
    assert data["version"] == 1 and len(data["entries"]) == 1

    def probed(**kw: object) -> bool:
        before = len(gpu.calls)
        resolve(gpu, path, **kw)  # type: ignore[arg-type]
        return len(gpu.calls) > before

    assert resolve(gpu, path) == first and not probed()  # same everything: hit
    assert not probed(free=FREE + 4 * GiB)  # more free memory than when probed: hit
    assert probed(free=FREE - 4 * GiB)  # less free memory: miss (and the entry is replaced)
    resolve(gpu, path)  # re-probe at full memory so later checks start from it
    other_gpu = {"devices": [{"name": "NVIDIA A100-SXM4-40GB", "total_bytes": 42_505_273_344}]}
    assert probed(device=other_gpu)
    assert probed(model="qwen-0.5b")
    assert probed(new_tokens=512)
    assert probed(prompt_tokens=1024)
    assert probed(dtype="torch.float32")
    assert probed(margin=0.8)  # a lower (safer) margin than the entry was found with
    assert not probed(margin=0.95)
    monkeypatch.setattr(
        bs_resolve, "library_versions", lambda: {"torch": "9.9", "transformers": "9"}
    )
    assert probed()
    assert not any(p.name.startswith(".batch_size.json.") for p in path.parent.iterdir())


def test_cache_atomic_write_and_corrupt_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "batch_size.json"
    path.write_text("{not json")
    replaced: list[tuple[str, str]] = []
    real_replace = bs_cache.os.replace

    def spy(src: str, dst: str) -> None:
        replaced.append((str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(bs_cache.os, "replace", spy)
    gpu = SimulatedGPU(SMOOTH["linear"][0])
    got = resolve(gpu, path)
    assert replaced and replaced[-1][1] == str(path)
    assert json.loads(path.read_text())["entries"]
    assert resolve(gpu, path) == got


def test_cache_entry_limited_by_a_smaller_cap(tmp_path: Path) -> None:
    cache = BatchSizeCache(tmp_path / "c.json")
    key = {"k": 1}
    gpu = SimulatedGPU(SMOOTH["linear"][0])
    result = search_batch_size(gpu, BUDGET, cap=64)
    cache.store(key, result, free_bytes=FREE, safety_margin=MARGIN, cap=64)
    assert cache.lookup(key, free_bytes=FREE, safety_margin=MARGIN, cap=64) is not None
    assert cache.lookup(key, free_bytes=FREE, safety_margin=MARGIN, cap=1024) is None
    smaller = cache.lookup(key, free_bytes=FREE, safety_margin=MARGIN, cap=32)
    assert smaller is not None and smaller["batch_size"] <= 32


# ---------------------------------------------------------------------------- the adapter


@pytest.fixture(scope="module")
def tiny_model():  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    from tests.archs import llama

    torch.manual_seed(0)
    config = llama(64, 32, 64, 2, 4, 2, max_position_embeddings=128, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def test_generation_workload_forces_max_new_tokens(tiny_model, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    shapes: list[tuple[int, ...]] = []
    real_generate = tiny_model.generate

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real_generate(*args, **kwargs)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(tiny_model, "generate", spy)
    # bias the model towards EOS: without min_new_tokens it would stop at once
    with torch.no_grad():
        tiny_model.lm_head.weight[2].fill_(5.0)
    try:
        run = bs.generation_workload(
            tiny_model, [5, 6, 7, 8, 9], 6, {"do_sample": False, "stop_strings": ["x"]}
        )
        run(3)
    finally:
        with torch.no_grad():
            tiny_model.lm_head.weight[2].normal_(0, 0.02)
    assert shapes == [(3, 5 + 6)]


def test_training_workload_leaves_the_weights_alone(tiny_model) -> None:  # type: ignore[no-untyped-def]
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    steps: list[int] = []

    def loss_fn(model, batch):  # type: ignore[no-untyped-def]
        steps.append(batch["input_ids"].shape[0])
        return model(**batch).loss

    run = bs.training_workload(
        tiny_model, bs._causal_lm_batch(tiny_model, list(range(3, 19))), loss_fn=loss_fn
    )
    run(4)
    assert steps == [4, 4]  # >= 2 optimizer steps
    assert all(p.grad is None for p in tiny_model.parameters())
    assert not tiny_model.training
    for k, v in tiny_model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_estimate_from_config_counts_the_kv_cache() -> None:
    from tests.archs import llama

    cfg = llama(128256, 2048, 8192, 16, 32, 8, head_dim=64)
    a = estimate_from_config(cfg, mode="generate", prompt_tokens=512, new_tokens=256)
    b = estimate_from_config(cfg, mode="generate", prompt_tokens=512, new_tokens=512)
    kv_per_token = 2 * 16 * 8 * 64 * 2  # K and V, layers, kv heads, head dim, bf16 bytes
    assert b.per_sample_bytes - a.per_sample_bytes == 256 * kv_per_token
    assert a.fixed_bytes == 0 and 2.0e9 < a.weights_bytes < 3.5e9  # ~1.2-1.5B params in bf16
    t = estimate_from_config(cfg, mode="train", prompt_tokens=512)
    assert t.fixed_bytes > a.weights_bytes  # gradients + AdamW moments
    ckpt = estimate_from_config(cfg, mode="train", prompt_tokens=512, gradient_checkpointing=True)
    assert ckpt.per_sample_bytes < t.per_sample_bytes
    assert 0 < a.max_batch(72 * GiB) < 2048


def test_estimate_from_model(tiny_model) -> None:  # type: ignore[no-untyped-def]
    est = bs.estimate_from_model(tiny_model, mode="generate", prompt_tokens=10, new_tokens=5)
    assert est is not None and est.per_sample_bytes > 0
    n = sum(p.numel() for p in tiny_model.parameters())
    assert est.weights_bytes == n * 4  # float32


# ------------------------------------------------- the CUDA meter, on a fake torch.cuda


class FakeCuda:
    """The torch.cuda calls the meter makes, over simulated devices: ``use[d]`` bytes per
    sample on device d (a sharded model loads its devices unevenly)."""

    def __init__(self, free: dict[int, float], use: dict[int, float]) -> None:
        self.free, self.use = free, use
        self.reserved = {d: int(2 * GiB) for d in free}  # weights
        self.peak = dict(self.reserved)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in (
            "is_available",
            "device_count",
            "mem_get_info",
            "get_device_properties",
            "synchronize",
            "reset_peak_memory_stats",
            "memory_reserved",
            "max_memory_reserved",
            "empty_cache",
        ):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.free)

    def mem_get_info(self, d: int) -> tuple[int, int]:
        return int(self.free[d]), int(80 * GiB)

    def get_device_properties(self, d: int):  # type: ignore[no-untyped-def]
        from types import SimpleNamespace

        return SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=int(80 * GiB))

    def synchronize(self, d: int | None = None) -> None:
        pass

    def reset_peak_memory_stats(self, d: int) -> None:
        self.peak[d] = self.reserved[d]

    def memory_reserved(self, d: int) -> int:
        return self.reserved[d]

    def max_memory_reserved(self, d: int) -> int:
        return self.peak[d]

    def empty_cache(self) -> None:
        pass

    def workload(self, b: int) -> None:
        for d, per_sample in self.use.items():
            if per_sample * b > self.free[d]:
                raise torch.OutOfMemoryError(f"CUDA out of memory on device {d}")
            self.peak[d] = max(self.peak[d], self.reserved[d] + int(per_sample * b))


def sharded_model():  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    params = [SimpleNamespace(device=SimpleNamespace(type="cuda", index=d)) for d in (0, 1)]
    return SimpleNamespace(parameters=lambda: iter(params), buffers=lambda: iter(()))


@pytest.mark.parametrize(
    ("free", "use", "limit"),
    [
        # equal devices: device 1 is the most loaded and decides (0.9·40/0.5 = 72), where the
        # guide's sum over devices would allow 0.9·80/0.8 = 90 and OOM device 1
        ({0: 40 * GiB, 1: 40 * GiB}, {0: 0.3 * GiB, 1: 0.5 * GiB}, 72),
        # unequal free memory: device 0 is the tighter one (0.9·20/0.3 = 60)
        ({0: 20 * GiB, 1: 40 * GiB}, {0: 0.3 * GiB, 1: 0.5 * GiB}, 60),
    ],
)
def test_sharded_model_most_loaded_device_decides(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, free: dict, use: dict, limit: int
) -> None:
    fake = FakeCuda(free, use)
    fake.install(monkeypatch)
    factory = bs.workload_probe(
        fake.workload, models=[sharded_model()], estimate=MemoryEstimate(0.4 * GiB), key={"m": 1}
    )
    setup = factory()
    assert setup is not None and setup.free_bytes == min(free.values())
    assert [d["name"] for d in setup.key["devices"]] == ["NVIDIA H100 80GB HBM3"] * 2
    got = resolve_batch_size(
        "auto",
        stage_kind="generate",
        fallback=1,
        measure_fn_factory=factory,
        cache_path=tmp_path / "c.json",
        cache_key={},
    )
    assert int(0.95 * (limit - limit // 16)) <= got <= int(0.95 * limit)
    for d in (0, 1):  # the chosen batch fits every device's own target
        assert use[d] * got <= 0.9 * free[d]


def test_meter_turns_oom_into_inf_and_passes_other_errors(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fake = FakeCuda({0: 10 * GiB}, {0: 1 * GiB})
    fake.install(monkeypatch)
    meter = bs._CudaMeter([0], logging.getLogger("test"))
    measure = meter.measure(fake.workload)
    assert measure(4) == 4 * GiB
    assert measure(11) == math.inf

    def broken(b: int) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        meter.measure(broken)(1)
