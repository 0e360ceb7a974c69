"""The page-copy kernel against its torch reference and a byte-level oracle.

Runs the Triton kernel under TRITON_INTERPRET=1 on machines without CUDA (tests/conftest.py).
Destinations are pre-filled with a poison pattern, so an element the kernel fails to
write, or writes where it should not, shows up as a difference.
"""

import numpy as np
import pytest
import torch

from hicache.errors import InvalidArgument
from hicache.kernels.copy_plan import CpuCopyWorkers, Segments
from hicache.kernels.page_copy import ReferencePlan, copy_pages, copy_pages_reference, copy_pages_triton, page_runs
from hicache.pools import DeviceLayout, DevicePool, HostPool, layer_segment_ranges, page_segments, state_segments
from hicache.spec import KVSpec, MHALayer, MLALayer, StateLayer

POISON = 0xA5
KERNELS = {"triton": copy_pages_triton, "reference": copy_pages_reference}


def specs(page_size):
    kda = StateLayer(conv_state_shape=(2, 6), temporal_state_shape=(2, 3, 3))
    return {
        "mha": KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=8, page_size=page_size),
        "mla": KVSpec.mla(num_layers=2, kv_lora_rank=12, qk_rope_head_dim=4, page_size=page_size),
        "fp8": KVSpec.mha(num_layers=2, num_kv_heads=3, head_dim=5, page_size=page_size, dtype="float8_e4m3fn"),
        "hybrid": KVSpec(page_size=page_size, layers=(kda, MHALayer(num_kv_heads=1, head_dim=4), kda,
                                                      MLALayer(kv_lora_rank=6, qk_rope_head_dim=2, dtype="float16"))),
        "tp2": KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=4, page_size=page_size, tp_size=2),
    }


def random_bytes(n, seed):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def oracle(src, dst, src_pages, dst_pages, segments):
    """Byte-by-byte expectation, in plain numpy."""
    out = dst.numpy().copy()
    data = src.numpy()
    for s, d in zip(src_pages, dst_pages):
        for so, ss, do, ds, n in zip(segments.src_offset, segments.src_stride, segments.dst_offset,
                                     segments.dst_stride, segments.nbytes):
            out[d * ds + do : d * ds + do + n] = data[s * ss + so : s * ss + so + n]
    return out


def run_both(src, dst_len, src_pages, dst_pages, segments, max_programs=16):
    results = {}
    for name, kernel in KERNELS.items():
        dst = torch.full((dst_len,), POISON, dtype=torch.uint8)
        kernel(src, dst, torch.tensor(src_pages, dtype=torch.int64), torch.tensor(dst_pages, dtype=torch.int64),
               segments, max_programs=max_programs)
        results[name] = dst
    expected = oracle(src, torch.full((dst_len,), POISON, dtype=torch.uint8), src_pages, dst_pages, segments)
    assert np.array_equal(results["reference"].numpy(), expected)
    assert torch.equal(results["triton"], results["reference"])
    return results["reference"]


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("kind", ["mha", "mla", "fp8", "hybrid", "tp2"])
def test_backup_and_load_all_layers(kind, page_size):
    spec = specs(page_size)[kind]
    rank = spec.tp_size - 1
    layout = DeviceLayout.build(spec, num_pages=6, num_state_slots=3 if spec.state_bytes else 0)
    device = random_bytes(layout.nbytes, seed=page_size)
    segments = page_segments(layout, rank)
    host_len = 5 * spec.host_page_bytes
    # Unsorted device pages, a repeated source, the padding page never touched.
    src_pages, dst_pages = [5, 2, 2, 6], [3, 0, 4, 1]
    host = run_both(device, host_len, src_pages, dst_pages, segments)
    # Host page 2 was never written, nor the other rank's share of written pages.
    pages = host.view(5, -1)
    assert bool((pages[2] == POISON).all())
    if spec.tp_size == 2:
        assert bool((pages[:, : spec.rank_page_bytes] == POISON).all())
        assert not bool((pages[[0, 1, 3, 4], spec.rank_page_bytes :] == POISON).all())
    # And back, all layers at once, into other device pages.
    back = run_both(host, layout.nbytes, dst_pages, [1, 3, 4, 2], segments.reversed())
    for page_from, page_to in ((5, 1), (2, 3), (2, 4), (6, 2)):
        for region in layout.token_regions:
            a = region.offset + page_from * region.unit_bytes
            b = region.offset + page_to * region.unit_bytes
            assert torch.equal(back[b : b + region.unit_bytes], device[a : a + region.unit_bytes])


