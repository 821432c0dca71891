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
            batched[i].feed_decoded(decoded[2 * k], decoded[2 * k + 1])
            assert batched[i].take() == one_by_one[i].add_tokens([streams[i][position]])
    assert [d.flush() for d in batched] == [d.flush() for d in one_by_one]
    assert [d.stopped for d in batched] == [d.stopped for d in one_by_one]


@pytest.mark.parametrize("stop", [[], ["Zürich", "und", "ext"]])
@pytest.mark.parametrize("seed", range(3))
def test_batch_of_several_tokens_a_request_streams_what_add_tokens_streams(tokenizer, stop, seed):
    """A speculative step gives each request a run of tokens (0 to 17 here): ``detokenize_batch``
    decodes them position by position across requests and must send add_tokens' pieces, stop cuts included."""
    import random

    from scheduler_svc.detokenizer import detokenize_batch

    rng = random.Random(seed)
    streams = [tokenizer.encode(text) for text in TEXTS] + [
        [rng.randrange(tokenizer.vocab_size) for _ in range(40)]  # ids that break characters anywhere
    ]
    one_by_one = [IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"), list(stop)) for _ in streams]
    batched = [IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"), list(stop)) for _ in streams]
    read = [0] * len(streams)
    while any(r < len(ids) and not d.stopped for r, ids, d in zip(read, streams, batched)):
        items, expected = [], []
        for i, ids in enumerate(streams):
            if read[i] >= len(ids) or batched[i].stopped:
                continue
            run = ids[read[i] : read[i] + rng.randrange(0, 18)]
            read[i] += len(run)
            items.append((batched[i], run))
            expected.append(one_by_one[i].add_tokens(run))
        assert detokenize_batch(tokenizer, items) == expected
    assert [d.flush() for d in batched] == [d.flush() for d in one_by_one]
    assert [d.stopped for d in batched] == [d.stopped for d in one_by_one]
    assert any(d.stopped for d in batched) == bool(stop)


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


def test_decode_is_transformers_decode(tokenizer):
    """The step loop decodes through the Rust tokenizer directly; the text must be transformers' own,
    special tokens skipped, for text and for random ids that break characters."""
    import random

    rng = random.Random(0)
    special = sorted(tokenizer.eos_token_ids) + list(tokenizer.hf.all_special_ids)
    batch = [tokenizer.encode(text) for text in TEXTS]
    batch += [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 12))] + [rng.choice(special)]
              for _ in range(200)]
    expected = [tokenizer.hf.decode(ids, skip_special_tokens=True) for ids in batch]
    assert [tokenizer.decode(ids) for ids in batch] == expected
    assert tokenizer.decode_batch(batch) == expected


@pytest.mark.parametrize("clean_up", [False, True])
def test_decode_follows_transformers_clean_up_of_spaces(model_dir, clean_up):
    """Some tokenizer configs (SmolLM2's, as some transformers versions convert it) ask for transformers' clean-up
    of tokenization spaces (" ." to "."), which the Rust tokenizer does not do: the direct decode must follow."""
    from scheduler_svc.tokenizer import Tokenizer, _direct_decoder

    tokenizer = Tokenizer(model_dir)
    hf = tokenizer.hf
    hf.clean_up_tokenization_spaces = clean_up
    # Recent transformers skip the clean-up for BPE unless told otherwise: make it happen when asked for.
    hf.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = clean_up
    decode = _direct_decoder(hf)
    texts = ["Well , that 's it . Is n't it ?", "a ' b ' c", "We 're here , you 've seen ."] + TEXTS
    for text in texts:
        ids = tokenizer.encode(text)
        assert decode(ids) == hf.decode(ids, skip_special_tokens=True)
    cleaned = decode(tokenizer.encode("Well , that 's it ."))
    assert (cleaned == "Well, that's it.") == clean_up
