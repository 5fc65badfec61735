"""The official `openai` client against kiln's example server (tests/serve_http.rs).

Usage: python serve_openai_client.py BASE_URL EXPECTATIONS.json LOAD_SECONDS

Every answer is compared with what kiln's `generate()` gave the same request
alone (the expectations file): completions, chat, streaming, concurrent
requests, a cancelled stream, malformed and refused requests, then a bounded
load test (concurrent clients for a fixed time on loopback) in which every
response must be complete and correct and the KV cache must stay in its pool.
"""
import concurrent.futures as cf
import json
import random
import sys
import threading
import time

import httpx
import openai

BASE, EXP, LOAD_SECS = sys.argv[1], sys.argv[2], float(sys.argv[3])
E = json.load(open(EXP))
MODEL = E["model"]
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=120)


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def metrics():
    text = httpx.get(BASE + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("kiln_") and "{" not in line:
            k, v = line.split(" ")
            out[k] = float(v)
    return out


def kwargs(c):
    k = dict(model=MODEL, max_tokens=c["max_tokens"], temperature=c["temperature"])
    if c.get("top_p") is not None:
        k["top_p"] = c["top_p"]
    if c.get("seed") is not None:
        k["seed"] = c["seed"]
    if c.get("stop") is not None:
        k["stop"] = c["stop"]
    return k


def completion(c, stream):
    if not stream:
        r = client.completions.create(prompt=c["prompt"], **kwargs(c))
        return r.choices[0].text, r.choices[0].finish_reason, r.usage
    text, finish = "", None
    for chunk in client.completions.create(prompt=c["prompt"], stream=True, **kwargs(c)):
        ch = chunk.choices[0]
        text += ch.text or ""
        if ch.finish_reason:
            finish = ch.finish_reason
    return text, finish, None


def chat(c, stream):
    msgs = c["messages"]
    if not stream:
        r = client.chat.completions.create(messages=msgs, **kwargs(c))
        m = r.choices[0].message
        check(m.role == "assistant", f"role {m.role}")
        return m.content, r.choices[0].finish_reason, r.usage
    text, finish, roles = "", None, []
    for chunk in client.chat.completions.create(messages=msgs, stream=True, **kwargs(c)):
        ch = chunk.choices[0]
        if ch.delta.role:
            roles.append(ch.delta.role)
        text += ch.delta.content or ""
        if ch.finish_reason:
            finish = ch.finish_reason
    check(roles == ["assistant"], f"the stream's roles: {roles}")
    return text, finish, None


def run_case(kind, c, stream):
    text, finish, usage = (completion if kind == "completion" else chat)(c, stream)
    what = f"{kind} {c['name']} (stream={stream})"
    check(text == c["text"], f"{what}: {text!r} != {c['text']!r}")
    check(finish == c["finish_reason"], f"{what}: finish {finish} != {c['finish_reason']}")
    if usage is not None:
        check(usage.prompt_tokens == c["prompt_tokens"], f"{what}: prompt_tokens {usage.prompt_tokens}")
        check(usage.completion_tokens == c["completion_tokens"], f"{what}: completion_tokens {usage.completion_tokens}")


cases = [("completion", c) for c in E["completions"]] + [("chat", c) for c in E["chats"]]

# Models.
check([m.id for m in client.models.list().data] == [MODEL], "the model list")

# One by one, plain and streaming.
for kind, c in cases:
    for stream in (False, True):
        run_case(kind, c, stream)

# Concurrent: every case twice, plain and streaming, at once.
with cf.ThreadPoolExecutor(16) as ex:
    futs = [ex.submit(run_case, k, c, s) for k, c in cases for s in (False, True) for _ in range(2)]
    for f in futs:
        f.result()

# A stream cancelled after two chunks frees its sequence; the server goes on.
long = dict(E["completions"][0], max_tokens=E["long_max_tokens"])
s = client.completions.create(prompt=long["prompt"], stream=True, **kwargs(long))
it = iter(s)
next(it)
next(it)
s.response.close()
deadline = time.time() + 30
while metrics()["kiln_running_sequences"] > 0:
    check(time.time() < deadline, "the cancelled stream keeps running")
    time.sleep(0.02)
m = metrics()
check(m["kiln_kv_blocks_used"] == 0, f"blocks still held after the cancel: {m}")
run_case(*cases[0], False)

# Malformed and refused requests: OpenAI's statuses and error bodies.
r = httpx.post(BASE + "/v1/completions", content=b'{"model": "x", "prompt": ', headers={"content-type": "application/json"})
check(r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", f"malformed JSON: {r.status_code} {r.text}")
r = httpx.post(BASE + "/v1/chat/completions", json={"model": MODEL, "messages": "hi"})
check(r.status_code == 400, f"messages of the wrong type: {r.status_code} {r.text}")
try:
    client.completions.create(model="no-such-model", prompt="a", max_tokens=2)
    fail("an unknown model was served")
except openai.NotFoundError as e:
    check(e.code == "model_not_found", f"unknown model: {e}")
try:
    client.completions.create(model=MODEL, prompt="a", max_tokens=0)
    fail("max_tokens 0 was accepted")
except openai.BadRequestError:
    pass
try:
    client.completions.create(model=MODEL, prompt="a", max_tokens=10**9)
    fail("a huge max_tokens was accepted")
except openai.BadRequestError as e:
    check(e.code == "context_length_exceeded", f"huge max_tokens: {e}")
try:
    client.completions.create(model=MODEL, prompt="x" * (E["max_context"] + 1), max_tokens=1)
    fail("a prompt longer than the context was accepted")
except openai.BadRequestError as e:
    check(e.code == "context_length_exceeded", f"long prompt: {e}")
check(httpx.get(BASE + "/health").text == "ok", "health")

# Load: clients in a loop for a fixed time, every answer checked; the KV
# cache's blocks never exceed the pool and all come back.
stop_at = time.time() + LOAD_SECS
done = [0]
lock = threading.Lock()
peak = [0.0]


def client_loop(seed):
    rng = random.Random(seed)
    while time.time() < stop_at:
        k, c = rng.choice(cases)
        run_case(k, c, rng.random() < 0.5)
        with lock:
            done[0] += 1


def watch():
    while time.time() < stop_at:
        m = metrics()
        check(m["kiln_kv_blocks_used"] <= m["kiln_kv_blocks_total"], f"blocks past the pool: {m}")
        peak[0] = max(peak[0], m["kiln_kv_blocks_used"])
        time.sleep(0.05)


with cf.ThreadPoolExecutor(E["load_clients"] + 1) as ex:
    futs = [ex.submit(client_loop, i) for i in range(E["load_clients"])] + [ex.submit(watch)]
    for f in futs:
        f.result()
m = metrics()
check(m["kiln_kv_blocks_used"] == 0 and m["kiln_running_sequences"] == 0, f"after the load: {m}")
check(done[0] > 0, "no request completed under load")
print(json.dumps({"ok": True, "load_requests": done[0], "peak_kv_blocks": peak[0]}), flush=True)
