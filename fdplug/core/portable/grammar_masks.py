"""The runner's side of structured outputs: one matcher per constrained request, a mask per step.

A request with ``structured_outputs`` gets a matcher when the runner takes it (a copy of the
compiled constraint, `fdplug.core.structured.grammars`), advanced over the tokens it already has
(a request resumed after preemption, or rebuilt after a failed step, replays them), and over each
token it samples. A step's masks are computed on a worker thread while the model runs (llguidance
releases the GIL) and applied to the logits of the constrained rows only: a row without a
constraint is never touched, so its tokens are the same with or without constrained neighbours.
A batch without constrained requests costs one dict lookup per step.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from fdplug.errors import RequestStepError

logger = logging.getLogger("fdplug")

MASK_TIMEOUT_S = 30.0     # a mask is microseconds; this only bounds a wait that must not hang a step
PROMPT_TAIL = 16          # a gate in the prompt's last tokens opens it (thinking switched off by the template)


class GrammarMasks:
    """Matchers of the constrained requests of one runner, by request id."""

    def __init__(self, compiler: Any) -> None:
        """``compiler``: a function returning this model's `GrammarCompiler` (built on first use)."""
        self._compiler = compiler
        self.matchers: dict[str, Any] = {}
        self.gated: dict[str, tuple[tuple[int, ...], list[int]]] = {}   # not yet past their gate: (gate, last tokens)
        self._pool: ThreadPoolExecutor | None = None
        self._pending_ids: list[str] = []     # the constrained requests of the masks under way

    def add(self, req_id: str, structured: tuple[str, str], output_token_ids: list[int],
            prompt_token_ids: list[int] = (), gate: tuple[int, ...] = ()) -> None:
        """A matcher for a request the runner takes, advanced over what it generated already.

        ``gate`` (`SamplingParams.reasoning_end_token_ids`): the constraint holds only what follows
        these tokens (a thinking model's answer after ``</think>``); already open when the prompt's
        last tokens hold them (a template that closed an empty reasoning: thinking switched off)."""
        matcher = self._compiler().matcher(*structured)
        start = 0 if not gate or _ends_within(list(prompt_token_ids[-PROMPT_TAIL:]), gate) else None
        for i in range(len(output_token_ids)):
            if start is None:
                if _ends_with(output_token_ids, i + 1, gate):
                    start = i + 1
                continue
            if not matcher.consume_token(int(output_token_ids[i])):
                logger.warning("request %s has a token outside its constraint; it goes on unconstrained", req_id)
                return      # as `accept` does: the request goes on, not held (live and replay agree)
        self.matchers[req_id] = matcher
        if start is None:
            self.gated[req_id] = (gate, list(output_token_ids[-len(gate):]))

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self.gated.pop(req_id, None)

    def clear(self) -> None:
        self.matchers.clear()
        self.gated.clear()

    def start(self, sampling_req_ids: list[str]) -> Future | None:
        """Begin this step's masks (rows of the sampled requests that are constrained); None if none is."""
        if not self.matchers:
            return None
        rows = [(i, self.matchers[rid]) for i, rid in enumerate(sampling_req_ids)
                if rid in self.matchers and rid not in self.gated]
        if not rows:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fdplug-grammar")
        self._pending_ids = [sampling_req_ids[i] for i, _ in rows]
        return self._pool.submit(self._fill, rows)

    def _fill(self, rows: list[tuple[int, Any]]) -> tuple[np.ndarray, np.ndarray]:
        import llguidance.numpy as lnp

        compiler = self._compiler()
        bitmask = lnp.allocate_token_bitmask(len(rows), compiler.tokenizer.vocab_size)
        for k, (_, matcher) in enumerate(rows):
            lnp.fill_next_token_bitmask(matcher, bitmask, k)
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")
        return np.fromiter((i for i, _ in rows), dtype=np.int64), allowed.view(bool)

    def apply(self, pending: Future | None, logits: Any, paddle: Any) -> Any:
        """``logits`` with every token a constrained row's grammar forbids at -inf."""
        if pending is None:
            return logits
        try:
            rows, allowed = pending.result(timeout=MASK_TIMEOUT_S)
        except Exception as exc:   # noqa: BLE001 -- a mask that failed or hung fails its requests, not the step
            if isinstance(exc, TimeoutError):
                self._pool = None      # the hung thread keeps the old pool; later steps get a fresh one
            blamed = list(self._pending_ids)
            raise RequestStepError(blamed, f"its structured_outputs mask failed ({type(exc).__name__})") from exc
        width = int(logits.shape[1])
        mask = np.zeros((len(rows), width), dtype=bool)
        n = min(width, allowed.shape[1])
        mask[:, :n] = allowed[:, :n]
        index = paddle.to_tensor(rows)
        picked = paddle.gather(logits, index)
        masked = paddle.where(paddle.to_tensor(mask), picked, paddle.full_like(picked, float("-inf")))
        return logits.scatter_(index, masked)      # in place: a copy of every row would cost ~5 ms a step

    def accept(self, sampling_req_ids: list[str], sampled: np.ndarray) -> None:
        """Advance each constrained request's matcher over the token it sampled."""
        if not self.matchers:
            return
        for rid, token in zip(sampling_req_ids, sampled):
            matcher = self.matchers.get(rid)
            if rid in self.gated:      # free until the gate: watch for it
                gate, tail = self.gated[rid]
                tail = (tail + [int(token)])[-len(gate):]
                if tuple(tail) == gate:
                    del self.gated[rid]
                else:
                    self.gated[rid] = (gate, tail)
                continue
            if matcher is not None and not matcher.consume_token(int(token)):
                logger.warning("request %s sampled token %d outside its constraint (%s); it goes on unconstrained",
                               rid, int(token), matcher.get_error()[:200])
                del self.matchers[rid]


def _ends_with(tokens: list[int], end: int, gate: tuple[int, ...]) -> bool:
    """Whether ``tokens[:end]`` ends with ``gate``."""
    return end >= len(gate) and tuple(tokens[end - len(gate):end]) == gate


def _ends_within(tokens: list[int], gate: tuple[int, ...]) -> bool:
    """Whether ``gate`` occurs in ``tokens``."""
    return any(_ends_with(tokens, end, gate) for end in range(len(gate), len(tokens) + 1))
