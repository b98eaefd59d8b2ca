"""Render the Markdown config reference (docs/config_reference.md) from the pydantic schema in `config/`.

    python -m grpo_trainer.config_reference > docs/config_reference.md

Every key appears with its dotted path (as written in overrides), type,
default and description; `tests/test_config_reference.py` fails when the
committed file is stale or a field has no description.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .config import Config
from .losses import AGGREGATION_DOCS, LOSS_VARIANTS, LossOptions, LossVariant

REGENERATE = "python -m grpo_trainer.config_reference > docs/config_reference.md"
REGENERATE_LOSS_FAMILY = "python -m grpo_trainer.config_reference --loss-family"  # rewrites docs/loss_family.md's table
LOSS_FAMILY_MARKER = f"<!-- Generated from the registry in grpo_trainer/losses.py by `{REGENERATE_LOSS_FAMILY}`. -->"
REQUIRED = "(required)"
LIST_INDEX = "N"  # list items are addressed by index, as in `rewards.0.weight=2`


@dataclass
class Row:
    path: str
    type: str
    default: str
    description: str


@dataclass
class Section:
    path: str  # "" for the top level
    description: str
    rows: list[Row]


def collect(model: type[BaseModel] = Config, prefix: str = "", description: str = "") -> list[Section]:
    """Sections in schema order: the scalar keys of `model`, then each nested section, depth first."""
    here = Section(prefix, description, [])
    nested: list[Section] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        sub, is_list = _sub_model(field.annotation)
        if sub is not None and issubclass(sub, LossOptions):  # one model per loss type: loss_options_table
            here.rows.append(Row(path, "mapping", _default(field), field.description or ""))
        elif sub is not None:
            sub_prefix = f"{path}.{LIST_INDEX}" if is_list else path
            desc = field.description or ""
            if is_list:
                desc += f" A list; each item has the keys below (`{LIST_INDEX}` is its index, e.g. `{path}.0`)."
                desc += f" Default: `{_default(field)}`."
            elif _is_optional(field.annotation):
                desc += f" Optional section (default: `{_default(field)}`)."
            nested.extend(collect(sub, sub_prefix, desc.strip()))
        else:
            here.rows.append(Row(path, type_name(field.annotation, field), _default(field), field.description or ""))
    return ([here] if here.rows or not prefix else []) + nested


def missing_descriptions(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Dotted paths of fields (sections included) without a description."""
    missing = []
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        if not (field.description or "").strip():
            missing.append(path)
        sub, is_list = _sub_model(field.annotation)
        if sub is not None and issubclass(sub, LossOptions):
            for variant in LOSS_VARIANTS.values():
                missing += [
                    f"{path}.{o} ({variant.name})"
                    for o, f in variant.options.model_fields.items()
                    if not (f.description or "").strip()
                ]
        elif sub is not None:
            missing += missing_descriptions(sub, f"{path}.{LIST_INDEX}" if is_list else path)
    return list(dict.fromkeys(missing))


def render_config_reference() -> str:
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from grpo_trainer/config/ by `{REGENERATE}`; do not edit by hand. -->",
        "",
        "Every key of the YAML config, as a dotted path: the same path sets it from the command line",
        "(`python -m grpo_trainer train CONFIG train.max_steps=50 rewards.0.weight=2`; values are parsed as YAML).",
        "Unknown keys and wrong types are errors at load time. `python -m grpo_trainer validate CONFIG` prints",
        "a config with every default filled in.",
        "",
    ]
    sections = collect()
    lines += ["Sections: " + ", ".join(f"[`{s.path or 'top level'}`](#{_anchor(s.path)})" for s in sections), ""]
    for section in sections:
        lines += [f"## {'`' + section.path + '`' if section.path else 'Top level'}", ""]
        if section.description:
            lines += [section.description, ""]
        if not section.rows:
            continue
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for row in section.rows:
            default = row.default if row.default == REQUIRED else _code(row.default)
            cells = [f"`{row.path}`", _code(row.type), default, row.description]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
        if section.path == "loss":
            lines += loss_variant_table() + loss_options_table()
    return "\n".join(lines).rstrip() + "\n"


