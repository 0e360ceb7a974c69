"""hicache's KV events decoded by vLLM's own ``KVEventBatch`` (``vllm.distributed.kv_events``),
as a vLLM-side subscriber decodes a worker's stream: a real daemon, a real engine's
requests, the events read off the daemon's PUB socket and replay socket."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

pytest.importorskip("vllm")

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from daemon_util import ClientEngine, DaemonProcess  # noqa: E402
from hicache.keys import page_keys  # noqa: E402
from tiers_util import SPEC  # noqa: E402


def test_vllms_decoder_reads_the_daemons_stream(tmp_path):
    daemon = DaemonProcess(tmp_path, events={"enabled": True}).start()
    decoder = __import__("msgspec").msgpack.Decoder(type=KVEventBatch)
    context = zmq.Context()
    engine = ClientEngine(daemon.endpoint)
    try:
        prompts = [np.random.default_rng(i).integers(0, 1000, 5 * SPEC.page_size).tolist() for i in range(3)]
        for tokens in prompts:
            engine.prefill(tokens)
        engine.client.flush()
        # Everything so far, from the replay socket (a subscriber joining late).
        replay = context.socket(zmq.DEALER)
        replay.connect(f"ipc://{tmp_path / 'hicache-events-replay.sock'}")
        replay.send((0).to_bytes(8, "big"))  # vLLM's request: the first stream from seq 0
        blocks: set[tuple[str, int]] = set()
        seqs = []
        while True:
            assert replay.poll(30_000), "no answer from the replay socket"
            frames = replay.recv_multipart()
            if frames[1] == b"":
                break
            seqs.append(int.from_bytes(frames[2], "big"))
            batch = decoder.decode(frames[3])  # vLLM's own decoder: strict, typed
            assert batch.data_parallel_rank is not None
            for event in batch.events:
                if isinstance(event, BlockStored):
                    assert event.block_size == SPEC.page_size
                    assert len(event.token_ids) == len(event.block_hashes) * SPEC.page_size
                    blocks.update((event.medium, h) for h in event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    blocks.difference_update((event.medium, h) for h in event.block_hashes)
                else:
                    assert isinstance(event, AllBlocksCleared)
                    blocks.clear()
        assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        want = {int.from_bytes(k[8:], "big") for tokens in prompts for k in page_keys(engine.ns(), tokens,
                                                                                    SPEC.page_size)}
        for medium in ("GPU", "CPU", "STORAGE"):  # (write-through: every page in all three)
            assert {h for m, h in blocks if m == medium} == want, medium
        replay.close(0)
    finally:
        engine.close()
        context.destroy(linger=0)
        assert daemon.stop() == 0
