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

from functools import lru_cache

from jinja2 import nodes
from jinja2.exceptions import TemplateSyntaxError

from fdplug.core.model.text.chat_template import CACHED_SOURCE_CHARS, parse_template


def reads_content_parts(source: str) -> bool:
    """Whether the template loops over a message's content (then it is given the list of parts)."""
    return _reads_content_parts(source) if len(source) <= CACHED_SOURCE_CHARS else _scan(source)


def _scan(source: str) -> bool:
    try:
        tree = parse_template(source)
    except (TemplateSyntaxError, RecursionError, MemoryError):
        return False      # rendering reports the template's fault with its own error
    aliases = {assign.target.name for assign in tree.find_all(nodes.Assign)
               if isinstance(assign.target, nodes.Name) and _is_content(assign.node)}
    for loop in tree.find_all(nodes.For):
        target = loop.iter
        if _is_content(target) or (isinstance(target, nodes.Name) and target.name in aliases):
            return True
    return False


_reads_content_parts = lru_cache(maxsize=32)(_scan)


@lru_cache(maxsize=32)
def names_developer_role(source: str) -> bool:
    """Whether the template compares a role with ``"developer"`` (OpenAI's newer name of the system
    role): one that does not gets such messages as ``system`` ones. A string constant in its syntax,
    so a comment or a default system prompt that mentions the word does not count."""
    try:
        tree = parse_template(source)
    except (TemplateSyntaxError, RecursionError, MemoryError):
        return False
    return any(const.value == "developer" for const in tree.find_all(nodes.Const))


def _is_content(node: nodes.Node) -> bool:
    """``x['content']`` or ``x.content``, possibly through filters (``message.content | list``)."""
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Getattr) and node.attr == "content"
