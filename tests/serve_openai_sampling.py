"""The `openai` client against kiln's server: the sampling surface (tests/serve_http.rs).

Usage: python serve_openai_sampling.py BASE_URL EXPECTATIONS_JSON

EXPECTATIONS_JSON lists what kiln's engine answered to each request alone
(text, tokens generated, log-probabilities, top log-probabilities):
0 completion logprobs=3, 1 chat logprobs top_logprobs=2, 2-4 the n=3
choices of one seeded sampled completion, 5 penalties and logit_bias,
6 the same prompt without them. Structured outputs are checked by parsing
and validating them (pydantic).
"""
import json
import sys

import httpx
import openai

URL, E = sys.argv[1], json.loads(sys.argv[2])
client = openai.OpenAI(base_url=URL, api_key="unused", max_retries=0, timeout=120)
TOL = 1e-6


def check(cond, msg):
    if not cond:
        print("FAIL: " + msg, flush=True)
        sys.exit(1)


def close(a, b, what):
    check(len(a) == len(b) and all(abs(x - y) <= TOL for x, y in zip(a, b)), f"{what}: {a} != {b}")


# Completions with logprobs, plain and streamed.
r = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, logprobs=3)
c = r.choices[0]
check(c.text == E[0]["text"], f"logprobs completion text {c.text!r}")
close(c.logprobs.token_logprobs, E[0]["logprobs"], "completion token_logprobs")
# Every top-3 dict has 3 keys: tokens that are not text alone are OpenAI's
# "bytes:\xNN" strings, which never collide.
for d, top in zip(c.logprobs.top_logprobs, E[0]["top"]):
    close(sorted(d.values(), reverse=True), top, "top_logprobs")
check(len(c.logprobs.tokens) == len(E[0]["logprobs"]) and c.logprobs.text_offset[0] == 0, "tokens / offsets")
text, lps = "", []
for ch in client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, logprobs=3, stream=True):
    text += ch.choices[0].text
    if ch.choices[0].logprobs:
        lps += ch.choices[0].logprobs.token_logprobs
check(text == E[0]["text"], "streamed logprobs text")
close(lps, E[0]["logprobs"], "streamed token_logprobs")

# Chat with logprobs and top_logprobs, plain and streamed.
msgs = [{"role": "user", "content": "Name a colour"}]
r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
c = r.choices[0]
check(c.message.content == E[1]["text"], f"chat text {c.message.content!r}")
close([t.logprob for t in c.logprobs.content], E[1]["logprobs"], "chat logprobs")
for t, top in zip(c.logprobs.content, E[1]["top"]):
    close([x.logprob for x in t.top_logprobs], top, "chat top_logprobs")
    for x in [t] + t.top_logprobs:
        b = bytes(x.bytes)
        try:
            check(x.token == b.decode("utf-8"), f"token {x.token!r} vs its bytes {b!r}")
        except UnicodeDecodeError:
            check(x.token == "bytes:" + "".join(f"\\x{y:02x}" for y in b), f"{x.token!r} for {b!r}")
lps = []
for ch in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=2, stream=True):
    if ch.choices and ch.choices[0].logprobs:
        lps += [t.logprob for t in ch.choices[0].logprobs.content]
close(lps, E[1]["logprobs"], "streamed chat logprobs")

# n = 3: choice i draws from seed + i; usage counts every choice.
r = client.completions.create(model="tiny", prompt="Once upon", max_tokens=10, temperature=0.9, seed=5, n=3)
check([c.index for c in r.choices] == [0, 1, 2], "choice indices")
check([c.text for c in r.choices] == [E[i]["text"] for i in (2, 3, 4)], f"n=3 texts {[c.text for c in r.choices]}")
check(r.usage.completion_tokens == sum(E[i]["generated"] for i in (2, 3, 4)), f"n=3 usage {r.usage}")
texts, usage = ["", "", ""], None
for ch in client.completions.create(model="tiny", prompt="Once upon", max_tokens=10, temperature=0.9, seed=5, n=3,
                                    stream=True, stream_options={"include_usage": True}):
    if ch.usage is not None:
        check(ch.choices == [], "the usage chunk has no choices")
        usage = ch.usage
    for c in ch.choices:
        texts[c.index] += c.text
check(texts == [E[i]["text"] for i in (2, 3, 4)], f"streamed n=3 texts {texts}")
check(usage is not None and usage.completion_tokens == r.usage.completion_tokens, f"streamed usage {usage}")
# Chat n = 3, streamed: each choice's deltas by index.
got = {}
for ch in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, n=3, stream=True):
    for c in ch.choices:
        got[c.index] = got.get(c.index, "") + (c.delta.content or "")
check(sorted(got) == [0, 1, 2] and len(set(got.values())) == 1, f"greedy chat n=3: {got}")

