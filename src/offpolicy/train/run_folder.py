"""Everything about the run's folder, in one place: what a fresh run replaces, what ``--resume`` continues, the metrics
log, checkpoints, the progress bar and the Ctrl-C contract — so that the training loop holds only the algorithm.

* One writer per folder: a ``run.out_dir`` in use by a live process (another ``offpolicy train``, a sweep's run) is
  refused with one line naming that process (:class:`offpolicy.folder_lock.FolderLock` on ``.run.lock``), before
  anything in it is read or written; a lock left by a crashed or killed process never blocks a new run or
  ``--resume``. The lock is held from :class:`RunFolder`'s construction to the end of its ``with`` block.
* Nothing lost: a fresh run into a ``run.out_dir`` that holds an earlier run (its checkpoints, metrics or TensorBoard
  logs) is refused with one line naming the folder and what it holds, before the model loads — unless
  ``--overwrite`` (``overwrite=True``): then the earlier run's files (checkpoints, killed-save leftovers, TensorBoard
  events, the metrics log) are replaced, with one :class:`RunReplacedWarning`; a later ``--resume`` would otherwise
  continue the earlier run's checkpoint under this run's config.
* ``--resume`` refuses a checkpoint of another seed and one past ``run.steps``, and one whose recipe settings
  (:func:`recipe_settings`: the preset, every ``algorithm`` and ``alp`` key, the sampling recipe, the threshold
  controllers) differ from the config's, naming each key with both values — unless ``--allow-changed KEY`` names it:
  then each change is appended to ``offpolicy_settings_changes.jsonl`` (step, key, old, new). It rewrites the
  metrics after the checkpoint's step; the checks run before the model loads.
* Ctrl-C: the first finishes the current step, checkpoints and stops; a second stops at once (no checkpoint: the
  weights are between two steps). A ``KeyboardInterrupt`` raised between steps (e.g. by ``on_step_end``) checkpoints
  the completed step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from offpolicy.folder_lock import FolderLock
from offpolicy.resume_settings import CHANGES_FILE, check_resume, covers, flatten, record_changes
from offpolicy.train.checkpoint import (
    checkpoint_files,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_info,
    save_checkpoint,
    temp_files,
)
from offpolicy.train.config import TrainConfig, config_to_yaml
from offpolicy.train.logging import MetricLogger, to_floats

# The lock file of a run folder (its owner's pid, host and command; see offpolicy.folder_lock).
LOCK_FILE = ".run.lock"


class RunReplacedWarning(UserWarning):
    """A fresh run replaced an earlier run's files in its ``run.out_dir`` (the demo silences it: that is its job)."""


