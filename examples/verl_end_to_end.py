"""verl end to end on a CPU: ``python -m verl.trainer.main_ppo`` — verl 0.9.1's own trainer loop (Ray local, the FSDP2
actor, vLLM's CPU build as verl's rollout server) — trains the embedded tiny model (a 1.3 M-parameter Qwen2) on the
embedded arithmetic task with offpolicy's plug-in switched on by its config keys: a correction (TIS) after verl's
advantages and the sync check after every weight sync (``sync/*`` in verl's step metrics).

    python examples/verl_end_to_end.py                      # 6 steps; minutes on 2 cores
    python examples/verl_end_to_end.py --break-sync-at 3    # the push does nothing from step 3: the run fails there
    python examples/verl_end_to_end.py --ranks 2 --steps 3  # two FSDP ranks (gloo), two vLLM replicas
    python examples/verl_end_to_end.py --dvp 1e-3           # DVP: vLLM samples with min-p, the actor scores likewise
    python examples/verl_end_to_end.py --precision bf16     # verl's own defaults: bf16 compute, bf16 rollout
    python examples/verl_end_to_end.py --correction calibrated_is  # another correction by name (default: TIS)
    python examples/verl_end_to_end.py --correction delight --loss-mode offpolicy_calibrated_clip  # and a policy loss
    python examples/verl_end_to_end.py --model lab-moe      # the mixture-of-experts lab model on its pattern task
    python examples/verl_end_to_end.py --loop one_step_off_policy --steps 2  # verl's one-step off-policy loop
    python examples/verl_end_to_end.py --loop fully_async --steps 3          # verl's fully async loop

It ends on one line: ``verl end to end: N steps, reward A -> B, sync checks K/K ok in S s``.

``--loop`` runs one of verl's asynchronous loops instead (the trainer and one vLLM server apart, the weights over the
test kit's CPU checkpoint engine, ``offpolicy_testkit.verl_async``) through the plug-in's entry point
``python -m offpolicy.integrations.verl.async_loops LOOP``.

``--ranks R`` shards the actor over R FSDP ranks (verl's ``trainer.n_gpus_per_node``, R processes joined by gloo).
With the rollout at TP = 1 verl's hybrid engine makes each rank a rollout replica of its own: every rank gathers the
full weights (an FSDP all-gather all ranks join) and pushes them into its own vLLM server; the sync check's actor
forward runs on every rank and the engine side is scored on every replica.

What a CPU lacks is bridged by ``offpolicy_testkit.verl_cpu_bridge`` — a CPU-CI harness shipped with the repository,
not with the package (named first in the job's ``VERL_USE_EXTERNAL_MODULES``; the repository root goes on the job's
``PYTHONPATH`` so that every Ray worker imports it) — and a metadata-only ``vllm`` distribution alias on
``PYTHONPATH``; Ray gets one
logical GPU for verl's resource pool, which nothing touches. ``--break-sync-at K`` is a test harness: this file,
named in ``VERL_USE_EXTERNAL_MODULES`` too, makes vLLM's worker drop the weights it receives from the K-th sync after
the initial one (it still receives them, so verl's sender finishes normally).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent  # the repository: offpolicy_testkit/ (the CPU bridge) sits there, beside examples/
BREAK_ENV = "OFFPOLICY_VERL_E2E_BREAK_SYNC_AT"
PRECISIONS = ("fp32", "bf16")
DATA_SOURCE = "offpolicy/arithmetic"
TIS = "{name: tis, upper: 2.0}"  # the correction of the runs unless told otherwise
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the prompt as the tiny model was trained


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's custom reward function. The arithmetic task (the tiny model's): the answer graded by closeness,
    1 / (1 + |got − answer|) for a well-formed integer (1 exact), 0 otherwise. The task's own reward (1 exact, 0.1
    any other integer) gives the tiny model's two samples of a prompt the same 0.1 nearly always — GRPO's advantages
    are then 0 and the weights do not move; closeness makes the samples differ. Any other embedded model's task (the
    pattern task of ``lab`` and ``lab-moe``): its own reward, with the example's columns from ``extra_info``."""
    if data_source != DATA_SOURCE:
        from offpolicy.models import get_recipe

        info = dict(extra_info or {})
        task = get_recipe(info.pop("model")).task()
        columns = {k: [v] for k, v in info.items() if k != "index"}
        return float(task.reward([solution_str], answer=[ground_truth], **columns)[0])
    from offpolicy.tasks.base import parse_int

    got = parse_int(solution_str)
    return 0.0 if got is None else 1.0 / (1.0 + abs(got - int(ground_truth)))


