"""The official `openai` Python client through a router (vllm-router) in front of tessera
replicas.

Usage:
  router_client.py basic BASE_URL MODEL
      completions and chat, streaming and not; greedy answers equal across repeats (whichever
      replica serves them).
  router_client.py load BASE_URL MODEL N CONCURRENCY KILL_PID KILL_AFTER
      N streamed completions, CONCURRENCY at a time; after KILL_AFTER of them have finished,
      SIGKILLs KILL_PID (a replica). Prints one JSON line: how many succeeded and failed, how
      many were in flight at the kill, and how many that started after the kill failed.
"""

import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai


def basic(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    greedy = dict(model=model, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    prompt = "The capital of France is"
    first = client.completions.create(prompt=prompt, **greedy)
    assert first.choices[0].finish_reason == "length", first
    assert first.usage.completion_tokens == 8, first.usage
    for _ in range(3):
        again = client.completions.create(prompt=prompt, **greedy)
        assert again.choices[0].text == first.choices[0].text, (again, first)
        chunks = list(client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True}, **greedy))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == first.choices[0].text
        assert chunks[-1].usage.completion_tokens == 8
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(messages=messages, **greedy)
    assert chat.object == "chat.completion" and chat.choices[0].message.content, chat
    streamed = list(client.chat.completions.create(messages=messages, stream=True, **greedy))
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    assert text == chat.choices[0].message.content, (text, chat)
    models = client.models.list()
    assert [m.id for m in models.data] == [model], models
    print("ok")


def load(base_url: str, model: str, n: int, concurrency: int, kill_pid: int, kill_after: int) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    lock = threading.Lock()
    state = {"done": 0, "killed_at": None, "in_flight": 0, "in_flight_at_kill": None}
    results = []

    def one(i: int) -> None:
        with lock:
            state["in_flight"] += 1
            started = time.monotonic()
        ok = True
        try:
            stream = client.completions.create(
                model=model, prompt=f"Request {i}: once upon a time", max_tokens=24, temperature=0,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            chunks = list(stream)
            # Complete only with the final chunks: a finish reason, then the usage of all 24
            # tokens (a stream cut off when its replica dies lacks them).
            reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
            ok = reasons == ["length"] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
            if not ok:
                print(f"request {i} incomplete: {len(chunks)} chunks, reasons {reasons}", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - any failure counts
            ok = False
            print(f"request {i} failed: {type(e).__name__}: {e}", file=sys.stderr)
        with lock:
            state["in_flight"] -= 1
            results.append((started, ok))
            if ok:
                state["done"] += 1
            if state["killed_at"] is None and state["done"] >= kill_after:
                state["in_flight_at_kill"] = state["in_flight"]
                os.kill(kill_pid, signal.SIGKILL)
                state["killed_at"] = time.monotonic()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(n)))
    killed_at = state["killed_at"]
    failed_after = sum(1 for s, ok in results if not ok and killed_at is not None and s > killed_at + 0.5)
    print(json.dumps({
        "ok": sum(1 for _, ok in results if ok),
        "failed": sum(1 for _, ok in results if not ok),
        "in_flight_at_kill": state["in_flight_at_kill"],
        "failed_started_after_kill": failed_after,
        "killed": killed_at is not None,
    }))


if __name__ == "__main__":
    if sys.argv[1] == "basic":
        basic(sys.argv[2], sys.argv[3])
    else:
        load(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8]))
