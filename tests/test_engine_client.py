"""The API process's engine client on its failure paths: nothing stays registered, one bad output
fails one request. Real ZMQ sockets stand in for the engine process (this side sends; a PULL reads)."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from fdplug.core.frontend.processor import ProcessedPrompt
from fdplug.core.model.text.tokenizer import Tokenizer
from fdplug.core.scheduler.output import EngineCoreOutput
from fdplug.demo.random_model import ensure_random_model
from fdplug.errors import EngineRequestError
from fdplug.plugin_api.sampling_params import SamplingParams
from fdplug.server.api.engine_client import EngineClient
from fdplug.server.api.metrics import ServerMetrics
from fdplug.server.engine import protocol as P


class _Engine:
    """What ``EngineClient`` uses of the launcher's engine process: its input socket, pid and poll()."""

    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.input_socket = self.context.socket(zmq.PUSH)
        self.input_socket.bind(address)
        self.peer = self.context.socket(zmq.PULL)
        self.peer.connect(address)
        self.pid = 0

    def poll(self):
        return None

    def received(self) -> list:
        messages = []
        while self.peer.poll(200):
            messages.append(P.unpack(self.peer.recv()))
        return messages

    def close(self) -> None:
        self.input_socket.close(0)
        self.peer.close(0)
        self.context.term()


@pytest.fixture
def client(tmp_path):
    model_dir = ensure_random_model()
    tokenizer = Tokenizer.from_dir(model_dir)
    info = P.EngineInfo(pid=0, model_dir=str(model_dir), architecture="x", dtype="float32",
                        vocab_size=tokenizer.vocab_size, eos_token_ids=[0], max_model_len=64, max_num_seqs=4,
                        max_num_batched_tokens=64, max_waiting_requests=8, block_size=16, num_kv_blocks=8,
                        kv_cache_tokens=128, kv_cache_description="", selection={})
    engine = _Engine(f"ipc://{tmp_path}/input")
    yield EngineClient(engine, info, tokenizer, ServerMetrics("m"), stall_timeout=60.0)
    engine.close()


def test_a_request_that_cannot_be_encoded_leaves_nothing_registered(client):
    async def main():
        with pytest.raises((OverflowError, TypeError)):   # a token id msgpack cannot carry, past every check
            client.add("r1", ProcessedPrompt(None, [5, 2**70]), SamplingParams(max_tokens=2))
        assert client.num_registered() == 0 and not client.child_to_parent
        assert not client.output_processor.has("r1")
        assert client.engine.received() == []          # nothing was sent either
        stream = client.add("r2", ProcessedPrompt(None, [5, 6]), SamplingParams(max_tokens=2, n=2))
        assert client.num_registered() == 1 and stream.child_ids == ["r2#0", "r2#1"]
        assert [m[0] for m in client.engine.received()] == [P.ADD]
    asyncio.run(main())


def test_an_output_the_api_cannot_process_fails_only_its_request(client):
    async def main():
        good = client.add("good", ProcessedPrompt(None, [5, 6]), SamplingParams(max_tokens=4), queue=asyncio.Queue())
        bad = client.add("bad", ProcessedPrompt(None, [7, 8]), SamplingParams(max_tokens=4))
        client.engine.received()
        client._on_outputs([EngineCoreOutput("bad", [-5]), EngineCoreOutput("good", [11])])   # -5: decode raises
        assert bad.done and isinstance(bad.result.exception(), EngineRequestError)
        assert not good.done and good.queue.get_nowait().token_ids == [11]
        assert client.num_registered() == 1
        assert any(m[0] == P.ABORT and m[1] == ["bad"] for m in client.engine.received())   # the engine frees it
    asyncio.run(main())
