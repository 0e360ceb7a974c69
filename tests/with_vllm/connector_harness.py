"""The hicache vLLM connector driven step by step, both roles in this process, with
fake vLLM scheduler objects (field names as in vLLM 0.32's
``vllm/v1/core/sched/output.py`` / ``vllm/v1/request.py``) and a real daemon over real
sockets: no engine to start. What the worker's forward would write into a block is
``fill(block, value)``."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from hicache.integrations.vllm import HicacheConnector, KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput

BS = 16  # vLLM block size (tokens)
LAYERS = 2
HEADS = 2
HEAD_DIM = 32
NUM_BLOCKS = 32
BLOCK_BYTES = HEADS * BS * 2 * HEAD_DIM * 2  # [H, N, 2*D] bf16
LAYER_STRIDE = NUM_BLOCKS * BLOCK_BYTES
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def vllm_config(endpoint: str, engine_id: str = "e1", *, tp: int = 1, rank: int = 0, kv_role: str = "kv_both",
                **extra) -> SimpleNamespace:
    """An engine's config as its scheduler (rank 0) or the worker of global ``rank`` sees it."""
    transfer = SimpleNamespace(
        kv_connector_extra_config={"hicache.endpoint": endpoint, **extra}, kv_role=kv_role,
        engine_id=engine_id, kv_load_failure_policy="fail", is_kv_producer=False)
    model = SimpleNamespace(get_num_kv_heads=lambda parallel: HEADS, get_head_size=lambda: HEAD_DIM,
                            model="test/tiny", revision=None)
    return SimpleNamespace(
        kv_transfer_config=transfer, cache_config=SimpleNamespace(block_size=BS),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, rank=rank),
        model_config=model)


def kv_cache_config() -> SimpleNamespace:
    tensor = SimpleNamespace(size=LAYERS * LAYER_STRIDE, layers=list(LAYER_NAMES), layer_stride=LAYER_STRIDE,
                             block_stride=BLOCK_BYTES, offset=0)
    return SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor], kv_cache_layout="LBHNC",
                           kv_cache_groups=[object()])


def kv_caches() -> dict[str, torch.Tensor]:
    """One flat allocation, one [B, H, N, 2D] bf16 view per layer (as vLLM 0.32 on CPU)."""
    flat = torch.zeros(LAYERS * LAYER_STRIDE, dtype=torch.int8)
    out = {}
    for i, name in enumerate(LAYER_NAMES):
        part = flat[i * LAYER_STRIDE : (i + 1) * LAYER_STRIDE]
        out[name] = part.view(torch.bfloat16).view(NUM_BLOCKS, HEADS, BS, 2 * HEAD_DIM)
    return out


def request(req_id: str, tokens: list[int], *, cache_salt=None, lora_request=None, mm_features=None,
            prompt_embeds=None, prompt_is_token_ids=None) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(tokens), cache_salt=cache_salt,
                           lora_request=lora_request, mm_features=mm_features or [],
                           prompt_embeds=prompt_embeds, prompt_is_token_ids=prompt_is_token_ids,
                           num_prompt_tokens=len(tokens))


def blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def cached_output(req_id: str, num_computed: int, num_scheduled: int) -> SimpleNamespace:
    """A running request scheduled again (no new blocks)."""
    cached = SimpleNamespace(req_ids=[req_id], resumed_req_ids=set(), new_block_ids=[None],
                             num_computed_tokens=[num_computed])
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={req_id: num_scheduled})


def new_req_output(req_id: str, block_ids: list[int], num_computed: int, num_scheduled: int) -> SimpleNamespace:
    new = SimpleNamespace(req_id=req_id, block_ids=(list(block_ids),), num_computed_tokens=num_computed)
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={req_id: num_scheduled})


def empty_output() -> SimpleNamespace:
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={})