class RunFolder:
    """``run.out_dir`` of one run. Build it first: a bad folder or a checkpoint of another run fails before any work.

    ``open(state)`` loads the checkpoint into the model / optimizer / ALP (or replaces an earlier run) and returns
    the first step to run; ``session(...)`` wraps the steps (logging, checkpoints, progress, Ctrl-C). The folder is
    locked from here to the end of ``with folder:`` (or :meth:`release`); a folder in use by another live process
    raises ``ValueError`` naming it.
    """

    def __init__(self, cfg: TrainConfig, resume: bool | str | Path = False, overwrite: bool = False,
                 allow_changed: tuple[str, ...] | list[str] = ()) -> None:
        self.cfg = cfg
        self.out_dir = Path(cfg.run.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.allow_changed = tuple(allow_changed)
        self.changes: list[dict[str, Any]] = []  # the allowed differences from the checkpoint, recorded by open()
        if resume and overwrite:
            raise ValueError("--resume continues the run in run.out_dir and --overwrite replaces it: pass one of them")
        if self.allow_changed and not resume:
            raise ValueError(f"--allow-changed {self.allow_changed[0]} applies to --resume only (a fresh run has no "
                             "checkpoint settings to differ from)")
        if resume and not self.ckpt_dir.is_dir():  # nothing to resume: say so without creating the folder
            self._resume_checkpoint(resume)
        _writable_dir(self.out_dir)
        self.lock = FolderLock(self.out_dir, LOCK_FILE, "run.out_dir")  # before reading or writing anything in it
        try:
            if not resume and not overwrite:
                earlier = describe_earlier_run(self.out_dir)
                if earlier is not None:
                    raise ValueError(f"run.out_dir {str(self.out_dir)!r} holds {earlier}: pass --overwrite to replace "
                                     "it, --resume to continue it, or choose another run.out_dir")
            self.resume_from = self._resume_checkpoint(resume) if resume else None
        except BaseException:
            self.lock.release()
            raise
        self.last_checkpoint: Path | None = self.resume_from

    def release(self) -> None:
        """Unlock the folder (another process may write it from now on)."""
        self.lock.release()

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def open(self, state: Any) -> int:
        """Restore the checkpoint into ``state`` or replace an earlier run; write ``config.yaml``. Returns the step to
        start from (``run.steps`` when a finished run is resumed again: then nothing is touched)."""
        start = 0
        if self.resume_from is not None:
            loaded = load_checkpoint(self.resume_from, model=state.model, optimizer=state.optimizer,
                                     extra_modules=_extra_modules(state))
            start = loaded["step"]
            if state.control is not None:  # the controllers continue where they were (thresholds, LR, windows)
                state.control.load_state_dict(loaded["metadata"].get("control"), state)
            if start == self.cfg.run.steps:  # e.g. a retry script: leave every file as it is
                warnings.warn(f"--resume: checkpoint {str(self.resume_from)!r} is already at run.steps="
                              f"{self.cfg.run.steps}; nothing to do (raise run.steps to train further)", stacklevel=3)
                return start
            for leftover in temp_files(self.ckpt_dir):  # half-written saves of the interrupted run: never usable
                leftover.unlink(missing_ok=True)
            record_changes(self.out_dir / CHANGES_FILE, self.changes, step=start, checkpoint=str(self.resume_from))
        else:
            self._clear_earlier_run()
        (self.out_dir / "config.yaml").write_text(config_to_yaml(self.cfg))
        return start

    def checkpoint(self, state: Any, step: int) -> Path:
        self.last_checkpoint = save_checkpoint(
            self.ckpt_dir, step=step, model=state.model, optimizer=state.optimizer, extra_modules=_extra_modules(state),
            metadata=_metadata(self.cfg, state), keep_last=3)
        return self.last_checkpoint

    @contextlib.contextmanager
    def session(self, state: Any, start: int, console: Any = None) -> Iterator[Session]:
        """The steps of this run: the metrics log is opened (emptied, or cut after ``start``), Ctrl-C is deferred,
        a ``KeyboardInterrupt`` ends the run cleanly, and the last step is checkpointed."""
        logger = MetricLogger(self.out_dir, tensorboard=self.cfg.run.tensorboard)
        if self.resume_from is not None:
            logger.truncate_after(start)  # the steps after the checkpoint are rewritten by this run
        else:
            logger.reset()
        session = Session(self, state, logger, start, console)
        try:
            with _DeferredInterrupt(console) as stop, session.progress_bar():
                session.stop = stop
                yield session
        except KeyboardInterrupt:
            session.interrupted = True
            if session.in_step:  # a second Ctrl-C mid-update: the weights are between two steps, no exact checkpoint
                _say(console, f"[red]stopped inside step {session.steps_done + 1}; last checkpoint: "
                              f"{_plain(self.last_checkpoint)}[/red]")
            else:
                self.checkpoint(state, session.steps_done)
                _say(console, f"[yellow]interrupted after step {session.steps_done}; checkpoint "
                              f"{_plain(self.last_checkpoint)} (resume with --resume)[/yellow]")
        finally:
            logger.close()
        done = session.steps_done
        if not session.interrupted and done > start and not _is_checkpoint_of(self.last_checkpoint, done):
            self.checkpoint(state, done)

    def _resume_checkpoint(self, resume: bool | str | Path) -> Path:
        """The checkpoint to resume from, checked against the config before anything is built or written.

        Refuses a checkpoint written by another run (its stored seed differs: continuing it would mix two runs in one
        folder), one whose recipe settings differ from the config's in a key ``allow_changed`` does not name (the
        allowed differences are kept in ``self.changes``) and a ``run.steps`` below the checkpoint's step (nothing
        could run, and the config would lie).
        """
        cfg = self.cfg
        path = latest_checkpoint(self.ckpt_dir) if isinstance(resume, bool) else Path(resume)
        if path is None:
            raise ValueError(f"--resume: no checkpoint in {str(self.ckpt_dir)!r}")
        info = read_checkpoint_info(path)  # names the file when it is corrupt or truncated
        stored = info.get("user", {})
        if stored.get("seed") is not None and stored["seed"] != cfg.run.seed:
            raise ValueError(f"--resume: checkpoint {str(path)!r} was written with run.seed={stored['seed']!r} (now "
                             f"{cfg.run.seed!r}); resume with the same seed, or start a fresh run without --resume")
        here, theirs = recipe_settings(cfg), stored.get("settings")
        if theirs is None:  # written before checkpoints held their settings: its preset is all there is to compare
            theirs = {"algorithm.preset": stored["preset"]} if stored.get("preset") is not None else {}
            here = {k: here[k] for k in theirs}
        else:  # a key added to the config after this checkpoint was written counts as its default
            theirs = {**{k: v for k, v in recipe_settings(TrainConfig()).items()
                         if not any(covers(k, s) for s in theirs)}, **theirs}
        where = f"--resume {self.out_dir}" if isinstance(resume, bool) else f"--resume {path}"
        self.changes = check_resume(here, theirs, allowed=self.allow_changed, where=where, step=info["step"],
                                    allow_hint=_allow_hint)
        if info["step"] > cfg.run.steps:
            raise ValueError(f"--resume: checkpoint {str(path)!r} is at step {info['step']}, past run.steps="
                             f"{cfg.run.steps}; set run.steps above {info['step']} to train further")
        return path

    def _clear_earlier_run(self) -> None:
        """Remove what an earlier run left in ``out_dir`` (its checkpoints, killed-save leftovers, TensorBoard events;
        its metrics.jsonl is emptied by the logger), with one warning naming the folder when there was anything."""
        metrics = self.out_dir / "metrics.jsonl"
        events = sorted((self.out_dir / "tensorboard").glob("events.out.tfevents.*"))
        changes = [self.out_dir / CHANGES_FILE] if (self.out_dir / CHANGES_FILE).is_file() else []
        stale = checkpoint_files(self.ckpt_dir) + temp_files(self.ckpt_dir) + events + changes
        if not stale and not (metrics.is_file() and metrics.stat().st_size > 0):
            return
        warnings.warn(f"run.out_dir {str(self.out_dir)!r} holds an earlier run: replacing its metrics, checkpoints "
                      "and TensorBoard logs (--overwrite)", RunReplacedWarning, stacklevel=4)
        for p in stale:
            p.unlink(missing_ok=True)


def describe_earlier_run(out_dir: str | Path) -> str | None:
    """What a run folder holds from an earlier run, in a few words (None when there is nothing a fresh run would
    replace: no checkpoint, no metrics row, no TensorBoard event file).

    "a finished run (preset 'tis', seed 0, step 50 of 50; 3 checkpoints, 50 metrics rows, TensorBoard logs)"; a run
    whose last checkpoint is before its configured ``run.steps`` is "an unfinished run". Damaged files are counted,
    never read beyond their header: describing a folder must not fail on what it describes.
    """
    out = Path(out_dir)
    checkpoints = checkpoint_files(out / "checkpoints")
    metrics = out / "metrics.jsonl"
    rows = _count_lines(metrics)
    events = sorted((out / "tensorboard").glob("events.out.tfevents.*"))
    if not checkpoints and not rows and not events:
        return None
    held = [f"{len(checkpoints)} checkpoint{'s' * (len(checkpoints) != 1)}"] if checkpoints else []
    if rows:
        held.append(f"{rows} metrics row{'s' * (rows != 1)}")
    if events:
        held.append("TensorBoard logs")
    identity, kind = [], "an earlier run"
    if checkpoints:
        try:
            info = read_checkpoint_info(checkpoints[-1])
        except ValueError:
            info = {}
        user, step = info.get("user", {}), info.get("step")
        if user.get("preset") is not None:
            identity.append(f"preset {user['preset']!r}")
        if user.get("seed") is not None:
            identity.append(f"seed {user['seed']}")
        planned = _configured_steps(out / "config.yaml")
        if isinstance(step, int):
            identity.append(f"step {step}" + (f" of {planned}" if planned else ""))
            if planned:
                kind = "a finished run" if step >= planned else "an unfinished run"
    return f"{kind} ({', '.join(identity) + '; ' if identity else ''}{', '.join(held)})"


def _count_lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def _configured_steps(config_yaml: Path) -> int | None:
    """``run.steps`` of the earlier run's ``config.yaml`` (None when absent or unreadable)."""
    try:
        from offpolicy.yaml_numbers import load_yaml

        steps = (load_yaml(config_yaml.read_text(encoding="utf-8")) or {}).get("run", {}).get("steps")
    except Exception:  # missing, unreadable, damaged YAML, not a mapping: the folder is described without its plan
        return None
    return steps if isinstance(steps, int) else None


class Session:
    """The bookkeeping between steps: ``with session.step():`` around a step's work, ``record`` after it."""

    def __init__(self, folder: RunFolder, state: Any, logger: MetricLogger, start: int, console: Any) -> None:
        self.folder, self.state, self.logger, self.console = folder, state, logger, console
        self.steps_done = start
        self.in_step = False
        self.interrupted = False
        self.stop: _DeferredInterrupt | None = None
        self._progress = _progress(console, folder.cfg.run.progress)
        self._task_id = None

    @contextlib.contextmanager
    def progress_bar(self) -> Iterator[None]:
        if self._progress is None:
            yield
            return
        cfg = self.folder.cfg
        self._task_id = self._progress.add_task(cfg.algorithm.preset, total=cfg.run.steps, completed=self.steps_done)
        with self._progress:
            yield

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One step's work: a second Ctrl-C in here stops without a checkpoint (see :meth:`RunFolder.session`)."""
        self.in_step = True
        yield
        self.in_step = False
        self.steps_done += 1

    def record(self, metrics: dict[str, Any], kl_key: str) -> dict[str, float]:
        """Sync the step's metrics to floats (logged at ``run.log_every`` and at the last step), move the progress
        bar, checkpoint at ``run.checkpoint_every``. Returns the floats, with ``step``."""
        run, step = self.folder.cfg.run, self.steps_done
        logged = step % run.log_every == 0 or step == run.steps
        floats = self.logger.log(step, metrics) if logged else to_floats(metrics)
        floats["step"] = step
        if self._progress is not None:
            preset = self.folder.cfg.algorithm.preset
            description = f"{preset} reward {floats['reward/mean']:.3f} kl {floats[kl_key]:.2e}"
            self._progress.update(self._task_id, advance=1, description=description)
        if run.checkpoint_every and step % run.checkpoint_every == 0:
            self.folder.checkpoint(self.state, step)
        return floats

    def stop_if_requested(self) -> None:
        """A first Ctrl-C during the step ends the run here, after the step (checkpointed)."""
        if self.stop is not None and self.stop.requested:
            raise KeyboardInterrupt


class _DeferredInterrupt:
    """First Ctrl-C: finish the current step, checkpoint, stop. Second Ctrl-C: stop now (KeyboardInterrupt)."""

    def __init__(self, console: Any | None) -> None:
        self.requested = False
        self.console = console
        self._old: Any = None

    def __enter__(self) -> _DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        _say(self.console, "[yellow]Ctrl-C: finishing this step, saving a checkpoint, then stopping "
                           "(press again to stop at once)[/yellow]")

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


# the sampling recipe's keys (DVP / replay score under it) and the controllers' targets (they move the thresholds)
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")
_CONTROL_KEYS = ("trm_acceptance", "is_max_masked", "window")


def recipe_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a resume must keep, flat (``algorithm.is_upper`` …): every ``algorithm`` key (the preset, the
    corrections, the objective and their thresholds), ALP's (``alp.*``), the sampling recipe
    (``rollout.sampling.temperature`` / ``top_p`` / ``top_k`` / ``min_p``) and the threshold controllers'
    targets (``control.trm_acceptance`` / ``is_max_masked`` / ``window``). Not the run's length, paths, logging or
    the optimiser."""
    sampling = cfg.rollout.sampling
    return flatten({
        "algorithm": cfg.algorithm.model_dump(mode="json"),
        "alp": cfg.alp.model_dump(mode="json"),
        "rollout": {"sampling": {k: getattr(sampling, k) for k in _SAMPLING_KEYS}},
        "control": {k: getattr(cfg.control, k) for k in _CONTROL_KEYS},
    })


def _allow_hint(keys: list[str]) -> str:
    return "pass " + " ".join(f"--allow-changed {k}" for k in keys)


def _metadata(cfg: TrainConfig, state: Any) -> dict[str, Any]:
    """A checkpoint's JSON header: the run's identity and recipe settings (checked on resume) and the controllers'
    state."""
    meta: dict[str, Any] = {"preset": cfg.algorithm.preset, "seed": cfg.run.seed, "settings": recipe_settings(cfg)}
    if state.control is not None:
        meta["control"] = state.control.state_dict()
    return meta


def _extra_modules(state: Any) -> dict[str, Any] | None:
    """What a checkpoint holds besides the model and optimizer: ALP's σ, and the engine's own (lagging) weights when
    ``rollout.sync_every > 1`` — or the weight history of ``rollout.async_mode`` — so that a resumed run samples from
    the same stale policy as the uninterrupted one."""
    modules = {"alp": state.alp} if state.alp is not None else {}
    if state.cfg.rollout.sync_every > 1:
        modules["engine"] = state.engine.model
    if getattr(state, "weight_history", None) is not None:  # rollout.async_mode: the old versions it samples with
        modules["weight_history"] = state.weight_history
    return modules or None


def _is_checkpoint_of(path: Path | None, step: int) -> bool:
    return path is not None and path.name.endswith(f"{step:08d}.safetensors")


def _writable_dir(out_dir: Path) -> None:
    """Create ``run.out_dir`` (an OSError there would otherwise surface as a traceback after the model had loaded)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"run.out_dir {str(out_dir)!r} cannot be created: {err.strerror or err}") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ValueError(f"run.out_dir {str(out_dir)!r} is not writable")


def _say(console: Any, text: str) -> None:
    if console is not None:
        console.print(text)


def _plain(value: Any) -> str:
    """User text (a path may hold ``[…]``) printed literally, not as rich markup."""
    from rich.markup import escape

    return escape(str(value))


def _progress(console: Any, enabled: bool):  # -> rich Progress | None
    if not enabled:
        return None
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)
