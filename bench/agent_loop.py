#!/usr/bin/env python3
"""Agent-loop prefix reuse: does each turn of a conversation prefill only what it added?

Plays an agent's conversation on each API (``/v1/chat/completions``, ``/v1/messages``, ``/v1/responses``): a long
system prompt, then TURNS turns, each sending the whole history (earlier answers as the API returned them, their
reasoning included) plus a new user message of TURN_WORDS words. Per turn it records the prompt, cached and
uncached (prefilled) tokens and the time to the first output event, then times a fresh prefill of just as many
tokens (random token ids through ``/v1/completions``, which no cache holds) for comparison.

A turn after the first passes when its uncached tokens are at most what it added since the previous prompt plus
one page (the prompt-end checkpoint), and its TTFT is within 10 % of the fresh prefill's. ``answer_reused`` says
whether the cache also reached past the previous answer (the template rendered it back as generated).

Before the measured conversations, a warm-up one (``--warmup-turns``, on the first API, a system prompt of its own)
pays the server process's one-time costs of a resumed prefill: on the H200 host a fresh server's first turn-2
request took 0.35-0.57 s more than the same request later, which would fail the TTFT comparison of whichever turn
came first. Its rows are in the report (``warmup``), not in the verdict.

Before the first turn, the last turn's size is counted with the server's tokenizer (``/v1/messages/count_tokens``:
the system prompt and every turn's words, plus every answer's budget) against its context (``/v1/models``'
``max_model_len``): a conversation that would not fit stops at once, with the tokens a word takes there (a
synthetic checkpoint's tokenizer makes several of a word).

Python standard library only. Prints (or writes with --out) a JSON report; exit code 0 when every turn passes, 2
when the conversation does not fit the context.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from client import Client, add_server_args, client_from_args, utc_now, write_json

PAGE = 256
TTFT_SLACK = 1.10
WORDS = ("agent", "buffer", "cache", "delta", "engine", "filter", "graph", "handle", "index", "journal", "kernel", "layer",
         "module", "node", "offset", "packet", "query", "record", "stream", "token", "update", "vector", "window", "yield")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def output_event(api: str, event: dict) -> bool:
    """Whether a streamed event carries model output (its arrival ends the time to first token)."""
    if api == "chat":
        return any(c.get("delta", {}).get(k) for c in event.get("choices", []) for k in ("content", "reasoning_content", "tool_calls"))
    if api == "messages":
        return event.get("type") in ("content_block_delta", "content_block_start")
    return event.get("type", "").endswith(".delta") or event.get("type") == "response.output_item.added"


class Conversation:
    """One API's request bodies and how its answers are read and sent back."""

    def __init__(self, api: str, model: str, system: str, max_tokens: int, thinking: bool):
        self.api, self.model, self.system, self.max_tokens, self.thinking = api, model, system, max_tokens, thinking
        self.history: list = []

    def request(self, user: str) -> tuple[str, dict]:
        if self.api == "chat":
            self.history.append({"role": "user", "content": user})
            body = {"model": self.model, "messages": [{"role": "system", "content": self.system}, *self.history], "stream": True,
                    "max_tokens": self.max_tokens, "temperature": 0, "stream_options": {"include_usage": True},
                    "chat_template_kwargs": {"enable_thinking": self.thinking, "clear_thinking": False}}
            return "/v1/chat/completions", body
        if self.api == "messages":
            self.history.append({"role": "user", "content": user})
            body = {"model": self.model, "system": self.system, "messages": list(self.history), "stream": True, "max_tokens": self.max_tokens,
                    "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": 1024} if self.thinking else {"type": "disabled"},
                    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
            return "/v1/messages", body
        self.history.append({"role": "user", "content": user})
        body = {"model": self.model, "instructions": self.system, "input": list(self.history), "stream": True, "store": False,
                "max_output_tokens": self.max_tokens, "temperature": 0, "reasoning": {"effort": "high" if self.thinking else "none"}}
        return "/v1/responses", body

    def answer(self, events: list[dict]) -> dict:
        """Record the answer in the history; return its usage as (prompt, cached, completion) tokens."""
        if self.api == "chat":
            text = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
            reasoning = "".join(c["delta"].get("reasoning_content") or "" for e in events for c in e.get("choices", []))
            self.history.append({"role": "assistant", "content": text, **({"reasoning_content": reasoning} if reasoning else {})})
            u = next(e["usage"] for e in events if e.get("usage"))
            return {"prompt": u["prompt_tokens"], "cached": u["prompt_tokens_details"]["cached_tokens"], "completion": u["completion_tokens"]}
        if self.api == "messages":
            blocks: dict[int, dict] = {}
            for e in events:
                if e["type"] == "content_block_start":
                    blocks[e["index"]] = dict(e["content_block"])
                elif e["type"] == "content_block_delta":
                    d, b = e["delta"], blocks[e["index"]]
                    key = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}.get(d["type"])
                    if key:
                        b[key] = b.get(key, "") + d[key]
            self.history.append({"role": "assistant", "content": [blocks[i] for i in sorted(blocks)] or ""})
            u = next(e["usage"] for e in events if e["type"] == "message_delta")
            return {"prompt": u["input_tokens"] + u["cache_read_input_tokens"], "cached": u["cache_read_input_tokens"], "completion": u["output_tokens"]}
        done = next(e["response"] for e in events if e["type"] in ("response.completed", "response.incomplete"))
        self.history += [{k: v for k, v in item.items() if k != "status"} for item in done["output"]]
        u = done["usage"]
        return {"prompt": u["input_tokens"], "cached": u["input_tokens_details"]["cached_tokens"], "completion": u["output_tokens"]}


