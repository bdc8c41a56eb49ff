"""The built-in demo model, and the generated models tests and benchmarks use.

``fdplug serve`` and ``fdplug.LLM()`` without a model run the demo: a tiny Qwen2 (Hugging Face
format, ChatML template, Qwen2's special, tool-call and vision tokens) actually trained, by
``tools/train_demo_model.py``, on the Python documentation every Python installation carries
(``pydoc_data``). It answers in recognisable words and its greedy output depends on the prompt, so
a newcomer sees the server work and HTTP tests can tell that inputs reach the model. It ships in
the package (``model/``, under 1 MB) and is read in place.

    chatml.py        tokens, chat template and tokenizer_config shared by every demo model
    bpe.py           a byte-level BPE learned in plain Python (deterministic)
    random_model.py  seeded random Qwen2 directories of any shape (tests, benchmarks, golden fixtures)
    publish.py       writing a generated directory once, atomically
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "model"


def demo_model_dir() -> Path:
    """The trained demo model's directory (inside the installed package)."""
    return DEMO_MODEL_DIR
