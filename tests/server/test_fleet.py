"""Three demo-model replicas behind the real SGLang router (``sglang-router``), with a shared Redis for the Responses
store and nginx in front for the Anthropic Messages API, on loopback (``bench/fleet.py``): conversation affinity and
cache reuse, spreading, ``previous_response_id`` across replicas, Claude Code's sessions through nginx (affinity,
spreading, a drained replica), a crash, and a rolling restart under load.

One fleet serves the whole module; the crash and the restart tests put every replica back before they end.
"""

from __future__ import annotations

import itertools
import json
import threading
import urllib.error
import urllib.request

import anthropic
import openai
import pytest

from bench.fleet import MODEL, REPO, Fleet, box_for_session, front_proxy_conf, get_json


@pytest.fixture(scope="module")
def fleet():
    with Fleet(replicas=3, replica_args=("--shutdown-grace-s", "30")) as f:
        yield f


def chat(url: str, messages: list[dict], max_tokens: int, stream: bool = False, started: threading.Event | None = None) -> dict:
    """One chat completion: ``status``, ``message``, ``usage`` and, for a stream, ``done`` (its ``[DONE]`` came:
    a stream cut short by a dying replica ends without it)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            if not stream:
                answer = json.load(r)
                return {"status": r.status, "message": answer["choices"][0]["message"], "usage": answer["usage"], "done": True}
            out = {"status": r.status, "message": {"role": "assistant", "content": ""}, "usage": None, "done": False}
            for line in r:
                if started is not None:
                    started.set()
                data = line.decode().strip().removeprefix("data: ")
                if data == "[DONE]":
                    out["done"] = True
                elif data.startswith("{"):
                    event = json.loads(data)
                    out["usage"] = event.get("usage") or out["usage"]
                    for choice in event["choices"]:
                        out["message"]["content"] += choice["delta"].get("content") or ""
            return out
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": e.read().decode(), "done": False}
    finally:
        if started is not None:
            started.set()


def served_delta(fleet: Fleet, endpoint: str, call):
    before = fleet.served(endpoint)
    result = call()
    return result, [a - b for a, b in zip(fleet.served(endpoint), before)]


def system(name: str) -> dict:
    return {"role": "system", "content": f"{name} is a coding agent. " + "It reads the files, runs the tests and reports back. " * 12}


def test_an_agents_five_turns_stay_on_one_replica_and_reuse_its_prefix_cache(fleet):
    messages = [system("Ayla")]
    replicas, usages = set(), []
    for turn in range(5):
        messages.append({"role": "user", "content": f"Turn {turn}: run the next step of the plan and show me the output."})
        answer, delta = served_delta(fleet, "/v1/chat/completions", lambda: chat(fleet.url, messages, max_tokens=12))
        assert answer["status"] == 200 and sum(delta) == 1
        replicas.add(delta.index(1))
        usages.append(answer["usage"])
        messages.append({"role": "assistant", "content": answer["message"]["content"] or ""})
    assert len(replicas) == 1
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached[0] < 20 and all(c > 0 for c in cached[1:])
    # a single box: the same shape of conversation sent to one replica directly
    direct = [system("Brun"), {"role": "user", "content": "Turn 0: run the next step of the plan and show me the output."}]
    first = chat(fleet.urls[0], direct, max_tokens=12)
    direct += [{"role": "assistant", "content": first["message"]["content"] or ""},
               {"role": "user", "content": "Turn 1: run the next step of the plan and show me the output."}]
    second = chat(fleet.urls[0], direct, max_tokens=12)["usage"]
    single_box = second["prompt_tokens_details"]["cached_tokens"] / second["prompt_tokens"]
    assert cached[1] / usages[1]["prompt_tokens"] >= 0.9 * single_box


def test_concurrent_conversations_spread_over_the_replicas_and_keep_their_own(fleet):
    """While one conversation's turn runs, a new conversation goes to an idle replica; each next turn follows its own."""
    first_started = threading.Event()
    conversations = {name: [system(name), {"role": "user", "content": f"{name}, start the task."}] for name in ("Cato", "Dara")}
    before = fleet.served("/v1/chat/completions")
    long_turn = threading.Thread(target=chat, args=(fleet.url, conversations["Cato"], 60, True, first_started))
    long_turn.start()
    first_started.wait()
    short = chat(fleet.url, conversations["Dara"], 8)
    long_turn.join()
    after_first = fleet.served("/v1/chat/completions")
    homes = {}
    assert short["status"] == 200
    assert sorted(b - a for a, b in zip(before, after_first)) == [0, 1, 1]
    for name in ("Cato", "Dara"):
        conversations[name] += [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Next step."}]
        answer, delta = served_delta(fleet, "/v1/chat/completions", lambda m=conversations[name]: chat(fleet.url, m, 8))
        assert answer["status"] == 200 and sum(delta) == 1
        homes[name] = delta.index(1)
    assert homes["Cato"] != homes["Dara"]


def test_the_router_lists_the_served_model(fleet):
    """It takes each replica's model id from /server_info's served_model_name."""
    assert [m["id"] for m in get_json(fleet.url + "/v1/models")["data"]] == [MODEL]


def test_previous_response_id_continues_on_any_replica(fleet):
    with openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0) as client:
        first = client.responses.create(model=MODEL, input="Remember the word 'basalt'.", max_output_tokens=8)
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.create(model=MODEL, input="again", previous_response_id="resp_" + "0" * 24)
    assert missing.value.body["param"] == "previous_response_id" and missing.value.body["code"] == "previous_response_not_found"
    # the router moves the conversation: every replica continues it
    for url in fleet.urls:
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            follow = client.responses.create(model=MODEL, input="Which word?", previous_response_id=first.id, max_output_tokens=8)
        assert follow.previous_response_id == first.id
        assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 8


