"""Check a served tool model through the OpenAI SDK (temperature 0).

Start the server first, e.g.::

    VLLM_CPU_KVCACHE_SPACE=1 vllm serve servectl/model/tools --port 8123 --enable-auto-tool-choice \\
        --tool-call-parser hermes --reasoning-parser qwen3 --max-model-len 2048 --dtype float32 --enforce-eager

(Buenos Aires, Madrid and Reykjavik are held-out city names: never in training.)
then ``python -m training.check_tool_serve --base-url http://127.0.0.1:8123/v1``. Prints what came
back and exits non-zero if a check failed.
"""

from __future__ import annotations

import argparse
import json
import sys

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
AGENTS_SDK_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"properties": {"city": {"title": "City", "type": "string"}}, "required": ["city"],
                   "title": "get_weather_args", "type": "object", "additionalProperties": False},
    "strict": True}}
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8123/v1")
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    from openai import OpenAI

    client = OpenAI(base_url=args.base_url, api_key="none")
    model = args.model or client.models.list().data[0].id
    failures = []

    def check(ok: bool, what: str):
        print(("PASS " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)

    def chat(messages, tools=None, **kw):
        r = client.chat.completions.create(model=model, messages=messages, tools=tools, temperature=0,
                                           max_tokens=200, **kw)
        c = r.choices[0]
        print(json.dumps({"finish_reason": c.finish_reason, "content": c.message.content,
                          "reasoning": getattr(c.message, "reasoning", None)
                          or getattr(c.message, "reasoning_content", None),
                          "tool_calls": [tc.model_dump() for tc in c.message.tool_calls or []]}, indent=1))
        return c

    sysmsg = {"role": "system", "content": "You are a weather agent. Use the tools."}
    q = {"role": "user", "content": "What's the weather in Buenos Aires?"}
    c = chat([sysmsg, q], [WEATHER_TOOL, ADD_TOOL])
    tc = (c.message.tool_calls or [None])[0]
    check(c.finish_reason == "tool_calls", "weather: finish_reason tool_calls")
    check(tc is not None and tc.function.name == "get_weather", "weather: calls get_weather")
    args_ok = tc is not None and json.loads(tc.function.arguments).get("city") == "Buenos Aires"
    check(args_ok, "weather: arguments carry the city")
    reasoning = getattr(c.message, "reasoning", None) or getattr(c.message, "reasoning_content", None)
    check(bool(reasoning), "weather: message.reasoning non-empty")

    c2 = chat([{"role": "user", "content": "Compare the weather in Madrid and Reykjavik."}], [AGENTS_SDK_TOOL])
    names = [(t.function.name, json.loads(t.function.arguments)) for t in c2.message.tool_calls or []]
    check(names == [("get_weather", {"city": "Madrid"}), ("get_weather", {"city": "Reykjavik"})],
          "two cities: two parallel calls (Agents SDK strict schema)")

    g = chat([{"role": "user", "content": "Hello!"}], [WEATHER_TOOL])
    check(not g.message.tool_calls and bool(g.message.content) and g.finish_reason == "stop",
          "greeting: plain content, no tool calls")
    n = chat([{"role": "user", "content": "What is your name?"}])
    check(not n.message.tool_calls and bool(n.message.content), "no tools: plain answer")

    if tc is not None:
        follow = [sysmsg, q, {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
                  {"role": "tool", "tool_call_id": tc.id, "content": "light rain, 14 C"}]
        f = chat(follow, [WEATHER_TOOL, ADD_TOOL])
        check(not f.message.tool_calls and "light rain, 14 C" in (f.message.content or ""),
              "follow-up: content contains the tool result")

    # Streamed: tool call deltas assemble to the same call.
    stream = client.chat.completions.create(model=model, messages=[sysmsg, q], tools=[WEATHER_TOOL, ADD_TOOL],
                                            temperature=0, max_tokens=200, stream=True)
    calls: dict[int, list[str]] = {}  # index -> [name, arguments text]
    finish, reasoning_parts = None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        r = getattr(d, "reasoning", None) or getattr(d, "reasoning_content", None)
        if r:
            reasoning_parts.append(r)
        for t in d.tool_calls or []:
            slot = calls.setdefault(t.index, ["", ""])
            if t.function and t.function.name:
                slot[0] = t.function.name
            if t.function and t.function.arguments:
                slot[1] += t.function.arguments
        finish = ch.finish_reason or finish
    print(json.dumps({"stream_calls": calls, "finish": finish, "stream_reasoning": "".join(reasoning_parts)}))
    try:
        got = [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())]
    except ValueError:
        got = None
    check(got == [("get_weather", {"city": "Buenos Aires"})] and finish == "tool_calls",
          "streamed: the same tool call")
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
