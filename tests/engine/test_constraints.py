"""Grammar constraints: vocabularies, masks, walks, and how the scheduler and the demo backend use them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers
import torch

from glm53.engine.constraints import GrammarError, MaskWorker, Vocabulary, apply_masks, compile_grammar, unpack_masks
from glm53.engine.interface import SamplingParams
from glm53.engine.tiny.backend import TinyBackend
from glm53.models.glm_special_tokens import SPECIAL_TOKENS
from glm53.tools.synth.tokenizer_files import tokenizer_json
from tests.engine.test_scheduler import Collector, gen, started
from tests.fakes import EOS, ScriptedBackend

TINY = TinyBackend(context_length=1024, max_batch_size=4, chunk_size=256)
VOCAB = TINY.vocabulary
TOK = TINY.tokenizer
DIGITS = json.dumps({"type": "integer", "minimum": 10, "maximum": 99})


def allowed(constraint) -> set[int]:
    row = np.zeros((1, constraint.mask_words), dtype=np.int32)
    constraint.fill_mask(row[0])
    return set(unpack_masks(torch.from_numpy(row), VOCAB.size)[0].nonzero().flatten().tolist())


def test_a_hugging_face_vocabulary_knows_glms_markers_by_their_ids():
    hf = tokenizers.Tokenizer.from_str(json.dumps(tokenizer_json(154880)))
    vocab = Vocabulary.from_hf(hf, 154880, {154820, 154827, 154829})
    assert vocab.size == 154880 and vocab.mask_words == 4840
    for token in SPECIAL_TOKENS:
        assert vocab.marker(token.text) == f"<[{token.glm_id}]>"
    grammar = compile_grammar("lark", f"start: {vocab.marker('<tool_call>')} \"x\"", vocab)
    constraint = grammar.start()
    constraint.advance(154843)
    constraint.advance(hf.encode("x").ids[0])
    assert constraint.error is None and constraint.ended_at == 2


def test_the_demo_vocabulary_matches_markers_whole_never_spelled():
    assert VOCAB.size == TOK.vocab_size and VOCAB.marker("</think>") == f"<[{TOK.id_of('</think>')}]>"
    with pytest.raises(GrammarError, match="no <nothing> token"):
        VOCAB.marker("<nothing>")
    constraint = compile_grammar("lark", f"start: \"a\" {VOCAB.marker('</think>')}", VOCAB).start()
    constraint.advance(ord("a"))
    assert allowed(constraint) == {TOK.id_of("</think>")}


def test_every_end_token_of_the_model_is_allowed_where_the_grammar_may_end_and_ends_it():
    ends = {TOK.id_of(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")}
    constraint = compile_grammar("regex", "ab|abc", VOCAB).start()
    for token in b"ab":
        constraint.advance(token)
    assert allowed(constraint) == {ord("c")} | ends
    constraint.advance(TOK.id_of("<|user|>"))
    assert constraint.ended_at == 3 and constraint.error is None


def test_a_complete_grammar_ends_without_an_end_token():
    constraint = compile_grammar("json_schema", DIGITS, VOCAB).start()
    constraint.advance(ord("4"))
    assert constraint.ended_at is None and ord("7") in allowed(constraint)
    constraint.advance(ord("7"))
    assert constraint.ended_at == 2


def test_a_token_the_grammar_does_not_allow_fails_the_walk():
    constraint = compile_grammar("json_schema", DIGITS, VOCAB).start()
    constraint.advance(ord("x"))
    assert constraint.ended_at == 1 and "doesn't satisfy the grammar" in constraint.error


@pytest.mark.parametrize("kind,source,says", [
    ("json_schema", "{nope", "key must be a string"), ("json_schema", '{"type": "object", "if": {}}', "if"),
    ("regex", "(", "regex"), ("lark", "start: missing_rule", "missing_rule"), ("ebnf", "root ::= (", "Expected '\\)'"),
])
def test_a_grammar_that_does_not_compile_says_why(kind, source, says):
    with pytest.raises(GrammarError, match=says):
        compile_grammar(kind, source, VOCAB)


def test_json_is_written_on_one_line_with_json_dumps_spacing():
    constraint = compile_grammar("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                            "required": ["a"], "additionalProperties": False}), VOCAB).start()
    for token in b'{"a"':
        constraint.advance(token)
    assert allowed(constraint) == {ord(":")}
    constraint.advance(ord(":"))
    assert allowed(constraint) == {ord(" ")}


def test_masks_leave_free_rows_alone_and_close_constrained_rows_past_the_vocabulary():
    worker = MaskWorker(width=VOCAB.size + 8)
    constraint = compile_grammar("regex", "[0-9]", VOCAB).start()
    masks = worker.start([None, constraint]).result()
    assert masks.shape == (2, VOCAB.size + 8) and masks[0].all()
    assert set(masks[1].nonzero().flatten().tolist()) == set(range(ord("0"), ord("9") + 1))
    assert worker.start([None, None]).result() is None
    logits = torch.zeros(2, VOCAB.size + 8)
    masked = apply_masks(logits, masks)
    assert torch.isfinite(masked[0]).all() and torch.isfinite(masked[1]).sum() == 10
    assert apply_masks(logits, None) is logits
    worker.close()


def test_the_scheduler_ends_a_job_where_its_grammar_ends():
    backend = ScriptedBackend(script=lambda p: list(b"42 and more"))
    s = started(backend)
    grammar = compile_grammar("json_schema", DIGITS, backend.vocabulary)
    free, held = Collector(), Collector()
    s.submit(gen(), free)
    s.submit(gen(grammar=grammar), held)
    assert held.wait().text == "42" and held.finish.reason == "stop" and held.finish.matched is None
    assert held.finish.completion_tokens == 2
    assert free.wait().text == "42 and more" and free.finish.matched == EOS
    s.stop()


class MaskIgnoringBackend(ScriptedBackend):
    """A backend that samples without looking at the mask (a bug the scheduler must contain)."""

    def _allowed(self, seq_id, tok):
        if seq_id in self.constraints:
            self.constraints[seq_id].advance(tok)
        return tok


def test_a_job_whose_backend_broke_its_grammar_fails_alone():
    backend = MaskIgnoringBackend(script=lambda p: list(b"x1"))
    s = started(backend)
    grammar = compile_grammar("json_schema", DIGITS, backend.vocabulary)
    broken, other = Collector(), Collector()
    s.submit(gen(grammar=grammar), broken)
    s.submit(gen(), other)
    assert broken.wait().finish.reason == "error" and "grammar" in broken.finish.error
    assert other.wait().finish.reason == "stop" and other.text == "x1"
    assert s.counters["sequence_errors"] == 1
    s.stop()


def test_the_demo_backend_holds_constrained_rows_and_leaves_free_ones_as_they_were():
    prompt = TOK.encode("[gMASK]<sop><|user|>hi<|assistant|><think></think>")
    sampled = SamplingParams(temperature=1.0, seed=5)

    def run(constrained: bool) -> dict[int, list[int]]:
        b = TinyBackend(context_length=1024, max_batch_size=4, chunk_size=256)
        grammar = compile_grammar("json_schema", DIGITS, b.vocabulary)
        b.add(0, prompt, sampled)
        if constrained:
            b.add(1, prompt, sampled, constraint=grammar.start())
        out: dict[int, list[int]] = {0: [], 1: []}
        while len(out[0]) < 40:
            for seq_id, tokens in b.step().items():
                out[seq_id] += [t.token_id for t in tokens]
                if seq_id == 1 and b._sequences[1].constraint.ended_at is not None:
                    b.remove(1)
        return out

    alone, mixed = run(False), run(True)
    assert mixed[0] == alone[0]
    assert 10 <= int(bytes(mixed[1]).decode()) <= 99
