"""A request's constraint (`SamplingParams.structured_outputs`) as a grammar, compiled for the model's vocabulary.

The engine is llguidance (MIT; no torch, no transformers): it compiles a JSON schema, a regex, a
choice or a Lark / GBNF grammar in about a millisecond, bounded by its parser limits (a schema too
large or too deep is an error, never a stall), and computes a token mask without holding the GIL.
One compiled matcher per distinct constraint is kept (`GrammarCompiler.matcher`), and each request
gets a copy of it (a microsecond). A constraint that does not compile is a 400 naming what is wrong;
JSON is compact (no free whitespace between tokens, so a model cannot pad forever).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from fdplug.core.structured.schema_check import check_schema
from fdplug.errors import InvalidRequestError

CACHED_GRAMMARS = 256
_JSON_OPTIONS = {"whitespace_flexible": False, "lenient": True}   # compact; unknown formats and
# unsupported regex features in a schema are ignored, not refused (tool schemas are written for any engine)


def grammar_text(kind: str, spec: str) -> str:
    """``(kind, spec)`` of `SamplingParams.structured_outputs` -> the llguidance grammar (its JSON text)."""
    import llguidance as llg

    matcher = llg.LLMatcher
    if kind == "json":
        schema = json.loads(spec)
        check_schema(schema)
        return matcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(spec)
    if kind == "choice":
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec)))
    return llg.grammar_from("grammar", spec)      # Lark or llama.cpp's GBNF


class GrammarCompiler:
    """The model's vocabulary for llguidance, and the compiled constraints of this process."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance as llg

        self.llg = llg
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self._templates: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, kind: str, spec: str) -> Any:
        """A fresh matcher for the constraint; an InvalidRequestError (400) if it does not compile."""
        key = (kind, spec)
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return template.deep_copy()
        try:
            grammar = grammar_text(kind, spec)
        except (ValueError, TypeError) as exc:
            raise _invalid(kind, str(exc)) from None
        template = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0,
                                      limits=self.llg.LLParserLimits(verbose_errors=False))
        if template.is_error():
            raise _invalid(kind, template.get_error())
        with self._lock:
            self._templates[key] = template
            while len(self._templates) > CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        return template.deep_copy()


def _invalid(kind: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"the {kind} constraint of structured_outputs does not compile: {why[:300]}",
                               fix="send a valid JSON schema, regex, choice list or Lark grammar.",
                               param="structured_outputs")


_compilers: dict[tuple[str, int], GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(model_dir: str, vocab_size: int) -> GrammarCompiler:
    """This process's compiler for a model (built on first use: reading the vocabulary takes ~0.2 s).

    Its end-of-sequence tokens are the ones a request stops on: the model config's, else the
    tokenizer's (as `fdplug.LLM` and the server pick them)."""
    key = (str(model_dir), vocab_size)
    with _compilers_lock:
        if key not in _compilers:
            from tokenizers import Tokenizer as HFTokenizer

            from fdplug.core.model.checkpoint.config import ModelConfig
            from fdplug.core.model.text.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_dir(Path(model_dir))
            eos_token_ids = ModelConfig.from_dir(model_dir).eos_token_ids or tokenizer.eos_token_ids
            backend = HFTokenizer.from_str(tokenizer.backend.to_str())
            backend.no_padding()
            backend.no_truncation()
            _compilers[key] = GrammarCompiler(backend.to_str(), vocab_size, list(eos_token_ids))
        return _compilers[key]