@pytest.mark.parametrize("kind", ["mha", "hybrid", "mla"])
def test_load_one_layer_touches_only_that_layer(kind):
    spec = specs(3)[kind]
    layout = DeviceLayout.build(spec, num_pages=4, num_state_slots=2 if spec.state_bytes else 0)
    host = random_bytes(3 * spec.host_page_bytes, seed=1)
    restore = page_segments(layout).reversed()
    for layer, indices in layer_segment_ranges(layout).items():
        out = run_both(host, layout.nbytes, [2, 0], [4, 1], restore.select(indices))
        written = np.flatnonzero(out.numpy() != POISON)
        for offset in written:
            owner = [r for r in layout.token_regions if r.offset <= offset < r.offset + r.nbytes]
            assert owner and owner[0].layer == layer


def test_state_slots_round_trip():
    spec = specs(4)["hybrid"]
    layout = DeviceLayout.build(spec, num_pages=2, num_state_slots=5)
    device = random_bytes(layout.nbytes, seed=3)
    segments = state_segments(layout)
    host = run_both(device, 4 * spec.state_bytes, [5, 1, 3], [0, 3, 2], segments)
    back = run_both(host, layout.nbytes, [0, 3, 2], [2, 4, 1], segments.reversed())
    for slot_from, slot_to in ((5, 2), (1, 4), (3, 1)):
        for region in layout.state_regions:
            a = region.offset + slot_from * region.unit_bytes
            b = region.offset + slot_to * region.unit_bytes
            assert torch.equal(back[b : b + region.unit_bytes], device[a : a + region.unit_bytes])


@pytest.mark.parametrize("max_programs", [1, 3, 64])
def test_grid_cap_and_odd_sizes(max_programs):
    # 7-byte segments force byte-wide words; a capped grid walks many items per program.
    segments = Segments((0, 7, 50), (21, 21, 21), (3, 10, 17), (24, 24, 24), (7, 7, 5))
    src = random_bytes(21 * 9 + 60, seed=9)
    run_both(src, 24 * 8, [8, 0, 3, 3, 1, 7], [7, 0, 2, 5, 4, 1], segments, max_programs=max_programs)
    assert segments.word_bytes == 1


def test_wide_words_are_used_when_everything_aligns():
    spec = specs(16)["mha"]
    layout = DeviceLayout.build(spec, num_pages=3)
    assert page_segments(layout).word_bytes == 8
    # A contiguous run moves as one strided copy, with the same result.
    device = random_bytes(layout.nbytes, seed=4)
    run_both(device, 4 * spec.host_page_bytes, [1, 2, 3], [0, 1, 2], page_segments(layout))


def test_segment_groups_cover_every_segment():
    spec = specs(3)["hybrid"]
    layout = DeviceLayout.build(spec, num_pages=4, num_state_slots=2)
    segments = page_segments(layout)
    assert sum(g.count for g in segments.groups) == len(segments)
    uniform = page_segments(DeviceLayout.build(specs(3)["mha"], num_pages=4))
    assert len(uniform.groups) == 1


