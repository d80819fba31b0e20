"""Writes the recorded raw outputs the tool-call parsers are held to (tests/agentrt/test_toolcall_formats.py):
one JSON line per output, with the calls, content and reasoning it must give, in three formats:

    harmony.jsonl    gpt-oss (--tool-call-parser openai)
    qwen3_xml.jsonl  Qwen3-Coder / Qwen3.5 (--tool-call-parser qwen3_coder)
    gemma3.jsonl     Gemma 3's tool_code / pythonic text (--tool-call-parser gemma3)

Each output is written the way the model writes it (its chat template's spelling, the quirks seen in the
wild: a missing end tag, a recipient in the header's role position, calls inside the thinking), from the
calls it stands for, so the expectations are the calls themselves, never a parser's answer. Kinds: single,
parallel, none, malformed (recoverable), reasoning. Run `python tests/server/data/toolcalls/make_cases.py`
to write the files again (deterministic)."""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather and a forecast.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
                                                     "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "search_docs", "description": "Search the documentation.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"},
                                                     "filters": {"type": "object"}}, "required": ["query"]}}},
    {"type": "function", "function": {"name": "create_event", "description": "Put an event in the calendar.",
     "parameters": {"type": "object", "properties": {"title": {"type": "string"}, "start": {"type": "string"},
                                                     "attendees": {"type": "array", "items": {"type": "string"}},
                                                     "all_day": {"type": "boolean"}}, "required": ["title", "start"]}}},
    {"type": "function", "function": {"name": "set_brightness", "description": "Set the lamp's brightness.",
     "parameters": {"type": "object", "properties": {"level": {"type": "number"}}, "required": ["level"]}}},
    {"type": "function", "function": {"name": "send_message", "description": "Send a chat message.",
     "parameters": {"type": "object", "properties": {"to": {"type": "string"}, "body": {"type": "string"},
                                                     "urgent": {"type": "boolean"}}, "required": ["to", "body"]}}},
    {"type": "function", "function": {"name": "run_sql", "description": "Run a read-only SQL query.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "params": {"type": "array"},
                                                     "limit": {"type": ["integer", "null"]}}, "required": ["query"]}}},
    {"type": "function", "function": {"name": "now", "description": "The current time.",
     "parameters": {"type": "object", "properties": {}}}},
]

# calls as (name, arguments): unicode, newlines, nested JSON, numbers of every kind, strings that look like numbers
CALLS = [
    ("get_weather", {"city": "Paris"}),
    ("get_weather", {"city": "Zürich", "unit": "c", "days": 3}),
    ("get_weather", {"city": "東京", "unit": "f"}),
    ("get_weather", {"city": "São Paulo", "days": 0}),
    ("search_docs", {"query": "paged attention block size", "top_k": 5}),
    ("search_docs", {"query": "kv \"cache\" eviction", "filters": {"year": {"gte": 2020}, "tags": ["llm", "serving"]}}),
    ("search_docs", {"query": "naïve café → résumé", "top_k": 12, "filters": {"lang": "fr", "exact": True}}),
    ("create_event", {"title": "Stand-up 🚀", "start": "2025-03-04T09:30:00+01:00", "attendees": ["ana@x.io", "bo@y.org"]}),
    ("create_event", {"title": "2024", "start": "tomorrow", "all_day": True}),
    ("create_event", {"title": "Review: Q3 <draft>", "start": "2025-10-01", "attendees": [], "all_day": False}),
    ("set_brightness", {"level": 0.75}),
    ("set_brightness", {"level": 40}),
    ("set_brightness", {"level": -1.5e-3}),
    ("send_message", {"to": "@maria", "body": "Running late,\nstart without me.\n\n— J"}),
    ("send_message", {"to": "ops", "body": "disk at 91% on db-2", "urgent": True}),
    ("send_message", {"to": "李雷", "body": "你好！明天见。", "urgent": False}),
    ("run_sql", {"query": "SELECT name, total FROM orders WHERE total > ? AND city = ?", "params": [100, "Oslo"]}),
    ("run_sql", {"query": "SELECT 1", "params": [], "limit": None}),
    ("run_sql", {"query": "SELECT *\nFROM t\nWHERE a < 3 AND b <> 'x'", "params": [[1, 2], {"k": "v"}], "limit": 10}),
    ("now", {}),
]

