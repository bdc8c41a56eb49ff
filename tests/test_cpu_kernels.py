"""The cpu device's compiled kernels: numerics against the definition, the build cache, and fallbacks.

``cpu_native`` must agree with the plain-Paddle reference on every case (decode rows go through C,
prefill rows through the reference's matmuls, the cache write through C; the ``cpu_native_swiglu`` op kernel's
SwiGLU against paddle's), and a machine that cannot build the kernels must still serve with the
reference, saying why.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from fdplug.core.frontend.llm import LLM
from fdplug.core.plugin_loading.selection import select_components
from fdplug.core.portable import ops as portable
from fdplug.core.portable.attention import ReferenceAttention
from fdplug.errors import ConfigError
from fdplug.plugin_api.sampling_params import SamplingParams
from fdplug.plugins.cpu import isa, kernel_build, kernels, native_norms
from fdplug.plugins.cpu.native_attention import NativeCpuAttention
from fdplug.testing.cases import (
    AttentionCase,
    SeqCase,
    attention_cases,
    naive_attention,
    run_attention,
)

if kernels.compiler() is None:  # the reference still serves; say so rather than fail on a compiler-less box
    pytest.skip("no C compiler on PATH: the compiled cpu kernels cannot be built here", allow_module_level=True)


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path):
    """An empty kernel cache and a forgotten load, so a test sees a first build (and leaves none behind)."""
    monkeypatch.setenv("FDPLUG_CACHE_DIR", str(tmp_path))
    kernels.forget()
    yield tmp_path
    kernels.forget()


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("case", attention_cases(seed=11), ids=lambda c: c.describe())
def test_native_attention_matches_the_definition(case, threads):
    for got, want in zip(run_attention(NativeCpuAttention(threads), case), naive_attention(case)):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


# head_dim 40: not a multiple of 8, so the portable C path runs; 128 and GQA 8:1 the wide ones.
@pytest.mark.parametrize("heads,kv_heads,dim,block", [(8, 8, 40, 16), (16, 2, 128, 16), (4, 2, 64, 32), (2, 1, 8, 4)])
def test_decode_over_long_shuffled_contexts(heads, kv_heads, dim, block):
    seqs = [SeqCase(context, 1) for context in (1, 7, 16, 17, 63, 200, 301)]
    case = AttentionCase(heads, kv_heads, dim, block, seqs, seed=heads * dim)
    got = run_attention(NativeCpuAttention(2), case)
    want = run_attention(ReferenceAttention(), case)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)


# Rows over more keys than the decode kernel's chunk (ATT_CHUNK_KEYS, 1,024) are split into chunks,
# each a work unit, merged after: against the definition (float64, on the cache's own values), and
# the same bits for a row alone or in a batch and on 1, 2 or 3 threads. Blocks shuffled; 1,023-1,025
# keys straddle the split, 300 stays one unit.
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_long_rows_split_into_chunks_match_the_definition_alone_or_in_a_batch(kv_dtype):
    rng = np.random.default_rng(7)
    heads, kv_heads, dim, block, scale = 9, 3, 64, 16, 64 ** -0.5
    lengths = [1023, 1024, 1025, 2048, 3001, 300]
    spans = [-(-n // block) for n in lengths]
    order = iter(rng.permutation(np.arange(1, sum(spans) + 1)).astype(np.int32))
    tables = np.zeros((len(lengths), max(spans)), np.int32)
    for i, span in enumerate(spans):
        tables[i, :span] = [next(order) for _ in range(span)]
    shape = (kv_heads, sum(spans) + 1, block, dim)
    caches = [paddle.to_tensor(rng.standard_normal(shape).astype(np.float32)).astype(kv_dtype) for _ in range(2)]
    q = rng.standard_normal((len(lengths), heads, dim)).astype(np.float32)
    rows, key_end = np.arange(len(lengths), dtype=np.int32), np.array(lengths, np.int32)

    def attend(which: np.ndarray, threads: int) -> np.ndarray:
        return kernels.paged_attention(paddle.to_tensor(q), *caches, which, tables, which, key_end[which],
                                       int(key_end[which].max()), scale, threads).numpy()

    batch = attend(rows, 2)
    keys, values = (c.astype("float32").numpy().astype(np.float64) for c in caches)
    for i, n in enumerate(lengths):
        pos = np.arange(n)
        at = (tables[i, pos // block], pos % block)
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = keys[g][at] @ q[i, h].astype(np.float64) * scale
            p = np.exp(scores - scores.max())
            np.testing.assert_allclose(batch[i, h], (p / p.sum()) @ values[g][at], atol=2e-5, rtol=1e-5)
        for threads in (1, 2, 3):
            alone = attend(np.array([i], np.int32), threads)
            assert np.array_equal(alone[0].view(np.uint32), batch[i].view(np.uint32)), (n, threads)


# The prefill kernel: head dims 64 and 128 (its compiled-in widths), 48 and 256 (the general loop),
# 40 (not a multiple of 16: the reference path); blocks of 4 (a 16-key tile spans four blocks) and
# 32; chunks after a context, longer than a piece (PREFILL_PIECE), and with bidirectional spans;
# groups of 1 to 4 query heads a kv head (3: SmolLM2's 9/3), so that a work unit's query vectors
# fill its micro-tiles (4 with AVX-512, 6 with AVX2) or leave a padded last one.
@pytest.mark.parametrize("heads,kv_heads,dim,block", [(8, 2, 64, 4), (4, 4, 128, 32), (6, 3, 48, 16),
                                                      (2, 1, 256, 16), (4, 2, 40, 16), (9, 3, 64, 16)])
def test_prefill_chunks_over_shuffled_blocks(heads, kv_heads, dim, block):
    seqs = [SeqCase(0, 300), SeqCase(37, 45, spans=[(50, 70)]), SeqCase(100, 3), SeqCase(0, 1)]
    case = AttentionCase(heads, kv_heads, dim, block, seqs, seed=heads + dim)
    native = NativeCpuAttention(3)
    assert native.prefill_kernel == (isa.level() >= 3)   # built where the (FDPLUG_CPU_ISA-capped) level has AVX2 + FMA
    for a, b in zip(run_attention(native, case), naive_attention(case)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("heads,kv_heads,dim,block", [(9, 3, 64, 16), (8, 2, 128, 4), (4, 2, 40, 16)])
def test_two_byte_caches_read_what_the_reference_reads(kv_dtype, heads, kv_heads, dim, block):
    """--kv-cache-dtype float16/bfloat16: decode (the C kernel's widening loads), prefill chunks
    (the keys transposed and the values widened once a call) and the cache write (rounded to nearest
    even, as paddle's astype) against the reference on caches of the same dtype: the same rounded
    values, float32 math, so float32's tolerance. Head dim 40: the kernels' scalar paths."""
    seqs = [SeqCase(0, 300), SeqCase(37, 45, spans=[(50, 70)]), SeqCase(100, 3), SeqCase(0, 1)]
    seqs += [SeqCase(context, 1) for context in (1, 17, 63, 200)]
    case = AttentionCase(heads, kv_heads, dim, block, seqs, seed=heads + dim + len(kv_dtype))
    got = run_attention(NativeCpuAttention(3), case, kv_dtype=kv_dtype)
    want = run_attention(ReferenceAttention(), case, kv_dtype=kv_dtype)
    exact = run_attention(ReferenceAttention(), case)
    for a, b, c in zip(got, want, exact, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)
        assert not np.allclose(b, c, atol=1e-7, rtol=1e-7)       # the rounding is there to see
        np.testing.assert_allclose(b, c, atol=0.05, rtol=0.05)   # and no bigger than a 2-byte value's


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_write_kv_rounds_as_paddle_rounds(kv_dtype):
    """The cache write into a 2-byte cache: the bits paddle's astype gives, for values across the
    type's range (float16: subnormals, the largest finite, past it to infinity)."""
    rng = np.random.default_rng(5)
    shape = (3, 9, 4, 16)
    slots = rng.permutation(36)[:11].astype(np.int64)
    scale = np.exp(rng.uniform(-20, 12, (11, 3, 16))).astype(np.float32)
    key, value = (paddle.to_tensor(rng.standard_normal((11, 3, 16), dtype=np.float32) * scale) for _ in range(2))
    caches = {name: [paddle.zeros(shape, dtype=kv_dtype), paddle.zeros(shape, dtype=kv_dtype)]
              for name in ("native", "reference")}
    prepared = ReferenceAttention().prepare(_decode_meta(slots))
    NativeCpuAttention(1).write_cache(key, value, *caches["native"], prepared)
    ReferenceAttention().write_cache(key, value, *caches["reference"], prepared)
    for native, reference in zip(caches["native"], caches["reference"]):
        np.testing.assert_array_equal(native.numpy().view(np.uint16), reference.numpy().view(np.uint16))


def test_rms_norm_rows_are_independent_and_other_shapes_fall_back():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((130, 37), dtype=np.float32) * 10
    weight = paddle.to_tensor(rng.standard_normal(37, dtype=np.float32))
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * weight.numpy()
    together = native_norms.rms_norm(paddle.to_tensor(x), weight, 1e-5, 3).numpy()     # threaded: >= 64 rows
    np.testing.assert_allclose(together, want, rtol=2e-6, atol=1e-6)
    alone = native_norms.rms_norm(paddle.to_tensor(x[7:8]), weight, 1e-5, 1).numpy()[0]
    np.testing.assert_array_equal(alone, together[7])
    odd = paddle.to_tensor(rng.standard_normal((4, 3, 37), dtype=np.float32))
    weights = paddle.to_tensor(rng.standard_normal((4, 1, 37), dtype=np.float32))   # neither [D] nor [3, D]
    np.testing.assert_array_equal(native_norms.rms_norm(odd, weights, 1e-5, 2).numpy(),
                                  portable.rms_norm(odd, weights, 1e-5).numpy())


def test_write_kv_stores_the_rows_the_reference_stores():
    rng = np.random.default_rng(3)
    shape = (3, 9, 4, 16)  # kv_heads, blocks, block_size, dim
    slots = rng.permutation(36)[:11].astype(np.int64)
    key, value = (paddle.to_tensor(rng.standard_normal((11, 3, 16), dtype=np.float32)) for _ in range(2))
    caches = {name: [paddle.zeros(shape), paddle.zeros(shape)] for name in ("native", "reference")}
    prepared = ReferenceAttention().prepare(_decode_meta(slots))
    NativeCpuAttention(1).write_cache(key, value, *caches["native"], prepared)
    ReferenceAttention().write_cache(key, value, *caches["reference"], prepared)
    for native, reference in zip(caches["native"], caches["reference"]):
        np.testing.assert_array_equal(native.numpy(), reference.numpy())
    assert np.count_nonzero(np.abs(caches["native"][0].numpy()).sum(axis=-1)) == 11 * 3


def test_out_of_range_slots_and_blocks_are_refused_before_the_c_code():
    selection = NativeCpuAttention(1)
    cache = paddle.zeros([2, 4, 4, 8])
    row = paddle.zeros([1, 2, 8])
    with pytest.raises(ValueError, match="slot mapping outside the KV cache"):
        selection.write_cache(row, row, cache, cache, selection.prepare(_decode_meta(np.array([16]))))
    prepared = selection.prepare(_decode_meta(np.array([3]), block_table=[[9]]))
    with pytest.raises(ValueError, match="block id 9 is outside the KV cache"):
        selection.attend(prepared.groups[0], paddle.zeros([1, 4, 8]), cache, cache, 1.0)


def _decode_meta(slots: np.ndarray, block_table=None):
    from fdplug.plugin_api.attention import AttentionMetadata

    n = len(slots)
    table = np.asarray(block_table if block_table is not None else [[0]] * n, dtype=np.int32)
    return AttentionMetadata(query_start_loc=np.arange(n + 1, dtype=np.int32), seq_lens=np.ones(n, np.int32),
                             positions=np.zeros(n, np.int64), key_end=np.ones(n, np.int32),
                             slot_mapping=np.asarray(slots, np.int64), block_tables=table, block_size=4)


@pytest.mark.own_build
def test_build_is_cached_per_source_and_reused(monkeypatch, tmp_path, tmp_path_factory):
    """A library is found again, not rebuilt (as a new process would), and a changed source is a new
    build, written atomically. The session's library, copied into an empty cache, stands for one built
    there: its name is its key (sources, flags, compiler, CPU), not its directory's."""
    session_library = Path(kernels.load()._name)
    monkeypatch.setenv("FDPLUG_CACHE_DIR", str(tmp_path))
    kernels.forget()
    try:
        path = kernel_build.library_path(kernels.compiler())
        assert path.name == session_library.name and path.parent == tmp_path / "kernels"
        path.parent.mkdir()
        shutil.copy2(session_library, path)
        stamp = path.stat().st_mtime_ns
        kernels.load()
        assert path.stat().st_mtime_ns == stamp and len(list(path.parent.glob("*.so"))) == 1
        # A changed source (a small one: a whole build takes 30-120 s) is a build of its own, which
        # here loads and is then refused for its ABI.
        changed = tmp_path_factory.mktemp("src") / "cpu_kernels.c"
        changed.write_text("int fdplug_kernels_abi(void) { return -1; }\n")
        monkeypatch.setattr(kernel_build, "SOURCE", changed)
        kernels.forget()
        with pytest.raises(kernels.KernelsUnavailable, match="has ABI -1, expected"):
            kernels.load()
        assert len(list(path.parent.glob("*.so"))) == 2
        assert not list(path.parent.glob("tmp*"))  # no half-written build left behind
    finally:
        kernels.forget()


def test_a_failing_compiler_falls_back_to_the_reference_and_says_why(fresh_kernels, monkeypatch):
    monkeypatch.setenv("CC", "false")
    reason = kernels.unavailable_reason()
    assert reason is not None and "false failed" in reason
    selection = select_components("cpu")
    assert selection.attention.name == "reference" and selection.ops["swiglu"].name == "paddle_swiglu"
    assert selection.moe.name == "reference"
    rejected = [d for d in selection.decisions if d.name.startswith("cpu_native")]
    assert {d.role for d in rejected} == {"op:swiglu", "op:rms_norm", "op:fp8_linear", "op:linear", "op:add_rms_norm",
                                          "op:rope", "op:argmax", "op:gguf_linear", "op:decoder_stack", "attention",
                                          "moe"}
    assert all("false failed" in d.reason for d in rejected)


def fake_compiler(folder: Path, about: str, version: str, build: str, name: str = "fake-cc") -> Path:
    """A compiler stand-in: ``--version`` prints ``about``, ``-dumpfullversion`` prints ``version``, and a
    build (any call with ``-o``) runs the shell ``build`` with $OUT the output and $ARGS the arguments,
    after appending its arguments to ``builds.log`` beside it."""
    script = folder / name
    script.write_text(f"""#!/bin/sh
case "$*" in *--version*) echo '{about}'; exit 0;; *-dumpfullversion*) echo '{version}'; exit 0;; esac
ARGS="$*"; OUT=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && OUT="$a"; prev="$a"; done
echo "$ARGS" >> "{folder}/builds.log"
{build}
""")
    script.chmod(0o755)
    return script


def builds(folder: Path) -> list[str]:
    log = folder / "builds.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.own_build
def test_a_failed_build_is_remembered_not_tried_again_on_every_call(fresh_kernels, monkeypatch, tmp_path):
    """A Zen 3 core takes ~2 minutes a build: a failure retried on every call had a suite's first
    minutes spent rebuilding, so the process keeps the failure until `kernels.forget`."""
    cc = fake_compiler(tmp_path, "fake 1.0", "1.0", "echo 'error: no' >&2; exit 1")
    monkeypatch.setenv("CC", str(cc))
    first, second = kernels.unavailable_reason(), kernels.unavailable_reason()
    assert first == second and "failed (exit 1)" in first and "error: no" in first
    with pytest.raises(kernels.KernelsUnavailable, match="error: no"):
        kernels.load()
    assert len(builds(tmp_path)) == 1
    kernels.forget()
    assert kernels.unavailable_reason() == first and len(builds(tmp_path)) == 2


@pytest.mark.own_build
def test_gcc_builds_in_parallel_and_falls_back_to_a_plain_build(fresh_kernels, monkeypatch, tmp_path, caplog):
    """GCC 10+ gets -flto=auto (its code generation on every core); where that build fails, one plain
    build follows; other compilers get no such flag. Every GCC build, both tries, goes without the RTL
    GCSE passes (kernel_build.GCC_FLAGS: the packed tiles' worker built in half the time)."""
    gcc = fake_compiler(tmp_path, "cc (Debian 12.2.0) 12.2.0\nCopyright (C) Free Software Foundation, Inc.", "12.2.0",
                        'case "$ARGS" in *-flto=auto*) exit 1;; esac; echo built > "$OUT"')
    monkeypatch.setenv("MAKE", "/bin/sh")   # a make on PATH or not, this machine's answer is not the question
    assert kernel_build.parallel_flags((str(gcc),)) == ("-flto=auto",)
    target = tmp_path / "out" / "lib.so"
    with caplog.at_level("WARNING", logger="fdplug"):
        kernel_build.build([str(gcc)], target)
    assert target.read_text() == "built\n" and "without -flto=auto" in caplog.text
    assert ["-flto=auto" in line for line in builds(tmp_path)] == [True, False]
    assert all("-fno-gcse -fno-gcse-after-reload" in line for line in builds(tmp_path))
    old_gcc = fake_compiler(tmp_path, "gcc 9.4.0 Free Software Foundation", "9.4.0", "exit 1", name="gcc-9")
    clang = fake_compiler(tmp_path, "clang version 17.0.6", "17.0.6", "exit 1", name="clang")
    assert kernel_build.parallel_flags((str(old_gcc),)) == () and kernel_build.parallel_flags((str(clang),)) == ()
    assert kernel_build.gcc_flags((str(old_gcc),)) == kernel_build.GCC_FLAGS
    assert kernel_build.gcc_flags((str(clang),)) == ()
    gcc_12 = fake_compiler(tmp_path, "gcc 12.2.0 Free Software Foundation", "12.2.0", "exit 1", name="gcc-12")
    monkeypatch.setenv("MAKE", str(tmp_path / "no-make"))   # GCC runs its LTO partitions through make
    assert kernel_build.parallel_flags((str(gcc_12),)) == ()


@pytest.mark.own_build
def test_a_build_past_its_time_is_ended_with_every_process_it_started(fresh_kernels, monkeypatch, tmp_path):
    """A compile still running at BUILD_TIMEOUT_S is killed with its children (GCC's cc1, lto1, make):
    left running, they took the 2 cores from the next process's build."""
    cc = fake_compiler(tmp_path, "fake 1.0", "1.0", f'sleep 60 & echo $! > "{tmp_path}/child"; wait')
    monkeypatch.setattr(kernel_build, "BUILD_TIMEOUT_S", 1.0)
    with pytest.raises(kernels.KernelsUnavailable, match="did not finish within 1 s"):
        kernel_build.build([str(cc)], tmp_path / "out" / "lib.so")
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "Z" not in Path(f"/proc/{child}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the compiler's child outlived the timeout"
        time.sleep(0.05)
    assert not list((tmp_path / "out").glob("tmp*"))


@pytest.mark.own_build
def test_an_unwritable_cache_is_kernels_unavailable_not_an_os_error(fresh_kernels, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(kernels.KernelsUnavailable, match="set FDPLUG_CACHE_DIR"):
        kernel_build.build_once(["cc"], blocker / "kernels" / "lib.so")


@pytest.mark.own_build
def test_processes_building_at_once_build_once(fresh_kernels, tmp_path):
    """Concurrent starts (an API process and its engines, a suite's servers) wait for one build under
    a file lock instead of each compiling (which, on 2 cores, pushed every build past its timeout)."""
    import threading

    cc = fake_compiler(tmp_path, "fake 1.0", "1.0", 'sleep 1; echo built > "$OUT"')
    path = fresh_kernels / "kernels" / "lib.so"
    errors: list[BaseException] = []

    def start() -> None:
        try:
            kernel_build.build_once([str(cc)], path)
        except BaseException as exc:  # noqa: BLE001 (reported by the assertion below)
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert path.read_text() == "built\n" and len(builds(tmp_path)) == 1


def test_kernels_on_makes_a_failed_build_a_startup_error(fresh_kernels, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", os.path.join(tmp_path, "no-such-compiler"))
    monkeypatch.setenv("FDPLUG_CPU_KERNELS", "on")
    with pytest.raises(ConfigError, match="FDPLUG_CPU_KERNELS=on but the cpu kernels are unavailable"):
        LLM(None, num_kv_blocks=16, max_model_len=64)


def test_kernels_off_selects_the_reference(fresh_kernels, monkeypatch):
    monkeypatch.setenv("FDPLUG_CPU_KERNELS", "off")
    selection = select_components("cpu")
    assert selection.attention.name == "reference" and selection.ops["swiglu"].name == "paddle_swiglu"
    assert any(d.name == "cpu_native_swiglu" and "FDPLUG_CPU_KERNELS=off" in d.reason for d in selection.decisions)
    assert not (fresh_kernels / "kernels").exists()  # off means not even a build


def test_native_is_the_cpu_default_and_generates_what_the_reference_generates(test_model_dir):
    prompts = [[5, 9, 3] * 11, [7], list(range(40, 90))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for swiglu, attention in ((None, None), ("paddle_swiglu", "reference")):
        llm = LLM(str(test_model_dir), attention_backend=attention, op_kernels=swiglu and {"swiglu": swiglu},
                  num_kv_blocks=64, max_model_len=256)
        selection = llm.engine.selection
        outputs[selection.ops["swiglu"].name, selection.attention.name] = [
            o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    assert set(outputs) == {("cpu_native_swiglu", "cpu_native"), ("paddle_swiglu", "reference")}
    assert outputs["cpu_native_swiglu", "cpu_native"] == outputs["paddle_swiglu", "reference"]


def test_a_float16_kv_cache_generates_what_the_reference_generates_on_one(test_model_dir):
    """``kv_cache_dtype="float16"``: half the cache's bytes (the plan says so), and the compiled
    attention and the reference, each on its own float16 cache, give the same tokens."""
    prompts = [[5, 9, 3] * 11, [7], list(range(40, 90))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens, plans = {}, {}
    for attention, kv in (("cpu_native", "float16"), ("reference", "float16"), ("cpu_native", "auto")):
        llm = LLM(str(test_model_dir), attention_backend=attention, num_kv_blocks=64, max_model_len=256,
                  kv_cache_dtype=kv)
        assert (str(llm.engine.runner.kv_caches[0][0].dtype)
                == ("paddle.float16" if kv == "float16" else "paddle.float32"))
        plans[attention, kv] = llm.engine.kv_plan
        tokens[attention, kv] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert tokens["cpu_native", "float16"] == tokens["reference", "float16"]
    half, full = plans["cpu_native", "float16"], plans["cpu_native", "auto"]
    assert half.bytes_per_block * 2 == full.bytes_per_block and half.describe().endswith("of float16")


def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices():
    from fdplug.core.config import EngineConfig

    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16"):
        EngineConfig(kv_cache_dtype="fp8")
    assert EngineConfig(dtype="float32", kv_cache_dtype="float16").kv_dtype() == "float16"
    assert EngineConfig(dtype="float32").kv_dtype() == "float32"


# Row counts on both sides of the threshold (one thread below SWIGLU_MIN_PARALLEL, then all threads
# with a row count no thread count divides); widths with and without a tail past the last multiple
# of eight.
@pytest.mark.parametrize("shape", [(1, 64), (3, 7, 2 * 1000), (64, 2 * 1536), (2047, 2 * 13), (301, 2 * 200)])
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_swiglu_matches_paddle(shape, threads):
    x = paddle.to_tensor(np.random.default_rng(sum(shape)).standard_normal(shape, dtype=np.float32) * 4)
    got = kernels.swiglu(x, threads)
    assert got.shape == [*shape[:-1], shape[-1] // 2]
    np.testing.assert_allclose(got.numpy(), F.swiglu(x).numpy(), rtol=1e-6, atol=1e-6)


def test_swiglu_at_the_ends_of_the_float_range():
    gates = np.array([-1e6, -200, -88, -87, -20, -1e-6, 0, 1e-6, 20, 87, 88, 200, 1e6, np.nan], dtype=np.float32)
    x = np.ones((1024, 2 * len(gates)), dtype=np.float32)  # over SWIGLU_MIN_PARALLEL: threaded
    x[:, :len(gates)] = gates
    got = kernels.swiglu(paddle.to_tensor(x), 2).numpy()[0]
    want = F.swiglu(paddle.to_tensor(x)).numpy()[0]
    np.testing.assert_allclose(got[:-1], want[:-1], rtol=1e-6, atol=1e-30)
    assert np.isnan(got[-1])


def test_swiglu_refuses_what_the_c_code_cannot_take():
    with pytest.raises(ValueError, match="even last dimension"):
        kernels.swiglu(paddle.ones([1024, 33]), 2)
    with pytest.raises(TypeError, match="float32"):
        kernels.swiglu(paddle.ones([1024, 32], dtype="float64"), 2)


def test_native_runner_puts_the_kernel_in_every_mlp(test_model_dir):
    from fdplug.core.model.layers.basic import SwiGLU

    llm = LLM(str(test_model_dir), num_kv_blocks=16, max_model_len=64)
    mlps = [layer for layer in llm.engine.runner.model.sublayers() if isinstance(layer, SwiGLU)]
    assert mlps and all(m.activation.func is kernels.swiglu for m in mlps)


# --------------------------------------------------------------------------------------------------
# the kernels' persistent thread pool
# --------------------------------------------------------------------------------------------------


def _raw_swiglu(lib, x: np.ndarray, threads: int) -> np.ndarray:
    """The C SwiGLU on numpy buffers (no paddle: usable in a forked child)."""
    out = np.empty((x.shape[0], x.shape[1] // 2), np.float32)
    lib.fdplug_swiglu(x.ctypes.data, out.ctypes.data, x.shape[0], x.shape[1] // 2, threads)
    return out


def test_pool_gives_the_same_results_for_any_thread_count_and_concurrent_callers():
    """One job at a time runs on the pool; callers from other threads meanwhile get fresh threads
    (ctypes drops the GIL, so these calls really overlap). Every result equals the one-thread one."""
    from concurrent.futures import ThreadPoolExecutor

    lib = kernels.load()
    x = np.random.default_rng(0).standard_normal((512, 256)).astype(np.float32)
    want = _raw_swiglu(lib, x, 1)
    for threads in (2, 8, 3, 65, 1, 2):        # the pool grows to 64 helpers and serves smaller jobs
        np.testing.assert_array_equal(_raw_swiglu(lib, x, threads), want)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: _raw_swiglu(lib, x, 2 + i % 3), range(200)))
    for got in results:
        np.testing.assert_array_equal(got, want)


def test_a_forked_child_runs_the_kernels_without_the_parents_pool():
    """The helpers are not forked. A job posted to them in the child must not wait for them (none
    claims it, so the caller does it all), and the child starts helpers of its own: after one call
    it has more threads than the one fork() gave it."""
    import time

    lib = kernels.load()
    x = np.random.default_rng(1).standard_normal((256, 128)).astype(np.float32)
    want = _raw_swiglu(lib, x, 2)                 # the parent's pool is up
    pid = os.fork()
    if pid == 0:                                   # child: exit code says whether it matched
        same = np.array_equal(_raw_swiglu(lib, x, 2), want)
        os._exit(0 if same and len(os.listdir("/proc/self/task")) > 1 else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in a kernel call")


def test_the_fma_peak_counts_the_work_it_was_asked_for():
    """bench/gemm.py's ceiling (csrc/fma_peak.c) divides the count this returns by the call's time:
    the count must be what was asked, rounded up by at most one iteration of 12 vectors a chunk
    (16 chunks a thread), on any threads; a request it cannot size does nothing and says 0."""
    lib = kernels.load()
    widest = 2 * 12 * 16                             # flops of an iteration of 16-lane vectors
    for threads in (1, 2, 3):
        for flops in (1.0, 1e6, 3.3e7):
            done = lib.fdplug_fma_peak(flops, threads)
            assert flops <= done <= flops + widest * 16 * threads, (threads, flops, done)
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e300):
        assert lib.fdplug_fma_peak(bad, 2) == 0.0