class Engine:
    """A scheduler connector and the worker connectors of one vLLM engine: one worker
    per TP rank (``tp``), each with KV caches of its own (``worker`` and ``caches``:
    rank 0's). A forward writes ``value + rank`` into each rank's blocks (a rank's
    shard of the heads differs from another's)."""

    def __init__(self, endpoint: str, engine_id: str = "e1", *, tp: int = 1, kv_role: str = "kv_both",
                 **extra) -> None:
        self.rank_caches = [kv_caches() for _ in range(tp)]
        self.workers = []
        for rank, caches in enumerate(self.rank_caches):
            worker = HicacheConnector(vllm_config(endpoint, engine_id, tp=tp, rank=rank, kv_role=kv_role, **extra),
                                      KVConnectorRole.WORKER, kv_cache_config())
            worker.register_kv_caches(caches)
            self.workers.append(worker)
        self.worker, self.caches = self.workers[0], self.rank_caches[0]
        self.scheduler = HicacheConnector(vllm_config(endpoint, engine_id, tp=tp, kv_role=kv_role, **extra),
                                          KVConnectorRole.SCHEDULER, kv_cache_config())

    def block(self, layer: int, block: int, rank: int = 0) -> torch.Tensor:
        return self.rank_caches[rank][LAYER_NAMES[layer]][block]

    def fill(self, block_ids, value: float) -> None:
        for rank in range(len(self.workers)):
            for b in block_ids:
                for layer in range(LAYERS):
                    self.block(layer, b, rank).fill_(value + rank)

    def values(self, block_ids, rank: int = 0) -> list[set[float]]:
        return [{float(v) for layer in range(LAYERS) for v in self.block(layer, b, rank).unique()}
                for b in block_ids]

    def execute(self, meta, forward=None, *, speculative: bool = False) -> KVConnectorOutput:
        """The worker's side of one step, as vLLM's model runner drives it: loads, (the
        forward), stores; the step's connector output. ``speculative``: in the order of
        an engine with a draft model (``GPUModelRunner`` with a ``speculative_config``:
        ``_get_kv_connector_output(defer_finalize=True)``), which collects the step's
        output before the stores (``finalize_kv_connector`` after the drafter ran)."""
        workers = self.workers
        for w in workers:
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
        for name in LAYER_NAMES:
            for w in workers:
                w.wait_for_layer_load(name)
        if forward is not None:
            forward()
        if not speculative:
            for w in workers:
                w.wait_for_save()
        # (vLLM's KVOutputAggregator: the union of the ranks' failed blocks, their worker
        # metadata aggregated)
        invalid, worker_meta = set(), None
        for w in workers:
            invalid |= set(w.get_block_ids_with_load_errors())
            mine = w.build_connector_worker_meta()
            worker_meta = mine if worker_meta is None else (worker_meta.aggregate(mine) if mine else worker_meta)
        out = KVConnectorOutput(invalid_block_ids=invalid, kv_connector_worker_meta=worker_meta)
        if speculative:
            for w in workers:
                w.wait_for_save()
        for w in workers:
            w.clear_connector_metadata()
        return out

    def deliver(self, out: KVConnectorOutput) -> None:
        """vLLM's update_from_output: a step's connector output reaches the scheduler's
        connector, unless it is empty (``ModelRunnerOutput.with_kv_conn_output_only``)."""
        if not out.is_empty():
            self.scheduler.update_connector_output(out)

    def step(self, output, forward=None) -> set[int]:
        """One step of synchronous scheduling: the metadata, the worker's step, its
        output to the scheduler; the blocks reported as failed loads. (Under
        asynchronous scheduling vLLM builds the next step's metadata before this
        step's output reaches the scheduler: ``execute`` and ``deliver``.)"""
        out = self.execute(self.scheduler.build_connector_meta(output), forward)
        self.deliver(out)
        return out.invalid_block_ids

    def prefill(self, req, block_ids: list[int], value: float, local_hit: int = 0) -> tuple[int, set[int]]:
        """A request scheduled whole: match beyond vLLM's ``local_hit``, alloc, load,
        forward (writes ``value`` into the blocks it computes), store. Returns the
        external hit and the failed blocks."""
        s = self.scheduler
        s.on_new_request(req)
        ext, _ = s.get_num_new_matched_tokens(req, local_hit)
        ext = ext or 0
        s.update_state_after_alloc(req, blocks(block_ids), ext)
        computed = local_hit + ext
        n = len(req.prompt_token_ids)
        first_computed_block = computed // BS
        errors = self.step(new_req_output(req.request_id, block_ids, computed, n - computed),
                           forward=lambda: self.fill(block_ids[first_computed_block:], value))
        return ext, errors

    def finish(self, req, block_ids) -> None:
        self.scheduler.request_finished(req, list(block_ids))

    def close(self) -> None:
        self.scheduler.shutdown()
        for w in self.workers:
            w.shutdown()


def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    """Wait for an event the test cannot be told of (a thread's retry, the daemon's
    bookkeeping); the bound only keeps a broken build from hanging."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def first_request_stores(e, p) -> None:
    """Request r1 computes prompt ``p`` into blocks 1-5 (values 7.0), finds nothing
    cached, and stores it."""
    ext, errors = e.prefill(request("r1", p), [1, 2, 3, 4, 5], 7.0)
    assert ext == 0 and not errors
    e.finish(request("r1", p), [1, 2, 3, 4, 5])
