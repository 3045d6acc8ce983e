#!/usr/bin/python3
"""Renders the Qwen3 chat_template of tokenizer_config.json with Debian's python3-jinja2 (the
environment transformers' apply_chat_template uses: sandboxed, trim_blocks, lstrip_blocks,
loopcontrols) on a fixed set of conversations, for tests/test_chat.cpp.

Usage: /usr/bin/python3 scripts/tokenizer/render_chat.py [TOKENIZER_CONFIG_JSON] [OUT_JSONL]
Output: one {"messages", "add_generation_prompt", "enable_thinking" (null = not passed), "text"}
per line.
"""
import json
import os
import sys

import jinja2
import jinja2.ext
import jinja2.sandbox

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../..")
CONFIG = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "third_party/qwen3-tokenizer/tokenizer_config.json")
OUT = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "tests/data/tokenizer/chat_qwen3.jsonl")


def u(c):
    return {"role": "user", "content": c}


def a(c, r=None):
    m = {"role": "assistant", "content": c}
    if r is not None:
        m["reasoning_content"] = r
    return m


def s(c):
    return {"role": "system", "content": c}


def t(c):
    return {"role": "tool", "content": c}


CONVERSATIONS = [
    [u("Hello!")],
    [s("You are a helpful assistant."), u("What is 2+2?")],
    [s("Be terse."), u("Hi"), a("Hello."), u("How are you?")],
    [u("Tell me a joke."), a("Why did the chicken cross the road?", "The user wants a joke.\nPick a classic."), u("Another one")],
    [u("Solve x+1=2"), a("x = 1", "Subtract 1 from both sides.")],
    [u("Explain"), a("<think>\nLet me think.\n</think>\n\nIt is simple.")],
    [u("Q1"), a("<think>\nfirst\n</think>\n\nA1"), u("Q2"), a("<think>\nsecond\n</think>\n\nA2")],
    [u("Use the tool"), a("Calling it."), t('{"result": 42}'), t('{"result": 43}'), a("The results are 42 and 43.")],
    [u("Start"), a("Let me check.", "I need a tool."), u("<tool_response>\nok\n</tool_response>"), a("Done", "The tool said ok.")],
    [s("sys one"), u("hi"), s("sys two"), u("again")],
    [u("")],
    [u("  leading and trailing spaces  \n\n")],
    [u("Unicode: café 中文 😀 עברית"), a("Noted: ünïcödé ✓")],
    [u("multi\nline\n\ntext"), a("\n\nanswer after blank lines")],
    [u("q"), a("answer", "")],
    [u("q"), a("answer", "\n\nreasoning wrapped in newlines\n\n")],
    [s("You are Qwen."), u("a"), a("b", "r1"), u("c"), a("d", "r2"), u("e")],
    [u("code please"), a("```python\nprint('hi')\n```", "Write a print.")],
    [u("Think about </think> tags"), a("plain text with no tags")],
    [u("x"), a("before</think>after")],
    [u("x"), a("<think>only open tag")],
    [t("orphan tool output")],
    [u("weather?"), a("", "Need the weather tool."), t("sunny"), a("It is sunny.", "Tool said sunny.")],
    [s("only a system message")],
    [s("sys"), u("u1"), a("a1"), u("u2"), a("a2", "r2")],
    [u("u"), a("a", "r"), a("second assistant turn in a row", "r2")],
    [u("<tool_response>\nx\n</tool_response>")],
    [u("q"), a("a"), t("t1"), u("q2")],
    [u("Tabs\tand\r\nCRLF"), a("ok\r\n")],
    [u("emoji 👨‍👩‍👧‍👦 flags 🇯🇵"), a("🎉", "celebrate")],
    [u("long " * 50)],
]
OPTIONS = [(True, None), (True, False), (False, None), (True, True)]


def main():
    with open(CONFIG, encoding="utf-8") as f:
        template = json.load(f)["chat_template"]
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    tmpl = env.from_string(template)
    n = 0
    with open(OUT, "w", encoding="utf-8") as out:
        for ci, conv in enumerate(CONVERSATIONS):
            for oi, (agp, think) in enumerate(OPTIONS):
                # Every conversation with the default options; the others for every third one.
                if oi > 0 and ci % 3 != oi - 1 and ci % 3 != 2:
                    continue
                kwargs = {"messages": conv, "add_generation_prompt": agp}
                if think is not None:
                    kwargs["enable_thinking"] = think
                text = tmpl.render(**kwargs)
                rec = {"messages": conv, "add_generation_prompt": agp, "enable_thinking": think, "text": text}
                out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                n += 1
    print(f"{n} renderings written to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
