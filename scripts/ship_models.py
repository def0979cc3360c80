"""Build the default embedded models (``tiny``, ``lab``) and write them into the package (offpolicy/models/data).

Run after changing a default recipe, the architecture or the tokenizer (tests/models/test_shipped.py fails until
then): ``python scripts/ship_models.py``. Each model is warm-started from its seed (≈2 min on 2 cores for both),
then its folder replaces the shipped one of the same ``<name>-<hash>``; folders of older recipes are removed.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from offpolicy.models.cache import SHIPPED_DIR, build_model, model_dir
from offpolicy.models.recipes import RECIPES


def main() -> None:
    SHIPPED_DIR.mkdir(parents=True, exist_ok=True)
    keep = set()
    for name in RECIPES:
        target = SHIPPED_DIR / model_dir(name, "/").name
        keep.add(target.name)
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
    main()
