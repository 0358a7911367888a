"""GLM-5 special tokens: their text, their GLM-5.3 id, and what each one means to the server.

One table for every component that needs the markers: the CPU demo tokenizer (``engine/tiny/tokenizer.py``)
numbers them compactly in table order, the synthetic-checkpoint writer places them at their GLM-5.3 ids.

Source of the ids: ``<|endoftext|>``, ``[gMASK]``, ``<sop>``, ``<|user|>``, ``<|assistant|>``,
``<|observation|>``, ``<think>`` and ``</think>`` are published for GLM-5.3; the others are inferred from the
GLM-4.5 layout, where the same markers occupy the same consecutive block.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecialToken:
    text: str
    glm_id: int
    ends_completion: bool = False  # generating it finishes the completion (GLM's EOS set)
    control: bool = True  # dropped by decode(skip_special=True); False: the output parsers must see it


SPECIAL_TOKENS: tuple[SpecialToken, ...] = (
    SpecialToken("<|endoftext|>", 154820, ends_completion=True),
    SpecialToken("[MASK]", 154821),
    SpecialToken("[gMASK]", 154822),
    SpecialToken("[sMASK]", 154823),
    SpecialToken("<sop>", 154824),
    SpecialToken("<eop>", 154825),
    SpecialToken("<|system|>", 154826),
    # A model that starts the next user turn, or asks for a tool result, has finished its answer.
    SpecialToken("<|user|>", 154827, ends_completion=True),
    SpecialToken("<|assistant|>", 154828),
    SpecialToken("<|observation|>", 154829, ends_completion=True),
    SpecialToken("<|begin_of_image|>", 154830),
    SpecialToken("<|end_of_image|>", 154831),
    SpecialToken("<|begin_of_video|>", 154832),
    SpecialToken("<|end_of_video|>", 154833),
    SpecialToken("<|begin_of_audio|>", 154834),
    SpecialToken("<|end_of_audio|>", 154835),
    SpecialToken("<|begin_of_transcription|>", 154836),
    SpecialToken("<|end_of_transcription|>", 154837),
    SpecialToken("<|code_prefix|>", 154838),
    SpecialToken("<|code_middle|>", 154839),
    SpecialToken("<|code_suffix|>", 154840),
    # The output parsers (reasoning split, tool calls) read these markers in the decoded text.
    SpecialToken("<think>", 154841, control=False),
    SpecialToken("</think>", 154842, control=False),
    SpecialToken("<tool_call>", 154843, control=False),
    SpecialToken("</tool_call>", 154844, control=False),
    SpecialToken("<tool_response>", 154845),
    SpecialToken("</tool_response>", 154846),
    SpecialToken("<arg_key>", 154847, control=False),
    SpecialToken("</arg_key>", 154848, control=False),
    SpecialToken("<arg_value>", 154849, control=False),
    SpecialToken("</arg_value>", 154850, control=False),
    SpecialToken("/nothink", 154851),
)

END_OF_TEXT = "<|endoftext|>"