@pytest.mark.parametrize("kernel", list(KERNELS.values()), ids=list(KERNELS))
def test_empty_and_invalid_requests(kernel):
    segments = Segments((0,), (8,), (0,), (8,), (8,))
    src = random_bytes(64, seed=0)
    dst = torch.full((64,), POISON, dtype=torch.uint8)
    empty = torch.empty(0, dtype=torch.int64)
    kernel(src, dst, empty, empty, segments)
    assert bool((dst == POISON).all())
    ids = torch.tensor
    with pytest.raises(InvalidArgument, match="destination page appears twice"):
        kernel(src, dst, ids([1, 2]), ids([3, 3]), segments)
    with pytest.raises(InvalidArgument):
        kernel(src, dst, ids([1, 2]), ids([3]), segments)
    with pytest.raises(InvalidArgument):
        kernel(src, dst, ids([8]), ids([0]), segments)  # past the source
    with pytest.raises(InvalidArgument):
        kernel(src, dst, ids([0]), ids([-1]), segments)
    with pytest.raises(InvalidArgument):
        kernel(src.view(torch.int8), dst, ids([0]), ids([0]), segments)
    with pytest.raises(InvalidArgument):
        kernel(src, dst, ids([0.0]), ids([0]), segments)
    assert bool((dst == POISON).all()), "a rejected copy wrote something"


def test_dispatcher_uses_the_reference_on_cpu(monkeypatch):
    import hicache.kernels.page_copy as module

    calls = []
    monkeypatch.setattr(module, "copy_pages_triton", lambda *a, **k: calls.append("triton"))
    segments = Segments((0,), (4,), (0,), (4,), (4,))
    src, dst = random_bytes(16, seed=0), torch.zeros(16, dtype=torch.uint8)
    copy_pages(src, dst, torch.tensor([1]), torch.tensor([2]), segments)
    assert calls == [] and torch.equal(dst[8:12], src[4:8])


def test_host_pool_and_device_pool_views(tmp_path):
    spec = specs(3)["hybrid"]
    layout = DeviceLayout.build(spec, num_pages=4, num_state_slots=2)
    pool = DevicePool(layout, torch.zeros(layout.nbytes, dtype=torch.uint8))
    k = pool.k_buffer(1)
    assert k.shape == (5 * 3, 1, 4) and k.dtype == torch.float16
    assert pool.kv_buffer(3).shape == (15, 1, 8)
    assert pool.buffer_of(0, "temporal").shape == (3, 2, 3, 3)
    k[3:6] = 1.5  # device page 1 of layer 1's K
    region = layout.token_regions[0]
    assert region.layer == 1 and bool((pool.buffer[region.offset + region.unit_bytes :][:2] != 0).any())
    host = HostPool(spec, 2, num_state_slots=1, pinned=False)
    assert host.pages.numel() == 2 * spec.host_page_bytes and host.states.numel() == spec.state_bytes
    host.close()


def test_cpu_copy_threads_split_a_copy_only_where_each_gets_enough_bytes():
    workers = CpuCopyWorkers(3, min_bytes_per_thread=1000)
    try:
        assert workers.parts(999, 50) == 1  # not worth a hand-off: the caller copies alone
        assert workers.parts(2500, 50) == 2
        assert workers.parts(10**9, 50) == 3  # no more than there are threads
        assert workers.parts(10**9, 2) == 2  # nor than there are pieces
        assert workers.parts(10**9, 0) == 1
    finally:
        workers.close()
    with pytest.raises(InvalidArgument):
        CpuCopyWorkers(2, min_bytes_per_thread=0)


def test_a_spread_copy_one_thread_of_which_fails_ends_only_once_every_thread_has():
    """Three copy threads; the second stops (a load whose copy deadline passed: its
    ``proceed`` raises) while the third is still in the middle of its share. The copy
    raises only once the third has ended: its caller then fails the load's ticket,
    and an engine that waits for the load to be over reuses the blocks — a thread
    still copying would write into another request's KV."""
    import threading

    workers = CpuCopyWorkers(3, min_bytes_per_thread=1)
    third_started, run_over = threading.Event(), threading.Event()
    events = []

    def copy(part: int) -> None:
        if part == 1:
            assert third_started.wait(30)
            raise RuntimeError("the copy deadline passed")
        if part == 2:
            third_started.set()
            run_over.wait(1)  # (ends on its own when the copy waits for it, as it should)
            events.append("third thread ended")

    def run() -> None:
        with pytest.raises(RuntimeError):
            workers.run(copy, [0, 1, 2])
        events.append("copy over")
        run_over.set()

    try:
        caller = threading.Thread(target=run)
        caller.start()
        caller.join(30)
        assert not caller.is_alive()
        assert events[0] == "third thread ended"
    finally:
        run_over.set()
        workers.close()


