"""TextStream: released pieces always add up to the final text, which ends before the
first stop string; partial stop strings and partial UTF-8 characters are held back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvpool.engine.text_stream import TextStream


def chars(ids):  # a "tokenizer" whose token i is the character chr(i)
    return "".join(chr(i) for i in ids)


def test_stop_string_split_over_tokens_is_held_back_and_never_released():
    stream = TextStream(chars, stop=("END",))
    out = [stream.update([ord(c) for c in "ab"])]
    out.append(stream.update([ord(c) for c in "abE"]))  # "E" might start "END"
    assert out == ["ab", ""]
    out.append(stream.update([ord(c) for c in "abEN"]))
    out.append(stream.update([ord(c) for c in "abENDxyz"]))
    assert "".join(out) == "ab" and stream.stopped


def test_false_alarm_is_released_once_settled():
    stream = TextStream(chars, stop=("END",))
    assert stream.update([ord(c) for c in "aE"]) == "a"
    assert stream.update([ord(c) for c in "aEx"]) == "Ex"


def test_incomplete_character_waits_and_final_flushes():
    stream = TextStream(lambda ids: "hi\ufffd" if len(ids) == 1 else "hi\u00e9")
    assert stream.update([1]) == "hi"
    assert stream.update([1, 2]) == "\u00e9"
    held = TextStream(chars, stop=("xyz",))
    assert held.update([ord("a"), ord("x")]) == "a"
    assert held.update([ord("a"), ord("x")], final=True) == "x"


@given(
    st.text(alphabet="abcEND", max_size=40),
    st.lists(st.sampled_from(["END", "b", "cc", "aEb"]), max_size=3),
    st.data(),
)
def test_pieces_concatenate_to_the_text_before_the_first_stop(text, stops, data):
    stream = TextStream(chars, stop=stops)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    pieces = [stream.update([ord(c) for c in text[:cut]]) for cut in cuts]
    pieces.append(stream.update([ord(c) for c in text], final=True))
    found = [text.find(s) for s in stops if s in text]
    expected = text[: min(found)] if found else text
    assert "".join(pieces) == expected


def test_the_stop_string_that_ended_the_text_is_named():
    pieces = ["The ", "sky ", "is ", "blue ", "and ", "green"]
    ids = list(range(len(pieces)))

    def decode(out):
        return "".join(pieces[i] for i in out)

    stream = TextStream(decode, stop=["green", "blue", "ue an"])
    sent = "".join(stream.update(ids[: k + 1]) for k in range(len(ids)))
    assert stream.stopped and stream.matched == "blue" and sent == "The sky is "
    plain = TextStream(decode, stop=["red"])
    plain.update(ids, final=True)
    assert not plain.stopped and plain.matched is None
