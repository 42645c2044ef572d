"""Issue 11: packing tasks on a GPU by memory, estimates that learn, CPU threads as a budget."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future

import pytest
from omegaconf import OmegaConf

from pita.core.dag import Plan
from pita.core.executor import TaskOutcome
from pita.core.parallel_executor import DagRunner, DeviceState, Scheduler
from pita.core.resources import host_cores, max_tasks_per_device, thread_budget, thread_env
from pita.core.tasks import TASK_STAGES
from pita.experiment import estimates
from tests.conftest import journal, only, run_cli, run_dirs, task_spec

STAGES = TASK_STAGES  # every stage a task can have
FAKE_8GB = 8 * 1024


def _task(tid, mem=1000, prio=1.0, stage="collect", rnd=0, deps=(), algo="QSharp"):
    return task_spec(
        id=tid,
        algo=algo,
        round=rnd,
        stage=stage,
        mem_mb=mem,
        priority=prio,
        deps=list(deps),
        family_cfg={"name": "tiny"},
        dataset_cfg={"name": "goal_walk"},
    )


def _fake_8gb(max_tasks=8):
    return Scheduler([DeviceState(0, FAKE_8GB, FAKE_8GB)], max_tasks_per_device=max_tasks)


# ---- the policy ------------------------------------------------------------------------------


def test_auto_packs_gpus_and_keeps_cpu_slots_at_one_task():
    assert max_tasks_per_device("auto", "cuda", 1, cores=16) == 8  # the measured cap
    assert max_tasks_per_device("auto", "cuda", 8, cores=16) == 2  # one core per packed worker
    assert max_tasks_per_device("auto", "fake", 1, cores=2) == 2
    assert max_tasks_per_device("auto", "cpu", 4, cores=16) == 1  # CPU mode unchanged
    assert max_tasks_per_device(3, "cuda", 1, cores=16) == 3  # an integer keeps its meaning


def test_thread_budget_is_cores_over_concurrent_workers():
    assert thread_budget("cuda", 1, 8, cores=16) == 2
    assert thread_budget("cuda", 8, 8, cores=16) == 1  # never 0
    assert (
        thread_budget("cpu", 2, 1, threads_per_worker=3, cores=16) == 3
    )  # CPU mode: as configured
    env = thread_env(4)
    assert (
        env["OMP_NUM_THREADS"] == env["PITA_TORCH_THREADS"] == "4"
        and env["PITA_DATALOADER_WORKERS"] == "3"
    )


def test_default_and_bad_max_tasks_per_gpu(tmp_path):
    from pita.experiment.config import ExecutorConfig

    assert ExecutorConfig().max_tasks_per_gpu == "auto"
    r = run_cli(["executor.max_tasks_per_gpu=lots", "dry_run=true"], tmp_path)
    assert r.returncode == 2 and "executor.max_tasks_per_gpu" in r.stderr + r.stdout


# ---- admission on fake:[8GB] -------------------------------------------------------------------


def test_tasks_fit_or_wait_on_a_fake_8gb_device():
    s = _fake_8gb()
    placed = s.place(
        [_task("a", 3000, 5), _task("b", 3000, 4), _task("c", 3000, 3), _task("d", 1000, 2)]
    )
    assert [t.id for t, _ in placed] == ["a", "b", "d"]  # c (3 GB) would exceed 8 GB; d (1 GB) fits
    assert s.available_mb(s.devices[0]) == FAKE_8GB - 7000
    s.release("a")
    assert [t.id for t, _ in s.place([_task("c", 3000, 3)])] == ["c"]


def test_the_cap_bounds_packing_even_when_memory_is_left():
    s = _fake_8gb(max_tasks=2)
    assert len(s.place([_task(f"t{i}", 100) for i in range(5)])) == 2


def test_large_single_device_task_is_not_starved_by_small_ones():
    s = _fake_8gb()
    s.place([_task("running", 3000)])
    waiting = [_task("large", 6000, prio=9), _task("small", 500, prio=1)]
    assert s.place(waiting) == []  # the device is held for the large task (> half the device)
    assert s.held == {0: "large"}
    s.release("running")
    assert [t.id for t, _ in s.place(waiting)] == ["large", "small"]


def test_a_passed_over_task_ages_into_a_hold():
    s = _fake_8gb()
    s.place([_task("r1", 2500), _task("r2", 2500)])  # 3.1 GB left
    medium = _task("medium", 3500, prio=9)  # not large (< half of 8 GB), does not fit yet
    for i in range(s.hold_after):
        placed = s.place([medium, _task(f"small{i}", 600, prio=1)])
        assert [t.id for t, _ in placed] == [f"small{i}"]
    # passed over hold_after times: now it holds the device and small tasks wait
    assert s.place([medium, _task("late", 100, prio=1)]) == []
    for tid in ("r1", "r2", *[f"small{i}" for i in range(s.hold_after)]):
        s.release(tid)
    assert [t.id for t, _ in s.place([medium])] == ["medium"]


# ---- learning from measured peaks -----------------------------------------------------------------


class _PeakExecutor:
    """Runs tasks in threads; each 'uses' `real_mb` of the fake device while it runs and
    reports it as its measured peak; records the largest real total at any moment."""

    def __init__(self, real_mb):
        self.real_mb = real_mb
        self.in_use = 0
        self.max_in_use = 0
        self.max_running = 0
        self.running = 0
        self.lock = threading.Lock()

    def submit(self, task, devices, cfg_dict, run_dir, attempt):
        fut: Future = Future()

        def work():
            with self.lock:
                self.in_use += self.real_mb
                self.running += 1
                self.max_in_use = max(self.max_in_use, self.in_use)
                self.max_running = max(self.max_running, self.running)
            time.sleep(0.05)
            with self.lock:
                self.in_use -= self.real_mb
                self.running -= 1
            fut.set_result(TaskOutcome(task.id, True, result={"peak_gpu_mb": self.real_mb}))

        threading.Thread(target=work, daemon=True).start()
        return fut


CFG = OmegaConf.create({"generation": {"batch_size": 64}, "algos": {"QSharp": {"batch_size": 256}}})


def test_packing_tasks_whose_real_peaks_exceed_the_device_is_held_back_by_admission():
    """Five collect tasks each really need 5 GB of an 8 GB device while planned at 1 GB.
    The first reports its peak; the DagRunner re-estimates the rest, which then run one at
    a time. Without the learned peaks (control) two would share the device: 10 GB."""

    def plan():
        p = Plan()
        p.add(_task("first", 1000, prio=9))
        for r in range(1, 5):
            p.add(_task(f"next{r}", 1000, rnd=r, deps=["first"]))
        return p

    learned = _PeakExecutor(real_mb=5000)
    runner = DagRunner(
        plan(),
        learned,
        _fake_8gb(),
        cfg_dict={},
        run_dir="unused",
        estimator=estimates.PeakEstimator(CFG),
    )
    assert runner.run().ok
    assert learned.max_running == 1 and learned.max_in_use <= FAKE_8GB
    assert (
        runner.plan.tasks["next4"].mem_mb
        == int(5000 * estimates.PEAK_MARGIN) + estimates.WORKER_OVERHEAD_MB
    )

    control = _PeakExecutor(real_mb=5000)
    assert DagRunner(plan(), control, _fake_8gb(), cfg_dict={}, run_dir="unused").run().ok
    assert control.max_in_use > FAKE_8GB  # what packing on wrong estimates would do


def test_a_recorded_peak_feeds_the_next_estimate_and_the_cache(tmp_path):
    cache = tmp_path / "task_peaks.json"
    done = _task("QSharp.goal_walk.tiny.r0.collect.s00", stage="collect")
    later = _task("QSharp.goal_walk.tiny.r1.collect.s01", stage="collect", rnd=1)
    other = _task("QSharp.goal_walk.tiny.r0.train", stage="train")
    peaks = estimates.PeakEstimator(CFG, cache)
    assert peaks.refine(later) is None
    assert peaks.observe(done, {"peak_gpu_mb": 2048.0})
    assert not peaks.observe(done, {})  # CPU: nothing measured, nothing learned
    mb, source = estimates.estimate(later, CFG, peaks=peaks)
    assert (
        mb == int(2048 * estimates.PEAK_MARGIN) + estimates.WORKER_OVERHEAD_MB and done.id in source
    )
    assert peaks.refine(other) is None  # another stage learns nothing from it
    again = estimates.PeakEstimator(CFG, cache)  # the next run reads the cache
    assert again.refine(later)[0] == mb and "cached peak" in again.refine(later)[1]
    changed = OmegaConf.create(
        {"generation": {"batch_size": 512}, "algos": {"QSharp": {"batch_size": 256}}}
    )
    assert (
        estimates.PeakEstimator(changed, cache).refine(later) is None
    )  # other batch size: other key


def test_resume_learns_from_result_json_of_finished_tasks(tmp_path):
    t = _task("QSharp.goal_walk.tiny.r0.collect.s00")
    folder = tmp_path / "tasks" / t.id
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps({"task_id": t.id, "peak_gpu_mb": 3000.0}))
    peaks = estimates.PeakEstimator(CFG)
    peaks.learn_from_run(tmp_path, {t.id: t}, {t.id})
    assert peaks.refine(_task("QSharp.goal_walk.tiny.r1.collect.s00", rnd=1))[0] > 3000


# ---- estimates from a checkpoint -------------------------------------------------------------------


def _save_tiny_llama(folder):
    from transformers import LlamaForCausalLM

    from tests.archs import llama

    config = llama(1000, 64, 256, 2, 4, 2, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters()), model


def test_estimate_reads_a_saved_checkpoint_without_loading_it(tmp_path):
    folder = tmp_path / "ckpt"
    n_params, model = _save_tiny_llama(folder)
    size = estimates.checkpoint_size(str(folder))
    tied = model.config.tie_word_embeddings
    assert size is not None and size.params == n_params - (
        0 if not tied else model.lm_head.weight.numel()
    )
    assert size.weight_bytes == size.params * 4  # float32 as saved
    assert size.config.num_key_value_heads == 2 and size.config.num_hidden_layers == 2
    assert estimates.checkpoint_size(str(folder), "bfloat16").weight_bytes == size.params * 2

    family = {
        "name": "custom",
        "reference": str(folder),
        "guide": str(folder),
        "memory_gb": 0.5,
        "dtype": "auto",
    }
    cfg = OmegaConf.create(
        {
            "generation": {"batch_size": 64, "max_new_tokens": 0},
            "training": {"micro_batch_size": 4},
            "algos": {"DPO": {"batch_size": 8}},
        }
    )
    collect = task_spec(
        id="DPO.gsm8k.custom.r0.collect.s00",
        algo="DPO",
        dataset="gsm8k",
        family="custom",
        stage="collect",
        mem_mb=512,
        family_cfg=family,
        dataset_cfg={"name": "gsm8k", "max_prompt_tokens": 512, "max_new_tokens": 512},
    )
    train = task_spec(
        **{
            **collect.to_dict(),
            "id": "DPO.gsm8k.custom.r0.train",
            "stage": "train",
            "shard_range": (0.0, 1.0),
        }
    )
    mb_collect, source = estimates.estimate(collect, cfg)
    assert source.startswith("size: config.json of")
    weights_mb = size.weight_bytes / 2**20
    # weights + a KV cache of 64 × 1024 tokens × 2 layers × 2 kv heads × 16 dims × K,V × 2 bytes
    kv_mb = 64 * 1024 * 2 * 2 * 16 * 2 * 2 / 2**20
    assert mb_collect >= weights_mb + kv_mb + estimates.WORKER_OVERHEAD_MB
    mb_train, _ = estimates.estimate(train, cfg)
    assert mb_train > mb_collect  # gradients + AdamW state + activations
    assert mb_train >= 4 * weights_mb  # weights, grads and two moments at least


def test_a_hub_family_of_unknown_size_never_gets_a_flat_half_gigabyte():
    family = {
        "name": "custom",
        "reference": "nobody/unknown-model",
        "guide": "nobody/unknown-model",
        "memory_gb": 0.5,
        "dtype": "auto",
    }
    t = _task("DPO.gsm8k.custom.r0.collect.s00", mem=512)
    t.family, t.family_cfg, t.algo = "custom", family, "DPO"
    mb, source = estimates.estimate(t, CFG, device_mb=[80 * 1024])
    assert mb == 80 * 1024 and "whole device" in source
    family["reference"] = family["guide"] = "nobody/Some-Model-8B"
    mb, source = estimates.estimate(t, CFG, sizes=estimates.ModelSizes(), device_mb=[80 * 1024])
    assert mb > 15 * 1024 and "8B" in source  # 8e9 parameters in bf16


# ---- real workers -------------------------------------------------------------------------------


def test_packed_workers_on_a_fake_gpu_share_the_cores(tmp_path):
    """fake:[8GB] with the defaults: tasks overlap on the one device (when the host has
    >= 2 cores) and every worker runs torch on cores ÷ concurrent workers threads."""
    cap = max_tasks_per_device("auto", "fake", 1)
    if cap < 2:
        pytest.skip("one core: auto admits one task per device")
    overrides = [
        f"+executor.stage_overrides.any.{s}=tests.packing_stages:threads_stage" for s in STAGES
    ]
    r = run_cli(
        [
            'system.devices="fake:[8GB]"',
            "experiment.name=packed",
            *only("reference", "DPO"),
            "executor.progress=false",
            *overrides,
        ],
        tmp_path,
        env={"PITA_TEST_SLEEP": "1.0"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    [run_dir] = run_dirs(tmp_path, "packed")
    budget = str(thread_budget("fake", 1, cap, cores=host_cores()))
    results = [json.loads(p.read_text()) for p in run_dir.glob("tasks/*/result.json")]
    assert results and all(
        res["torch_threads"] == int(budget) and res["omp"] == budget for res in results
    )
    events = journal(run_dir)
    running, most = 0, 0
    for e in events:
        running += {"task_running": 1, "task_done": -1}.get(e["event"], 0)
        most = max(most, running)
    assert 2 <= most <= cap


def test_a_worker_without_preimport_gives_a_torch_stage_its_thread_budget(tmp_path):
    """executor.preimport=false on a fake device: the worker skips its own torch set-up (the
    suite's sleep stages never import torch) and a stage that imports torch itself still
    runs on the pool's thread budget, from the environment the worker started with."""
    from pita.core.gpu_manager import GPUManager
    from pita.core.worker_pool import WorkerPool

    pool = WorkerPool(
        GPUManager("fake:1"), max_tasks_per_device=2, preimport=False, log_dir=tmp_path / "w"
    )
    task = task_spec(
        id="t",
        algo="reference",
        dataset="-",
        family="-",
        stage="evaluate",
        fn="tests.packing_stages:threads_stage",
    )
    try:
        outcome = pool.submit(task, [0], {}, tmp_path).result(timeout=120)
    finally:
        pool.shutdown(kill=True)
    assert outcome.ok, outcome.message
    budget = thread_budget("fake", 1, 2)  # 1 on a 2-core host, where torch alone would take 2
    assert outcome.result["omp"] == str(budget) and outcome.result["torch_threads"] == budget
