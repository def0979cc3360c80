#!/usr/bin/env python3
"""The README's install lines beside a user's own vLLM and torch: does pip keep the user's versions?

A user with a newer stack (vLLM 0.33, which pins torch 2.14.0) follows the README's Install block. This asks pip's
resolver, metadata only, what each ``pip install`` line of that block would install together with the user's
versions — ``pip install --dry-run --ignore-installed --report FILE <the line's arguments> vllm==0.33.0 torch==2.14.0``
in a throwaway venv, all lines at once (pip waits on the index, not the CPU) — and reads the report:

* **keeps**: pip resolves, and the report installs each user package at the user's version;
* **changed**: the report installs a user package at another version (or not at all) — the line would downgrade or
  replace it: a failure naming the package;
* **refused**: pip finds no resolution with the user's versions (ResolutionImpossible): in a real environment pip
  would replace a user package to satisfy the line. A failure, unless the line is one of ``KNOWN_CONFLICTS``, whose
  conflict the docs explain; a known conflict that resolves is a failure too (the docs would say something false).

    scripts/check_resolution.py --timeout 900            # CI (.ci/run, in the background from its start)
    scripts/check_resolution.py --user vllm==0.32.0 --user torch==2.13.0 --timeout 300

Exit 0: every line has its expected verdict. Needs the package index (or its mirror); installs nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USER = ("vllm==0.33.0", "torch==2.14.0")  # the newest vLLM and the torch it pins (checked against the index here)
# besides the README's lines: the TRL line with the vllm extra its comment names (docs/quickstart-trl.md prints it)
ALSO = ("pip install -e '.[trl,vllm]'",)
SHOWN = ("torch", "vllm", "transformers", "trl", "verl")  # the versions the summary prints for each line
# line's requirement -> (the package pip cannot keep, why: what the docs tell the user to do instead)
KNOWN_CONFLICTS = {
    ".[verl]": ("transformers", "verl 0.9.1 needs transformers>=5.5.3,<5.11, vLLM >= 0.32 needs >=5.16.1: install "
                "verl's own stack first (pip install 'verl[vllm]==0.9.1'), then this line (docs/quickstart-verl.md)"),
}


@dataclass
class Verdict:
    """One install line's outcome: ``kind`` is keeps / changed / refused / error; ``versions`` what pip would install
    (canonical name -> version), ``changed`` one ``"name want -> got"`` per user package pip would not keep, ``conflict``
    the package a refusal is about."""

    line: str
    kind: str
    versions: dict[str, str] = field(default_factory=dict)
    changed: list[str] = field(default_factory=list)
    conflict: str | None = None
    detail: str = ""
    seconds: float = 0.0


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def install_lines(readme: str) -> list[str]:
    """The ``pip install`` commands of the ```bash block under ``## Install``, as printed (comments dropped)."""
    block = re.search(r"^## Install\n.*?^```bash\n(.*?)^```", readme, re.DOTALL | re.MULTILINE)
    if block is None:
        raise ValueError("README.md: no ```bash block under '## Install'")
    lines = [line.split(" #", 1)[0].strip() for line in block.group(1).splitlines()]
    found = [line for line in lines if line.startswith("pip install ")]
    if not found:
        raise ValueError("README.md: the '## Install' block has no 'pip install' line")
    return found


