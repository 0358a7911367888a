import pytest

from glm53.engine.detok import IncrementalDetokenizer
from glm53.engine.stops import StopMatcher
from tests.fakes import EOS, ByteTokens


def feed_all(matcher, pieces):
    out, matched = [], None
    for p in pieces:
        text, matched = matcher.feed(p)
        out.append(text)
        if matched:
            return "".join(out), matched
    return "".join(out) + matcher.flush(), None


@pytest.mark.parametrize("split", range(1, 12))
def test_stop_found_across_any_split(split):
    text = "abc STOP def"
    assert feed_all(StopMatcher(["STOP"]), [text[:split], text[split:]]) == ("abc ", "STOP")


def test_earliest_stop_wins_and_held_text_is_minimal():
    m = StopMatcher(["xyz", "b"])
    assert m.feed("ax") == ("a", None)  # "x" might start "xyz"
    assert m.feed("yb") == ("xy", "b")


def test_no_match_releases_everything():
    assert feed_all(StopMatcher(["</end>"]), ["a</e", "nx", "</en"]) == ("a</enx</en", None)


def test_without_stops_text_passes_through():
    assert StopMatcher([]).feed("abc") == ("abc", None)


def detok_all(ids, skip=False):
    d = IncrementalDetokenizer(ByteTokens(), skip)
    return [d.add(i) for i in ids] + [d.flush()]


def test_multibyte_characters_wait_until_complete():
    pieces = detok_all(list("é€😀".encode()))
    assert "".join(pieces) == "é€😀"
    assert all("\ufffd" not in p for p in pieces)


def test_invalid_bytes_do_not_stall_the_stream():
    pieces = detok_all([0xFF] * 10 + list(b"ok"))
    assert "".join(pieces).endswith("ok")
    assert sum(1 for p in pieces[:10] if p) >= 1  # emitted before the end despite never completing


def test_special_tokens_are_kept_or_skipped():
    assert "".join(detok_all([104, EOS, 105])) == "h<eos>i"
    assert "".join(detok_all([104, EOS, 105], skip=True)) == "hi"
