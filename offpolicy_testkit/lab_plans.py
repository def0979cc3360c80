"""Small sweep plans of the lab's executor tests (local and Ray)."""

from __future__ import annotations


def small_plan(out, tiny_run, **kw):
    """The ``quick`` setting cut to naive and mis × (none, bf16) × 2 seeds × 3 steps unless ``kw`` says otherwise;
    ``extra``: trainer overrides after the tiny model's."""
    from offpolicy.lab.plan import plan_sweep

    kw.setdefault("presets", "naive,mis")
    kw.setdefault("mismatches", "none,bf16")
    kw.setdefault("seeds", 2)
    kw.setdefault("steps", 3)
    extra = kw.pop("extra", [])
    return plan_sweep(out, "quick", overrides=[*tiny_run, *extra], **kw)


def no_prepare(plan):
    """A sweep's ``prepare`` that builds nothing (the tests' runs use the tiny model, or no model at all)."""
    return None
