"""Incremental detokenization: UTF-8 safe, spaces right, stop strings never leak."""

from __future__ import annotations

import pytest

from scheduler_svc.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, this is a test.",
    "Emoji 🎉🚀 and accents: café, naïve, Zürich.",
    "中文字符和日本語のテキスト",
    "  leading spaces\n\nand\tTabs  ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_one_token_at_a_time_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"))
    pieces = [detok.add_tokens([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1  # byte-level BPE splits the emoji
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add_tokens([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add_tokens([ids[-1]]) == "🎉"


def test_stop_string_across_tokens_is_cut_and_never_sent(tokenizer):
    ids = tokenizer.encode("The answer is forty-two. END of message")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["END"])
    sent = ""
    for t in ids:
        sent += detok.add_tokens([t])
        assert "E" not in sent.split("two.")[-1], "a prefix of the stop string leaked"
        if detok.stopped:
            break
    assert detok.stopped
    assert sent + detok.flush() == "The answer is forty-two. "


def test_held_back_prefix_is_released_when_it_is_not_a_stop(tokenizer):
    ids = tokenizer.encode("Go to the ENTRANCE now")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["END"])
    text = "".join(detok.add_tokens([t]) for t in ids) + detok.flush()
    assert not detok.stopped and text == "Go to the ENTRANCE now"


@pytest.mark.parametrize("stop", [[], ["Zürich", "und"]])
def test_batched_decoding_streams_the_same_pieces(tokenizer, stop):
    """The step loop decodes all requests' windows in one batch; the pieces must not change."""
    streams = [tokenizer.encode(text) for text in TEXTS]
    one_by_one = [IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"), list(stop)) for _ in streams]
    batched = [IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"), list(stop)) for _ in streams]
    for position in range(max(map(len, streams))):
        live = [i for i, ids in enumerate(streams) if position < len(ids) and not batched[i].stopped]
        windows = [w for i in live for w in batched[i].next_windows(streams[i][position])]
        decoded = tokenizer.decode_batch(windows)
        assert decoded == [tokenizer.decode(w) for w in windows]
        for k, i in enumerate(live):
            assert batched[i].take_decoded(decoded[2 * k], decoded[2 * k + 1]) == one_by_one[i].add_tokens([streams[i][position]])
    assert [d.flush() for d in batched] == [d.flush() for d in one_by_one]
    assert [d.stopped for d in batched] == [d.stopped for d in one_by_one]


def test_flush_releases_the_complete_text_of_held_back_tokens(tokenizer):
    """A request cut off inside a character still gets the characters before it (here the space)."""
    ids = tokenizer.encode("naïve 🎉")
    detok = IncrementalDetokenizer(tokenizer, [])
    sent = "".join(detok.add_tokens([t]) for t in ids[:-1])  # the emoji's last byte never comes
    assert sent + detok.flush() == "naïve "


@pytest.mark.parametrize("seed", range(4))
def test_whole_output_at_once_equals_token_by_token(tokenizer, seed):
    """``add_all`` (two decodes) gives the text of ``add_tokens`` per token plus ``flush``, also for
    random ids that break characters anywhere, and for text cut at any token."""
    import random

    rng = random.Random(seed)
    text_ids = tokenizer.encode(" ".join(TEXTS) * 2)
    for trial in range(150):
        if trial % 2:
            prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(12))]
            output = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        else:
            cut = rng.randrange(len(text_ids))
            prompt, output = text_ids[:cut], text_ids[cut : rng.randrange(cut + 1, len(text_ids) + 1)]
        by_token = IncrementalDetokenizer(tokenizer, prompt)
        expected = "".join(by_token.add_tokens([t]) for t in output) + by_token.flush()
        assert IncrementalDetokenizer(tokenizer, prompt).add_all(output) == expected, (prompt[-5:], output)
