"""``offpolicy lab --executor ray``: the sweep's runs as Ray actors, on a local Ray cluster or an existing one.

The sweep is the same (:func:`offpolicy.lab.sweep.run_sweep`: plan, resume, summary, report, Ctrl-C); only where a
run's process starts changes. The runner keeps up to ``--jobs`` *run slots*, each a Ray actor holding
``cpus_per_run`` CPUs (default 1) on some node; a slot starts one run at a time exactly as the local runner does
(:func:`offpolicy.lab.launch.start_run`: ``offpolicy train <overrides> [--resume]`` forked from the slot's zygote,
its own session, one thread, output appended to the run's ``train.log``, killed if the slot dies) and reports its
exit code. So, as with the local executor:

* a run's files are written where the local executor writes them, ``OUT/runs/<run>/``: on a multi-node cluster
  ``OUT`` must be a shared filesystem mounted at the same path on every node (the actor checks, and a run on a node
  that cannot see its folder fails naming the node);
* the runner's first Ctrl-C reaches each running run once (the run finishes its step, checkpoints, exits 130), a
  second stops them at once; runs not started yet are not started;
* a failed run — a node that died included — is listed with the last line of its log; a later sweep with the same
  command resumes it from its checkpoint (no automatic retry: a rerun is the retry, as with the local executor);
* the trainer's imports are paid once per slot (its zygote), not once per run.

The driver forwards its ``OFFPOLICY_*``, ``HF_*`` and ``TRANSFORMERS_*`` environment variables to the runs (the
model cache, offline mode) and warm-starts the embedded model once per node before the runs (a shared cache is
built once; a node-local one once per node). ``offpolicy`` must be installed on every node.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from offpolicy.lab.launch import start_run

# Environment variables of the driver that the runs see too (where the model cache is, offline mode).
FORWARDED_ENV = ("OFFPOLICY_", "HF_", "TRANSFORMERS_")


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("--executor ray needs Ray: pip install 'offpolicy[ray]'") from None
    return ray


def forwarded_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The driver's variables that reach every run (see :data:`FORWARDED_ENV`)."""
    environ = dict(os.environ) if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV)}


class RunSlot:
    """The Ray actor that runs a sweep's runs one after another on its node, as the local runner would.

    Each run starts through :func:`offpolicy.lab.launch.start_run` — forked from this actor's own zygote (trainer
    imported once per slot, not once per run), or a subprocess for a given command line. Every fork happens on one
    thread this actor owns for its whole life: Linux ties the parent-death signal to the thread that forked, so a
    run started from one of Ray's pool threads could be killed when that thread retires.
    """

    def __init__(self, cwd: str) -> None:
        self._environ = dict(os.environ)  # the node's own environment; each run adds the driver's variables to it
        if cwd and Path(cwd).is_dir():
            os.chdir(cwd)
        self.host = socket.gethostname()
        self._requests: queue.Queue = queue.Queue()
        self._runs: dict[int, Any] = {}  # run number -> its process handle, or the error that kept it from starting
        self._changed = threading.Condition()
        threading.Thread(target=self._launcher, name="offpolicy-launcher", daemon=True).start()

    def _launcher(self) -> None:
        while True:
            fn, reply = self._requests.get()
            # Ray's worker threads block SIGINT, and a forked child inherits the mask: a run (or the zygote its
            # runs are forked from) would never see the runner's Ctrl-C. Unblocked around the fork only.
            blocked = signal.pthread_sigmask(signal.SIG_SETMASK, [])
            try:
                reply.put((fn(), None))
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
                reply.put((None, err))
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def start(self, number: int, argv: list[str], log_path: str, command: bool, env: dict[str, str]) -> tuple[str, int]:
        """Start run ``number`` (``argv``: offpolicy's arguments, or a command line when ``command``) with ``env``
        added to its environment; returns the host and the run's pid."""
        os.environ.clear()  # start_run hands os.environ to the run; this actor runs nothing else
        os.environ.update({**self._environ, **env})
        log = Path(log_path)
        result: Any
        if not log.parent.is_dir():
            result = OSError(f"run folder {str(log.parent)!r} is not visible on Ray node {self.host!r}: the sweep "
                             "folder --out must be on a filesystem every node mounts at the same path")
        else:
            reply: queue.Queue = queue.Queue()
            self._requests.put((lambda: start_run(list(argv), log, command=command), reply))
            proc, err = reply.get()
            result = proc if err is None else err
        with self._changed:
            self._runs[number] = result
            self._changed.notify_all()
        if isinstance(result, BaseException):
            raise result
        return self.host, result.pid

    def wait(self, number: int) -> int:
        """Run ``number``'s exit code, once it has ended (negative: killed by that signal); the error that kept it
        from starting, raised. (A threaded actor's calls may run in any order: this one waits for ``start``.)"""
        with self._changed:
            self._changed.wait_for(lambda: number in self._runs)
            proc = self._runs[number]
        if isinstance(proc, BaseException):
            raise proc
        while (code := proc.poll()) is None:
            time.sleep(0.05)
        return int(code)

    def send_signal(self, number: int, sig: int) -> None:
        with self._changed:
            self._changed.wait_for(lambda: number in self._runs)
            proc = self._runs[number]
        if not isinstance(proc, BaseException) and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)


