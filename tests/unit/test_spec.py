import dataclasses

import pytest
import torch

from hicache.errors import InvalidArgument
from hicache.spec import (
    KVSpec,
    MHALayer,
    MLALayer,
    StateLayer,
    dtype_itemsize,
    storage_dtype,
    torch_dtype,
)


def llama_like(**overrides):
    params = dict(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, model="test/model@1")
    params.update(overrides)
    return KVSpec.mha(**params)


def test_mha_sizes():
    spec = llama_like()
    assert spec.num_layers == 32
    assert spec.token_bytes(0) == 8 * 128 * 2 * 2
    assert spec.page_bytes(31) == 16 * 8 * 128 * 2 * 2 == 65536
    assert spec.rank_page_bytes == spec.host_page_bytes == 32 * 65536
    assert spec.state_bytes == 0


def test_fingerprint_vector():
    # Pinned: a changed fingerprint orphans every persisted disk tier.
    assert llama_like().fingerprint_hex == "d9e9722bfa5f994fa892127b30f6421f"
    assert len(llama_like().fingerprint) == 16


def test_mla_sizes():
    spec = KVSpec.mla(num_layers=61, kv_lora_rank=512, qk_rope_head_dim=64, page_size=1)
    assert spec.page_bytes(0) == 576 * 2
    assert spec.host_page_bytes == 61 * 576 * 2
    (comp,) = spec.layers[0].token_components
    assert comp.shape == (1, 576)


def test_fp8_is_stored_as_uint8_but_fingerprinted_by_kind():
    e4m3 = llama_like(dtype="float8_e4m3fn")
    e5m2 = llama_like(dtype="float8_e5m2")
    assert storage_dtype("float8_e4m3fn") == "uint8" and dtype_itemsize("float8_e5m2") == 1
    assert torch_dtype("float8_e4m3fn") == torch.uint8
    assert torch_dtype("bfloat16") == torch.bfloat16
    assert e4m3.page_bytes(0) == e5m2.page_bytes(0) == 16 * 8 * 128 * 2
    assert e4m3.fingerprint != e5m2.fingerprint


def test_hybrid_state_layers():
    kda = StateLayer(conv_state_shape=(3, 4096), temporal_state_shape=(16, 128, 128))
    full = MHALayer(num_kv_heads=4, head_dim=128, dtype="bfloat16")
    spec = KVSpec(page_size=16, layers=(kda, kda, kda, full), model="kimi-linear")
    assert spec.page_bytes(0) == 0
    assert spec.page_bytes(3) == 16 * 4 * 128 * 2 * 2
    assert spec.host_page_bytes == spec.page_bytes(3)
    assert spec.state_bytes == 3 * (3 * 4096 * 2 + 16 * 128 * 128 * 4)
    assert [s.layer for s in spec.host_page_layout()] == [3, 3]


@pytest.mark.parametrize(
    "change",
    [
        dict(page_size=32),
        dict(num_layers=31),
        dict(num_kv_heads=4),
        dict(head_dim=64),
        dict(dtype="bfloat16"),
        dict(model="test/model@2"),
        dict(tp_size=2),
    ],
)
def test_fingerprint_changes_with_anything_that_changes_bytes(change):
    assert llama_like(**change).fingerprint != llama_like().fingerprint


def test_fingerprint_stable_and_layer_order_matters():
    assert llama_like() == llama_like() and llama_like().fingerprint == llama_like().fingerprint
    a, b = MHALayer(num_kv_heads=8, head_dim=128), MLALayer(kv_lora_rank=512, qk_rope_head_dim=64)
    assert KVSpec(page_size=4, layers=(a, b)).fingerprint != KVSpec(page_size=4, layers=(b, a)).fingerprint
    # v_head_dim defaults to head_dim, and spelling it out is the same spec.
    explicit = KVSpec(page_size=4, layers=(MHALayer(num_kv_heads=8, head_dim=128, v_head_dim=128),))
    assert explicit.fingerprint == KVSpec(page_size=4, layers=(a,)).fingerprint


def test_host_page_layout_is_rank_major_and_contiguous():
    spec = llama_like(num_layers=3, tp_size=2)
    layout = spec.host_page_layout()
    assert len(layout) == 2 * 3 * 2
    offset = 0
    for seg in layout:
        assert seg.offset == offset and seg.nbytes == 16 * 8 * 128 * 2
        offset += seg.nbytes
    assert offset == spec.host_page_bytes == 2 * spec.rank_page_bytes
    assert [(s.rank, s.layer, s.component) for s in layout[:3]] == [(0, 0, "k"), (0, 0, "v"), (0, 1, "k")]
    assert layout[6].rank == 1 and layout[6].offset == spec.rank_page_bytes


