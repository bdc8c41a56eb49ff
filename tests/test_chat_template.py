"""The chat-template renderer: the same output as Jinja's own sandbox, and a bound on every kind of work."""

from __future__ import annotations

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fdplug.core.model.text import chat_template, content_format, template_budget
from fdplug.core.model.text.chat_messages import normalize_messages
from fdplug.core.model.text.chat_template import render_template
from fdplug.errors import InvalidRequestError

# Everything a real chat template does: loops with loop variables, a recursive loop, macros, a
# namespace, filters (map, select, join, tojson, trim, indent, center, replace, format, truncate),
# string methods, `~`, `+`, `*`, `%`, str.format, and a call block.
RICH = """{%- macro show(m) -%}[{{ m.role|upper }}:{{ m.content|trim }}]{%- endmacro -%}
{%- macro boxed(tag) -%}<{{ tag }}>{{ caller() }}</{{ tag }}>{%- endmacro -%}
{%- set ns = namespace(last_user=-1, text='') -%}
{%- for m in messages -%}
  {%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif -%}
  {{ loop.index }}/{{ loop.length }}{{ ' last' if loop.last }} {{ show(m) }}
  {%- set ns.text = ns.text ~ m.content[:3] -%}
{%- endfor %}
{{ ns.last_user }} {{ ns.text }} {{ messages|map(attribute='role')|join(',') }}
{{ messages|selectattr('role', 'equalto', 'user')|list|length }} {{ tools|tojson }}
{% for item in tree recursive %}({{ item.name }}{% if item.children %}{{ loop(item.children) }}{% endif %}){% endfor %}
{{ '%-6s|%3d' % ('ab', 7) }} {{ '{:>5}|{}'.format('x', 3) }} {{ '-' * 5 + '=' * 3 }} {{ 'a,b'.split(',') }}
{{ 'hello'|center(11) }}|{{ 'x\ny'|indent(2) }}|{{ 'aaa'|replace('a', 'bb') }}|{{ '%s-%s'|format(1, 2) }}
{{ 'long text here'|truncate(9, True, '...', 0) }} {{ 'Hi'.ljust(4) }}| {{ (3 ** 4) // 2 }} {{ range(3)|sum }}
{%- call boxed('b') %}{{ show({'role': 'x', 'content': ' y '}) }}{% endcall %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""

CONTEXT = {
    "messages": [{"role": "system", "content": " be brief "}, {"role": "user", "content": "hello there"},
                 {"role": "assistant", "content": "hi"}, {"role": "user", "content": "bye"}],
    "tools": [{"name": "f", "args": [1, 2]}], "add_generation_prompt": True,
    "tree": [{"name": "a", "children": [{"name": "b", "children": []}, {"name": "c", "children": [
        {"name": "d", "children": []}]}]}],
}


def plain(source: str, context: dict) -> str:
    """Jinja's sandbox with transformers' settings and ``tojson``, unmetered."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = chat_template._tojson
    return env.from_string(source).render(**context)


def test_metering_changes_nothing_a_template_renders():
    assert render_template(RICH, CONTEXT) == plain(RICH, CONTEXT)


