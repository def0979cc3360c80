"""``key.sub=value`` overrides into a config tree, and pydantic's and YAML's errors as one line naming the key.

A value is YAML (``3``, ``1e-4``, ``true``, ``[0, 1]``, ``null``; numbers as :mod:`offpolicy.yaml_numbers` reads
them) except for string fields, which take the text as
written. :func:`offpolicy.train.config.load_config` applies them.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from offpolicy.yaml_numbers import load_yaml, yaml_problem


def _is_text_field(annotation: Any) -> bool:
    """True for ``str``, ``Path`` and their ``Optional`` forms: fields whose override value is taken verbatim."""
    if annotation in (str, Path):
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return len(args) == 1 and args[0] in (str, Path)
    return False


def _parse_text(text: str, optional: bool) -> str | None:
    """A string field's override value: the raw text. YAML would cut ``exp #1`` at the comment and turn ``2024`` /
    ``no`` into an int / a bool that the field then rejects. An optional field's YAML null (``null``, ``~``, empty)
    still resets it to None."""
    if optional and text.strip() in ("", "~", "null", "Null", "NULL"):
        return None
    return text


def _parse_value(text: str) -> Any:
    """``key=value`` values are YAML scalars/lists: ``3`` → int, ``1e-4`` → float, ``true`` → bool, ``[0,1]`` → list,
    numbers as in config files (:mod:`offpolicy.yaml_numbers`).

    Raises ``yaml.YAMLError`` for text YAML cannot parse (the caller names the override).
    """
    return load_yaml(text)


def _section_keys(section: type[BaseModel]) -> list[str]:
    return sorted(section.model_fields)



def set_override(tree: dict, key: str, text: str, root: type[BaseModel]) -> None:
    """Set ``key`` (dotted, from the top of the config class ``root``) in ``tree`` to the value ``text`` stands for:
    verbatim for string fields, YAML else. ``ValueError`` naming the key for one ``root`` does not have."""
    parts = key.split(".")
    cls = root
    node = tree
    for depth, part in enumerate(parts):
        fields = cls.model_fields
        where = ".".join(parts[:depth]) or "top level"
        if part not in fields:
            raise ValueError(f"unknown config key {key!r} (valid keys in {where!r}: {', '.join(_section_keys(cls))})")
        ann = fields[part].annotation
        section = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if depth == len(parts) - 1:
            if section is not None:
                raise ValueError(f"config key {key!r} is a section; set one of its keys, e.g. "
                                 f"{key}.{_section_keys(section)[0]}=…")
            if _is_text_field(ann):
                node[part] = _parse_text(text, optional=ann not in (str, Path))
                return
            try:
                node[part] = _parse_value(text)
            except yaml.YAMLError as err:
                raise ValueError(f"override {key}={text!r} is not valid YAML: {yaml_problem(err)}") from None
            return
        if section is None:
            raise ValueError(f"unknown config key {key!r}: {'.'.join(parts[: depth + 1])!r} is not a section")
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"config key {'.'.join(parts[: depth + 1])!r} must be a mapping")
        cls = section


def explain(err: ValidationError) -> str:
    """pydantic's validation errors as one line: ``invalid config: key: message; …``."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown config key {key!r}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{key}: {msg}" if key else msg)
    return "invalid config: " + "; ".join(lines)