def test_round_trip_through_dict():
    kda = StateLayer(conv_state_shape=(3, 64), temporal_state_shape=(2, 8, 8))
    spec = KVSpec(
        page_size=8,
        layers=(kda, MHALayer(num_kv_heads=2, head_dim=16, v_head_dim=8, dtype="float8_e4m3fn"),
                MLALayer(kv_lora_rank=32, qk_rope_head_dim=8)),
        model="m",
        tp_size=2,
    )
    again = KVSpec.from_dict(spec.to_dict())
    assert again == spec and again.fingerprint == spec.fingerprint


@pytest.mark.parametrize(
    "build",
    [
        lambda: KVSpec.mha(num_layers=0, num_kv_heads=8, head_dim=128, page_size=16),
        lambda: KVSpec.mha(num_layers=2, num_kv_heads=8, head_dim=128, page_size=0),
        lambda: KVSpec.mha(num_layers=2, num_kv_heads=-1, head_dim=128, page_size=16),
        lambda: KVSpec.mha(num_layers=2, num_kv_heads=8, head_dim=128, page_size=16, dtype="float64"),
        lambda: KVSpec.mha(num_layers=2, num_kv_heads=8, head_dim=128, page_size=16, tp_size=0),
        lambda: KVSpec(page_size=16, layers=()),
        lambda: KVSpec(page_size=16, layers=("mha",)),
        lambda: KVSpec(page_size=16, layers=(StateLayer(conv_state_shape=(3, 4), temporal_state_shape=(1, 2)),)),
        lambda: StateLayer(conv_state_shape=(), temporal_state_shape=(1,)),
        lambda: MHALayer(num_kv_heads=True, head_dim=4),
        lambda: KVSpec.from_dict({"format": 99}),
        lambda: KVSpec.from_dict({"format": 1, "page_size": 4, "layers": [{"kind": "gqa"}]}),
        lambda: KVSpec.from_dict({"format": 1, "page_size": 4, "layers": [{"kind": "mha", "heads": 2}]}),
        lambda: KVSpec.from_dict({"format": 1, "page_size": 4, "layers": [], "colour": "red"}),
        lambda: KVSpec.from_dict([]),
    ],
)
def test_bad_specs_are_rejected(build):
    with pytest.raises(InvalidArgument):
        build()


def test_specs_are_frozen():
    spec = llama_like()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.page_size = 32  # type: ignore[misc]


def test_a_spec_off_the_wire_is_refused_whatever_its_fields_hold():
    """Unhashable kinds and dtypes, and more layers than any model has, are bad
    arguments (a registration must never fail as a bug)."""
    from hicache.spec import MAX_LAYERS

    base = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4).to_dict()
    layer = base["layers"][0]
    for bad in ({"layers": [layer | {"kind": ["mha"]}]}, {"layers": [layer | {"dtype": {"a": 1}}]},
                {"layers": [layer | {"dtype": ["float16"]}]}, {"layers": [layer] * (MAX_LAYERS + 1)},
                {"layers": [layer | {"num_kv_heads": [2]}]}, {"page_size": "4"}, {"tp_size": None}):
        with pytest.raises(InvalidArgument):
            KVSpec.from_dict(base | bad)
    assert KVSpec.from_dict(base | {"layers": [layer] * MAX_LAYERS}).num_layers == MAX_LAYERS


def test_a_sliding_window_is_part_of_the_spec_and_of_nothing_else_before_it():
    """SWA layers (issue 20): the window changes the fingerprint (a hit needs other pages),
    not the bytes of a page; a spec without windows keeps the fingerprint it always had."""
    full = MHALayer(num_kv_heads=4, head_dim=64)
    swa = MHALayer(num_kv_heads=4, head_dim=64, sliding_window=128)
    plain = KVSpec(page_size=16, layers=(full, full), model="gemma-like")
    mixed = KVSpec(page_size=16, layers=(swa, full), model="gemma-like")
    assert mixed.fingerprint != plain.fingerprint
    assert mixed.host_page_bytes == plain.host_page_bytes
    assert "sliding_window" not in plain.to_dict()["layers"][0]
    assert mixed.to_dict()["layers"][0]["sliding_window"] == 128
    assert KVSpec.from_dict(mixed.to_dict()) == mixed
    assert KVSpec.from_dict(mixed.to_dict()).fingerprint == mixed.fingerprint
    assert KVSpec(page_size=16, layers=(MHALayer(num_kv_heads=4, head_dim=64, sliding_window=0), full),
                  model="gemma-like").fingerprint == plain.fingerprint
    for bad in (-1, 1.5, True, "128"):
        with pytest.raises(InvalidArgument):
            MHALayer(num_kv_heads=4, head_dim=64, sliding_window=bad)
