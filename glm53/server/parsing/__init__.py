"""Model output parsing: reasoning, content and GLM tool calls, streamed or whole."""

from glm53.server.parsing.events import (
    ContentText,
    Event,
    ParsedOutput,
    ParsedToolCall,
    ReasoningText,
    ToolCallArguments,
    ToolCallBegin,
    ToolCallEnd,
    collect,
)
from glm53.server.parsing.output_parser import OutputParser, State, new_call_id, parse_output

__all__ = [
    "ContentText",
    "Event",
    "OutputParser",
    "ParsedOutput",
    "ParsedToolCall",
    "ReasoningText",
    "State",
    "ToolCallArguments",
    "ToolCallBegin",
    "ToolCallEnd",
    "collect",
    "new_call_id",
    "parse_output",
]
