"""Benchmark data: Spec-Bench question files and CNN/DailyMail articles, read from a path.

Both become ``BenchItem``s: one conversation of one or more user turns. A multi-turn item (the
MT-bench rows of Spec-Bench) is run turn by turn: answer turn 1, append that answer as an
assistant message, then ask turn 2. Each turn is one request, so one "sequence" in the paper's
"calls per sequence".

Row shapes (one JSON object per line):
    Spec-Bench  {"question_id": int, "category": str, "turns": [str, ...], "reference": [...]?}
    CNN/DM      {"id": str, "article": str, "highlights": str, ...}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SPEC_BENCH = "spec_bench"
CNNDM = "cnndm"
CNNDM_CATEGORY = "cnndm"

SUMMARIZE_PROMPT = "Summarize the following news article in three sentences.\n\nArticle:\n{article}"


@dataclass(frozen=True)
class BenchItem:
    """One conversation to run: its user turns and, for CNN/DM, the reference summary."""

    dataset: str
    item_id: str
    category: str
    turns: tuple[str, ...]
    reference: str | None = None
    """CNN/DM's highlights (the ROUGE reference); None for Spec-Bench."""

    @property
    def num_turns(self) -> int:
        return len(self.turns)


@dataclass(frozen=True)
class DataSelection:
    """Which items of a file to run."""

    categories: tuple[str, ...] = ()
    """Keep only these categories (empty: all). CNN/DM rows are category ``cnndm``."""
    limit: int | None = None
    """At most this many items per category, in file order (None: all)."""
    max_article_chars: int | None = None
    """Cut CNN/DM articles to this many characters (at a word boundary); None keeps them whole."""

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ValueError("limit must be >= 1")
        if self.max_article_chars is not None and self.max_article_chars < 1:
            raise ValueError("max_article_chars must be >= 1")


def load_items(path: str | Path, selection: DataSelection = DataSelection()) -> list[BenchItem]:
    """Read a Spec-Bench or CNN/DM JSONL file (the shape is told by its rows) and select items."""
    rows = _read_jsonl(Path(path))
    items = [_to_item(row, selection, f"{path}:{number}") for number, row in enumerate(rows, start=1)]
    return _select(items, selection)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise ValueError(f"data file not found: {path}")
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _to_item(row: dict, selection: DataSelection, where: str) -> BenchItem:
    if "turns" in row:
        return _spec_bench_item(row, where)
    if "article" in row and "highlights" in row:
        return _cnndm_item(row, selection.max_article_chars)
    raise ValueError(f"{where}: neither a Spec-Bench row (turns) nor a CNN/DM row (article, highlights)")


def _spec_bench_item(row: dict, where: str) -> BenchItem:
    turns = row["turns"]
    if not turns or not all(isinstance(turn, str) and turn for turn in turns):
        raise ValueError(f"{where}: turns must be a non-empty list of non-empty strings")
    return BenchItem(SPEC_BENCH, str(row["question_id"]), str(row["category"]), tuple(turns))


def _cnndm_item(row: dict, max_article_chars: int | None) -> BenchItem:
    article = truncate_words(row["article"].strip(), max_article_chars)
    prompt = SUMMARIZE_PROMPT.format(article=article)
    return BenchItem(CNNDM, str(row.get("id", "")), CNNDM_CATEGORY, (prompt,), reference=row["highlights"])


def truncate_words(text: str, max_chars: int | None) -> str:
    """``text`` cut to at most ``max_chars`` characters, at the last space before the cut."""
    if max_chars is None or len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    space = cut.rfind(" ")
    return cut[:space] if space > 0 else cut


def _select(items: list[BenchItem], selection: DataSelection) -> list[BenchItem]:
    wanted = set(selection.categories)
    counts: dict[str, int] = {}
    selected = []
    for item in items:
        if wanted and item.category not in wanted:
            continue
        if selection.limit is not None and counts.get(item.category, 0) >= selection.limit:
            continue
        counts[item.category] = counts.get(item.category, 0) + 1
        selected.append(item)
    return selected


def conversation(item: BenchItem, answers: list[str]) -> list[dict]:
    """The chat messages for the next turn: every earlier turn followed by its answer.

    >>> conversation(BenchItem("spec_bench", "1", "writing", ("a", "b")), ["A"])
    [{'role': 'user', 'content': 'a'}, {'role': 'assistant', 'content': 'A'}, {'role': 'user', 'content': 'b'}]
    """
    if len(answers) >= item.num_turns:
        raise ValueError(f"item {item.item_id} has {item.num_turns} turns; {len(answers)} answered already")
    messages = []
    # Fewer answers than turns: the turns after the last answer are still to come.
    for turn, answer in zip(item.turns, answers, strict=False):
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": item.turns[len(answers)]})
    return messages
