"""The benchmark's data loaders: Spec-Bench rows, CNN/DM rows, selection, multi-turn prompts."""

from __future__ import annotations

import json

import pytest

from spade_bench.data import CNNDM, SPEC_BENCH, BenchItem, DataSelection, conversation, load_items, truncate_words

SPEC_ROWS = [
    {"question_id": 2, "category": "writing", "turns": ["Draft an email.", "Critique it."]},
    {"question_id": 4, "category": "writing", "turns": ["Write a poem."]},
    {"question_id": 6, "category": "qa", "turns": ["Who?"], "reference": ["Nobody."]},
]


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in SPEC_ROWS) + "\n")
    return path


def test_spec_bench_rows(spec_file):
    items = load_items(spec_file)
    assert [(i.dataset, i.item_id, i.category, i.num_turns) for i in items] == [
        (SPEC_BENCH, "2", "writing", 2),
        (SPEC_BENCH, "4", "writing", 1),
        (SPEC_BENCH, "6", "qa", 1),
    ]
    assert items[0].reference is None


def test_limit_is_per_category_and_categories_filter(spec_file):
    assert [i.item_id for i in load_items(spec_file, DataSelection(limit=1))] == ["2", "6"]
    assert [i.item_id for i in load_items(spec_file, DataSelection(categories=("qa",)))] == ["6"]


def test_cnndm_rows_become_summarisation_prompts(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps({"id": "x1", "article": "One two three four five.", "highlights": "One two ."}) + "\n")
    (item,) = load_items(path, DataSelection(max_article_chars=10))
    assert (item.dataset, item.item_id, item.category, item.reference) == (CNNDM, "x1", "cnndm", "One two .")
    assert item.turns[0].startswith("Summarize the following news article")
    assert item.turns[0].endswith("One two")  # cut at the last space before 10 characters


def test_multi_turn_conversation_carries_earlier_answers():
    item = BenchItem(SPEC_BENCH, "2", "writing", ("Draft an email.", "Critique it."))
    assert conversation(item, []) == [{"role": "user", "content": "Draft an email."}]
    assert conversation(item, ["Dear boss"]) == [
        {"role": "user", "content": "Draft an email."},
        {"role": "assistant", "content": "Dear boss"},
        {"role": "user", "content": "Critique it."},
    ]
    with pytest.raises(ValueError):
        conversation(item, ["a", "b"])


def test_truncate_words():
    assert truncate_words("short", 10) == "short"
    assert truncate_words("alpha beta gamma", 12) == "alpha beta"
    assert truncate_words("unbroken", 3) == "unb"
    assert truncate_words("anything", None) == "anything"


def test_bad_input_is_a_value_error(tmp_path):
    with pytest.raises(ValueError):
        load_items(tmp_path / "missing.jsonl")
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps({"text": "no turns, no article"}) + "\n")
    with pytest.raises(ValueError):
        load_items(path)
    with pytest.raises(ValueError):
        DataSelection(limit=0)