def write_data(folder: Path, steps: int, prompts: int, model: str = "tiny") -> tuple[Path, Path]:
    """verl's parquet rows (``data_source``, chat ``prompt``, ``reward_model.ground_truth``) from the task the
    embedded ``model`` was warm-started on (tiny: arithmetic; lab, lab-moe: pattern)."""
    import pandas as pd

    from offpolicy.models import get_recipe

    task = get_recipe(model).task()
    source = DATA_SOURCE if task.name == "arithmetic" else f"offpolicy/{task.name}"
    extra = {} if source == DATA_SOURCE else {"model": model}  # compute_score rebuilds the task from its name

    def rows(n: int, seed: int) -> list[dict]:
        return [{"data_source": source, "prompt": [{"role": "user", "content": ex.prompt}], "ability": task.name,
                 "reward_model": {"style": "rule", "ground_truth": ex.answer},
                 "extra_info": {"index": i, **extra, **(ex.meta if extra else {})}}
                for i, ex in enumerate(task.examples(n, seed))]

    train, val = folder / "train.parquet", folder / "val.parquet"
    pd.DataFrame(rows(steps * prompts, 0)).to_parquet(train)
    pd.DataFrame(rows(prompts, 1)).to_parquet(val)
    return train, val


def model_copy(folder: Path, model: str = "tiny") -> Path:
    """An embedded model's files (``tiny``, ``lab``, ``lab-moe``: :data:`offpolicy.models.RECIPES`) with a chat
    template (verl applies one to every prompt; the embedded models have none)."""
    from offpolicy.models import model_path

    out = folder / model
    shutil.copytree(model_path(model), out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def overrides(model: Path, train: Path, val: Path, steps: int, prompts: int, samples: int, env: dict,
              ray_dir: Path, sync_check: str = "error", ranks: int = 1, dvp: float | None = None,
              precision: str = "fp32", correction: str = TIS, loss_mode: str | None = None,
              loop: str = "main_ppo", recipe: Path | None = None) -> list[str]:
    """verl's config for the run: the tiny model in fp32 on both sides (``precision="fp32"``) or as verl runs by
    default (``"bf16"``: fp32 master weights, FSDP's bf16 mixed precision for the actor's forward and backward, a
    bf16 vLLM engine), 2 prompts × 2 samples, 8 new tokens,
    ``ranks`` FSDP ranks (verl's ``trainer.n_gpus_per_node``; Ray gets as many logical GPUs, which nothing touches).
    Each rank holds its share of the step's ``prompts × samples`` rows; with the rollout at TP = 1 verl's hybrid
    engine makes every rank a rollout replica of its own (one vLLM server per rank, each fed by its rank's push).
    ``dvp``: DVP's ρ — the plug-in's agent loop (``offpolicy_agent``) asks vLLM to sample with ``min_p = ρ`` and the
    actor scores over its own min-p safe set (``OFFPOLICY_VERL: {sampling: {min_p: ρ}}``). ``correction``: the
    plug-in's correction after verl's advantages, as ``OFFPOLICY_VERL``'s ``correction`` value in YAML (a name such
    as ``calibrated_is``, a mapping with its parameters, or a list of either). ``loss_mode``: verl's policy loss
    (``actor_rollout_ref.actor.policy_loss.loss_mode``), e.g. one the plug-in registers (``offpolicy_calibrated_clip``);
    None: verl's default. ``recipe``: a recipe file (:class:`offpolicy.Recipe`), handed to the plug-in unchanged as
    ``OFFPOLICY_VERL: {recipe: PATH}`` in place of ``correction`` / ``sync_check`` / ``dvp`` (the agent loop is the
    plug-in's when the recipe samples with a recipe of its own, as DVP does, or needs the engine's top-K, as score
    centering does). ``loop``: verl's loop —
    ``main_ppo`` (synchronous, the plug-in's trainer by ``trainer.v1.trainer_mode``), ``one_step_off_policy`` or
    ``fully_async`` (the trainer and one vLLM server apart, on one more logical GPU, the weights over the test
    kit's CPU checkpoint engine: :func:`offpolicy_testkit.verl_async.loop_overrides`)."""
    from offpolicy_testkit.verl_async import loop_overrides, merged

    separated = loop_overrides(loop, ranks, steps, prompts)
    if ranks < 1 or (prompts * samples) % ranks:
        raise ValueError(f"ranks must be >= 1 and divide prompts × samples = {prompts * samples}, got {ranks}")
    per_rank = prompts * samples // ranks
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    modules = "offpolicy_testkit.verl_cpu_bridge,offpolicy.integrations.verl.plugin"
    if separated:  # the separated loops' CPU harness (a checkpoint engine, a vLLM keyword) after the bridge
        modules = modules.replace(",", ",offpolicy_testkit.verl_async,", 1)
    if env.get(BREAK_ENV):
        modules += ",verl_end_to_end"
    sampling = "" if dvp is None else f", sampling: {{min_p: {dvp}}}"
    block = f"{{correction: {correction}, sync_check: {sync_check}{sampling}}}"
    agent_loop = dvp is not None
    if recipe is not None:
        from offpolicy import Recipe, fetch_plan

        block = f"{{recipe: {Path(recipe).resolve()}}}"
        plan = fetch_plan(Recipe.load(Path(recipe)).bound_transforms())
        agent_loop = plan.sampling_recipe or plan.topk > 0  # the loop samples with the recipe and records the top-K
    job_env = {**env, "VERL_USE_EXTERNAL_MODULES": modules, "OFFPOLICY_VERL": block}
    out = [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
        f"data.train_files={train}", f"data.val_files={val}", f"data.train_batch_size={prompts}",
        "data.max_prompt_length=16", "data.max_response_length=8", "data.dataloader_num_workers=0",
        "data.shuffle=false",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.use_remove_padding=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "actor_rollout_ref.model.external_lib=offpolicy.integrations.verl.plugin",
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.optim.lr=1e-4",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={per_rank}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
        "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.n={samples}",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.load_format=auto", "+actor_rollout_ref.rollout.enable_sleep_mode=false",
        "actor_rollout_ref.rollout.free_cache_engine=false", "actor_rollout_ref.rollout.max_model_len=64",
        "actor_rollout_ref.rollout.max_num_seqs=8", "actor_rollout_ref.rollout.max_num_batched_tokens=512",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={per_rank}",
        "actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.rollout.agent.num_workers=1",
        f"trainer.n_gpus_per_node={ranks}", "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}", "trainer.total_epochs=1", "trainer.logger=[console,file]",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.device=cpu",
        "reward.num_workers=1", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        f"reward.custom_reward_function.path={Path(__file__).resolve()}",
        "reward.custom_reward_function.name=compute_score",
        "ray_kwargs.ray_init.num_cpus=16", f"+ray_kwargs.ray_init.num_gpus={ranks + (1 if separated else 0)}",
        "+ray_kwargs.ray_init.include_dashboard=false", f"+ray_kwargs.ray_init._temp_dir={ray_dir}",
    ]
    out = merged(out, separated or ["trainer.v1.trainer_mode=offpolicy"])  # synchronous: the plug-in's trainer by name
    if precision == "fp32":  # the actor's forward in fp32 as the engine's (verl's default mixed precision is bf16)
        out += ["actor_rollout_ref.actor.fsdp_config.dtype=float32",
                "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
                "+actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=fp32",
                "+actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype=fp32",
                "actor_rollout_ref.rollout.dtype=float32"]
    else:  # verl's defaults, said out loud: bf16 compute over fp32 master weights, a bf16 engine
        out += ["actor_rollout_ref.actor.fsdp_config.dtype=bfloat16", "actor_rollout_ref.rollout.dtype=bfloat16"]
    if loss_mode is not None:  # the plug-in's losses are registered by its external_lib in every worker
        out += [f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}"]
    if agent_loop:
        out += ["actor_rollout_ref.rollout.agent.default_agent_loop=offpolicy_agent",
                "actor_rollout_ref.model.use_fused_kernels=false"]
    out += [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}='{v}'" for k, v in job_env.items()]
    return out


def read_records(path: Path) -> list[tuple[int, dict]]:
    """verl's file logger's records (``trainer.logger`` has ``file``; ``VERL_FILE_LOGGER_PATH``), ``(step,
    metrics)`` in the order logged, numbers only. The trainer's process writes each record in one unbuffered write,
    whereas its console lines reach the log through Ray's log monitor, which can cut a long line in two. A last line
    cut short by a killed run is left out."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        data = record.get("data", {})
        out.append((int(record["step"]), {k: float(v) for k, v in data.items()
                                          if isinstance(v, (int, float)) and not isinstance(v, bool)}))
    return out


def parse_log(text: str, records: list[tuple[int, dict]]) -> dict:
    """Steps, the reward of the first and last step and the sync checks from verl's logged metrics
    (:func:`read_records`): a training step's record carries ``critic/score/mean`` (the fully async trainer also logs
    the rollouter's timing under step numbers); ``sync_records``: the records carrying the sync check, as ``(step,
    metrics)``; ``checks_run``: the sync checks the plug-in's trainer logged having run in the console log (the fully
    async trainer logs a step's metrics at the next sync, so its last check reaches no step record)."""
    steps = [(s, m) for s, m in records if "critic/score/mean" in m]
    rewards = [m["critic/score/mean"] for _, m in steps]
    last = steps[-1][1] if steps else {}
    return {"steps": len(steps), "reward_first": rewards[0] if rewards else float("nan"),
            "reward_last": rewards[-1] if rewards else float("nan"),
            "checks": int(last.get("sync/checks", 0)), "passed": int(last.get("sync/passed", 0)),
            "replicas": int(last.get("sync/replicas", 1)),
            "checks_run": len(re.findall(r"sync check after the weight sync of step \d+", text)),
            "sync_ok": [m.get("sync/ok") for _, m in steps],
            "sync_records": [(s, m) for s, m in records if "sync/ok" in m],
            "rollout_corr": {k: v for k, v in last.items() if k.startswith("rollout_corr/")},
            "metrics": [m for _, m in steps]}