class _Slot:
    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.busy = False
        self.dead = False
        self.runs = 0  # runs started in this slot: the number of the current one


class RayRun:
    """The driver's handle of a run on Ray, with the ``subprocess.Popen`` calls the sweep runner uses."""

    def __init__(self, ray: Any, slot: _Slot, argv: list[str], log_path: Path, command: bool,
                 env: dict[str, str]) -> None:
        self._ray = ray
        self.slot = slot
        self.actor = slot.actor
        self.log_path = log_path
        slot.busy = True
        slot.runs += 1
        self.number = slot.runs
        slot.actor.start.remote(self.number, argv, str(log_path), command, env)
        self._exit = slot.actor.wait.remote(self.number)
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is None:
            ready, _ = self._ray.wait([self._exit], timeout=0)
            if ready:
                self._code = self._exit_code()
                self.slot.busy = False
        return self._code

    def _exit_code(self) -> int:
        exceptions = self._ray.exceptions
        try:
            return int(self._ray.get(self._exit))
        except exceptions.RayActorError as err:  # the actor, or its node, died: the run with it
            self.slot.dead = True
            _append(self.log_path, f"error: the Ray actor of this run died: {_first_line(err)}")
            return -int(signal.SIGKILL)
        except exceptions.RayTaskError as err:  # the run could not start there: say why in its log
            why = _first_line(getattr(err, "cause", None) or err)
            _append(self.log_path, f"error: the run could not start on Ray: {why}")
            return 1

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self.actor.send_signal.remote(self.number, int(sig))


