import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm53.engine.tiny.tokenizer import ByteTokenizer
from glm53.models.glm_special_tokens import SPECIAL_TOKENS

tok = ByteTokenizer()


def test_vocabulary_is_bytes_then_specials_in_table_order():
    assert tok.vocab_size == 256 + 32
    assert [tok.id_of(t.text) for t in SPECIAL_TOKENS] == list(range(256, 288))
    assert tok.decode([256]) == "<|endoftext|>"
    assert tok.decode([287]) == "/nothink"


def test_glm_ids_are_the_consecutive_block_from_endoftext():
    assert [t.glm_id for t in SPECIAL_TOKENS] == list(range(154820, 154852))


def test_eos_and_control_sets():
    assert {tok.decode([i]) for i in tok.eos_ids} == {"<|endoftext|>", "<|user|>", "<|observation|>"}
    kept = {t.text for t in SPECIAL_TOKENS} - {tok.decode([i]) for i in tok.special_ids}
    assert kept == {"<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Hello, world!\n",
        "héllo wörld, ñandú, Straße",
        "日本語のテキスト",
        "emoji 🎉👍🏽 and a family 👨‍👩‍👧",
        "[gMASK]<sop><|user|>hi<|assistant|><think></think>",
        "x<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>y",
        "<|user|><|user|>",
        "<|user|",  # an unfinished marker is plain text
    ],
)
def test_round_trip(text):
    assert tok.decode(tok.encode(text)) == text


# Text with markers (and pieces of markers) mixed in; lone surrogates are excluded because they cannot
# come back from UTF-8.
_pieces = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",))),
    st.sampled_from([t.text for t in SPECIAL_TOKENS] + ["<|", "|>", "</"]),
)


@given(st.lists(_pieces, max_size=8).map("".join))
def test_round_trip_any_text(text):
    assert tok.decode(tok.encode(text)) == text


def test_plain_text_is_utf8_bytes():
    assert tok.encode("aé🎉") == list("aé🎉".encode())


def test_markers_adjacent_to_text_become_single_ids():
    user, assistant = tok.id_of("<|user|>"), tok.id_of("<|assistant|>")
    assert tok.encode("a<|user|>é<|assistant|>") == [ord("a"), user, 0xC3, 0xA9, assistant]


def test_neighbouring_markers_with_shared_letters_stay_apart():
    assert tok.encode("[gMASK][MASK][sMASK]") == [tok.id_of("[gMASK]"), tok.id_of("[MASK]"), tok.id_of("[sMASK]")]


def test_skip_special_drops_control_markers_but_keeps_parser_markers():
    ids = tok.encode("[gMASK]<sop><|user|>hi<|assistant|><think>hmm</think>ok<tool_call>f</tool_call><|endoftext|>")
    assert tok.decode(ids, skip_special=True) == "hi<think>hmm</think>ok<tool_call>f</tool_call>"


def test_incomplete_utf8_decodes_to_replacement_character():
    euro = "€".encode()
    assert tok.decode(list(euro[:2])) == "\ufffd"
    assert tok.decode(list(euro[:2]) + [tok.id_of("<|user|>")] + list(euro)) == "\ufffd<|user|>€"


def test_lone_surrogate_does_not_break_encoding():
    assert "\ufffd" in tok.decode(tok.encode("a\ud800b"))


@pytest.mark.parametrize("bad", [-1, 288, 10**6])
def test_decode_refuses_ids_outside_the_vocabulary(bad):
    with pytest.raises(ValueError, match=str(bad)):
        tok.decode([65, bad])


@pytest.mark.parametrize("text", ["plain", "Grüße 世界 🎉", "[gMASK]<sop><|user|>hi<think></think>"])
def test_token_bytes_join_to_the_texts_bytes(text):
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_token_bytes_of_a_split_character_and_of_a_special_token():
    assert [tok.token_bytes(i) for i in tok.encode("é")] == [b"\xc3", b"\xa9"]
    assert tok.token_bytes(tok.id_of("<think>")) == b"<think>"
    with pytest.raises(ValueError):
        tok.token_bytes(tok.vocab_size)