# ----- Anthropic Messages through the front proxy (nginx), as Claude Code sends it: one session id a conversation


def claude_client(fleet: Fleet, session: str) -> anthropic.Anthropic:
    # no retries of the SDK's own: a request the fleet failed must show as failed
    return anthropic.Anthropic(base_url=fleet.front_url, api_key="unused", max_retries=0,
                               default_headers={"X-Claude-Code-Session-Id": session})


def home_box(fleet: Fleet, session: str) -> int:
    return box_for_session(session, [url.removeprefix("http://") for url in fleet.urls])


def sessions_on(fleet: Fleet, box: int | None, count: int, prefix: str) -> list[str]:
    """The first ``count`` session ids ``prefix-0``, ``prefix-1``, ... whose home is ``box`` (any box: None)."""
    ids = (f"{prefix}-{k}" for k in itertools.count())
    return list(itertools.islice((s for s in ids if box is None or home_box(fleet, s) == box), count))


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_the_tests_front_proxy_is_the_one_the_nixos_module_deploys():
    """bench/fleet.py and nix/lib/front-proxy.nix fill the same template: for the module's defaults, the same text
    (nix/tests/golden/front-proxy-default.json is what the Nix side renders; nix/ci/check.sh keeps it in step)."""
    golden = json.loads((REPO / "nix/tests/golden/front-proxy-default.json").read_text())["config"]
    assert front_proxy_conf(["10.0.0.11:30000", "10.0.0.12:30000"], "127.0.0.1:30001", "127.0.0.1:30000",
                            "/run/glm53-front-proxy", 2) == golden


def test_a_claude_code_sessions_five_turns_stay_on_its_home_box_and_reuse_its_prefix_cache(fleet):
    session = sessions_on(fleet, None, 1, "claude-affinity")[0]
    prompt = system("Ezra")["content"]
    messages, boxes, cached = [], set(), []
    with claude_client(fleet, session) as client:
        for turn in range(5):
            messages.append({"role": "user", "content": f"Turn {turn}: run the next step of the plan and show me the output."})
            answer, delta = served_delta(fleet, "/v1/messages", lambda: client.messages.create(
                model=MODEL, max_tokens=12, system=prompt, messages=messages))
            assert sum(delta) == 1
            boxes.add(delta.index(1))
            cached.append(answer.usage.cache_read_input_tokens)
            messages.append({"role": "assistant", "content": text_of(answer) or "."})
    assert boxes == {home_box(fleet, session)}
    assert cached[0] < 20 and all(c > 0 for c in cached[1:]), cached