def timed_stream(client: Client, api: str, path: str, body: dict) -> tuple[list[dict], float]:
    t0 = time.monotonic()
    events, ttft = [], None
    for t, event in client.stream(path, body):
        if ttft is None and output_event(api, event):
            ttft = t - t0
        events.append(event)
    return events, ttft if ttft is not None else time.monotonic() - t0


def fresh_ttft(client: Client, model: str, tokens: int, vocab: int, rng: random.Random) -> float:
    """TTFT of a prompt of ``tokens`` random ids (no cache holds them), one token generated."""
    low = min(1000, vocab // 4)  # above the special and byte tokens where the vocabulary has them
    ids = [rng.randrange(low, vocab) for _ in range(max(tokens, 1))]
    _, ttft = timed_stream(client, "completions", "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1, "stream": True})
    return ttft


def system_prompt(args) -> str:
    return args.system_prefix + words(random.Random(args.seed), args.system_words)


def does_not_fit(client: Client, args) -> str | None:
    """Why the last turn would not fit the server's context (None when it fits, or when the server does not say)."""
    models = client.get_optional("/v1/models") or {}
    limit = next((m.get("max_model_len") for m in models.get("data", []) if m.get("id") == args.model), None)
    if not limit:
        return None
    rng = random.Random(args.seed + 2)
    turns = " ".join(words(rng, args.turn_words) for _ in range(args.turns))
    body = {"model": args.model, "system": system_prompt(args), "messages": [{"role": "user", "content": turns}]}
    counted = client.post("/v1/messages/count_tokens", body)["input_tokens"]
    need = counted + args.turns * (args.max_tokens + 16)  # the answers and each turn's template tokens
    if need <= limit:
        return None
    per_word = counted / max(args.system_words + args.turns * args.turn_words, 1)
    return (f"the last turn would need about {need} tokens ({counted} of prompt words at {per_word:.1f} tokens a word on this "
            f"server, {args.turns} answers of up to {args.max_tokens}), past its {limit}-token context: lower --system-words, "
            f"--turn-words or --turns")


def run_api(client: Client, api: str, args, rng: random.Random, label: str = "") -> list[dict]:
    convo = Conversation(api, args.model, system_prompt(args), args.max_tokens, args.thinking)
    turns, previous = [], None
    for k in range(args.turns):
        path, body = convo.request(f"Turn {k + 1} of {api}: " + words(rng, args.turn_words))
        events, ttft = timed_stream(client, api, path, body)
        usage = convo.answer(events)
        row = {"turn": k + 1, **usage, "uncached": usage["prompt"] - usage["cached"], "ttft_s": round(ttft, 4)}
        if previous is not None:
            added = usage["prompt"] - previous["prompt"]
            answer_end = (previous["prompt"] + previous["completion"] - 1) // PAGE * PAGE
            row.update(added=added, answer_reused=usage["cached"] >= answer_end, prefill_ok=row["uncached"] <= added + PAGE)
            row["fresh_ttft_s"] = round(fresh_ttft(client, args.model, row["uncached"], args.vocab, rng), 4)
            row["ttft_ok"] = ttft <= TTFT_SLACK * row["fresh_ttft_s"]
        turns.append(row)
        previous = usage
        print(f"{label}{api} turn {k + 1}: {row}", file=sys.stderr)
    return turns


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(ap)
    ap.add_argument("--model", default="glm-5.3-flash")
    ap.add_argument("--api", choices=("chat", "messages", "responses", "all"), default="all")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=20000, help="words of the shared system prompt (~1.3 tokens each with "
                    "the real tokenizer; a synthetic checkpoint's makes ~7)")
    ap.add_argument("--system-prefix", default="You are a careful coding agent. Reference material follows.\n")
    ap.add_argument("--turn-words", type=int, default=700, help="words of each turn's new user message")
    ap.add_argument("--max-tokens", type=int, default=300, help="tokens of each answer")
    ap.add_argument("--thinking", action="store_true", help="answers reason first (sent back with the history)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup-turns", type=int, default=2, help="turns of an unjudged conversation played first (0: none)")
    ap.add_argument("--out", default=None, help="write the JSON report here (else print it)")
    args = ap.parse_args()
    client = client_from_args(args)
    info = client.get_optional("/server_info")
    args.vocab = (info or {}).get("loaded_model", {}).get("vocab_size", 150000)
    why = does_not_fit(client, args)
    if why:
        print(f"agent_loop: {why}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed + 1)
    apis = ("chat", "messages", "responses") if args.api == "all" else (args.api,)
    # each API (and the warm-up) gets a system prompt of its own, so no conversation is served from another's pages
    warmup = []
    if args.warmup_turns > 0:
        plain = (args.turns, args.system_prefix)
        args.turns, args.system_prefix = args.warmup_turns, "[warmup] " + args.system_prefix
        warmup = run_api(client, apis[0], args, random.Random(args.seed + 5), label="warm-up ")
        args.turns, args.system_prefix = plain
    results = {}
    for i, api in enumerate(apis):
        args.system_prefix = f"[{api}] " + args.system_prefix
        results[api] = run_api(client, api, args, random.Random(args.seed + 10 * (i + 1)))
        args.system_prefix = args.system_prefix.split("] ", 1)[1]
    later = [t for rows in results.values() for t in rows[1:]]
    passed = bool(later) and all(t["prefill_ok"] and t["ttft_ok"] for t in later)
    report = {"bench": "agent_loop", "time": utc_now(), "url": args.url, "server_info": info,
              "args": {k: v for k, v in vars(args).items() if k not in ("api_key",)}, "warmup": warmup, "turns": results, "passed": passed}
    write_json(report, args.out)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
