#!/usr/bin/env python3
"""Speed sweep: the original project's protocol "P2" (prefill and decode rates over HTTP), plus a fixed-length
decode mode, ``/stats`` snapshots around every phase and the server's effective configuration in the result.

1. Warm-up: one request of 512 random token ids (16 new tokens).
2. Prefill, for each ``--prefill`` length N: ``--reps`` prompts of N random ids, seeded per length and rep (and by
   the run's ``--seed``) so that no prompt shares a prefix with another: no prefix-cache hits. Each is streamed
   through ``/generate`` at temperature 0; rate = N / time to the first token. Median, min, max and all reps.
3. Decode, for each concurrency C of ``--conc``: ``--dec-reps`` rounds of C streams started together. Each stream
   is a thinking-off GLM chat prompt (a nonce, then "Write a detailed, well-structured explanation of TOPIC.",
   16 topics) tokenised by ``/tokenize`` and streamed through ``/generate`` at temperature 0.
   - natural (the original): ``max_new_tokens`` = (context - prompt) / C - 64, so answers end at EOS and arms
     decode different amounts;
   - ``--fixed-decode N``: every prompt is padded to exactly ``--fixed-context`` tokens and every stream decodes
     exactly N tokens (``ignore_eos``), so every arm decodes the same amount at the same context length.
   Round aggregate = all tokens / (last token - first first-token); per-stream rate = tokens after the first /
   (last token - first token). The level reports the median over rounds.
4. ``C1@LEN`` for each ``--prefix`` LEN: the C1 measurement behind LEN random ids placed before the chat prompt.

Random ids are drawn from ``--id-range`` (the original's [1000, 150000)), cut to the vocabulary the server reports.

The original's command line works as written: ``--card`` names the machine and arm (recorded, and the key of its
entry in the best-known file ``--best``), ``--config`` is recorded as given, ``--template`` picks the decode
prompts' chat format by name, and the early exit is the original's: after each prefill length and after C1 and
C4, a median below ``(1 - --tol)`` x the card's best known value ends the run (exit status 3, ``status``
``EARLY_EXIT ...``, the result so far written) unless ``--no-early-exit`` is given.
Python standard library only; works against any server with ``/generate`` and ``/tokenize``; ``/stats`` and
``/server_info`` are recorded when the server has them (else null). Writes JSON to ``--out`` (or prints it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import threading
import time

from client import THINKING_OFF, Client, ServerError, add_server_args, client_from_args, utc_now, write_json

PROTOCOL = "bench/sweep.py P2 (glm53 v1)"
# The decode prompts' chat formats by name, thinking off (the original's two)
TEMPLATES = {"glm": THINKING_OFF, "qwen": "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"}
DEFAULT_BEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference", "best_known.json")
EARLY_EXIT_STATUS = 3
WARMUP_TOKENS = 512
TOPICS = (
    "how a compiler turns source code into machine code", "the causes and consequences of the French Revolution",
    "how vaccines train the immune system", "the physics of how airplanes fly", "how public-key cryptography works",
    "the water cycle and its effect on climate", "how a relational database executes a query",
    "the history and mechanics of the printing press", "how photosynthesis stores energy",
    "the economics of supply and demand", "how the internet routes a packet across the world",
    "the life cycle of a star", "how neural networks learn from data", "the rise and fall of the Roman Republic",
    "how an electric motor converts current into motion", "the theory of plate tectonics",
)
INSTRUCTION = "Write a detailed, well-structured explanation of {}."
# Padding for --fixed-decode prompts: ordinary prose, so the routing it causes looks like a real prompt's.
FILLER = (
    " Some background for the reader follows. Good explanations start from what the reader already knows, name"
    " each new idea before using it, give a concrete example for every abstract claim, and end each part with a"
    " short summary of what was shown and why it matters for the next part."
)


def random_ids(seed: int, tag: str, n: int, id_range: tuple[int, int]) -> list[int]:
    """``n`` ids from ``id_range``, the same for the same ``(seed, tag)`` on every machine."""
    rng = random.Random(f"{seed}:{tag}")
    return [rng.randrange(*id_range) for _ in range(n)]


def ids_sha256(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


def spread(values: list[float], digits: int = 2) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "n": len(values), "all": [round(v, digits) for v in values]}


class ChatPrompts:
    """Token ids of the decode prompts: natural (the chat prompt as the server tokenises it) or, with
    ``fixed_context``, padded with ``FILLER`` to exactly that many tokens. ``template`` is the chat format, a
    ``TEMPLATES`` value with ``{}`` for the user's text."""

    def __init__(self, client: Client, seed: int, fixed_context: int | None, template: str = THINKING_OFF):
        self.client = client
        self.fixed_context = fixed_context
        self.template = template
        self.nonce_prefix = f"{seed:08x}"
        self._head, _, tail = template.partition("{}")
        if fixed_context:
            self._tail = self._tokenize(tail)
            self._filler = self._tokenize(FILLER)

    def _tokenize(self, text: str) -> list[int]:
        return self.client.post("/tokenize", {"text": text})["tokens"]

    def user_text(self, phase: str, rnd: int, stream: int) -> str:
        topic = TOPICS[(rnd + stream) % len(TOPICS)]
        return f"[{self.nonce_prefix}-{phase}-r{rnd}-s{stream}] " + INSTRUCTION.format(topic)

    def ids(self, phase: str, rnd: int, stream: int) -> list[int]:
        text = self.user_text(phase, rnd, stream)
        if not self.fixed_context:
            return self._tokenize(self.template.format(text))
        head = self._tokenize(self._head + text + "\n\n")
        need = self.fixed_context - len(head) - len(self._tail)
        if need < 0:
            raise ValueError(f"--fixed-context {self.fixed_context} is shorter than the chat prompt ({len(head) + len(self._tail)} tokens)")
        pad = (self._filler * (need // len(self._filler) + 1))[:need]
        return head + pad + self._tail


def generate_body(ids: list[int], max_new: int, ignore_eos: bool) -> dict:
    return {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": ignore_eos}}


def completion_tokens(event: dict) -> int:
    meta = event.get("meta_info") or {}
    n = meta.get("completion_tokens")
    return n if isinstance(n, int) else len(event.get("output_ids") or ())


def run_stream(client: Client, ids: list[int], max_new: int, ignore_eos: bool, start: threading.Barrier | None = None) -> dict:
    """One streamed generation: when it was sent, ``(arrival, cumulative tokens)`` of each event that added
    tokens, the finish reason and the prompt tokens the server reports as cached."""
    if start is not None:
        start.wait()
    sent = time.monotonic()
    arrivals: list[tuple[float, int]] = []
    last_event: dict = {}
    for t, event in client.stream("/generate", generate_body(ids, max_new, ignore_eos)):
        n = completion_tokens(event)
        if n > (arrivals[-1][1] if arrivals else 0):
            arrivals.append((t, n))
        last_event = event
    if not arrivals:
        raise ServerError("POST /generate", "the stream ended without a token")
    meta = last_event.get("meta_info") or {}
    finish = meta.get("finish_reason")
    return {"sent": sent, "arrivals": arrivals, "finish": finish.get("type") if isinstance(finish, dict) else finish,
            "cached_tokens": meta.get("cached_tokens")}


class EarlyExit(Exception):
    """A gate failed: the run ends here (the message is the result's status)."""


class Gates:
    """The original's early exit: a phase's median against the card's best known value (``--best``)."""

    def __init__(self, best: dict, tol: float, early_exit: bool):
        self.best, self.tol, self.early_exit = best, tol, early_exit
        self.results: dict[str, dict] = {}

    def check(self, key: str, value: float) -> None:
        """Record the gate; :raise EarlyExit: when ``value`` is below (1 - tol) x the best known and early exit is on."""
        best = self.best.get(key)
        passed = best is None or value >= (1 - self.tol) * best
        self.results[key] = {"value": value, "best_known": best, "pass": passed}
        if not passed and self.early_exit:
            raise EarlyExit(f"EARLY_EXIT at {key}: {value:.1f} < {1 - self.tol:.2f} x best known {best}")


def load_best(path: str, card: str | None) -> dict:
    """The card's entry of a best-known file (``{card: {gate: value}}``); empty without a card or a file."""
    if card is None or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f).get(card, {})


def warm_up(client: Client, seed: int, ctx: int, id_range: tuple[int, int]) -> None:
    ids = random_ids(seed, "warmup", max(1, min(WARMUP_TOKENS, ctx - 32)), id_range)
    run_stream(client, ids, 16, ignore_eos=True)


def prefill_phase(client: Client, lengths: list[int], reps: int, seed: int, ctx: int, id_range: tuple[int, int],
                  results: dict, hashes: dict, gates: Gates) -> None:
    """Fills ``{length: spread of rates}`` and ``{length: sha256 of its prompts}`` length by length (what was
    measured stays when a gate ends the run)."""
    for n in lengths:
        if n >= ctx:
            results[str(n)] = {"skipped": f"{n} tokens do not fit the context ({ctx})"}
            continue
        rates, ttfts, cached, prompts = [], [], [], []
        for rep in range(reps):
            ids = random_ids(seed, f"prefill:{n}:{rep}", n, id_range)
            prompts.append(ids)
            s = run_stream(client, ids, 1, ignore_eos=True)
            ttft = s["arrivals"][0][0] - s["sent"]
            rates.append(n / ttft)
            ttfts.append(ttft)
            cached.append(s["cached_tokens"])
            print(f"prefill {n}: rep {rep}: {n / ttft:.1f} tok/s", file=sys.stderr)
        results[str(n)] = {**spread(rates), "ttft_s": [round(t, 4) for t in ttfts], "cached_tokens": cached}
        hashes[str(n)] = ids_sha256(prompts)
        gates.check(f"prefill_{n}", results[str(n)]["median"])


def decode_round(client: Client, prompts: list[list[int]], max_new: int, ignore_eos: bool) -> dict:
    """C streams started together (one thread each)."""
    start = threading.Barrier(len(prompts))
    streams: list[dict | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            streams[i] = run_stream(client, prompts[i], max_new, ignore_eos, start)
        except Exception as e:  # re-raised in the caller's thread below
            errors.append(e)
            start.abort()  # the others stop waiting at the barrier

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    first = min(s["arrivals"][0][0] for s in streams)
    last = max(s["arrivals"][-1][0] for s in streams)
    tokens = [s["arrivals"][-1][1] for s in streams]
    rates = [(s["arrivals"][-1][1] - s["arrivals"][0][1]) / (s["arrivals"][-1][0] - s["arrivals"][0][0])
             for s in streams if s["arrivals"][-1][0] > s["arrivals"][0][0]]
    return {
        "aggregate": round(sum(tokens) / (last - first), 2) if last > first else None,
        "per_stream_mean": round(statistics.fmean(rates), 2) if rates else None,
        "per_stream_min": round(min(rates), 2) if rates else None,
        "tokens": sum(tokens), "tokens_per_stream": tokens, "finish": [s["finish"] for s in streams],
        "ttft_max": round(max(s["arrivals"][0][0] - s["sent"] for s in streams), 4),
        "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": max_new,
    }


def decode_level(client: Client, name: str, rounds: list[list[list[int]]], ctx: int, fixed: int | None) -> dict:
    """Median over rounds of one concurrency level; ``rounds`` holds each round's prompts."""
    results = []
    for r, prompts in enumerate(rounds):
        c = len(prompts)
        longest = max(map(len, prompts))
        max_new = fixed or (ctx - longest) // c - 64
        if max_new < 1 or longest + max_new > ctx:
            return {"skipped": f"prompts of {longest} tokens leave no room to decode {max_new} tokens at C={c} in a context of {ctx}"}
        results.append(decode_round(client, prompts, max_new, ignore_eos=fixed is not None))
        print(f"decode {name}: round {r}: {results[-1]['aggregate']} tok/s aggregate, {results[-1]['tokens']} tokens", file=sys.stderr)
    level: dict = {"rounds": results}
    for key in ("aggregate", "per_stream_mean"):
        values = [x[key] for x in results if x[key] is not None]
        level[key] = spread(values) if values else None
    kv_tokens = sum(len(p) + (fixed or 0) for p in rounds[0])
    if fixed and kv_tokens > ctx:
        level["note"] = f"the streams need {kv_tokens} cache tokens together, more than the context ({ctx}): some may wait"
    return level


def stats_delta(before, after):
    """Differences of the numeric leaves of two ``/stats`` snapshots (meaningful for counters), with
    ``hit_rate`` = hits / (hits + misses) added to every object that has both."""
    if isinstance(after, bool) or isinstance(before, bool):
        return None
    if isinstance(after, (int, float)) and isinstance(before, (int, float)):
        return after - before
    if isinstance(after, dict) and isinstance(before, dict):
        out = {k: d for k in after if k in before and (d := stats_delta(before[k], after[k])) is not None}
        add_hit_rates(out)
        return out or None
    if isinstance(after, list) and isinstance(before, list) and len(after) == len(before):
        out = [stats_delta(b, a) for b, a in zip(before, after)]
        return out if any(x is not None for x in out) else None
    return None


def add_hit_rates(delta: dict) -> None:
    """For every counter pair ``PREFIXhits`` / ``PREFIXmisses`` (``hits``, ``unique_hits``, ...), set
    ``PREFIXhit_rate`` to the phase's own rate, replacing the meaningless difference of two cumulative rates."""
    for key in [k for k in delta if k.endswith("hits")]:
        prefix = key[: -len("hits")]
        hits, misses = delta[key], delta.get(prefix + "misses")
        if not isinstance(hits, (int, float)) or not isinstance(misses, (int, float)):
            continue
        delta[prefix + "hit_rate"] = round(hits / (hits + misses), 6) if hits + misses > 0 else None


class StatsRecorder:
    """``/stats`` before and after each phase; null where the server has no ``/stats``."""

    def __init__(self, client: Client):
        self.client = client
        self.available = client.get_optional("/stats") is not None
        self.phases: dict[str, dict] = {}

    def snapshot(self):
        return self.client.get("/stats") if self.available else None

    def around(self, phase: str, fn, *args):
        before = self.snapshot()
        try:
            return fn(*args)
        finally:  # a phase a gate ended early keeps its snapshots too
            after = self.snapshot()
            self.phases[phase] = {"before": before, "after": after, "delta": stats_delta(before, after) if before else None}


def context_length(client: Client, info: dict | None, given: int | None) -> int:
    """``--ctx``, else ``/server_info``'s ``context_length``, else ``/v1/models``' ``max_model_len``."""
    if given:
        return given
    if info and isinstance(info.get("context_length"), int):
        return info["context_length"]
    models = client.get_optional("/v1/models") or {}
    for card in models.get("data") or ():
        if isinstance(card.get("max_model_len"), int):
            return card["max_model_len"]
    raise ValueError("the server reports no context length: give --ctx")


def token_id_range(wanted: tuple[int, int], info: dict | None) -> tuple[int, int]:
    """``wanted`` cut to the vocabulary ``/server_info`` reports; the whole vocabulary when that leaves nothing."""
    vocab = ((info or {}).get("loaded_model") or {}).get("vocab_size")
    lo, hi = wanted
    if isinstance(vocab, int):
        hi = min(hi, vocab)
        lo = lo if lo < hi else 0
    return lo, hi


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(ap)
    ap.add_argument("--label", help="free text naming this arm (stored as 'label')")
    ap.add_argument("--out", help="write the result JSON here (default: print it)")
    ap.add_argument("--prefill", type=int, nargs="*", default=[8192, 32768], help="prefill lengths in tokens")
    ap.add_argument("--conc", type=int, nargs="*", default=[1, 2, 4], help="decode concurrency levels")
    ap.add_argument("--reps", type=int, default=3, help="prompts per prefill length")
    ap.add_argument("--dec-reps", type=int, default=2, help="rounds per decode level")
    ap.add_argument("--prefix", type=int, nargs="*", default=[32768], help="random-id prefix lengths for C1@LEN (none: skip)")
    ap.add_argument("--fixed-decode", type=int, metavar="N", help="every stream decodes exactly N tokens (ignore_eos) from a --fixed-context prompt")
    ap.add_argument("--fixed-context", type=int, default=512, help="prompt tokens of every --fixed-decode stream (default 512)")
    ap.add_argument("--ctx", type=int, help="the context length (default: what the server reports)")
    ap.add_argument("--id-range", type=int, nargs=2, default=[1000, 150000], metavar=("LO", "HI"), help="random ids come from [LO, HI)")
    ap.add_argument("--seed", type=int, help="seed of every random prompt and nonce (default: a fresh one, recorded)")
    ap.add_argument("--card", help="the machine and arm, e.g. rtx-3090-24gb/glm-5.3-flash-offload (recorded; its entry in --best is what the gates compare with)")
    ap.add_argument("--config", help="free text describing the server's configuration, e.g. '<commit> fast' (recorded)")
    ap.add_argument("--template", choices=sorted(TEMPLATES), default="glm", help="chat format of the decode prompts (default glm, thinking off)")
    ap.add_argument("--best", default=DEFAULT_BEST, help="best-known values, {card: {gate: value}} (default reference/best_known.json, if present)")
    ap.add_argument("--tol", type=float, default=0.05, help="a gate fails below (1 - TOL) x the best known value (default 0.05)")
    ap.add_argument("--no-early-exit", dest="early_exit", action="store_false", help="record failed gates but run every phase")
    args = ap.parse_args(argv)
    counts = {"--prefill": args.prefill, "--conc": args.conc, "--prefix": args.prefix, "--reps": [args.reps],
              "--dec-reps": [args.dec_reps], "--fixed-decode": [] if args.fixed_decode is None else [args.fixed_decode], "--fixed-context": [args.fixed_context]}
    for flag, values in counts.items():
        if any(v < 1 for v in values):
            ap.error(f"{flag} takes positive numbers, not {values}")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**32)
    return args


def measure(client: Client, args, result: dict, stats: StatsRecorder, gates: Gates) -> None:
    """Every phase, in order, filling ``result`` as it goes. :raise EarlyExit: a gate failed."""
    ctx, id_range, seed = result["ctx_len"], tuple(result["params"]["id_range"]), args.seed
    warm_up(client, seed, ctx, id_range)
    stats.around("prefill", prefill_phase, client, args.prefill, args.reps, seed, ctx, id_range,
                 result["prefill"], result["prompt_sha256"]["prefill"], gates)
    prompts = ChatPrompts(client, seed, args.fixed_context if args.fixed_decode else None, TEMPLATES[args.template])
    result["nonce_prefix"] = prompts.nonce_prefix
    levels = [(f"C{c}", c, 0) for c in args.conc] + [(f"C1@{_short(n)}", 1, n) for n in args.prefix]
    for name, c, prefix in levels:
        # tokenised here, before the phase's first /stats snapshot
        rounds = [[random_ids(seed, f"prefix:{prefix}:{r}", prefix, id_range) + prompts.ids(name, r, s) for s in range(c)]
                  for r in range(args.dec_reps)]
        result["decode"][name] = level = stats.around(name, decode_level, client, name, rounds, ctx, args.fixed_decode)
        result["prompt_sha256"]["decode"][name] = ids_sha256(rounds)
        if c in (1, 4) and not prefix and level.get("aggregate"):  # the original's decode gates
            gates.check(f"decode_{name}", level["aggregate"]["median"])


def _short(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def sweep(client: Client, args: argparse.Namespace) -> dict:
    started = utc_now()
    info = client.get_optional("/server_info")
    stats = StatsRecorder(client)
    result = {
        "label": args.label, "card": args.card, "config": args.config, "url": client.base, "started": started, "finished": None,
        "protocol": PROTOCOL, "status": "RUNNING",
        "template": {"name": args.template, "prompt": TEMPLATES[args.template].format("{user}")},
        "ctx_len": context_length(client, info, args.ctx),
        "params": {"prefill": args.prefill, "reps": args.reps, "conc": args.conc, "dec_reps": args.dec_reps,
                   "prefix": args.prefix, "decode_mode": "fixed" if args.fixed_decode else "natural",
                   "fixed_decode": args.fixed_decode, "fixed_context": args.fixed_context if args.fixed_decode else None,
                   "id_range": list(token_id_range(tuple(args.id_range), info)), "seed": args.seed, "warmup_tokens": WARMUP_TOKENS},
        "server_info": info, "prefill": {}, "decode": {}, "prompt_sha256": {"prefill": {}, "decode": {}}, "nonce_prefix": None,
        "tol": args.tol, "best_known_before": load_best(args.best, args.card),
    }
    gates = Gates(result["best_known_before"], args.tol, args.early_exit)
    try:
        measure(client, args, result, stats, gates)
        result["status"] = "DONE"
    except EarlyExit as e:
        result["status"] = str(e)
        print(result["status"], file=sys.stderr)
    result["gates"] = gates.results
    result["stats"] = stats.phases if stats.available else None
    result["finished"] = utc_now()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = sweep(client_from_args(args), args)
    except (ServerError, OSError, ValueError) as e:  # OSError: the server cannot be reached
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_json(result, args.out)
    return EARLY_EXIT_STATUS if result["status"] != "DONE" else 0


if __name__ == "__main__":
    sys.exit(main())
