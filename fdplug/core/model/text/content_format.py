"""How a chat template reads a message's content: as one string, or as OpenAI's list of parts.

A text template renders ``message['content']`` as a string, so a list of parts is joined into one
first (text parts with newlines, as vLLM does). A multimodal processor's template instead loops over
the parts and renders each itself: Qwen2.5-VL's writes ``<|vision_start|><|image_pad|><|vision_end|>``
for an image part and a text part's text right after it. Joined into one string, that prompt would
gain a newline token after every picture that transformers' processor (and vLLM) never put there, and
the model would see another prompt than the one it was trained on.

So the format is read from the template's syntax, as vLLM's ``--chat-template-content-format auto``
does: a template with a ``for`` loop over a message's ``content`` (directly, through a filter, or
through a variable set from it) gets the parts; any other gets the string. The parts are vLLM's:
``{"type": "text", "text": ...}``, and ``{"type": "image"}`` / ``{"type": "video"}`` for an item (its
data stays with the request's items; the template only writes the item's placeholder).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from jinja2 import nodes
from jinja2.exceptions import TemplateSyntaxError

from fdplug.core.model.text.chat_template import CACHED_SOURCE_CHARS, parse_template


@dataclass(frozen=True, slots=True)
class TemplateTraits:
    """What the message normalization needs to know of a template, read from one parse of it."""

    reads_content_parts: bool   # loops over a message's content: it is given the list of parts
    names_developer_role: bool  # compares a role with "developer"; else such messages become "system"


def template_traits(source: str) -> TemplateTraits:
    """The template's traits; sources up to CACHED_SOURCE_CHARS parsed once (as they are compiled)."""
    return _cached_traits(source) if len(source) <= CACHED_SOURCE_CHARS else _traits(source)


def reads_content_parts(source: str) -> bool:
    """Whether the template loops over a message's content (then it is given the list of parts)."""
    return template_traits(source).reads_content_parts


def names_developer_role(source: str) -> bool:
    """Whether the template compares a role with ``"developer"`` (OpenAI's newer name of the system
    role): one that does not gets such messages as ``system`` ones. A string constant in its syntax,
    so a comment or a default system prompt that mentions the word does not count."""
    return template_traits(source).names_developer_role


def _traits(source: str) -> TemplateTraits:
    try:
        tree = parse_template(source)
    except (TemplateSyntaxError, RecursionError, MemoryError):
        return TemplateTraits(False, False)   # rendering reports the template's fault with its own error
    aliases = {assign.target.name for assign in tree.find_all(nodes.Assign)
               if isinstance(assign.target, nodes.Name) and _is_content(assign.node)}
    parts = any(_is_content(loop.iter) or (isinstance(loop.iter, nodes.Name) and loop.iter.name in aliases)
                for loop in tree.find_all(nodes.For))
    return TemplateTraits(parts, any(const.value == "developer" for const in tree.find_all(nodes.Const)))


_cached_traits = lru_cache(maxsize=32)(_traits)


def _is_content(node: nodes.Node) -> bool:
    """``x['content']`` or ``x.content``, possibly through filters (``message.content | list``)."""
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Getattr) and node.attr == "content"