def run(steps: int = 6, prompts: int = 2, samples: int = 2, break_sync_at: int | None = None,
        timeout: float = 1500, log: Path | None = None, sync_check: str = "error", ranks: int = 1,
        dvp: float | None = None, precision: str = "fp32", correction: str = TIS, model: str = "tiny",
        loss_mode: str | None = None, loop: str = "main_ppo", recipe: Path | None = None) -> dict:
    """Run ``python -m verl.trainer.main_ppo`` (``loop="main_ppo"``; another loop: through the plug-in's entry point
    ``python -m offpolicy.integrations.verl.async_loops LOOP``) in its own process group (killed at the end, with every Ray and vLLM
    process it started); returns the parsed log, its return code, the time and the log's tail."""
    if str(ROOT) not in sys.path:  # run as a script: sys.path[0] is examples/, the test kit is one folder up
        sys.path.insert(0, str(ROOT))
    from offpolicy_testkit.verl_cpu_bridge import vllm_distribution_alias

    from offpolicy.rollout.vllm_server import vllm_cpu_env

    folder = Path(tempfile.mkdtemp(prefix="verl-e2e-"))
    alias = vllm_distribution_alias(folder / "alias")
    model_dir = model_copy(folder, model)
    train, val = write_data(folder, steps, prompts, model)
    path = os.pathsep.join(p for p in (str(alias), str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**vllm_cpu_env(folder / "cache"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": path,
           "RAY_memory_monitor_refresh_ms": "0", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    records = folder / "metrics.jsonl"  # verl's file logger, in the trainer's process
    env["VERL_FILE_LOGGER_PATH"] = str(records)
    if break_sync_at is not None:
        env[BREAK_ENV] = str(break_sync_at)
    entry = ["verl.trainer.main_ppo"] if loop == "main_ppo" else ["offpolicy.integrations.verl.async_loops", loop]
    command = [sys.executable, "-m", *entry,
               *overrides(model_dir, train, val, steps, prompts, samples, env, folder / "ray", sync_check, ranks, dvp,
                         precision, correction, loss_mode, loop, recipe)]
    log = log or folder / f"{loop}.log"
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                cwd=folder, start_new_session=True)
        seen: dict[int, bytes] = {}  # every process main_ppo started (Ray's daemons and workers, vLLM's), by pid
        try:
            failed_at = None
            while proc.poll() is None and time.perf_counter() - start < timeout:
                seen.update((pid, _cmdline(pid)) for pid in _descendants(proc.pid))
                time.sleep(2)
                # main_ppo has reported its error (Hydra's last line, after the traceback; the metrics file is
                # written as each step ends). Ray's shutdown adds nothing to the result but can hang: a few
                # seconds for the workers' last lines to reach the log through Ray's log monitor, then end it
                if failed_at is None and "HYDRA_FULL_ERROR" in log.read_text(errors="replace")[-400:]:
                    failed_at = time.perf_counter()
                if failed_at is not None and time.perf_counter() - failed_at > 5:
                    break
        finally:
            _stop(proc)
            for pid, cmdline in seen.items():  # orphans left behind, if still the same process
                if cmdline and _cmdline(pid) == cmdline:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
        rc = proc.returncode if proc.returncode is not None and failed_at is None else (proc.returncode or 1)
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    return {**parse_log(text, read_records(records)), "rc": rc, "seconds": seconds, "log": str(log),
            "tail": text[-6000:]}


def _stop(proc: subprocess.Popen) -> None:
    """End the run: every descendant of ``main_ppo`` (Ray's daemons, its workers, vLLM's processes) and its process
    group, by pid — never another job's Ray."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in [*_descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        time.sleep(3)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _descendants(root: int) -> list[int]:
    """Every live process below ``root`` (from /proc's parent ids)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                ppid = int(stat[stat.rindex(")") + 2:].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _break_sync_in_vllm() -> None:
    """The harness (imported by verl in every process when ``--break-sync-at K`` is given): in vLLM's worker, the
    K-th sync after the initial one and every later one receive the weights and drop them."""
    from offpolicy_testkit import verl_cpu_bridge as cpu_bridge

    broken_from = int(os.environ[BREAK_ENV])
    calls = {"n": -1}  # the first call is verl's initial sync (on_init_end)

    def drop_from_k(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] < broken_from:
            return cpu_bridge.update_weights_from_ipc_cpu(self, *args, **kwargs)
        self.reload_weights = lambda **_: None  # received, not loaded: the engine keeps its old weights
        try:
            return cpu_bridge.update_weights_from_ipc_cpu(self, *args, **kwargs)
        finally:
            del self.reload_weights

    def patch(module):
        module.vLLMColocateWorkerExtension.update_weights_from_ipc = drop_from_k

    cpu_bridge._after_import(cpu_bridge.EXTENSION_MODULE, patch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--break-sync-at", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=1500)
    parser.add_argument("--log", type=Path, default=None)
    parser.add_argument("--sync-check", choices=("error", "warn", "off"), default="error")
    parser.add_argument("--ranks", type=int, default=1, help="FSDP ranks of verl's actor (gloo, one per process)")
    parser.add_argument("--dvp", type=float, default=None, help="DVP's ρ: vLLM samples with min_p = ρ")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32 on both sides, or verl's defaults (bf16 compute, bf16 engine)")
    parser.add_argument("--model", default="tiny", choices=("tiny", "lab", "lab-moe"),
                        help="embedded model (lab-moe: the lab model's mixture-of-experts twin) and its task")
    parser.add_argument("--loop", default="main_ppo", choices=("main_ppo", "one_step_off_policy", "fully_async"),
                        help="verl's loop: synchronous main_ppo, or an asynchronous one (the trainer and vLLM apart)")
    parser.add_argument("--correction", default=TIS,
                        help="the plug-in's correction in YAML: a name (calibrated_is, delight, …) or a mapping")
    parser.add_argument("--loss-mode", default=None,
                        help="verl's policy loss, e.g. offpolicy_calibrated_clip (default: verl's own)")
    parser.add_argument("--recipe", type=Path, default=None,
                        help="a recipe file for the plug-in, in place of --correction / --sync-check / --dvp")
    args = parser.parse_args()
    result = run(args.steps, break_sync_at=args.break_sync_at, timeout=args.timeout, log=args.log,
                 sync_check=args.sync_check, ranks=args.ranks, dvp=args.dvp, precision=args.precision,
                 correction=args.correction, model=args.model, loss_mode=args.loss_mode, loop=args.loop,
                 recipe=args.recipe)
    if result["rc"] != 0:
        print(result["tail"])
        print(f"verl end to end: failed (exit {result['rc']}) after {result['steps']} steps in "
              f"{result['seconds']:.0f} s; log: {result['log']}")
        return 1
    print(f"verl end to end: {result['steps']} steps, reward {result['reward_first']:.3g} -> "
          f"{result['reward_last']:.3g}, sync checks {result['passed']}/{result['checks']} ok in "
          f"{result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
elif os.environ.get(BREAK_ENV) and __name__ == "verl_end_to_end":
    _break_sync_in_vllm()