@pytest.mark.parametrize("source, says", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "operations"),
    ("{% for i in range(100000) recursive %}{{ loop(range(100000)) if loop.depth < 3 }}{% endfor %}",
     "work budget"),                                # operations or time, whichever runs out first
    ("{% macro f(n) %}{% for i in range(1000) %}{{ i }}{% endfor %}{{ f(n) if n < 5000 }}{% endmacro %}{{ f(1) }}",
     "RecursionError"),                             # Python's recursion limit: ~160k operations, 0.1 s
    ("{{ 'x' * 10**10 }}", "a value of 1 x 10000000000 items"),
    ("{{ [1, 2] * 10**9 }}", "items"),
    ("{{ 2 ** (10**9) }}", "integer power"),
    ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}", "integer"),
    ("{{ 'a'.ljust(10**9) }}", "a width of 1000000000"),
    ("{{ 'a'.zfill(10**9) }}", "a width"),
    ("{{ 'a\\tb'.expandtabs(10**9) }}", "expanded tabs"),
    ("{{ 'a'|center(10**9) }}", "a width"),
    ("{{ 'a'|indent(10**9) }}", "an indent"),
    ("{{ 'a'|wordwrap(10**9) }}", "a width"),
    ("{{ range(10)|batch(10**9, 'x')|list }}", "a batch size"),
    ("{{ '%0999999999d' % 1 }}", "a format width"),
    ("{{ '%*d' % (10**9, 1) }}", "'*' width"),
    ("{{ '{:>999999999}'.format(1) }}", "a format width"),
    ("{{ '{:{w}}'.format(1, w=10**9) }}", "nested field"),
    ("{{ '%0999999999d'|format(1) }}", "a format width"),
    ("{{ ('a' * 100000)|replace('a', 'a' * 1000) }}", "replace() result"),
    ("{{ ('a' * 100000).replace('a', 'a' * 1000) }}", "replace() result"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "characters"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "characters"),
    ("{% set s = 'x' * 1000000 %}{{ ([s] * 40)|join }}", "joined string"),
    ("{% set s = 'x' * 1000000 %}{{ ''.join([s] * 40) }}", "joined string"),
    ("{% for i in range(40) %}{{ 'x' * 1000000 }}{% endfor %}", "output"),
    ("{{ x|tojson(indent=10**9) }}", "an indent"),
    ("{% set big = 'y' * 100 %}{{ ([big] * 1000000)|tojson }}", "print as more than"),
    ("{% set big = 'y' * 100 %}{{ [big] * 1000000 }}", "print as more than"),
    ("{{ (range(100000)|list)|tojson(indent=1000) }}", "a JSON text"),
    # found in review: bodies joined by Jinja itself, repeated fields, bytes
    ("{% set big = 'y' * 30000000 %}{% set y %}{% for i in range(1000) %}{{ big }}{% endfor %}{% endset %}",
     "joined string"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s %}{{ ns.s }}{{ ns.s }}{% endset %}"
     "{% endfor %}", "characters"),
    ("{% macro twice(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='ab') %}"
     "{% for i in range(40) %}{% set ns.s = twice(ns.s) %}{% endfor %}", "characters"),
    ("{{ 'a'.encode() * 10**10 }}", "items"),
    ("{% set x = 'a' * 30000000 %}{{ ('%s' * 1000) % ((x,) * 1000) }}", "a formatted string"),
    ("{% set x = 'a' * 30000000 %}{{ ('%(a)s' * 1000) % {'a': x} }}", "a formatted string"),
    ("{% set x = 'a' * 30000000 %}{{ ('{0}' * 1000).format(x) }}", "a formatted string"),
    ("{% set x = 'a' * 30000000 %}{{ ('%s' * 1000)|format(*((x,) * 1000)) }}", "a formatted string"),
    ("{{ ('%1000000s' * 1000) % ((1,) * 1000) }}", "a formatted string"),
    ("{{ ('x\n' * 1000000)|indent(100) }}", "an indent of all lines"),
    ("{{ ('a' * 1000000).translate({97: 'b' * 1000}) }}", "a translated string"),
    ("{{ ('a ' * 15000000).split() }}", "a split"),
    ("{{ ('a' * 30000000)|list }}", "a list of characters"),
    ("{{ " + "(" * 2000 + "1" + ")" * 2000 + " }}", "could not be compiled"),
    ("{% if 1 %}" * 1000 + "{% endif %}" * 1000, "could not be compiled"),
    ("{{ [x] * 2000000 }}", "items"),
    ("{% set ns = namespace(l=['ab']) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
     "print as more than"),
    ("{% set ns = namespace(l=['ab']) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
     "{{ ns.l|string }}", "print as more than"),
    ("{% set ns = namespace(l=['ab']) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
     "{{ 'x' ~ ns.l }}", "characters"),
    ("{% set ns = namespace(l=['ab']) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
     "{{ '%s' % [ns.l] }}", "a formatted string"),
    ("{% set ns = namespace(l=['ab']) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
     "{{ '{}'.format(ns.l) }}", "a formatted string"),
    ("{% set ns = namespace(l=['ab']) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
     "{{ [ns.l]|join }}", "joined string"),
    ("{% set ns = namespace(l=[1]) %}{% for i in range(30) %}{% set ns.l = ns.l + ns.l %}{% endfor %}", "items"),
])
def test_every_kind_of_runaway_work_is_a_400(source, says):
    with pytest.raises(InvalidRequestError) as info:
        render_template(source, {"x": [1, [2]]})
    assert info.value.http_status == 400 and says in info.value.message, info.value.message


def test_percent_and_braces_are_told_apart():
    """JSON-looking text in a ``%`` format is not a ``str.format`` field (found in review)."""
    for source in ("""{{ '{"name": "%s", "args": {"x": 1}}' % fn }}""",
                   """{{ '{"limit": 5000000, "f": "%s"}'|format(fn) }}""",
                   "{{ '{}/{:>3}'.format(fn, 7) }}", "{{ '{a}'.format_map({'a': fn}) }}"):
        assert render_template(source, {"fn": "f"}) == plain(source, {"fn": "f"})


