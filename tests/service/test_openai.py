"""The OpenAI-compatible routes (``/v1``) on a real ``kvstore serve --model``, driven by the official
``openai`` client (and httpx for the raw wire format).

Reuse is what is checked most: a second turn reports the stored tokens it did not prefill as
``usage.prompt_tokens_details.cached_tokens`` — the resent history's whole 64-token blocks at
least, a named session's whole stored conversation — in the same server and after a restart. A
server that re-prefills the history reports ``cached_tokens == 0`` and fails those checks; one that
continues the wrong rows fails the checks on the stored tokens of each answer's session.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from kvstore.api.chat_template import continuation, render
from kvstore.api.openai_turns import StopText
from kvstore.formats import coli_kv
from service.support import KEY, OTHER_KEY, metrics

BLOCK = 64  # the store's prefix block (kvstore.migrations.index.PREFIX_BLOCK_TOKENS)
SYSTEM = "You are a careful assistant. " * 6  # 174 bytes: the tiny model's byte tokenizer makes one token per byte
GREEDY = {"temperature": 0, "max_tokens": 8}


def client(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def stored_tokens(http: httpx.Client, session_id: str) -> list[int]:
    """The token of every record the session holds."""
    body = http.get(f"/sessions/{session_id}/resume", params={"format": "coli_kv"}).content
    header = coli_kv.parse_header(body[: coli_kv.HEADER_BYTES])
    records = np.frombuffer(body[coli_kv.HEADER_BYTES :], dtype=coli_kv.record_dtype(header.geometry, header.tier))
    return records["token"].tolist()


def cached(answer) -> int:
    return answer.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


# ---------------------------------------------------------------------------- no server
def test_stop_text_never_hands_out_any_part_of_a_stop_string():
    def run(pieces, stops):
        text = StopText(stops)
        out = "".join(text.feed(piece) for piece in pieces)
        return out + text.finish(), text.stopped

    assert run(["Hel", "lo wo", "rld"], ["o w"]) == ("Hell", True)
    assert run(["ab", "c"], ["cd"]) == ("abc", False)  # "c" was held back, then handed out at the end
    assert run(["x", "E", "N", "D", "y"], ["END", "NDy"]) == ("x", True)  # the earliest stop string wins
    assert run(["a", "b"], []) == ("ab", False)
    held = StopText(["STOP"])
    assert held.feed("go ST") == "go " and held.feed("A") == "STA" and held.feed("STOP") == "" and held.stopped


def test_the_default_template_renders_answers_as_written_and_continues_them(tokenizer):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": " Hello."},
        {"role": "user", "content": "And?"},
    ]
    first = render(tokenizer, conversation[:2])
    assert first == "Be brief.\n\nUser: Hi\nAssistant:"
    # the answer follows its prompt as the model wrote it: the history re-renders to prompt + answer
    assert render(tokenizer, conversation) == first + " Hello." + "\nUser: And?\nAssistant:"
    assert continuation(tokenizer, conversation) == "\nUser: And?\nAssistant:"
    assert continuation(tokenizer, conversation[3:]) == "\nUser: And?\nAssistant:"  # only the new messages


# ---------------------------------------------------------------------------- a served model
def test_models_chat_and_completions_in_openai_shapes(make_server, model_dir, tokenizer):
    server = make_server("--model", str(model_dir))
    api = client(server)
    listed = api.models.list()
    assert [(m.id, m.object, m.owned_by) for m in listed.data] == [("tiny", "model", "kvstore")]
    assert isinstance(listed.data[0].created, int) and api.models.retrieve("tiny").id == "tiny"

    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], **GREEDY)
    assert chat.object == "chat.completion" and chat.model == "tiny" and chat.id.startswith("chatcmpl-")
    (choice,) = chat.choices
    assert choice.index == 0 and choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    prompt = len("User: Hello\nAssistant:")  # the default template; one token per byte
    usage = chat.usage
    assert (usage.prompt_tokens, cached(chat), usage.total_tokens) == (prompt, 0, prompt + usage.completion_tokens)
    assert 1 <= usage.completion_tokens <= 8
    with server.client() as http:
        session = http.get(f"/sessions/{chat.session_id}").json()  # the extension field names it
        assert session["tags"] == ["openai"] and session["n_records"] == usage.total_tokens
        assert stored_tokens(http, chat.session_id)[:prompt] == tokenizer("User: Hello\nAssistant:")["input_ids"]

    text = api.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert text.object == "text_completion" and text.choices[0].finish_reason in ("stop", "length")
    assert isinstance(text.choices[0].text, str) and text.usage.prompt_tokens == len("Once upon a time")
    ids = api.completions.create(model="tiny", prompt=[40, 41, 42, 43], max_tokens=3, temperature=0.7, seed=3)
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens <= 3
    again = api.completions.create(model="tiny", prompt=[40, 41, 42, 43], max_tokens=3, temperature=0.7, seed=3)
    assert again.choices[0].text == ids.choices[0].text  # the same seed, the same answer

    # the raw wire format: OpenAI's JSON, plus the reuse split in headers
    with server.client() as http:
        raw = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert raw.status_code == 200 and raw.headers["X-KV-Prefilled-Tokens"] == "2"
        assert set(raw.json()) == {
            "id",
            "object",
            "created",
            "model",
            "system_fingerprint",
            "choices",
            "usage",
            "session_id",
        }
        assert raw.json()["system_fingerprint"] == http.get("/engine").json()["fingerprint"]


def test_a_streamed_answer_is_the_non_streamed_one_in_chunks(make_server, model_dir):
    server = make_server("--model", str(model_dir))
    api = client(server)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me"}], "temperature": 0, "max_tokens": 24}
    whole = api.chat.completions.create(**ask)
    chunks = list(api.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "chat.completion.chunk" for c in chunks)
    *pieces, last, usage = chunks
    assert last.choices[0].finish_reason == whole.choices[0].finish_reason and usage.choices == []
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == whole.choices[0].message.content
    assert usage.usage.completion_tokens == whole.usage.completion_tokens
    assert usage.usage.prompt_tokens == len("User: Tell me\nAssistant:")
    assert all(c.usage is None for c in chunks[:-1]) and usage.session_id == last.session_id

    completion = {"model": "tiny", "prompt": "abc", "temperature": 0, "max_tokens": 10}
    text = api.completions.create(**completion).choices[0].text
    streamed = list(api.completions.create(**completion, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text and streamed[-1].choices[0].finish_reason

    # on the wire: `data: {json}` events, the last one `data: [DONE]`
    with server.client() as http, http.stream("POST", "/v1/chat/completions", json={**ask, "stream": True}) as raw:
        assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
        body = "".join(raw.iter_text())
    events = [block for block in body.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in events) and body.endswith("data: [DONE]\n\n")
    parsed = [json.loads(block.removeprefix("data: ")) for block in events[:-1]]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in parsed) == whole.choices[0].message.content
    assert "usage" not in parsed[0]  # only with stream_options.include_usage


def test_stop_strings_end_the_answer_before_them(make_server, model_dir):
    server = make_server("--model", str(model_dir))
    api = client(server)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Count"}], "temperature": 0, "max_tokens": 40}
    free = api.chat.completions.create(**ask).choices[0].message.content
    assert len(free) > 8, free
    stop = free[5:7]
    expected = free[: free.index(stop)]
    stopped = api.chat.completions.create(**ask, stop=[stop, "\x00never"])
    assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == (expected, "stop")
    streamed = list(api.chat.completions.create(**ask, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_resent_history_and_a_named_session_reuse_the_stored_turns_across_a_restart(
    make_server, model_dir, tokenizer, tmp_path
):
    data = tmp_path / "shared-data"
    first_server = make_server("--model", str(model_dir), data=data)
    api = client(first_server)
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a latent cache?"}]
    first = api.chat.completions.create(model="tiny", messages=opening, **GREEDY)
    prompt = first.usage.prompt_tokens
    assert prompt == len(render(tokenizer, opening)) > 2 * BLOCK and cached(first) == 0
    answer = first.choices[0].message.content
    history = [*opening, first.choices[0].message]  # the client sends back the message it got

    # the history resent: at least the first prompt's whole blocks are not prefilled again
    resent = [*history, {"role": "user", "content": "And then?"}]
    second = api.chat.completions.create(model="tiny", messages=resent, **GREEDY)
    assert cached(second) >= prompt // BLOCK * BLOCK
    rendered = render(tokenizer, [*opening, {"role": "assistant", "content": answer}, resent[-1]])
    assert second.usage.prompt_tokens == len(tokenizer(rendered)["input_ids"])

    # the same request again reuses all of its prompt but the token the model reads to answer
    regenerated = api.chat.completions.create(model="tiny", messages=opening, **GREEDY)
    assert cached(regenerated) == prompt - 1 and regenerated.session_id != first.session_id
    assert regenerated.choices[0].message.content == answer  # greedy, from the stored rows

    # a named session: the stored prompt and answer are the conversation, reused whole
    named = api.chat.completions.create(model="tiny", messages=opening, extra_body={"session_id": "chat-1"}, **GREEDY)
    assert named.session_id == "chat-1" and cached(named) == 0
    stored = named.usage.prompt_tokens + named.usage.completion_tokens
    reply = [*opening, {"role": "assistant", "content": named.choices[0].message.content}]
    follow = api.chat.completions.create(
        model="tiny",
        messages=[*reply, {"role": "user", "content": "Go on."}],
        extra_body={"session_id": "chat-1"},
        **GREEDY,
    )
    assert follow.session_id == "chat-1" and cached(follow) == stored
    assert follow.usage.prompt_tokens == stored + len("\nUser: Go on.\nAssistant:")
    stored = follow.usage.prompt_tokens + follow.usage.completion_tokens
    first_server.stop()

    # a new server process on the same data folder: the rows come from the journals
    second_server = make_server("--model", str(model_dir), data=data)
    api = client(second_server)
    with second_server.client() as http:
        before = metrics(http)
    again = api.chat.completions.create(
        model="tiny", messages=[*history, {"role": "user", "content": "Once more?"}], **GREEDY
    )
    assert cached(again) >= prompt // BLOCK * BLOCK
    only_new = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Last one."}], extra_body={"session_id": "chat-1"}, **GREEDY
    )  # with a named session, the messages after the last answer are enough
    assert only_new.session_id == "chat-1" and cached(only_new) == stored
    with second_server.client() as http:
        after = metrics(http)
    assert after["kvstore_reused_tokens_total"] - before["kvstore_reused_tokens_total"] == cached(again) + stored
    assert after['kvstore_restores_total{source="journal"}'] >= 2


def test_token_prompts_continue_their_session_in_place_and_racing_turns_fork(make_server, model_dir):
    server = make_server("--model", str(model_dir))
    api = client(server)
    opening = list(range(10, 10 + 3 * BLOCK))
    first = api.completions.create(model="tiny", prompt=opening, max_tokens=6, temperature=0)
    with server.client() as http:
        conversation = stored_tokens(http, first.session_id)
    assert conversation[: len(opening)] == opening and len(conversation) == first.usage.total_tokens

    # the whole stored session and more: continued in place, every stored token reused
    more = api.completions.create(model="tiny", prompt=conversation + [7, 8, 9], max_tokens=4, temperature=0)
    assert more.session_id == first.session_id and cached(more) == len(conversation)

    # two requests continue that session at once, each with its own new turn: one continues it, the
    # other finds it moved on and forks it; each answer is stored after exactly its own prompt
    with server.client() as http:
        base = stored_tokens(http, first.session_id)
    prompts = [base + [20 + i, 21 + i] for i in range(2)]
    answers: list = [None, None]
    start = threading.Barrier(2)

    def ask(i: int) -> None:
        start.wait()
        answers[i] = client(server).completions.create(model="tiny", prompt=prompts[i], max_tokens=32, temperature=0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(answers) and answers[0].session_id != answers[1].session_id
    with server.client() as http:
        for sent, answer in zip(prompts, answers):
            rows = stored_tokens(http, answer.session_id)
            assert rows[: len(sent)] == sent and len(rows) == answer.usage.total_tokens
            assert cached(answer) >= len(base) // BLOCK * BLOCK
        assert http.get(f"/sessions/{first.session_id}/verify").json()["ok"]


def test_a_session_changed_under_a_turn_gets_the_answer_on_a_fork(make_server, model_dir):
    server = make_server("--model", str(model_dir))
    api = client(server)
    opening = [{"role": "user", "content": "Start."}]
    api.chat.completions.create(model="tiny", messages=opening, extra_body={"session_id": "moved"}, **GREEDY)
    with server.client() as http:
        before = http.get("/sessions/moved").json()["n_records"]
        rows = http.get("/sessions/moved/resume").content  # its own rows, appended again behind the turn's back
        done: list = []

        def ask() -> None:
            try:
                done.append(
                    api.chat.completions.create(
                        model="tiny",
                        messages=[{"role": "user", "content": "A long answer, please."}],
                        extra_body={"session_id": "moved"},
                        max_tokens=600,
                        temperature=0,
                    )
                )
            except openai.APIError as exc:  # shown by the assertion below
                done.append(exc)

        asked = threading.Thread(target=ask)
        asked.start()
        time.sleep(0.3)
        appended = http.post(
            "/sessions/moved/append", content=rows, headers={"Content-Type": "application/octet-stream"}
        )
        assert appended.status_code == 200, appended.text
        asked.join(300)
        (answer,) = done
        assert not isinstance(answer, Exception), answer
        assert answer.session_id != "moved" and cached(answer) == before
        forked = stored_tokens(http, answer.session_id)
        assert forked[:before] == stored_tokens(http, "moved")[:before] and len(forked) == answer.usage.total_tokens
        assert http.get("/sessions/moved").json()["n_records"] == 2 * before  # the other writer's rows, untouched
    log = server.stop()
    # the append landed during the turn (generated again on a fork), or just before it (begun on a fork)
    assert "changed under the turn" in log or "moved on since the plan" in log, log


def test_a_client_that_leaves_cancels_its_turn(make_server, model_dir):
    server = make_server("--model", str(model_dir))
    ask = {"model": "tiny", "prompt": "Go", "max_tokens": 4000, "temperature": 0}
    with server.client() as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=ask, timeout=1.0)
        with http.stream("POST", "/v1/completions", json={**ask, "stream": True}) as live:
            for line in live.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    break
        for _ in range(600):
            if metrics(http)["kvstore_turns_cancelled_total"] == 2:
                break
            time.sleep(0.05)  # each turn ends on the server after its client left
        assert metrics(http)["kvstore_turns_cancelled_total"] == 2
        sessions = http.get("/sessions", params={"tag": "openai"}).json()["sessions"]
        assert sessions and all(2 < s["n_records"] < 2 + 4000 for s in sessions)


def test_refusals_are_openai_errors_and_the_rest_of_the_api_keeps_its_own(make_server, model_dir):
    server = make_server("--model", str(model_dir))
    api = client(server)
    say = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.AuthenticationError) as wrong_key:
        client(server, "not-a-key").chat.completions.create(model="tiny", messages=say)
    assert wrong_key.value.status_code == 401 and wrong_key.value.body["type"] == "authentication_error"
    with pytest.raises(openai.NotFoundError) as unknown_model:
        api.chat.completions.create(model="gpt-4o", messages=say)
    assert unknown_model.value.code == "model_not_found" and "tiny" in unknown_model.value.message

    refused = {
        "logprobs": {"logprobs": True},
        "n": {"n": 2},
        "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        "response_format": {"response_format": {"type": "json_object"}},
        "presence_penalty": {"presence_penalty": 0.5},
        "logit_bias": {"logit_bias": {"5": 10}},
        "messages[0].content[0]": {
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        },
        "max_tokens": {"max_tokens": 1 << 20},
        "temperature": {"temperature": 3},
        "frobnicate": {"extra_body": {"frobnicate": True}},
        "session_id": {"extra_body": {"session_id": "../escape"}},
    }
    for param, options in refused.items():
        with pytest.raises(openai.BadRequestError) as bad:
            api.chat.completions.create(**{"model": "tiny", "messages": say, **options})
        assert bad.value.body["param"] == param and param.split("[")[0] in bad.value.message, (param, bad.value.body)
    for param, options in {"echo": {"echo": True}, "best_of": {"best_of": 2}, "suffix": {"suffix": "end"}}.items():
        with pytest.raises(openai.BadRequestError) as bad:
            api.completions.create(model="tiny", prompt="x", **options)
        assert bad.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as batch:
        api.completions.create(model="tiny", prompt=["one", "two"])
    assert batch.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as vocab:
        api.completions.create(model="tiny", prompt=[1, 2, 100000])
    assert "[0, 512)" in vocab.value.message

    with server.client() as http, server.client(OTHER_KEY) as bob:
        for method, path, body, status in [
            ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [', 400),
            ("POST", "/v1/chat/completions", b'{"model": "tiny", "model": "tiny", "messages": []}', 400),
            ("GET", "/v1/chat/completions", None, 405),
            ("POST", "/v1/embeddings", b"{}", 404),
        ]:
            answer = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
            assert answer.status_code == status and set(answer.json()["error"]) == {"message", "type", "param", "code"}
        assert http.get("/sessions", params={"tag": "openai"}).json()["sessions"] == []  # nothing was created
        assert http.get("/sessions/nope").json()["error"] == "SessionNotFound"  # the service's own shape elsewhere
        # another owner's session is not found, not continued: it starts its own
        mine = api.chat.completions.create(model="tiny", messages=say, extra_body={"session_id": "mine"}, max_tokens=2)
        theirs = client(server, OTHER_KEY).chat.completions.create(
            model="tiny", messages=say, extra_body={"session_id": "mine"}, max_tokens=2
        )
        assert cached(mine) == cached(theirs) == 0 and bob.get("/sessions/mine").json()["owner"] == "bob"

    no_model = make_server()
    with pytest.raises(openai.InternalServerError) as unloaded:
        client(no_model).models.list()
    assert unloaded.value.status_code == 503 and "--model" in unloaded.value.message


def test_a_prompt_far_past_the_context_is_refused_from_its_beginning(make_server, model_dir):
    """A text too long to fit is refused once its beginning alone holds clearly more tokens than the
    context has room for — the rest is never tokenized — as a new conversation and as the next turn
    of a stored one (whose tokens count against the room); a prompt that fits is still answered."""
    server = make_server("--model", str(model_dir))
    api = client(server)
    flood = "x" * 600_000  # the byte tokenizer: a token a character, past the 65,536-token context
    first = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_body={"session_id": "long"}
    )
    stored = first.usage.total_tokens
    for extra, held in (({}, 0), ({"session_id": "long"}, stored)):
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": flood}], max_tokens=4, extra_body=extra
            )
        body = refused.value.body
        assert body["code"] == "context_length_exceeded" and body["param"] == "messages", body
        assert (
            f"holds {held} stored tokens" in body["message"] and "characters of its new text alone" in body["message"]
        )
    with server.client() as http:
        assert len(stored_tokens(http, "long")) == stored  # the stored turn is as it was
    assert api.completions.create(model="tiny", prompt="x" * 2000, max_tokens=2).usage.prompt_tokens >= 2000


def test_the_servers_limits_answer_429_with_retry_after_and_cap_max_tokens(make_server, model_dir):
    server = make_server("--model", str(model_dir), "--max-turns-per-owner", "1", "--max-new-tokens", "400")
    api = client(server)
    say = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as over:
        api.chat.completions.create(model="tiny", messages=say, max_completion_tokens=401)
    assert over.value.body["param"] == "max_completion_tokens" and "400" in over.value.message
    capped = api.chat.completions.create(model="tiny", messages=say, temperature=0)  # no max_tokens: the cap
    assert capped.usage.completion_tokens <= 400
    assert capped.choices[0].finish_reason == ("length" if capped.usage.completion_tokens == 400 else "stop")

    # The turn that keeps alice busy must still run when her next request arrives, however slow the
    # machine: 60,000 greedy tokens (a minute and more on the tiny model, within its 65,536-token
    # context), cancelled when the stream closes.
    server.stop()
    roomy = make_server("--model", str(model_dir), "--max-turns-per-owner", "1", "--max-new-tokens", "60000")
    api = client(roomy)
    with (
        roomy.client() as http,
        http.stream(
            "POST",
            "/v1/completions",
            json={"model": "tiny", "prompt": "Go", "max_tokens": 60000, "temperature": 0, "stream": True},
        ) as busy,
    ):
        assert busy.status_code == 200, busy.read()
        # alice's one turn is in flight. The iterator stays referenced to the end of the block: a
        # dropped one is closed at once, and closing it closes the stream, which the server reads
        # as a client gone and cancels the turn (under load before the request below arrived).
        lines = busy.iter_lines()
        next(lines)
        with pytest.raises(openai.RateLimitError) as refused:
            api.chat.completions.create(model="tiny", messages=say, max_tokens=2)
        assert refused.value.response.headers["Retry-After"] == "1" and refused.value.code == "server_busy"
        other = client(roomy, OTHER_KEY).chat.completions.create(model="tiny", messages=say, max_tokens=2)
        assert other.usage.completion_tokens <= 2  # another owner's turn runs meanwhile
        assert next(lines, None) is not None  # and alice's turn streams on, never cancelled by the checks