@pytest.mark.parametrize("min_bytes", [1, 1 << 30])
def test_the_reference_spread_over_threads_writes_what_the_oracle_says(min_bytes, monkeypatch):
    """Irregular page runs split over three threads (every pair a thread's when each may
    take a byte), or kept on the calling thread (a copy under the threshold)."""
    spec = specs(3)["hybrid"]
    layout = DeviceLayout.build(spec, num_pages=40, num_state_slots=2)
    device = random_bytes(layout.nbytes, seed=5)
    segments = page_segments(layout)
    src_pages = [1, 2, 3, 9, 10, 30, 4, 5, 6, 7, 8, 20, 21, 39]
    dst_pages = [0, 1, 2, 5, 6, 13, 7, 8, 9, 10, 11, 3, 4, 12]
    workers = CpuCopyWorkers(3, min_bytes_per_thread=min_bytes)
    batches = []
    run = workers.run
    monkeypatch.setattr(workers, "run", lambda fn, parts: (batches.append(len(parts)), run(fn, parts))[1])
    try:
        host_len = 14 * spec.host_page_bytes
        dst = torch.full((host_len,), POISON, dtype=torch.uint8)
        copy_pages_reference(device, dst, torch.tensor(src_pages), torch.tensor(dst_pages), segments, workers=workers)
        expected = oracle(device, torch.full((host_len,), POISON, dtype=torch.uint8), src_pages, dst_pages, segments)
        assert np.array_equal(dst.numpy(), expected)
        assert batches == ([3] if min_bytes == 1 else [])
    finally:
        workers.close()


@pytest.mark.parametrize("min_bytes", [1, 1 << 30])
def test_a_plan_of_several_buffers_moves_the_same_runs_through_each(min_bytes):
    """One plan over three source buffers (an engine-owned pool's allocations, with
    their own offsets and strides) into one destination: each buffer's segments written
    as by a copy of that buffer alone, the runs found once and spread over threads or
    not; a second move of other runs through the same plan writes those too."""
    parts = [(random_bytes(900, seed=20), Segments((0,), (40,), (0,), (96,), (24,))),
             (random_bytes(1200, seed=21), Segments((8, 32), (56, 56), (24, 48), (96, 96), (24, 24))),
             (random_bytes(700, seed=22), Segments((3,), (30,), (72,), (96,), (24,)))]
    dst = torch.full((96 * 12,), POISON, dtype=torch.uint8)
    plan = ReferencePlan([(src, dst, segments) for src, segments in parts])
    expected = dst.clone()
    workers = CpuCopyWorkers(2, min_bytes_per_thread=min_bytes)
    try:
        for src_pages, dst_pages in (([3, 4, 5, 11, 0, 7], [2, 3, 4, 5, 9, 0]), ([20, 1], [11, 6])):
            plan.run(page_runs(torch.tensor(src_pages), torch.tensor(dst_pages)), workers)
            for src, segments in parts:
                expected = torch.from_numpy(oracle(src, expected, src_pages, dst_pages, segments))
            assert torch.equal(dst, expected)
    finally:
        workers.close()
    assert plan.bytes_per_pair == 96 and plan.on_cpu


def test_segments_whose_offsets_step_backwards_on_one_side():
    # A spec with SWA layers puts them last in a host page, so a device pool's first
    # layer can land after its second (an engine-owned pool: one segment a layer).
    segments = Segments((0, 48), (96, 96), (24, 0), (48, 48), (24, 24))
    src = random_bytes(96 * 4, seed=11)
    run_both(src, 48 * 4, [3, 0, 1, 2], [0, 1, 2, 3], segments)
    run_both(random_bytes(48 * 4, seed=12), 96 * 4, [0, 1, 2, 3], [3, 0, 1, 2], segments.reversed())
