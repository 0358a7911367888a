#!/usr/bin/env python3
"""Teacher-forced quality against a reference panel: does the server predict what the reference model predicted?

The panel (format of the original project, ``reference/README.md``) is a JSON list of items, one per prompt:

- ``prompt``: the user text (for people; never sent);
- ``prompt_len``: P, how many of ``tokens`` are the prompt;
- ``tokens``: the prompt ids (thinking-off chat format) followed by the reference's greedy completion ids;
- ``completion``: the completion's text (for people);
- ``top20_ids``, ``top20_lp``: one list per scored position, best first: the reference's top-20 token ids and
  their log-probabilities. Position j is the distribution that predicted token P + j, so there is one position
  per completion token, or one more (the distribution after the last token).

Each item is one ``/generate`` request (SGLang shapes): ``input_ids = tokens``, ``return_logprob``,
``logprob_start_len = P - 1``, ``top_logprobs_num 20``, ``token_ids_logprob`` = every reference id of the item,
``max_new_tokens 1`` (more requests when the ids exceed ``--max-ids``). Input entry e of the answer holds the
distribution that predicted token P - 1 + e, so position j is entry j + 1, and the position after the last token
is the output's first entry.

Per position:

- top-1 agreement: the server's most likely token (from its top-k) is the reference's first id;
- greedy match: the server's most likely token is the reference completion's token P + j;
- KL(reference || server) over the reference's top-20 ids, both renormalised over those ids.

A reference id that is not in the server's top-k is taken from its requested-id log-probabilities and counted
(``outside_topk``). An id the server's answer has in neither is counted in ``missing_ids`` and given the
log-probability ``FLOOR_LOGPROB`` (probability 1e-30, as in the original scorer), so the KL charges it in full
instead of dropping it. That happens with ``--topk-only`` (servers without ``token_ids_logprob``) and for ids
outside the vocabulary ``/server_info`` reports (``loaded_model.vocab_size``), which are not sent: the server would
refuse the whole request.

Output (JSON, to ``--out`` or stdout): ``positions``, ``top1_agreement``, ``mean_kl_top20``, ``p99_kl``,
``max_kl``, ``median_kl``, ``greedy_match``, ``missing_ids``, ``outside_topk``, ``per_prompt[{i, prompt,
positions, top1, kl, p99_kl, greedy_match, first_disagreement, outside_topk, missing_ids}]``, ``gates``,
``passed``, ``panel{path, items, sha256}``, ``server_info`` (the server's ``/server_info``: effective settings;
null where it has none).

Python standard library only; works against any server with ``/generate`` (glm53, the original, SGLang).
Exit status: 0; 1 when a ``--min-top1`` / ``--max-kl`` gate fails; 2 on a bad panel or a server error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from client import Client, ServerError, add_server_args, client_from_args, percentile, utc_now, write_json

FLOOR_LOGPROB = math.log(1e-30)
TOP_K = 20
PANEL_KEYS = ("prompt", "prompt_len", "tokens", "completion", "top20_ids", "top20_lp")


class PanelError(ValueError):
    pass


def load_panel(path: str) -> list[dict]:
    """The panel's items, checked. :raise PanelError: naming the item and the field at fault."""
    items = json.loads(Path(path).read_text())
    if not isinstance(items, list) or not items:
        raise PanelError(f"{path}: a panel is a non-empty JSON list of items")
    for i, item in enumerate(items):
        missing = [k for k in PANEL_KEYS if k not in item]
        if missing:
            raise PanelError(f"panel item {i}: missing {', '.join(missing)}")
        p, tokens, ids, lps = item["prompt_len"], item["tokens"], item["top20_ids"], item["top20_lp"]
        if not 1 <= p <= len(tokens):
            raise PanelError(f"panel item {i}: prompt_len {p} is outside 1..{len(tokens)}")
        if len(ids) != len(lps) or any(len(a) != len(b) or not a for a, b in zip(ids, lps)):
            raise PanelError(f"panel item {i}: top20_ids and top20_lp differ in shape or hold an empty position")
        if not ids or len(ids) > len(tokens) - p + 1:
            raise PanelError(f"panel item {i}: {len(ids)} positions, but a completion of {len(tokens) - p} tokens has 1..{len(tokens) - p + 1}")
    return items


def logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def kl_on_support(ref_lp: list[float], server_lp: list[float]) -> float:
    """KL(ref || server) with both renormalised over the same ids (the reference's top-k)."""
    ref_norm, server_norm = logsumexp(ref_lp), logsumexp(server_lp)
    kl = sum(math.exp(r - ref_norm) * ((r - ref_norm) - (s - server_norm)) for r, s in zip(ref_lp, server_lp))
    return max(kl, 0.0)  # rounding can leave -1e-17 where the two agree


def _as_map(entries) -> dict[int, float]:
    """``[[logprob, id, text], ...]`` (or None) as ``{id: logprob}``."""
    return {int(e[1]): float(e[0]) for e in entries or () if e[0] is not None}


def request_body(item: dict, ids: list[int], top_k: int) -> dict:
    p = item["prompt_len"]
    body = {
        "input_ids": item["tokens"], "return_logprob": True, "logprob_start_len": p - 1, "top_logprobs_num": top_k,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }
    if ids:
        body["token_ids_logprob"] = ids
    return body


def server_distributions(client: Client, item: dict, wanted: list[int], top_k: int, max_ids: int) -> list[tuple[dict, dict]]:
    """``(top-k map, requested-id map)`` for each scored position of ``item``. The requested ids go in batches of
    at most ``max_ids`` (the server's limit per request); the top-k comes from the first answer."""
    batches = [wanted[i : i + max_ids] for i in range(0, len(wanted), max_ids)] or [[]]
    n = len(item["top20_ids"])
    tops: list[dict] = []
    requested: list[dict] = [{} for _ in range(n)]
    for b, ids in enumerate(batches):
        meta = client.post("/generate", request_body(item, ids, top_k)).get("meta_info") or {}
        # entry 0 predicted token P-1 (a prompt token); position j is entry j+1, the one after the end is the output's
        top_entries = list(meta.get("input_top_logprobs") or [])[1:] + list(meta.get("output_top_logprobs") or [])[:1]
        req_entries = list(meta.get("input_token_ids_logprobs") or [])[1:] + list(meta.get("output_token_ids_logprobs") or [])[:1]
        if len(top_entries) < n:
            raise ServerError("POST /generate", f"{len(top_entries)} top-logprob entries for {n} scored positions")
        if b == 0:
            tops = [_as_map(e) for e in top_entries[:n]]
        for j, entry in enumerate(req_entries[:n]):
            requested[j].update(_as_map(entry))
    return list(zip(tops, requested))


@dataclass
class ItemScore:
    kls: list[float] = field(default_factory=list)
    top1: int = 0
    greedy: int = 0
    greedy_positions: int = 0  # positions with a reference token (all but a final one past the end)
    outside_topk: int = 0
    missing_ids: int = 0
    first_disagreement: int | None = None

    def summary(self, i: int, prompt: str) -> dict:
        n = len(self.kls)
        return {
            "i": i, "prompt": prompt[:80], "positions": n, "top1": round(self.top1 / n, 6), "kl": round(sum(self.kls) / n, 8),
            "p99_kl": round(percentile(self.kls, 99), 8),
            "greedy_match": round(self.greedy / self.greedy_positions, 6) if self.greedy_positions else None,
            "first_disagreement": self.first_disagreement, "outside_topk": self.outside_topk, "missing_ids": self.missing_ids,
        }


def score_item(item: dict, dists: list[tuple[dict, dict]]) -> ItemScore:
    p, tokens = item["prompt_len"], item["tokens"]
    out = ItemScore()
    for j, ((top, requested), ref_ids, ref_lp) in enumerate(zip(dists, item["top20_ids"], item["top20_lp"])):
        argmax = max(top, key=top.get) if top else None
        if argmax == ref_ids[0]:
            out.top1 += 1
        elif out.first_disagreement is None:
            out.first_disagreement = j
        if p + j < len(tokens):
            out.greedy_positions += 1
            out.greedy += argmax == tokens[p + j]
        server_lp = []
        for t in ref_ids:
            if t in top:
                server_lp.append(top[t])
                continue
            out.outside_topk += 1
            if t in requested:
                server_lp.append(requested[t])
            else:
                out.missing_ids += 1
                server_lp.append(FLOOR_LOGPROB)
        out.kls.append(kl_on_support(ref_lp, server_lp))
    return out


