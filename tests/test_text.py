"""gateway.text: incremental detokenization and stop strings, fed one piece at a time, no server.

The tiny BPE tokenizer is byte-level: characters it never saw in training ("ß", "東", "🙂") are
split into byte tokens, so one character can span two to four tokens.
"""

from __future__ import annotations

import random

import pytest

from gateway.text import REPLACEMENT_CHAR, IncrementalDetokenizer, StopStringFilter

MULTI_BYTE_TEXT = "naïve café 東京 🙂 Straße Жук 😀!"


@pytest.fixture(scope="module")
def tokenizer(target_model):
    return target_model.tokenizer


def non_special_ids(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return [token_id for token_id in range(len(tokenizer)) if token_id not in special]


def stream_deltas(tokenizer, token_ids: list[int]) -> list[str]:
    """Every delta the detokenizer releases, one per add(), then the flush."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [detokenizer.add(token_id) for token_id in token_ids] + [detokenizer.flush()]


# --- IncrementalDetokenizer -------------------------------------------------------------------


def test_joined_deltas_equal_decode_of_all_tokens_for_random_sequences(tokenizer):
    rng = random.Random(0)
    vocabulary = non_special_ids(tokenizer)
    for _ in range(300):
        token_ids = [rng.choice(vocabulary) for _ in range(rng.randrange(1, 40))]
        assert "".join(stream_deltas(tokenizer, token_ids)) == tokenizer.decode(token_ids)


def test_deltas_are_valid_utf8_for_random_sequences(tokenizer):
    rng = random.Random(1)
    vocabulary = non_special_ids(tokenizer)
    for _ in range(300):
        token_ids = [rng.choice(vocabulary) for _ in range(rng.randrange(1, 40))]
        for delta in stream_deltas(tokenizer, token_ids):
            assert delta.encode("utf-8").decode("utf-8") == delta


def test_text_of_valid_utf8_streams_without_replacement_characters(tokenizer):
    token_ids = tokenizer.encode(MULTI_BYTE_TEXT)
    deltas = stream_deltas(tokenizer, token_ids)
    assert [delta for delta in deltas if REPLACEMENT_CHAR in delta] == []
    assert "".join(deltas) == MULTI_BYTE_TEXT


def test_character_split_over_byte_tokens_is_released_whole_with_its_last_byte(tokenizer):
    token_ids = tokenizer.encode("a東")
    assert len(token_ids) == 4  # "a" and the three bytes of 東
    assert stream_deltas(tokenizer, token_ids) == ["a", "", "", "東", ""]


def test_invalid_byte_at_the_end_is_released_by_flush(tokenizer):
    lone_byte = tokenizer.encode("ß")[0]  # 0xC3: the first byte of a two-byte character
    token_ids = tokenizer.encode("ok") + [lone_byte]
    deltas = stream_deltas(tokenizer, token_ids)
    assert deltas[-2:] == ["", REPLACEMENT_CHAR]
    assert "".join(deltas) == "ok" + REPLACEMENT_CHAR


def test_special_tokens_are_skipped(tokenizer):
    token_ids = tokenizer.encode("hi") + [tokenizer.eos_token_id] + tokenizer.encode("yo")
    assert "".join(stream_deltas(tokenizer, token_ids)) == "hiyo"


# --- StopStringFilter -------------------------------------------------------------------------


def test_text_without_stop_strings_passes_through():
    stop_filter = StopStringFilter([])
    assert [stop_filter.append("ab"), stop_filter.append("cd"), stop_filter.flush()] == ["ab", "cd", ""]
    assert not stop_filter.is_stopped


def test_stop_inside_one_delta_cuts_before_it():
    stop_filter = StopStringFilter(["END"])
    assert stop_filter.append("hello END world") == "hello "
    assert stop_filter.is_stopped


def test_stop_split_across_two_deltas_never_reaches_the_client():
    stop_filter = StopStringFilter(["END"])
    assert stop_filter.append("abcE") == "abc"
    assert stop_filter.append("ND more") == ""
    assert stop_filter.is_stopped


def test_stop_split_across_three_deltas_holds_every_piece():
    stop_filter = StopStringFilter(["END"])
    assert [stop_filter.append("x E"), stop_filter.append("N"), stop_filter.append("D!")] == ["x ", "", ""]
    assert stop_filter.is_stopped


def test_partial_stop_prefix_is_held_then_released_when_it_does_not_continue():
    stop_filter = StopStringFilter(["END"])
    assert stop_filter.append("abEN") == "ab"
    assert stop_filter.append("x") == "ENx"
    assert not stop_filter.is_stopped


def test_flush_releases_a_held_partial_prefix():
    stop_filter = StopStringFilter(["END"])
    assert stop_filter.append("abEN") == "ab"
    assert stop_filter.flush() == "EN"


def test_earliest_stop_wins_over_the_first_listed():
    stop_filter = StopStringFilter(["world", "lo"])
    assert stop_filter.append("hello world") == "hel"


def test_earliest_stop_wins_when_a_longer_stop_starts_first():
    stop_filter = StopStringFilter(["op", "long stop"])
    assert stop_filter.append("a long st") == "a "
    assert stop_filter.append("op") == ""
    assert stop_filter.is_stopped


def test_stop_that_overlaps_its_own_partial_prefix_is_found():
    stop_filter = StopStringFilter(["aab"])
    assert stop_filter.append("aaa") == "a"
    assert stop_filter.append("b") == ""
    assert stop_filter.is_stopped


def test_nothing_is_released_after_a_stop():
    stop_filter = StopStringFilter(["END"])
    stop_filter.append("xEND")
    assert [stop_filter.append("more"), stop_filter.flush()] == ["", ""]