def loss_variant_table() -> list[str]:
    """`loss.type`'s values as the registry `losses.LOSS_VARIANTS` defines them (the table the trainer reads too)."""
    lines = [
        "`loss.type` values (from the registry, `grpo_trainer/losses.py: LOSS_VARIANTS`; formulas in docs/loss_family.md):",
        "",
        "| `loss.type` | ratio | surrogate | aggregation | depends on micro-batching | zero-advantage skip exact | "
        "options | paper |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in LOSS_VARIANTS.values():
        cells = [
            f"`{v.name}`",
            v.ratio,
            f"`{v.surrogate.__name__}`",
            v.aggregation,
            "yes" if v.per_micro_batch else "no",
            "yes" if v.exact_zero_advantage_skip else "no",
            ", ".join(f"`{o}`" for o in v.options.model_fields) or "none",
            v.paper,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines + [""]


def loss_options_table() -> list[str]:
    """`loss.options`: each options model of the registry once, with the types that read it."""
    lines = [
        "`loss.options` by loss type (each type's own model; an option of another type is an error). The flat keys "
        "of earlier versions still load into them:",
        "",
        "| option | type | default | read by | flat key | description |",
        "|---|---|---|---|---|---|",
    ]
    models: dict[type[LossOptions], list[LossVariant]] = {}
    for v in LOSS_VARIANTS.values():
        models.setdefault(v.options, []).append(v)
    for model, variants in models.items():
        for name, field in model.model_fields.items():
            flat = sorted({k for v in variants for k, o in v.legacy_keys.items() if o == name})
            cells = [
                f"`loss.options.{name}`",
                _code(type_name(field.annotation, field)),
                _code(_default(field)),
                ", ".join(f"`{v.name}`" for v in variants),
                ", ".join(f"`loss.{k}`" for k in flat),
                field.description or "",
            ]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines + [""]


def loss_family_table() -> list[str]:
    """docs/loss_family.md's table of the loss types: each registry entry's docs row."""
    lines = [
        "| `loss.type` | per-token loss | aggregation into the batch loss | paper | choose it when |",
        "|---|---|---|---|---|",
    ]
    for v in LOSS_VARIANTS.values():
        cells = [f"`{v.name}`", v.formula, AGGREGATION_DOCS[v.aggregation], v.paper, v.use]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def with_loss_family_table(text: str) -> str:
    """`text` (docs/loss_family.md) with the table after LOSS_FAMILY_MARKER (up to the next blank line) regenerated."""
    lines = text.split("\n")
    start = lines.index(LOSS_FAMILY_MARKER) + 1
    end = lines.index("", start)
    return "\n".join(lines[:start] + loss_family_table() + lines[end:])


# ----------------------------------------------------------------------------- types and defaults


def type_name(annotation: Any, field: FieldInfo | None = None) -> str:
    """A short, readable type: `int > 0`, `str | null`, `int > 0 | null`, `"grpo" | "dapo"`, `list["jsonl"]`."""
    optional = _is_optional(annotation)
    if optional:
        rest = tuple(a for a in typing.get_args(annotation) if a is not type(None))
        annotation = rest[0] if len(rest) == 1 else Union[rest]  # noqa: UP007 (`|` cannot join a tuple of types)
    text = _type(annotation)
    if field is not None:
        bounds = []
        for meta in field.metadata:
            for attr, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
                value = getattr(meta, attr, None)
                if value is not None:
                    bounds.append(f"{symbol} {value}")
        if bounds:
            text += " " + ", ".join(bounds)
    return text + (" | null" if optional else "")


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if origin is Literal:
        return " | ".join(_literal(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type(a) for a in args)
    if origin in (list, tuple, set, frozenset):
        return f"list[{', '.join(_type(a) for a in args if a is not Ellipsis)}]"
    if origin is dict:
        return f"mapping[{', '.join(_type(a) for a in args)}]" if args else "mapping"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(_literal(m.value) for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if isinstance(annotation, type):
        return {"str": "str", "int": "int", "float": "float", "bool": "bool"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation).replace("typing.", "")


def _literal(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else _yaml(value)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.get_default(call_default_factory=True)
    elif field.default is PydanticUndefined:
        return REQUIRED
    else:
        value = field.default
    return _yaml(_plain(value))


def _plain(value: Any) -> Any:
    """Models to dicts of their non-default keys, so a default list of rewards reads like its YAML."""
    if isinstance(value, BaseModel):
        return {k: _plain(v) for k, v in value.model_dump(exclude_defaults=True).items()} or "{}"
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    return value


def _yaml(value: Any) -> str:
    if isinstance(value, str) and value in ("{}", ""):
        return value or '""'
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def _sub_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the section model, is it a list of them) for `Model`, `Model | None`, `list[Model]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, tuple) and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], True
    if origin in (Union, types.UnionType):
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1 and all(a is type(None) or a is models[0] for a in args):
            return models[0], False
    return None, False


def _is_optional(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (Union, types.UnionType) and type(None) in typing.get_args(annotation)


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _anchor(path: str) -> str:
    """GitHub's heading anchor: lower case, punctuation other than - and _ dropped, spaces to -."""
    heading = path or "top level"
    return "".join(c for c in heading.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


if __name__ == "__main__":
    import sys
    from pathlib import Path

    if sys.argv[1:] == ["--loss-family"]:
        doc = Path(__file__).resolve().parent.parent / "docs" / "loss_family.md"
        doc.write_text(with_loss_family_table(doc.read_text()))
    else:
        sys.stdout.write(render_config_reference())
