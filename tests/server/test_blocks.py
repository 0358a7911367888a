"""The parser's events grouped into content blocks (``server/blocks.py``), fed whole and split at every character."""

from __future__ import annotations

import pytest

from glm53.server.blocks import REASONING, TEXT, TOOL_CALL, BlockDelta, Blocks, BlockStart, BlockStop
from glm53.server.parsing import OutputParser

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]


def ids():
    n = iter(range(100))
    return lambda: f"call_{next(n)}"


def grouped(chunks: list[str], reasoning_open: bool = True):
    parser, blocks = OutputParser(TOOLS, reasoning_open, ids()), Blocks()
    events = [ev for chunk in chunks for ev in blocks.feed(parser.feed(chunk))]
    events += blocks.feed(parser.finish()) + blocks.close()
    return [(b.kind, b.text, b.name) for b in blocks.blocks], events


CASES = {
    "reasoning then text": ("Think.</think>\n\nAnswer.", [(REASONING, "Think.", None), (TEXT, "Answer.", None)]),
    "whitespace between sections is no block": (" Plan.</think>\n\n<tool_call>get_time</tool_call>\n",
                                                [(REASONING, "Plan.", None), (TOOL_CALL, "{}", "get_time")]),
    "a call inside reasoning splits it": ("a<tool_call>add<arg_key>a</arg_key><arg_value>2</arg_value></tool_call>b</think>c",
                                          [(REASONING, "a", None), (TOOL_CALL, '{"a": 2}', "add"), (REASONING, "b", None), (TEXT, "c", None)]),
    "only whitespace after reasoning": ("Done.</think>  \n", [(REASONING, "Done.", None)]),
}


@pytest.mark.parametrize("name", CASES)
def test_blocks_are_the_same_however_the_output_is_split(name):
    text, expected = CASES[name]
    whole, _ = grouped([text])
    assert whole == expected
    for cut in range(1, len(text)):
        assert grouped([text[:cut], text[cut:]])[0] == expected, cut
    assert grouped(list(text))[0] == expected


def test_each_block_opens_its_deltas_and_closes_in_order():
    _, events = grouped(list("Think.</think>Answer."))
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "BlockStart" and kinds[-1] == "BlockStop" and kinds.count("BlockStart") == kinds.count("BlockStop") == 2
    open_index = None
    for e in events:
        if isinstance(e, BlockStart):
            assert open_index is None
            open_index = e.block.index
        elif isinstance(e, BlockDelta):
            assert e.index == open_index
        elif isinstance(e, BlockStop):
            assert e.block.index == open_index
            open_index = None
    assert "".join(e.text for e in events if isinstance(e, BlockDelta)) == "Think.Answer."