PREAMBLES = ["Let me check that.", "Sure — looking it up now.", "I'll do both at once.", "One moment.",
             "Je vérifie.", "好的，我来查一下。"]
ANSWERS = [
    "It is 18 °C and sunny in Paris.",
    "The function `get_weather` needs a city; which one do you mean?",
    "Here is the query:\n\n```sql\nSELECT * FROM orders;\n```",
    "[1] Vaswani et al., 2017.",
    "You could call search_docs(query=\"x\") yourself, but I already know: use 16-token blocks.",
    "To use a tool, write <tool_call> tags — but no tool is needed here: 2 + 2 = 4.",
    "{\"note\": \"this is JSON in an answer, not a call\"}",
    "Done. 🎉 Nothing else to do.",
    "   Leading spaces and a trailing newline.\n",
    "Line one\nLine two\n\nLine four with <angle> brackets & ampersands.",
]
THOUGHTS = [
    "The user wants the weather. I should call get_weather.",
    "Need two lookups; do them in parallel.\nFirst the docs, then the message.",
    "Hmm, 3 * 7 = 21. No tool needed.",
    "They wrote in Japanese: 天気. Use the city 東京.",
    "Check constraints: level must be within 0..1? Not stated. Use 0.75.",
]


def record(fmt: str, kind: str, i: int, text: str, calls: list, content: str | None, reasoning: str | None = None,
           reasoning_parser: str | None = None, thinking: bool = False) -> dict:
    return {"id": f"{fmt}-{kind}-{i:02d}", "kind": kind, "text": text, "reasoning_parser": reasoning_parser,
            "thinking": thinking, "expect": {"calls": [{"name": n, "arguments": a} for n, a in calls],
                                             "content": content, "reasoning": reasoning}}


# --- harmony -------------------------------------------------------------------------------------------
def h_call(name: str, args: dict, style: int, first: bool) -> str:
    body = json.dumps(args, ensure_ascii=style % 2 == 0, separators=(",", ":") if style % 3 == 0 else None)
    start = "" if first else "<|start|>assistant"
    if style % 4 == 0:  # the recipient after the channel, with <|constrain|> (what gpt-oss writes most)
        return f"{start}<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{body}"
    if style % 4 == 1:  # the recipient in the role position, as the chat template renders past calls
        return f"{start} to=functions.{name}<|channel|>commentary json<|message|>{body}"
    if style % 4 == 2:
        return f"{start}<|channel|>commentary to=functions.{name} json<|message|>{body}"
    return f"{start}<|channel|>commentary to=functions.{name}<|message|>{body}"


def h_msg(channel: str, text: str, first: bool, end: str = "<|end|>") -> str:
    return f"{'' if first else '<|start|>assistant'}<|channel|>{channel}<|message|>{text}{end}"