def gate_results(args, top1: float, mean_kl: float) -> dict:
    gates = {}
    if args.min_top1 is not None:
        gates["min_top1"] = {"limit": args.min_top1, "value": top1, "pass": top1 >= args.min_top1}
    if args.max_kl is not None:
        gates["max_kl"] = {"limit": args.max_kl, "value": mean_kl, "pass": mean_kl <= args.max_kl}
    return gates


def score(client: Client, items: list[dict], args, vocab_size: int | None) -> dict:
    scores = []
    for i, item in enumerate(items):
        ref_ids = sorted({t for ids in item["top20_ids"] for t in ids})
        # ids the server cannot have would make it refuse the whole request; they count as missing instead
        wanted = [] if args.topk_only else [t for t in ref_ids if vocab_size is None or 0 <= t < vocab_size]
        scores.append(score_item(item, server_distributions(client, item, wanted, args.top_k, args.max_ids)))
        print(f"item {i}: top-1 {scores[-1].top1}/{len(scores[-1].kls)}, missing ids {scores[-1].missing_ids}", file=sys.stderr)
    kls = [kl for s in scores for kl in s.kls]
    greedy_positions = sum(s.greedy_positions for s in scores)
    return {
        "positions": len(kls), "top1_agreement": round(sum(s.top1 for s in scores) / len(kls), 6),
        "mean_kl_top20": round(sum(kls) / len(kls), 8), "p99_kl": round(percentile(kls, 99), 8),
        "max_kl": round(max(kls), 8), "median_kl": round(statistics.median(kls), 8),
        "greedy_match": round(sum(s.greedy for s in scores) / greedy_positions, 6) if greedy_positions else None,
        "missing_ids": sum(s.missing_ids for s in scores), "outside_topk": sum(s.outside_topk for s in scores),
        "per_prompt": [s.summary(i, item["prompt"]) for i, (s, item) in enumerate(zip(scores, items))],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(ap)
    ap.add_argument("--panel", required=True, help="the reference panel (JSON, format in this module's docstring)")
    ap.add_argument("--out", help="write the result JSON here (default: print it)")
    ap.add_argument("--min-top1", type=float, help="exit 1 when the top-1 agreement is below this")
    ap.add_argument("--max-kl", type=float, help="exit 1 when the mean KL is above this")
    ap.add_argument("--top-k", type=int, default=TOP_K, help="top_logprobs_num to ask for (default 20)")
    ap.add_argument("--max-ids", type=int, default=4096, help="token_ids_logprob per request (glm53 accepts 4096)")
    ap.add_argument("--topk-only", action="store_true", help="do not send token_ids_logprob (servers without it): ids outside the top-k count as missing")
    args = ap.parse_args(argv)
    if args.top_k < 1 or args.max_ids < 1:
        ap.error("--top-k and --max-ids take positive numbers")
    return args


def run(client: Client, args: argparse.Namespace) -> dict:
    """:raise PanelError, OSError: an unusable panel or server. :raise ServerError: the server refused or misanswered."""
    items = load_panel(args.panel)
    started = utc_now()
    info = client.get_optional("/server_info")
    result = score(client, items, args, ((info or {}).get("loaded_model") or {}).get("vocab_size"))
    gates = gate_results(args, result["top1_agreement"], result["mean_kl_top20"])
    result.update(
        url=client.base, started=started, finished=utc_now(),
        panel={"path": args.panel, "items": len(items), "sha256": hashlib.sha256(Path(args.panel).read_bytes()).hexdigest()},
        floor_logprob=FLOOR_LOGPROB, top_k=args.top_k, topk_only=args.topk_only, gates=gates,
        passed=all(g["pass"] for g in gates.values()), server_info=info,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(client_from_args(args), args)
    except (ServerError, OSError, ValueError) as e:  # ValueError: the panel; OSError: its file, or the server unreachable
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_json(result, args.out)
    print(f"{result['positions']} positions: top-1 {result['top1_agreement']:.4f}, mean KL {result['mean_kl_top20']:.4g}, "
          f"p99 KL {result['p99_kl']:.4g}, missing ids {result['missing_ids']}", file=sys.stderr)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