class RayExecutor:
    """Where the runs of :func:`~offpolicy.lab.sweep.run_sweep` start: Ray actors instead of local processes.

    ``address``: an existing cluster (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``); None starts a local
    cluster for the sweep (``num_cpus``: its size, default all cores) and stops it at the end. ``cpus_per_run``:
    the CPUs each run reserves (its torch threads: ``run.threads`` should match). ``env``: more environment
    variables for the runs (besides the forwarded ones). ``init``: more ``ray.init`` arguments. Use it as a context
    manager (``run_sweep`` does); entered again (several sweeps in one ``with``), it keeps its cluster and run
    slots until the outermost block ends.
    """

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None, cpus_per_run: float = 1.0,
                 env: dict[str, str] | None = None, init: dict[str, Any] | None = None) -> None:
        if not isinstance(cpus_per_run, (int, float)) or isinstance(cpus_per_run, bool) or cpus_per_run <= 0:
            raise ValueError(f"cpus_per_run must be a number > 0, got {cpus_per_run!r}")
        if address is not None and num_cpus is not None:
            raise ValueError("num_cpus sizes a local Ray cluster; it cannot be set with address")
        self.address = address
        self.num_cpus = num_cpus
        self.cpus_per_run = cpus_per_run
        self.env = dict(env or {})
        self.init_kwargs = dict(init or {})
        self._ray: Any = None
        self._started_ray = False
        self._depth = 0
        self._slot_class: Any = None
        self._slots: list[_Slot] = []
        self.last_run: RayRun | None = None  # the run started last

    def __enter__(self) -> RayExecutor:
        self._depth += 1
        if self._depth > 1:
            return self
        ray = self._ray = _ray()
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, **self.init_kwargs}
            if self.address is not None:
                kwargs["address"] = self.address
            elif self.num_cpus is not None:
                kwargs["num_cpus"] = self.num_cpus
            try:
                ray.init(**kwargs)
            except (ConnectionError, RuntimeError) as err:
                self._depth = 0
                where = f"the Ray cluster at {self.address!r}" if self.address else "a local Ray cluster"
                raise ValueError(f"--executor ray: cannot reach {where}: {_first_line(err)}") from None
            self._started_ray = True
        # one actor per run slot (at most --jobs); two calls at once: wait() blocks while send_signal() forwards a
        # Ctrl-C
        self._slot_class = ray.remote(num_cpus=self.cpus_per_run, max_concurrency=2, max_restarts=0)(RunSlot)
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        for slot in self._slots:  # their runs have ended (the runner waits for them); this frees the CPUs
            with contextlib.suppress(Exception):
                self._ray.kill(slot.actor)
        self._slots = []
        if self._started_ray:
            self._ray.shutdown()
            self._started_ray = False

    def describe(self) -> str:
        """One line: the cluster and its CPUs."""
        cpus = self._ray.cluster_resources().get("CPU", 0)
        nodes = sum(1 for n in self._ray.nodes() if n.get("Alive"))
        where = "a local Ray cluster" if self.address is None else f"the Ray cluster at {self.address}"
        return f"{where} ({nodes} node{'' if nodes == 1 else 's'}, {cpus:g} CPUs, {self.cpus_per_run:g} per run)"

    def default_jobs(self) -> int:
        """Runs at a time that the cluster's CPUs hold."""
        return max(1, int(self._ray.cluster_resources().get("CPU", 1) // self.cpus_per_run))

    def prepare(self, plan: Any, prepare: Callable[[Any], Any]) -> None:
        """``prepare(plan)`` here, then on every other alive node (each builds or finds the embedded model in its
        cache; a shared cache is found ready)."""
        ray = self._ray
        prepare(plan)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        task = ray.remote(num_cpus=self.cpus_per_run)(_prepare_on_node)
        env = {**forwarded_env(), **self.env}
        refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(plan, prepare, env) for n in ray.nodes() if n.get("Alive") and n["NodeID"] != here]
        ray.get(refs)

    def start(self, argv: list[str], log_path: Path, *, command: bool) -> RayRun:
        """Start one run (what :func:`offpolicy.lab.launch.start_run` does locally)."""
        self._slots = [s for s in self._slots if not s.dead]
        slot = next((s for s in self._slots if not s.busy), None)
        if slot is None:
            slot = _Slot(self._slot_class.remote(os.getcwd()))
            self._slots.append(slot)
        self.last_run = RayRun(self._ray, slot, list(argv), log_path, command, {**forwarded_env(), **self.env})
        return self.last_run


def _prepare_on_node(plan: Any, prepare: Callable[[Any], Any], env: dict[str, str]) -> None:
    os.environ.update(env)
    prepare(plan)


def _append(path: Path, line: str) -> None:
    with contextlib.suppress(OSError), path.open("a", encoding="utf-8") as f:
        f.write(line + "\n")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