def pins(user: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``["vllm==0.33.0"]`` -> ``{"vllm": "0.33.0"}``; anything but ``name==version`` is refused."""
    out = {}
    for spec in user:
        name, sep, version = spec.partition("==")
        if not sep or not name or not version:
            raise ValueError(f"--user: want name==version, got {spec!r}")
        out[canonical(name)] = version
    return out


def read_report(report: dict, user: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """pip's ``--report`` JSON (format 1) -> (what it installs: name -> version, the user packages it changes)."""
    if str(report.get("version")) != "1":
        raise ValueError(f"pip's report: format {report.get('version')!r}, this reads format 1")
    versions = {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}
    changed = [f"{name} {want} -> {versions.get(name, 'not installed')}" for name, want in user.items()
               if versions.get(name) != want]
    return versions, changed


def conflict_package(stderr: str) -> str | None:
    """The package pip's ResolutionImpossible is about: the one most often named after "depends on" / "requested"
    under "The conflict is caused by:"; None when pip failed for another reason."""
    if "ResolutionImpossible" not in stderr and "conflict is caused by" not in stderr:
        return None
    cause = stderr.split("The conflict is caused by:", 1)[-1]
    names = re.findall(r"(?:depends on|requested) ([A-Za-z0-9][A-Za-z0-9._-]*)", cause)
    return max(set(names), key=names.count) if names else "?"


def expected(line: str) -> tuple[str, str] | None:
    """The known conflict of a line (see KNOWN_CONFLICTS), or None: the line must keep the user's versions."""
    return next((known for req, known in KNOWN_CONFLICTS.items() if req in shlex.split(line)), None)


def judge(line: str, returncode: int, report: dict | None, stderr: str, user: dict[str, str]) -> Verdict:
    if returncode == 0 and report is not None:
        versions, changed = read_report(report, user)
        return Verdict(line, "changed" if changed else "keeps", versions, changed)
    package = conflict_package(stderr)
    if package is not None:
        return Verdict(line, "refused", conflict=package, detail=_tail(stderr.split("The conflict is caused by:")[-1]))
    return Verdict(line, "error", detail=_tail(stderr))


def failure(verdict: Verdict) -> str | None:
    """Why a verdict fails the check, or None."""
    known = expected(verdict.line)
    if verdict.kind == "changed":
        return f"changes the user's {', '.join(verdict.changed)}"
    if verdict.kind == "error":
        return f"pip failed: {verdict.detail}"
    if verdict.kind == "refused" and (known is None or known[0] != verdict.conflict):
        return f"no resolution keeps the user's versions (conflict on {verdict.conflict}): {verdict.detail}"
    if verdict.kind == "keeps" and known is not None:
        return f"resolves, but KNOWN_CONFLICTS (and the docs) say it conflicts on {known[0]}: update both"
    return None


def resolve(line: str, python: Path, user: tuple[str, ...], workdir: Path, timeout: float) -> Verdict:
    """pip's dry run of ``line`` beside ``user``, from the repository root (the lines install ``.``)."""
    report_file = workdir / f"report-{abs(hash(line))}.json"
    args = shlex.split(line)[2:]  # after "pip install"
    # not --quiet: pip prints a conflict's cause ("X depends on ...") only at its default verbosity
    command = [str(python), "-m", "pip", "install", "--dry-run", "--ignore-installed", "--progress-bar", "off",
               "--report", str(report_file), *args, *user]
    started = time.monotonic()
    try:
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Verdict(line, "error", detail=f"pip's resolver ran past --timeout {timeout:g} s",
                       seconds=time.monotonic() - started)
    report = json.loads(report_file.read_text()) if out.returncode == 0 and report_file.is_file() else None
    verdict = judge(line, out.returncode, report, out.stdout + out.stderr, pins(user))
    verdict.seconds = time.monotonic() - started
    return verdict


def _tail(text: str, lines: int = 6) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip() and "is ignored: it is" not in line]
    return " | ".join(kept[:lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--user", action="append", help="a user's package==version (repeatable; default: "
                        + " ".join(USER) + ")")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per line (default 300)")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = parser.parse_args(argv)
    user = tuple(args.user or USER)
    pins(user)  # refuse a malformed --user before creating anything
    lines = [*install_lines(args.readme.read_text(encoding="utf-8")), *ALSO]
    with tempfile.TemporaryDirectory(prefix="offpolicy-resolution-") as tmp:
        workdir = Path(tmp)
        # a throwaway venv: the resolver sees no installed package, and pip's own version is the venv's
        subprocess.run([sys.executable, "-m", "venv", str(workdir / "venv")], check=True)
        python = workdir / "venv" / "bin" / "python"
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(lines)) as pool:
            verdicts = list(pool.map(lambda line: resolve(line, python, user, workdir, args.timeout), lines))
    print(f"pip's resolver, beside {' '.join(user)} ({time.monotonic() - started:.0f} s):")
    failed = 0
    for v in verdicts:
        shown = ", ".join(f"{name} {v.versions[name]}" for name in SHOWN if name in v.versions)
        print(f"  {v.line}: {v.kind}" + (f" ({shown})" if shown else "") + (f" on {v.conflict}" if v.conflict else "")
              + f" [{v.seconds:.0f} s]")
        why = failure(v)
        if why is None and v.kind == "refused":
            print(f"    known conflict: {expected(v.line)[1]}")  # type: ignore[index]
        if why is not None:
            failed += 1
            print(f"    FAIL: {v.line}: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
