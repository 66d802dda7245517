"""The config keys as `train.py --help` lists them: every key of the typed schema (training.config) with its
default, its allowed values and the comment written beside its field, one line each.

Generated from the dataclasses themselves, so a key added to the schema is listed without anyone touching this
file (tests/test_train.py compares the list with the dataclass fields). The descriptions are the fields' trailing
comments in the source (a comment line right below a field continues its comment), read with `tokenize`: the
schema keeps one description per key, where a reader of the code sees it too.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import textwrap
import tokenize
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

from omegaconf import MISSING

from training.config import Config, describe_range


@dataclass(frozen=True)
class ConfigKey:
    """One leaf key of the schema: its dotted name, default as YAML spells it ("" when the recipe must set it),
    what values it takes, and its description."""

    name: str
    default: str
    required: bool
    allowed: str  # "one of vca, mhsa", "a finite value >= 1", or ""
    description: str


def config_keys(schema: type = Config, prefix: str = "") -> list[ConfigKey]:
    """Every leaf key of the dataclass `schema` and of the sections it nests, in declaration order."""
    keys = []
    comments = field_comments(schema)
    for item in dataclasses.fields(schema):
        name = f"{prefix}{item.name}"
        field_type = typing.get_type_hints(schema)[item.name]
        if dataclasses.is_dataclass(field_type):
            keys += config_keys(field_type, f"{name}.")
            continue
        default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
        allowed = ""
        if "choices" in item.metadata:
            allowed = "one of " + ", ".join(yaml_value(choice) for choice in item.metadata["choices"])
        elif "range" in item.metadata:
            allowed = describe_range(*item.metadata["range"])
        elif "decided_by" in item.metadata:
            allowed = f"set by training from {item.metadata['decided_by']}"
        required = default is MISSING or default is dataclasses.MISSING  # ModelSpec.name has no default
        keys.append(ConfigKey(name, "" if required else yaml_value(default), required, allowed, comments[item.name]))
    return keys


def yaml_value(value: Any) -> str:
    """A default as an override writes it: null, true, 0.0001, [0.9,0.999], vca (no spaces: one shell word)."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


@cache
def field_comments(schema: type) -> dict[str, str]:
    """Field name -> the comment beside it in the class source (with the comment lines right below it), or ""."""
    source = textwrap.dedent(inspect.getsource(schema))
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    code_lines = {line for line, text in enumerate(source.splitlines(), start=1) if not text.strip().startswith("#")}
    found = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            parts, line = [comments[node.end_lineno]] if node.end_lineno in comments else [], node.end_lineno + 1
            while parts and line in comments and line not in code_lines:  # a comment continued below the field
                parts.append(comments[line])
                line += 1
            found[node.target.id] = " ".join(parts)
    return found


def describe_keys(schema: type = Config) -> str:
    """The help text: one section per top-level section (its docstring's first line), one line per key."""
    lines = [
        "config keys (set in the YAML file or as section.key=value; 'required' keys have no default and come from "
        "the recipe's YAML):"
    ]
    for section in dataclasses.fields(schema):
        section_type = typing.get_type_hints(schema)[section.name]
        summary = (inspect.getdoc(section_type) or "").split("\n\n")[0].replace("\n", " ")
        lines += ["", f"{section.name}: {summary}"]
        for key in config_keys(section_type, f"{section.name}."):
            setting = f"{key.name}=" + ("(required)" if key.required else key.default)
            note = "; ".join(part for part in (key.description, key.allowed) if part)
            lines.append(f"  {setting:<44} {note}")
    return "\n".join(lines)