def test_the_budget_is_per_render(monkeypatch):
    monkeypatch.setattr(template_budget, "MAX_OPERATIONS", 3000)
    source = "{% for i in range(1000) %}{{ i|string }}{% endfor %}"    # ~2000 operations
    expected = "".join(map(str, range(1000)))
    assert render_template(source, {}) == expected
    assert render_template(source, {}) == expected      # the second starts afresh
    with pytest.raises(InvalidRequestError, match="operations"):
        render_template("{% for i in range(2000) %}{{ i|string }}{% endfor %}", {})


def test_a_render_past_its_time_limit_stops(monkeypatch):
    monkeypatch.setattr(template_budget, "TIMEOUT_S", 0.0)
    with pytest.raises(InvalidRequestError, match="more than 0 s"):
        render_template("{% for i in range(5000) %}{% endfor %}", {})


def test_python_internals_stay_out_of_reach():
    for source in ("{{ ''.__class__ }}", "{{ x.__init__ }}", "{{ cycler.__init__.__globals__ }}"):
        with pytest.raises(InvalidRequestError, match="sandbox forbids|rendering the chat template failed"):
            render_template(source, {"x": 1})


@pytest.mark.parametrize("source, parts", [
    ("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% for p in m.content | selectattr('type', 'eq', 'text') %}{% endfor %}{% endfor %}",
     True),
    ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", False),                  # a string template
    ("{% for m in messages %}{% for x in m['tool_calls'] %}{% endfor %}{{ m.content }}{% endfor %}", False),
    ("{% set c = messages[0]['content'] %}{% for m in messages %}{{ c }}{% endfor %}", False),
    ("{% for p in m['content'] %", False),                       # not Jinja: rendering says so, not this
])
def test_the_content_format_is_read_from_the_template(source, parts):
    """A template that loops over a message's content gets the list of parts (content_format.py)."""
    assert content_format.reads_content_parts(source) is parts


def test_the_developer_role_is_read_from_the_template():
    assert content_format.names_developer_role("{% if m.role == 'developer' %}x{% endif %}")
    assert not content_format.names_developer_role("{# developer #}{{ 'Be a developer.' }}x")


def test_a_parts_reading_template_gets_text_and_item_parts():
    recorded = []
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}},
                                             {"type": "video_feature", "video_feature": {}}]},
                {"role": "assistant", "content": "b"}]

    def handler(part, index):
        recorded.append((part["type"], index))
        return "<pad>"

    got = normalize_messages(messages, handler, content_parts=True)
    assert got[0]["content"] == [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "video"}]
    assert got[1]["content"] == "b" and recorded == [("image_url", 0), ("video_feature", 0)]
    assert normalize_messages(messages, handler)[0]["content"] == "a\n<pad>\n<pad>"
    with pytest.raises(InvalidRequestError, match="text part without a text string"):
        normalize_messages([{"role": "user", "content": [{"type": "text"}]}], content_parts=True)


CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("text, want", [
    ("end", "<|im_start|>assistant\nend"),              # also inside "<|im_end|>": cut after the message's own
    ("  The answer is", "<|im_start|>assistant\nThe answer is"),   # the template trims it
    ("<|im_start|>", "<|im_start|>assistant\n<|im_start|>"),
])
def test_continue_final_message_cuts_after_the_last_messages_text(text, want):
    from fdplug.core.model.text.tokenizer import Tokenizer
    from fdplug.demo import DEMO_MODEL_DIR

    tokenizer = Tokenizer.from_dir(str(DEMO_MODEL_DIR))
    messages = [{"role": "user", "content": "Say end"}, {"role": "assistant", "content": text}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False, chat_template=CHATML,
                                           continue_final_message=True)
    assert prompt == "<|im_start|>user\nSay end<|im_end|>\n" + want
    parts = [{**messages[0]}, {"role": "assistant", "content": [{"type": "text", "text": text}]}]
    parts_template = CHATML.replace("{{ m['content'] | trim }}",
                                    "{% for p in m['content'] %}{{ p['text'] | trim }}{% endfor %}")
    assert tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "Say end"}]},
                                          parts[1]], add_generation_prompt=False, chat_template=parts_template,
                                         continue_final_message=True).endswith(want)
    with pytest.raises(InvalidRequestError, match="not in the prompt"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
                                      add_generation_prompt=False, continue_final_message=True,
                                      chat_template="{% for m in messages %}{{ m['role'] }}{% endfor %}")