def test_sessions_whose_ids_hash_to_different_boxes_are_served_there(fleet):
    """Each on the box nginx's ring gives its id; a request without the header on the box its address hashes to."""
    first = sessions_on(fleet, None, 1, "claude-spread")[0]
    second = next(s for s in sessions_on(fleet, None, 50, "claude-spread") if home_box(fleet, s) != home_box(fleet, first))
    for session in (first, second, first, second):
        with claude_client(fleet, session) as client:
            answer, delta = served_delta(fleet, "/v1/messages", lambda c=client, s=session: c.messages.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": f"{s}: next step."}]))
        assert answer.stop_reason in ("end_turn", "max_tokens")
        assert delta == [int(i == home_box(fleet, session)) for i in range(len(fleet.urls))]
    # a client without the header is keyed by its address
    with anthropic.Anthropic(base_url=fleet.front_url, api_key="unused", max_retries=0) as client:
        _, delta = served_delta(fleet, "/v1/messages", lambda: client.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "No session: next step."}]))
    assert delta == [int(i == home_box(fleet, "127.0.0.1")) for i in range(len(fleet.urls))]
    # count_tokens takes the same way, and everything else goes through nginx to the router
    before = fleet.served("/v1/messages/count_tokens")
    with claude_client(fleet, first) as client:
        assert client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hello"}]).input_tokens > 0
    assert [a - b for a, b in zip(fleet.served("/v1/messages/count_tokens"), before)] == \
        [int(i == home_box(fleet, first)) for i in range(len(fleet.urls))]
    assert get_json(fleet.front_url + "/v1/models") == get_json(fleet.url + "/v1/models")


def test_a_drained_box_fails_no_messages_request(fleet):
    """Three Claude Code sessions, two of them at home on the box that is stopped as a service manager stops it
    (SIGTERM: 503 to new requests while it drains, then exit) and started again; every request is answered in full:
    nginx retries the 503s and the refused connections on the next box of the ring."""
    victim = 1
    sessions = [*sessions_on(fleet, victim, 2, "claude-drain"),
                next(s for s in sessions_on(fleet, None, 50, "claude-drain") if home_box(fleet, s) != victim)]
    stop, victim_down = threading.Event(), threading.Event()
    results: list[dict] = []

    def session_loop(session: str) -> None:
        with claude_client(fleet, session) as client:
            for i in range(200):  # a bound, far above what the restart takes
                if stop.is_set():
                    return
                request = {"model": MODEL, "max_tokens": 16,
                           "messages": [{"role": "user", "content": f"{session}, request {i}: check the build."}]}
                down = victim_down.is_set()
                try:
                    if i % 2:
                        with client.messages.stream(**request) as stream:
                            answer = stream.get_final_message()
                    else:
                        answer = client.messages.create(**request)
                    results.append({"session": session, "down": down, "stop_reason": answer.stop_reason})
                except anthropic.APIError as e:
                    results.append({"session": session, "down": down, "error": repr(e)})

    clients = [threading.Thread(target=session_loop, args=(s,)) for s in sessions]
    for t in clients:
        t.start()
    fleet.wait_until(lambda: {r["session"] for r in results} == set(sessions), "every session answered once", 60)
    fleet.drain(victim)
    victim_down.set()
    # the box stays away until every session has been answered without it (a loaded machine may start one late)
    fleet.wait_until(lambda: {r["session"] for r in results if r["down"]} == set(sessions),
                     f"every session answered while replica {victim} is away", 60)
    fleet.start_replica(victim)
    fleet.wait_healthy(victim)
    victim_down.clear()
    fleet.wait_until(lambda: all(fleet.routed()), f"replica {victim} back in the router's rotation", 30)
    stop.set()
    for t in clients:
        t.join()
    failed = [r for r in results if r.get("stop_reason") not in ("end_turn", "max_tokens")]
    assert failed == []
    # the victim's sessions went on while it was away (their requests went to the next box of the ring)
    assert {r["session"] for r in results if r["down"]} == set(sessions)
    # and come home once it is back: nginx tries it again after fail_timeout (one health interval)
    probe = claude_client(fleet, sessions[0])

    def served_at_home() -> bool:
        _, delta = served_delta(fleet, "/v1/messages/count_tokens", lambda: probe.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "hello"}]))
        return delta[victim] == 1
    fleet.wait_until(served_at_home, f"session {sessions[0]} back on replica {victim}", 30)
    probe.close()


