"""Build the default embedded models (``tiny``, ``lab``, ``lab-moe``) and write them into the package
(offpolicy/models/data).

Run after changing a default recipe, the architecture or the tokenizer (tests/models/test_shipped.py fails until
then): ``python scripts/ship_models.py`` (all of them) or ``python scripts/ship_models.py lab-moe`` (those named; the
other shipped folders stay as they are). Each model is warm-started from its seed (≈2 min on 2 cores for the dense
ones, ≈7 min for lab-moe), then its folder replaces the shipped one of the same ``<name>-<hash>``; folders of older
recipes are removed.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from offpolicy.models.cache import SHIPPED_DIR, build_model, model_dir
from offpolicy.models.recipes import RECIPES


def main(names: list[str]) -> None:
    unknown = sorted(set(names) - set(RECIPES))
    if unknown:
        raise SystemExit(f"unknown recipe(s) {unknown}: use some of {sorted(RECIPES)}")
    SHIPPED_DIR.mkdir(parents=True, exist_ok=True)
    keep = {model_dir(name, "/").name for name in RECIPES}  # current folders of the recipes not rebuilt stay
    for name in names or list(RECIPES):
        target = SHIPPED_DIR / model_dir(name, "/").name
        with tempfile.TemporaryDirectory(dir=SHIPPED_DIR) as tmp:
            (Path(tmp) / "model").mkdir()
            built = build_model(name, Path(tmp) / "model")
            if target.exists():
                shutil.rmtree(target)
            shutil.move(str(built), target)
        target.chmod(0o755)
        for f in target.iterdir():
            f.chmod(0o644)  # tempfile folders are private; the package data is not
        print(f"{name}: {target} ({sum(f.stat().st_size for f in target.iterdir()) / 2**20:.1f} MiB)")
    for old in SHIPPED_DIR.iterdir():
        if old.is_dir() and old.name not in keep:
            shutil.rmtree(old)


if __name__ == "__main__":
    main(sys.argv[1:])
