"""The docs a user reads agree with the code they describe: every list of the loss types that is written by hand
(not generated from the registry, grpo_trainer/losses.py: LOSS_VARIANTS) names exactly the registry's types, and
every link between the docs leads to a file and a heading that exist. pyproject's description, README's intro
and its `loss.type` sentence, and the generated tables are checked in tests/test_loss_registry.py."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from grpo_trainer.config_reference import render_config_reference
from grpo_trainer.losses import LOSS_TYPES, LOSS_VARIANTS
from helpers import ROOT

README = ROOT / "README.md"
LOSS_FAMILY = ROOT / "docs" / "loss_family.md"
NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split()


def test_loss_family_counts_the_registrys_types():
    sentence = re.search(r"`loss\.type` picks one of (\w+) variants", LOSS_FAMILY.read_text())
    assert sentence is not None, "docs/loss_family.md: its opening sentence no longer says how many types there are"
    assert sentence.group(1) == NUMBERS[len(LOSS_TYPES)], f"docs/loss_family.md says {sentence.group(1)}: {LOSS_TYPES}"


def test_the_clipped_types_listed_are_the_ones_with_a_clip_option():
    listed = re.search(r"Clipped types only \(([^)]*)\)", LOSS_FAMILY.read_text()).group(1)
    clipped = [name for name, variant in LOSS_VARIANTS.items() if "delta" in variant.options.model_fields]
    assert re.findall(r"`(\w+)`", listed) == clipped


def test_every_loss_recipe_is_listed_where_the_recipes_are_and_trains_its_type():
    """configs/<type>.yaml is the ready recipe of a type: README and docs/loss_family.md list each, and it sets
    that type (a recipe added for a new type shows up in both lists, or this fails)."""
    recipes = [t for t in LOSS_TYPES if (ROOT / "configs" / f"{t}.yaml").is_file()]
    assert len(recipes) >= 7, recipes
    readme, family = README.read_text(), LOSS_FAMILY.read_text()
    for t in recipes:
        assert yaml.safe_load((ROOT / "configs" / f"{t}.yaml").read_text())["loss"]["type"] == t
        assert f"`{t}.yaml`" in readme or f"`configs/{t}.yaml`" in readme, f"README's recipe list lacks {t}.yaml"
        assert f"| `configs/{t}.yaml` | `{t}` loss" in family, f"docs/loss_family.md's recipe table lacks {t}.yaml"


def test_the_config_reference_lists_the_registrys_types():
    """docs/config_reference.md is generated (tests/test_config_reference.py holds it to the schema); its table of
    `loss.type` values must come from the registry, one row per type, in the registry's order."""
    rows = re.findall(r"^\| `(\w+)` \| (?:token|sequence\w*) \|", render_config_reference(), re.M)
    assert rows == list(LOSS_TYPES)


# ----------------------------------------------------------------------------- links between the docs


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(markdown: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", markdown.read_text(), flags=re.S | re.M)  # a `# comment` in code is no heading
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_every_link_between_the_docs_leads_to_a_file_and_a_heading():
    broken = []
    for page in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#\s:]*)(?:#([^)\s]+))?\)", page.read_text()):
            if not target and not anchor:
                continue
            linked = (page.parent / target).resolve() if target else page
            name = f"{page.relative_to(ROOT)} -> {target}#{anchor}"
            if not linked.exists():
                broken.append(f"{name}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{name}: no such heading")
    assert broken == []