def harmony(rng: random.Random) -> list[dict]:
    out = []
    for i in range(14):  # single: a call, after thinking or a preamble or nothing
        name, args = CALLS[i % len(CALLS)]
        lead, reasoning, content = "", None, None
        if i % 3 == 0:
            reasoning = THOUGHTS[i % len(THOUGHTS)]
            lead = h_msg("analysis", reasoning, True)
        elif i % 3 == 1:
            content = PREAMBLES[i % len(PREAMBLES)]
            lead = h_msg("commentary", content, True)
        text = lead + h_call(name, args, i, not lead) + ("<|call|>" if i % 5 == 0 else "")  # stop text kept
        out.append(record("harmony", "single", i, text, [(name, args)], content, reasoning))
    for i in range(10):  # parallel: several calls in one output (the model did not stop at <|call|>)
        picks = rng.sample(CALLS, 2 + i % 2)
        text = h_msg("analysis", THOUGHTS[1], True) if i % 2 else ""
        for k, (name, args) in enumerate(picks):
            text += h_call(name, args, i + k, not text) + "<|call|>"
        out.append(record("harmony", "parallel", i, text, picks, None, THOUGHTS[1] if i % 2 else None))
    for i in range(10):  # none: an answer, with or without thinking
        answer = ANSWERS[i]
        if i % 3 == 0:
            text, reasoning = h_msg("analysis", THOUGHTS[2], True) + h_msg("final", answer, False, ""), THOUGHTS[2]
        elif i % 3 == 1:
            text, reasoning = h_msg("final", answer, True, "<|return|>" if i % 2 else ""), None
        else:
            text = h_msg("analysis", "a", True) + h_msg("analysis", "b", False) + h_msg("final", answer, False)
            reasoning = "a\nb"
        out.append(record("harmony", "none", i, text, [], answer, reasoning))
    malformed = [  # (text, calls, content, reasoning)
        ('<|channel|>analysis<|message|>Think first.<|start|>assistant<|channel|>commentary to=functions.get_weather '
         '<|constrain|>json<|message|>{"city": "Paris"}', [CALLS[0]], None, "Think first."),  # no <|end|>
        ('<|channel|>analysis<|message|>Think.<|end|><|channel|>commentary to=functions.now <|constrain|>json'
         '<|message|>{}', [CALLS[-1]], None, "Think."),  # no <|start|>assistant between messages
        ('<|channel|>commentary to=functions.set_brightness <|constrain|>json<|message|>\n  {"level": 40}  \n',
         [CALLS[11]], None, None),  # whitespace around the arguments
        ('<|channel|>commentary to=functions.now json<|message|><|call|>', [CALLS[-1]], None, None),  # empty body
        ('<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Paris"}}<|call|>',
         [CALLS[0]], None, None),  # a stray brace after the object
        ('<|channel|>final<|message|>Partial answer, cut', [], "Partial answer, cut", None),  # no <|return|>
        ('<|channel|>analysis<|message|>Cut short while thinking', [], None, "Cut short while thinking"),
        ('<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary to=functions.get_wea',
         [], None, "x"),  # cut in a header: dropped
        ('Plain text with no harmony markup at all.', [], "Plain text with no harmony markup at all.", None),
        ('<|channel|>analysis<|message|>Use the browser.<|end|><|start|>assistant<|channel|>analysis to=browser.search '
         'code<|message|>{"query": "vllm"}<|call|>', [], None, 'Use the browser.\n{"query": "vllm"}'),  # built-in tool
        ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par',
         [], None, '{"city": "Par'),  # arguments cut short: not a call, kept as reasoning
        ('<|channel|>commentary to=functions.unknown_tool json<|message|>{"a": 1}', [], None, '{"a": 1}'),
    ]
    for i, (text, calls, content, reasoning) in enumerate(malformed):
        out.append(record("harmony", "malformed", i, text, calls, content, reasoning))
    for i in range(8):  # reasoning: calls written in the analysis channel, and the openai_gptoss reasoning parser
        name, args = CALLS[(3 * i + 1) % len(CALLS)]
        thought = THOUGHTS[i % len(THOUGHTS)]
        body = json.dumps(args, ensure_ascii=False)
        text = (h_msg("analysis", thought, True) +
                f"<|start|>assistant<|channel|>analysis to=functions.{name} code<|message|>{body}<|call|>")
        if i % 2:
            text = f"<|channel|>analysis to=functions.{name} <|constrain|>json<|message|>{body}"
            thought = None
        out.append(record("harmony", "reasoning", i, text, [(name, args)], None, thought,
                          reasoning_parser="openai_gptoss" if i % 3 else None))
    return out


# --- Qwen3-Coder / Qwen3.5 XML --------------------------------------------------------------------------
def x_value(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value, ensure_ascii=False)


def x_call(name: str, args: dict, style: int, wrap: bool = True) -> str:
    nl = "" if style % 3 == 2 else "\n"  # compact, as some fine-tunes write it
    params = "".join(f"<parameter={k}>{nl}{x_value(v)}{nl}</parameter>{nl}" for k, v in args.items())
    call = f"<function={name}>{nl}{params}</function>"
    return f"<tool_call>{nl}{call}{nl}</tool_call>" if wrap else call