def run_load(fleet: Fleet, count: int, max_tokens: int, results: list) -> list[threading.Thread]:
    threads = []
    for i in range(count):
        messages = [{"role": "user", "content": f"Load request {i}: " + "summarise the log " * (3 + i)}]
        t = threading.Thread(target=lambda m=messages, s=i % 2 == 0: results.append(chat(fleet.url, m, max_tokens, s)))
        t.start()
        threads.append(t)
    return threads


def test_a_killed_replica_costs_only_the_requests_it_was_running(fleet):
    results: list[dict] = []
    before = fleet.served("/v1/chat/completions")

    def all_started() -> bool:  # each of the 9 is running or answered (under load a short one may be done already)
        answered = sum(fleet.served("/v1/chat/completions")) - sum(before)
        return sum(fleet.active()) + answered == 9

    threads = run_load(fleet, 9, 200, results)
    fleet.wait_until(all_started, "all 9 requests to start", 60)
    running = fleet.active()
    victim = running.index(max(running))
    fleet.kill(victim)
    for t in threads:
        t.join()
    failed = [r for r in results if r["status"] != 200 or not r["done"]]
    assert len(results) == 9 and len(failed) <= running[victim]
    # what was lost is streams cut short (no [DONE]): the router retried the unstreamed ones on another replica
    assert all(r["status"] == 200 for r in results)
    assert all(r["usage"]["completion_tokens"] == 200 for r in results if r not in failed)
    # new work goes to the others at once: the first request that meets the dead replica opens its circuit and is retried
    after: list[dict] = []
    for t in run_load(fleet, 6, 4, after):
        t.join()
    assert [r["status"] for r in after] == [200] * 6 and all(r["done"] for r in after)
    fleet.start_replica(victim)
    fleet.wait_healthy(victim)
    fleet.wait_until(lambda: all(fleet.routed()), "the restarted replica back in rotation", 30)


def test_a_rolling_restart_under_load_fails_no_request(fleet):
    """Each replica in turn is stopped as a service manager stops it (SIGTERM: drain, exit) and started again, while
    three clients keep sending requests, streamed and not; every one of them is answered in full."""
    restarted = threading.Event()
    results: list[dict] = []

    def client(k: int) -> None:
        for i in range(200):  # a bound, far above what the restart takes
            if restarted.is_set():
                return
            messages = [{"role": "user", "content": f"Client {k}, request {i}: check the build."}]
            results.append(chat(fleet.url, messages, max_tokens=24, stream=i % 2 == 1))

    clients = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in clients:
        t.start()
    answered_per_phase = []
    for i in range(len(fleet.urls)):
        done_before = len(results)
        fleet.drain(i)
        fleet.start_replica(i)
        fleet.wait_healthy(i)
        fleet.wait_until(lambda: all(fleet.routed()), f"replica {i} back in rotation", 30)
        answered_per_phase.append(len(results) - done_before)
    restarted.set()
    for t in clients:
        t.join()
    failed = [r for r in results if r["status"] != 200 or not r["done"]]
    assert failed == [] and all(n > 0 for n in answered_per_phase)
