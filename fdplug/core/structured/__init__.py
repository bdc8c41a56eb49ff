"""Structured outputs: a request's output held to a JSON schema, a regex, a choice or a grammar
(`grammars`), by masking the logits of the tokens that cannot follow (`fdplug.core.portable.grammar_masks`)."""