def qwen3_xml(rng: random.Random) -> list[dict]:
    out = []
    for i in range(14):
        name, args = CALLS[(i * 7) % len(CALLS)]
        content = PREAMBLES[i % len(PREAMBLES)] if i % 2 else None
        text = (content + "\n\n" if content else "") + x_call(name, args, i)
        out.append(record("qwen3_xml", "single", i, text, [(name, args)], content))
    for i in range(10):
        picks = rng.sample(CALLS, 2 + i % 3)
        text = ("\n".join(x_call(n, a, i + k) for k, (n, a) in enumerate(picks)))
        content = None
        if i % 3 == 1:
            content = PREAMBLES[2]
            text = content + "\n" + text
        out.append(record("qwen3_xml", "parallel", i, text, picks, content))
    for i in range(10):
        out.append(record("qwen3_xml", "none", i, ANSWERS[i], [], ANSWERS[i]))
    w, s = CALLS[1], CALLS[13]
    malformed = [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n<parameter=unit>\nc\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", [w], None),  # a </parameter> missing
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=unit>\nc\n"
         "</parameter>\n<parameter=days>\n3\n</parameter>\n</tool_call>", [w], None),  # no </function>
        (x_call(*w, 0).removesuffix("\n</tool_call>"), [w], None),  # cut before </tool_call>
        (x_call(*w, 0, wrap=False), [w], None),  # no <tool_call> wrapper (Qwen3.5 does this)
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=unit>\nc\n"
         "</parameter>\n<parameter=days>\n3", [w], None),  # cut short in a value
        ("<tool_call>\n<function=set_brightness>\n<parameter=level>\n 40 \n</parameter>\n</function>\n</tool_call>",
         [CALLS[11]], None),  # spaces around a number
        (x_call(*s, 0) + "\n" + x_call(*CALLS[-1], 1).replace("</tool_call>", ""), [s, CALLS[-1]], None),
        ("<tool_call>\n<function=run_sql>\n<parameter=query>\nSELECT 1\n</parameter>\n<parameter=params>\n[]\n"
         "</parameter>\n<parameter=limit>\nnull\n</parameter>\n</function>\n</tool_call>", [CALLS[17]], None),
        ("<tool_call>\n<function=search_docs>\n<parameter=query>\nnaïve café → résumé\n</parameter>\n"
         "<parameter=top_k>\n12\n</parameter>\n<parameter=filters>\n{'lang': 'fr', 'exact': True}\n</parameter>\n"
         "</function>\n</tool_call>", [CALLS[6]], None),  # a Python dict, not JSON
        ("Done.\n<tool_call>\n<function=now>\n</function>\n</tool_call>\nAnything else?", [CALLS[-1]],
         "Done.\n\nAnything else?"),
    ]
    for i, (text, calls, content) in enumerate(malformed):
        out.append(record("qwen3_xml", "malformed", i, text, calls, content))
    for i in range(10):  # the qwen3 reasoning parser: calls inside the think block and after it
        name, args = CALLS[(5 * i + 2) % len(CALLS)]
        thought = THOUGHTS[i % len(THOUGHTS)]
        call = x_call(name, args, i)
        thinking = i % 2 == 1  # the prompt opened the block (Qwen3.5): the output starts in it
        open_tag = "" if thinking else "<think>\n"
        if i % 3 == 0:  # the call inside the block, never closed (the model stopped after it)
            text, reasoning, content = f"{open_tag}{thought}\n{call}", f"\n{thought}\n" if not thinking else f"{thought}\n", None
        elif i % 3 == 1:  # inside, then the block closes, then an answer
            text = f"{open_tag}{thought}\n{call}\n</think>\n\nCalling it now."
            reasoning, content = (f"\n{thought}\n" if not thinking else f"{thought}\n"), "Calling it now."
        else:  # after the block, as trained
            text = f"{open_tag}{thought}\n</think>\n\n{call}"
            reasoning, content = (f"\n{thought}\n" if not thinking else f"{thought}\n"), None
        out.append(record("qwen3_xml", "reasoning", i, text, [(name, args)], content, reasoning,
                          reasoning_parser="qwen3", thinking=thinking))
    return out


