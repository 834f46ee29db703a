"""Incremental detokenizer and stop strings with the demo checkpoint's real byte-level BPE tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pipeserve.detokenize import REPLACEMENT, IncrementalDetokenizer, TextStream, held_suffix
from pipeserve.tokenizer import TokenizerAssets

MIXED = "Hello 🙂 world! 你好，世界 👍🏽 café — naïve ∑ ok"


@pytest.fixture(scope="module")
def tok(llama_dir: Path) -> TokenizerAssets:
    return TokenizerAssets.load(llama_dir)


def stream_all(tok: TokenizerAssets, ids: list[int], stops: list[str] = ()) -> tuple[list[str], TextStream]:
    ts = TextStream(tok.decode, stops)
    deltas = []
    for i in ids:
        if ts.stopped:
            break
        deltas.append(ts.push(i))
    deltas.append(ts.finish())
    return deltas, ts


def test_multibyte_characters_split_over_tokens_are_held_until_whole(tok: TokenizerAssets) -> None:
    ids = tok.encode(MIXED)
    # The demo BPE has no merges for these characters: each is split over byte tokens.
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok.decode)
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == MIXED == tok.decode(ids)
    emoji_at = [k for k, d in enumerate(deltas) if "🙂" in d]
    assert len(emoji_at) == 1 and deltas[emoji_at[0] - 1] == ""  # held, then released whole


def test_random_id_sequences_concatenate_to_the_full_decode(tok: TokenizerAssets) -> None:
    rng = random.Random(7)
    vocab = tok.tokenizer.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tok.decode)
        got = "".join(detok.push(i) for i in ids) + detok.flush()
        assert got == tok.decode(ids), ids


def test_incomplete_character_at_the_end_is_flushed_as_a_full_decode_would(tok: TokenizerAssets) -> None:
    ids = tok.encode("ab🙂")[:-1]  # drop the emoji's last byte
    detok = IncrementalDetokenizer(tok.decode)
    streamed = "".join(detok.push(i) for i in ids)
    assert streamed == "ab"
    assert streamed + detok.flush() == tok.decode(ids) == "ab" + REPLACEMENT


def test_special_tokens_are_skipped(tok: TokenizerAssets) -> None:
    ids = tok.encode("<|im_start|>assistant\nhi there<|im_end|><|endoftext|>")
    deltas, ts = stream_all(tok, ids)
    assert "".join(deltas) == ts.text == "assistant\nhi there"


def test_stop_string_across_token_boundaries_is_trimmed(tok: TokenizerAssets) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    ids = tok.encode(text)
    stop = "fox jum"
    assert not any(stop in tok.decode([i]) for i in ids)  # no single token holds it
    deltas, ts = stream_all(tok, ids, [stop])
    assert ts.stopped and ts.text == "The quick brown "
    assert "".join(deltas) == ts.text
    assert ts.num_tokens < len(ids)  # generation ends at the token completing the stop string


def test_possible_stop_prefix_is_held_back_then_released(tok: TokenizerAssets) -> None:
    text = "hello world? yes"
    ids = tok.encode(text)
    ts = TextStream(tok.decode, ["world!"])
    released = ""
    for i in ids:
        released += ts.push(i)
        assert held_suffix(released, ["world!"]) == 0  # never releases what may start the stop string
    released += ts.finish()
    assert not ts.stopped and released == text


def test_stop_string_with_multibyte_characters(tok: TokenizerAssets) -> None:
    deltas, ts = stream_all(tok, tok.encode(MIXED), ["世界"])
    assert ts.stopped and ts.text == "Hello 🙂 world! 你好，" == "".join(deltas)
    assert all(REPLACEMENT not in d for d in deltas)


def test_earliest_of_several_stop_strings_wins(tok: TokenizerAssets) -> None:
    _, ts = stream_all(tok, tok.encode("alpha beta gamma delta"), ["delta", "beta", "zzz"])
    assert ts.text == "alpha "


def test_streamed_deltas_equal_blocking_text_for_random_stops(tok: TokenizerAssets) -> None:
    rng = random.Random(3)
    text = MIXED + " " + MIXED[::-1]
    ids = tok.encode(text)
    for _ in range(100):
        a = rng.randrange(len(text))
        stop = text[a : a + rng.randint(1, 4)]
        deltas, ts = stream_all(tok, ids, [stop])
        assert "".join(deltas) == ts.text == text[: text.find(stop)]


def test_held_suffix() -> None:
    assert held_suffix("abc wor", ["world"]) == 3
    assert held_suffix("abc world", ["world"]) == 0  # a whole match is not a proper prefix
    assert held_suffix("xx", ["x", "xxy"]) == 2
    assert held_suffix("", ["abc"]) == 0


def test_no_stop_string_before_min_tokens() -> None:
    """vLLM's min_tokens: stop strings are looked for from the min_tokens-th token on, including one
    that began in the text before it (held back until then, so it is trimmed as vLLM trims it)."""
    letters = lambda ids: "".join(chr(97 + i) for i in ids)  # noqa: E731
    early = TextStream(letters, ["bc"], min_tokens=3)
    sent = [early.push(t) for t in (1, 2)]
    assert not early.stopped and "".join(sent) == "b"  # "c" may begin a stop string: held
    sent += [early.push(1), early.push(2)]
    assert early.stopped and early.text == "".join(sent) == "bc"
    straddling = TextStream(letters, ["cd"], min_tokens=2)
    sent = [straddling.push(2), straddling.push(3)]
    assert straddling.stopped and straddling.text == "".join(sent) == ""
    plain = TextStream(letters, ["bc"], min_tokens=5)
    sent = [plain.push(t) for t in (1, 2, 0)] + [plain.finish()]
    assert not plain.stopped and "".join(sent) == plain.text == "bca"