# Penalties and logit_bias (token 120 is "x"), plain and streamed.
kw = dict(model="tiny", prompt="abcabc", max_tokens=12, temperature=0, presence_penalty=0.6, frequency_penalty=0.5,
          logit_bias={"120": 4}, extra_body={"repetition_penalty": 1.3})
r = client.completions.create(**kw)
check(r.choices[0].text == E[5]["text"], f"penalised text {r.choices[0].text!r} != {E[5]['text']!r}")
text = "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **kw))
check(text == E[5]["text"], "streamed penalised text")
r = client.completions.create(model="tiny", prompt="abcabc", max_tokens=12, temperature=0)
check(r.choices[0].text == E[6]["text"], "unpenalised text")

# echo: the prompt, then the answer.
r = client.completions.create(model="tiny", prompt="abcabc", max_tokens=12, temperature=0, echo=True)
check(r.choices[0].text == "abcabc" + E[6]["text"], "echo")

# Refused: a field the server does not honour, values out of range.
for kwargs, param in [
    (dict(extra_body={"best_of": 2}), "best_of"),
    (dict(extra_body={"guided_choice": ["a"]}), "guided_choice"),
    (dict(logit_bias={"999": 1}), "logit_bias"),
    (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(n=0), "n"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(logprobs=21), "logprobs"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
]:
    try:
        client.completions.create(model="tiny", prompt="a", max_tokens=2, **kwargs)
        check(False, f"{kwargs} was accepted")
    except openai.BadRequestError as e:
        check(e.body["param"] == param and e.body["type"] == "invalid_request_error", f"{kwargs}: {e.body}")
try:
    client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, top_logprobs=3)
    check(False, "top_logprobs without logprobs was accepted")
except openai.BadRequestError as e:
    check(e.body["param"] == "top_logprobs", f"{e.body}")
r = httpx.post(URL + "/chat/completions", json={"model": "tiny", "messages": msgs, "echo": True})
check(r.status_code == 400 and r.json()["error"]["param"] == "echo", f"chat echo: {r.text}")
# Structured output: a pydantic model through `parse` (json_schema, strict),
# greedy and sampled, and streamed; vLLM's structured_outputs regex and choice.
from typing import Literal

import pydantic


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=3)
    age: int = pydantic.Field(ge=0, le=120)
    colour: Literal["red", "green", "blue"]
    tags: list[bool] = pydantic.Field(max_length=2)


# A short prompt: the model's context is 192 tokens.
smsgs = [{"role": "system", "content": "JSON"}, {"role": "user", "content": "Who?"}]
for kw in [dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=1.0, seed=4)]:
    r = client.chat.completions.parse(model="tiny", messages=smsgs, max_tokens=100, response_format=Person, **kw)
    p = r.choices[0].message.parsed
    check(isinstance(p, Person) and r.choices[0].finish_reason == "stop", f"parsed {kw}: {r.choices[0].message}")
# Without additionalProperties false, any further (unbounded) property is valid.
strict = dict(Person.model_json_schema(), additionalProperties=False)
schema = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": strict}}
text, finish = "", None
for ch in client.chat.completions.create(model="tiny", messages=smsgs, max_tokens=100, temperature=1.0, seed=9,
                                         response_format=schema, stream=True):
    if ch.choices:
        text += ch.choices[0].delta.content or ""
        finish = ch.choices[0].finish_reason or finish
check(finish == "stop", f"the streamed structured output ended by {finish}")
Person.model_validate_json(text)
for so, ok in [({"regex": "[a-z]{3}-[0-9]{2,4}"}, lambda t: len(t) >= 6 and t[3] == "-" and t[4:].isdigit()),
               ({"choice": ["yes", "no", "(maybe)"]}, lambda t: t in ["yes", "no", "(maybe)"])]:
    for seed in (1, 2):
        r = client.completions.create(model="tiny", prompt="Q: ", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body={"structured_outputs": so})
        check(ok(r.choices[0].text), f"{so}: {r.choices[0].text!r}")
for bad, param in [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "response_format"),
                   ({"type": "xml"}, "response_format")]:
    try:
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, response_format=bad)
        check(False, f"{bad} was accepted")
    except openai.BadRequestError as e:
        check(e.body["param"] == param, f"{bad}: {e.body}")
try:
    client.completions.create(model="tiny", prompt="a", max_tokens=5, extra_body={"structured_outputs": {"regex": "[a-"}})
    check(False, "a bad regex was accepted")
except openai.BadRequestError as e:
    check(e.body["param"] == "structured_outputs", f"bad regex: {e.body}")

# The server keeps serving.
r = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
check(r.choices[0].text == E[0]["text"], "served after the refusals")
print(json.dumps({"ok": True}))