# --- Gemma 3 -------------------------------------------------------------------------------------------
def py_value(value) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if value is None:
        return "None"
    if isinstance(value, list):
        return "[" + ", ".join(py_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {py_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)


def g_call(name: str, args: dict) -> str:
    return f"{name}(" + ", ".join(f"{k}={py_value(v)}" for k, v in args.items()) + ")"


def gemma3(rng: random.Random) -> list[dict]:
    out = []
    for i in range(14):
        name, args = CALLS[(i * 3) % len(CALLS)]
        if i % 3 == 0:
            text, content = f"```tool_code\n{g_call(name, args)}\n```", None
        elif i % 3 == 1:
            content = PREAMBLES[i % len(PREAMBLES)]
            text = f"{content}\n\n```tool_code\n{g_call(name, args)}\n```"
        else:
            text, content = f"[{g_call(name, args)}]", None
        out.append(record("gemma3", "single", i, text, [(name, args)], content))
    for i in range(10):
        picks = rng.sample(CALLS, 2 + i % 2)
        if i % 3 == 0:
            text = "[" + ", ".join(g_call(n, a) for n, a in picks) + "]"
        elif i % 3 == 1:
            text = "```tool_code\n" + "\n".join(g_call(n, a) for n, a in picks) + "\n```"
        else:
            text = "\n".join(f"```tool_code\n{g_call(n, a)}\n```" for n, a in picks)
        out.append(record("gemma3", "parallel", i, text, picks, None))
    nones = [*ANSWERS, "```python\nprint('hello')\n```", "[1, 2, 3] are the first numbers.",
             "```tool_code\nnot a call at all\n```"]
    for i, answer in enumerate(nones):
        out.append(record("gemma3", "none", i, answer, [], answer))
    w = CALLS[2]
    malformed = [
        (f"```tool_code\n{g_call(*w)}", [w], None),  # no closing fence
        (f"```tool_code\nprint({g_call(*w)})\n```", [w], None),  # print(...) as Google's guide writes it
        (f"```tool_code\ndefault_api.{g_call(*w)}\n```", [w], None),  # Gemini's module prefix
        (f"```python\n[{g_call(*w)}]\n```", [w], None),  # a python fence around the list
        (f"```json\n[{g_call(*w)}]\n```", [w], None),  # the fence seen in vLLM issue 14734
        (f"[{g_call(*w)}] I will report back.", [w], "I will report back."),  # text after the list
        (f"  \n[{g_call(*CALLS[18])}]", [CALLS[18]], None),  # leading whitespace, a multi-line string
        (f"```tool_code\n{g_call(*w)}\n```\nThe result will follow.", [w], "The result will follow."),
        (f"[{g_call('now', {})}, {g_call(*CALLS[11])}]", [CALLS[-1], CALLS[11]], None),
        ("```tool_code\nset_brightness(level=true)\n```", [("set_brightness", {"level": True})], None),  # JSON's true
    ]
    for i, (text, calls, content) in enumerate(malformed):
        out.append(record("gemma3", "malformed", i, text, calls, content))
    for i in range(6):  # with a reasoning parser: the call after the thinking, or a tool_code block inside it
        name, args = CALLS[(i * 5 + 4) % len(CALLS)]
        thought = THOUGHTS[i % len(THOUGHTS)]
        block = f"```tool_code\n{g_call(name, args)}\n```"
        if i % 2:
            text, reasoning = f"<think>\n{thought}\n{block}", f"\n{thought}\n"
        else:
            text, reasoning = f"<think>{thought}</think>\n{block}", thought
        out.append(record("gemma3", "reasoning", i, text, [(name, args)], None, reasoning, reasoning_parser="qwen3"))
    return out


def main() -> None:
    (HERE / "tools.json").write_text(json.dumps(TOOLS, indent=1, ensure_ascii=False) + "\n")
    for name, make in [("harmony", harmony), ("qwen3_xml", qwen3_xml), ("gemma3", gemma3)]:
        rows = make(random.Random(49))
        with open(HERE / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(name, len(rows))


if __name__ == "__main__":
    main()
