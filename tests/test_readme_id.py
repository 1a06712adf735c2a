"""README.id.md is a translation of README.md: the same sections in the same order, the same variables."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, variables_table

from rig.facts import config


def headings(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """Each heading outside code blocks: its level, and the code spans and numbers it carries (not translated)."""
    out, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"^(#{1,6}) (.*)$", line)):
            out.append((m[1], tuple(re.findall(r"`[^`]+`|\b\d+\b", m[2]))))
    return out


@pytest.fixture(scope="module")
def texts():
    en = (ROOT / "README.md").read_text()
    id_path = ROOT / "README.id.md"
    assert id_path.exists(), "README.id.md is missing"
    return en, id_path.read_text()


def test_the_translation_says_the_english_one_is_the_reference(texts):
    _, idn = texts
    head = "\n".join(idn.splitlines()[:12])
    assert "README.md" in head and re.search(r"acuan|rujukan", head)


def test_same_sections_in_the_same_order(texts):
    en, idn = texts
    assert headings(idn) == headings(en)
    # the commands are not translated: every code block is the same, in the same order
    blocks = lambda t: re.findall(r"^```[a-z]*\n(.*?)^```", t, re.M | re.S)  # noqa: E731
    assert blocks(idn) == blocks(en)


def test_same_variables_table_rows(texts):
    # the meanings are translated; the names and defaults, and their order, are not (README and docs/variables)
    en, idn = texts
    names_defaults = lambda rows: [row[:2] for row in rows]  # noqa: E731
    assert names_defaults(variables_table(idn, "| Variabel | Bawaan | Arti |")) == names_defaults(variables_table(en))
    full_en, full_id = ((ROOT / "docs" / name).read_text() for name in ("variables.md", "variables.id.md"))
    assert names_defaults(variables_table(full_en)) == [(v.name, v.default) for v in config.VARS]
    assert names_defaults(variables_table(full_id, "| Variabel | Bawaan | Arti |")) == \
        names_defaults(variables_table(full_en))
    assert "variables.md" in full_id.split("|", 1)[0]  # the English page is the reference
