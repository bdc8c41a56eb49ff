"""``fdplug generate``: offline generation from the command line, without a server."""

from __future__ import annotations

from typing import Any

import click

from fdplug.cli.options import engine_kwargs, engine_options
from fdplug.cli.user_errors import user_errors


@click.command("generate")
@engine_options
@click.option("--prompt", "prompts", multiple=True, required=True, help="Prompt text (repeat for several).")
@click.option("--chat", is_flag=True, help="Wrap each prompt as a user message in the model's chat template.")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@user_errors
def generate_command(prompts: tuple[str, ...], chat: bool, max_tokens: int, temperature: float, top_p: float,
                     top_k: int, seed: int | None, **kw: Any) -> None:
    """Generate text offline: one prompt streams to the terminal, several show a progress bar.

    stdout is only the text; stderr says why each output ended and how many tokens it has, because
    a chat model given a raw prompt often ends at once and an empty line alone explains nothing.
    """
    from fdplug.core.frontend.llm import LLM
    from fdplug.plugin_api.sampling_params import SamplingParams

    llm = LLM(**engine_kwargs(kw))
    click.echo(f"[{llm.describe()}]", err=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    if chat:
        texts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        inputs: list[Any] = [{"prompt": t, "prompt_token_ids": llm.tokenizer.encode(t, add_special_tokens=False)}
                             for t in texts]
    else:
        inputs = list(prompts)
    ended: list[tuple[str | None, int, bool]] = []   # (finish_reason, tokens, blank) per prompt
    if len(inputs) == 1:
        tokens, finish, blank = 0, None, True
        for delta in llm.stream(inputs[0], params):
            click.echo(delta.text, nl=False)
            tokens, finish = tokens + len(delta.token_ids), delta.finish_reason or finish
            blank = blank and not delta.text.strip()
        click.echo()
        click.echo(f"[finish_reason={finish}, {_tokens(tokens)}]", err=True)
        ended.append((finish, tokens, blank))
    else:
        for prompt, output in zip(prompts, llm.generate(inputs, params)):
            out = output.outputs[0]
            click.echo(f"--- {prompt!r} -> {out.finish_reason}, {_tokens(len(out.token_ids))}\n{out.text}")
            ended.append((out.finish_reason, len(out.token_ids), not out.text.strip()))
    empty = next(((finish, tokens) for finish, tokens, blank in ended if blank), None)
    if empty is not None and not chat:
        click.echo(f"note: empty output (finish_reason={empty[0]} after {_tokens(empty[1])}): a chat model given a raw "
                   "prompt often ends at once; try --chat to wrap it in the model's chat template.", err=True)


def _tokens(n: int) -> str:
    return f"{n} token{'s' * (n != 1)}"
