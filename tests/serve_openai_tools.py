"""The `openai` client against kiln's server: tool calls (tests/serve_http.rs).

Usage: python serve_openai_tools.py BASE_URL TOOLS_JSON

The model is a tiny random one: whatever it calls must be a call to one of
the tools with arguments that follow the tool's schema, which only the
server's constraint can guarantee.
"""
import json
import sys

import openai

URL, TOOLS = sys.argv[1], json.loads(sys.argv[2])
client = openai.OpenAI(base_url=URL, api_key="unused", max_retries=0, timeout=120)
msgs = [{"role": "user", "content": "Weather in Paris?"}]


def check(cond, msg):
    if not cond:
        print("FAIL: " + msg, flush=True)
        sys.exit(1)


def valid_call(name, arguments):
    args = json.loads(arguments)
    if name == "get_weather":
        return args.get("city") in ("Paris", "Oslo") and args.get("unit") in ("C", "F") and len(args) == 2
    return name == "get_time" and args == {}


# required: any tool; named: that tool. Greedy and sampled, plain and streamed.
for choice, names in [("required", {"get_weather", "get_time"}),
                      ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
                      ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})]:
    for kw in [dict(temperature=0), dict(temperature=1.0, seed=5)]:
        r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice=choice,
                                           max_tokens=150, **kw)
        c = r.choices[0]
        check(c.finish_reason == "tool_calls" and c.message.tool_calls, f"{choice} {kw}: {c}")
        for t in c.message.tool_calls:
            check(t.type == "function" and t.id.startswith("call_"), f"{t}")
            check(t.function.name in names and valid_call(t.function.name, t.function.arguments), f"{choice}: {t}")
        calls, finish, content = {}, None, ""
        for ch in client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=150, stream=True, **kw):
            d = ch.choices[0].delta
            content += d.content or ""
            for t in d.tool_calls or []:
                e = calls.setdefault(t.index, {"name": "", "arguments": ""})
                e["name"] += (t.function.name or "")
                e["arguments"] += (t.function.arguments or "")
            finish = ch.choices[0].finish_reason or finish
        check(finish == "tool_calls" and content.strip() == "", f"streamed {choice}: {finish} {content!r}")
        got = [(e["name"], e["arguments"]) for _, e in sorted(calls.items())]
        want = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
        check(got == want, f"streamed calls {got} != {want}")

# auto: a <tool_call> block the model writes is parsed (steered by a regex here).
block = r'Checking\.\n<tool_call>\n\{"name": "get_time", "arguments": \{\}\}\n</tool_call>'
r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="auto", max_tokens=150,
                                   extra_body={"structured_outputs": {"regex": block}})
c = r.choices[0]
check(c.message.content == "Checking." and [t.function.name for t in c.message.tool_calls] == ["get_time"], f"{c}")
check(c.finish_reason == "tool_calls", f"auto: {c.finish_reason}")
# none: the same text stays text.
r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=150,
                                   extra_body={"structured_outputs": {"regex": block}})
text = 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
check(r.choices[0].message.tool_calls is None and r.choices[0].message.content == text, f"{r.choices[0]}")
# The tools are in the prompt (the template's tools preamble and every definition).
plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, temperature=0)
check(r.usage.prompt_tokens > plain.usage.prompt_tokens + len(json.dumps(TOOLS)), f"{r.usage} vs {plain.usage}")

# A round trip: the call and its result go back; the server answers.
call = c.message.tool_calls[0]
msgs2 = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
r = client.chat.completions.create(model="tiny", messages=msgs2, tools=TOOLS, max_tokens=5, temperature=0)
check(r.choices[0].finish_reason in ("stop", "length", "tool_calls"), f"round trip: {r}")

# Refused: an unknown tool, a bad schema, a choice without tools.
for kw, param in [(dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
                  (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]),
                   "tools"),
                  (dict(tool_choice="required"), "tool_choice"),
                  (dict(tools=[{"type": "retrieval"}]), "tools")]:
    try:
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, **kw)
        check(False, f"{kw} was accepted")
    except openai.BadRequestError as e:
        check(e.body["param"] == param and e.body["type"] == "invalid_request_error", f"{kw}: {e.body}")
r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0)
check(r.choices[0].finish_reason in ("stop", "length"), "served after the refusals")
print(json.dumps({"ok": True}))
