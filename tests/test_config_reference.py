"""docs/config_reference.md is generated from the pydantic schema and must match it; every key is documented."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from grpo_trainer.config import Config
from grpo_trainer.config_reference import REGENERATE, missing_descriptions, render_config_reference, type_name
from helpers import ROOT

DOC = ROOT / "docs" / "config_reference.md"


def test_committed_reference_matches_the_schema():
    expected = render_config_reference()
    actual = DOC.read_text() if DOC.is_file() else ""
    if actual != expected:
        import difflib

        diff = "".join(
            list(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True), "committed", "generated"))[:40]
        )
        raise AssertionError(
            f"docs/config_reference.md is out of date with grpo_trainer/config/. Regenerate it from the repo root:\n"
            f"    PYTHONPATH=. {REGENERATE}\n(or `.venv/bin/{REGENERATE}`)\nFirst differences:\n{diff}"
        )


def test_every_config_field_has_a_description():
    missing = missing_descriptions()
    assert not missing, f"these config keys need `Field(..., description=...)` in grpo_trainer/config/: {missing}"


def _leaf_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = field.annotation
        args = getattr(annotation, "__args__", ())
        sub = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else next(
            (a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None
        )
        if sub is None:
            paths.append(path)
        else:
            is_list = getattr(annotation, "__origin__", None) is list
            paths += _leaf_paths(sub, f"{path}.N." if is_list else f"{path}.")
    return paths


def test_every_key_appears_with_its_dotted_path():
    text = render_config_reference()
    leaves = _leaf_paths(Config)
    assert len(leaves) > 30
    for path in leaves:
        assert f"| `{path}` |" in text, path
    assert "| `train.max_steps` | `int > 0` | `100` |" in text
    assert "| `rewards.N.name` | `str` | (required) |" in text
    assert "| `data.subset` | `str \\| null` | `null` |" in text  # pipes escaped inside table cells


def test_an_undocumented_field_is_found():
    class Inner(BaseModel):
        documented: int = Field(1, description="yes")
        bare: int = 2

    class Outer(BaseModel):
        inner: Inner = Field(default_factory=Inner, description="a section")
        items: list[Inner] = Field(default_factory=list)

    assert missing_descriptions(Outer) == ["inner.bare", "items", "items.N.bare"]


def test_type_names_are_readable():
    assert type_name(Literal["a", "b"]) == '"a" | "b"'
    assert type_name(list[Literal["jsonl"]]) == 'list["jsonl"]'
    assert type_name(str | None) == "str | null"
    assert type_name(dict[str, int]) == "mapping[str, int]"
