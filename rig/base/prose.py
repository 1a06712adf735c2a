"""Plain English-like prose made on the box, the same bytes everywhere: a bench run's book text.

A bench run must need nothing but the server, so its prompts are cut from text the
rig writes itself instead of a book fetched from the internet. The text is made by
a seeded generator from a fixed vocabulary: sentences of varied length and shape,
grouped into paragraphs, so a tokenizer sees ordinary words, punctuation and
line breaks.
"""

from __future__ import annotations

import random
from pathlib import Path

from rig.base import atomic

#: Bump when the generator changes, so a cached copy of the old text is never mistaken for the new.
VERSION = 1

SUBJECTS = (
    "the keeper", "a traveller", "the old captain", "my neighbour", "the young clerk", "her brother",
    "the harbour master", "a quiet student", "the miller", "our teacher", "the village doctor", "a stranger",
    "the gardener", "his daughter", "the last guard", "the cook", "a weary soldier", "the ferryman",
    "the baker's son", "the surveyor", "an honest merchant", "the widow", "the night watchman", "the engineer",
)
VERBS = (
    "carried", "found", "watched", "mended", "counted", "remembered", "followed", "opened", "painted",
    "wrote", "measured", "answered", "questioned", "lifted", "hid", "sold", "borrowed", "described",
    "cleaned", "guarded", "read", "built", "explained", "forgot", "noticed", "repaired", "studied", "kept",
)
OBJECTS = (
    "the lantern", "a letter", "the narrow bridge", "the map of the valley", "a broken clock", "the long road",
    "the garden wall", "a box of tools", "the grey horse", "the ledger", "a bundle of rope", "the north window",
    "the church bell", "a basket of apples", "the stone well", "the ship's log", "a folded coat", "the river gate",
    "the tall ladder", "an empty cart", "the winter stores", "a sealed envelope", "the brass key", "the old mill",
)
PLACES = (
    "by the harbour", "at the edge of the town", "in the market square", "under the bridge", "near the chapel",
    "behind the inn", "along the river", "on the hill road", "in the cellar", "beside the station",
    "across the fields", "inside the workshop", "at the crossroads", "in the library", "on the quay",
)
TIMES = (
    "before dawn", "after supper", "in the spring", "every morning", "late that night", "on market day",
    "during the storm", "at noon", "when the bells rang", "long ago", "in the first week of winter", "at dusk",
)
LINKS = ("and", "but", "while", "because", "although", "so", "until", "after", "before", "since")
ADVERBS = ("slowly", "carefully", "quietly", "at once", "without a word", "with great care", "again", "twice")
SAYINGS = (
    "Nothing is lost that is written down", "Count twice and cut once", "The road is longer in the rain",
    "A closed door keeps its own secrets", "Every lamp needs oil", "Tomorrow the tide will turn",
)


def _clause(rng: random.Random) -> str:
    parts = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    if rng.random() < 0.5:
        parts.append(rng.choice(PLACES))
    if rng.random() < 0.3:
        parts.append(rng.choice(ADVERBS))
    if rng.random() < 0.35:
        parts.append(rng.choice(TIMES))
    return " ".join(parts)


def _sentence(rng: random.Random) -> str:
    shape = rng.random()
    if shape < 0.08:
        text = f'"{rng.choice(SAYINGS)}," said {rng.choice(SUBJECTS)}'
    elif shape < 0.16:
        text = f"Why had {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        return text[0].upper() + text[1:] + "?"
    else:
        text = _clause(rng)
        for _ in range(rng.choice((0, 0, 1, 1, 2))):
            text += f"{',' if rng.random() < 0.4 else ''} {rng.choice(LINKS)} {_clause(rng)}"
    return text[0].upper() + text[1:] + rng.choice((".", ".", ".", "!", ";")).replace(";", ".")


def generate(words: int, seed: int = 1661) -> str:
    """At least ``words`` words of prose in paragraphs; the same text for the same arguments."""
    rng = random.Random(seed)
    paragraphs, count = [], 0
    while count < words:
        sentences = [_sentence(rng) for _ in range(rng.randint(3, 9))]
        count += sum(len(s.split()) for s in sentences)
        paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs) + "\n"


def ensure(path: Path, words: int = 200_000) -> Path:
    """``path`` holding the generated text, written once (atomically) and rewritten only when it differs."""
    text = generate(words).encode()
    if not path.is_file() or path.read_bytes() != text:
        atomic.write_bytes(path, text)
    return path
