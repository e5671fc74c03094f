"""KV layouts: keys, byte form, and the moves between engine tensors and staging."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from kvstore.errors import InvalidArgument  # noqa: E402
from kvstore_client.adapters.layout import (  # noqa: E402
    HeadInterior,
    KVLayout,
    PagedFormat,
    gather_hf,
    gather_paged,
    hf_layers_from,
    load_blocks,
    save_blocks,
    scatter_paged,
)


def layout(**kw: object) -> KVLayout:
    fields: dict[str, object] = dict(
        model="m", num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32", block_tokens=8
    )
    fields.update(kw)
    return KVLayout(**fields)  # type: ignore[arg-type]


def test_every_field_that_changes_bytes_changes_the_keys() -> None:
    tokens = list(range(32))
    base = layout()
    variants = [
        layout(model="other"), layout(dtype="bfloat16"), layout(num_layers=4), layout(num_kv_heads=1),
        layout(head_dim=8), layout(tp_rank=1, tp_size=2), layout(tp_size=2), layout(block_tokens=16),
        # Pipeline stages: the same 3 layers as the first or the last stage of a 6-layer model.
        layout(model_layers=6), layout(first_layer=3, model_layers=6),
    ]  # fmt: skip
    keys = set(base.keys(tokens))
    for other in variants:
        assert keys.isdisjoint(other.keys(tokens)), other
    assert base.keys(tokens) == layout().keys(tokens)
    assert len(base.keys(tokens)) == 4 and base.tail_key(tokens) is None
    assert base.tail_key(tokens[:13]) not in keys


def test_the_namespace_spells_every_field_and_a_stage_its_layers() -> None:
    assert layout().namespace == "kv2/m/float32/3L-2H-4D/tp0of1"
    assert layout(first_layer=3, model_layers=6, tp_rank=1, tp_size=2).namespace == "kv2/m/float32/6L[3-5]-2H-4D/tp1of2"
    with pytest.raises(InvalidArgument, match="past the model"):
        layout(first_layer=4, model_layers=6)


def test_extras_separate_keys_from_the_block_they_are_in_on() -> None:
    """An adapter or salt on block 0 changes every key; an image in block 2 changes keys 2.. only."""
    lay, tokens = layout(), list(range(32))
    plain = lay.keys(tokens)
    assert lay.keys(tokens, [b"", b"", b""]) == plain  # empty extras are none
    salted = lay.keys(tokens, [b"salt"])
    assert set(salted).isdisjoint(plain) and lay.keys(tokens, [b"salt"]) == salted
    imaged = lay.keys(tokens, [b"", b"", b"image-1"])
    assert imaged[:2] == plain[:2] and set(imaged[2:]).isdisjoint(plain)
    assert lay.keys(tokens, [b"", b"", b"image-2"])[2:] != imaged[2:]
    # A prompt shorter than a block: the tail key takes block 0's extra.
    assert lay.tail_key(tokens[:5], [b"salt"]) != lay.tail_key(tokens[:5])
    with pytest.raises(InvalidArgument, match="extras"):
        lay.keys(tokens, b"salt")  # type: ignore[arg-type]


def test_each_layer_is_one_contiguous_byte_range() -> None:
    lay = layout()
    staging = lay.staging(2)
    assert staging[0].numel() * 4 == lay.block_bytes() == 3 * lay.layer_bytes()
    for layer in range(3):
        start, length = lay.layer_range(layer)
        flat = staging[0].reshape(-1).view(torch.uint8)
        assert flat[start : start + length].data_ptr() == staging[0, layer].data_ptr()
        assert length == staging[0, layer].numel() * 4
    assert lay.block_bytes(tokens=3) == 3 * 2 * 3 * 2 * 4 * 4
    with pytest.raises(InvalidArgument):
        lay.layer_range(3)


@pytest.mark.parametrize(
    "kw",
    [{"model": ""}, {"num_layers": 0}, {"head_dim": -1}, {"dtype": "int8"}, {"tp_rank": 2, "tp_size": 2},
     {"block_tokens": 1.5}],
)  # fmt: skip
def test_bad_layouts_are_rejected_by_name(kw: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument, match=next(iter(kw)) if "tp" not in next(iter(kw)) else "tp_rank"):
        layout(**kw)


def _hf_cache(lay: KVLayout, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (1, lay.num_kv_heads, tokens, lay.head_dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(lay.num_layers)]


def test_hf_cache_round_trips_through_blocks_and_a_tail() -> None:
    lay = layout()
    cache = _hf_cache(lay, 21)  # two full blocks and a tail of 5
    full = lay.staging(2)
    gather_hf(cache, lay, 0, full)
    tail = lay.staging(1, tokens=5)
    gather_hf(cache, lay, 16, tail)
    # Token-major inside a layer: block 1, layer 2, V, token 3, head 1 is the cache's token 11 of head 1.
    assert torch.equal(full[1, 2, 1, 3, 1], cache[2][1][0, 1, 11])
    back = hf_layers_from([full, tail], lay)
    for (k, v), (k2, v2) in zip(cache, back, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2) and k2.is_contiguous()
    for tokens in (0, 3, 16, 19):  # the first tokens only: inside a block, on a boundary, inside the tail
        cut = hf_layers_from([full, tail], lay, tokens)
        assert all(
            torch.equal(k[:, :, :tokens], k2) and k2.shape[2] == tokens
            for (k, _), (k2, _) in zip(cache, cut, strict=True)
        )
    with pytest.raises(InvalidArgument):
        hf_layers_from([full, tail], lay, 22)


def test_hf_gather_rejects_a_cache_of_another_shape() -> None:
    lay = layout()
    with pytest.raises(InvalidArgument, match="layers"):
        gather_hf(_hf_cache(lay, 8)[:2], lay, 0, lay.staging(1))
    with pytest.raises(InvalidArgument, match="tokens"):
        gather_hf(_hf_cache(lay, 8), lay, 0, lay.staging(2))
    with pytest.raises(InvalidArgument, match="layout wants"):
        gather_hf(_hf_cache(layout(num_kv_heads=1), 8), lay, 0, lay.staging(1))


@pytest.mark.parametrize("order", ["BHNC", "2BNHD", "B2NHD", "BNHC", "2BHND"])
def test_paged_pages_round_trip_in_any_order(order: str) -> None:
    lay = layout(block_tokens=8)
    fmt = PagedFormat(order, block_size=4)  # two pages per stored block
    canonical = (10, 2, 4, lay.num_kv_heads, lay.head_dim)  # B2NHD: 10 pages

    def engine_tensor() -> torch.Tensor:
        base = torch.randn(canonical)
        if "C" not in order:
            return base.permute(["B2NHD".index(c) for c in order]).contiguous()
        # Fused K|V: [B, N, H, 2, D] -> the order's dims with 2D merged into C (K first).
        spelled = order.replace("C", "2D")
        return base.permute(["B2NHD".index(c) for c in spelled]).contiguous().flatten(spelled.index("2"), -1)

    caches = [engine_tensor() for _ in range(lay.num_layers)]
    pages = [7, 2, 5, 9]  # two blocks, out of order in the pool
    staging = lay.staging(2)
    assert gather_paged(caches, lay, fmt, pages, staging) == 2
    # Block 1 holds pages 5 then 9: its token 5 is page 9's token 1.
    view = fmt.canonical(caches[1])
    assert torch.equal(staging[1, 1, 0, 5], view[9, 0, 1])
    fresh = [torch.zeros_like(c) for c in caches]
    assert scatter_paged(staging, fresh, lay, fmt, [0, 1, 3, 4]) == 2
    for c, f in zip(caches, fresh, strict=True):
        src, dst = fmt.canonical(c), fmt.canonical(f)
        assert torch.equal(dst[[0, 1, 3, 4]], src[pages])
        assert not dst[[2, 5, 6, 7, 8, 9]].any()  # nothing else touched


def cpu_attn_like(pages: int, heads: int, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [B, H, N, 2D] tensor filled as vLLM's CPU attention does: per head K transposed [D, N], then V [N, D].
    Returns it with the K and V it holds, each [B, N, H, D]."""
    k, v = torch.randn(pages, n, heads, d), torch.randn(pages, n, heads, d)
    head_pages = torch.cat(
        (k.permute(0, 2, 3, 1).reshape(pages, heads, -1), v.permute(0, 2, 1, 3).reshape(pages, heads, -1)), -1
    )
    return head_pages.view(pages, heads, n, 2 * d), k, v


def test_a_head_interior_reads_k_transposed_then_v() -> None:
    n, d = 4, 3
    offsets = torch.stack([
        torch.arange(n).view(n, 1) + n * torch.arange(d).view(1, d),  # K^T: token stride 1, dim stride n
        n * d + d * torch.arange(n).view(n, 1) + torch.arange(d).view(1, d),  # V: token stride d, dim stride 1
    ])  # fmt: skip
    interior = HeadInterior.from_offsets("cpu_attn/vec", offsets)
    assert interior.k == (0, 1, n) and interior.v == (n * d, d, 1)
    lay = layout(block_tokens=8, head_dim=d)
    fmt = PagedFormat("BHNC", block_size=n, interior=interior)
    caches, ks, vs = zip(*(cpu_attn_like(10, 2, n, d) for _ in range(lay.num_layers)), strict=True)
    staging = lay.staging(2)
    assert gather_paged(list(caches), lay, fmt, [7, 2, 5, 9], staging) == 2
    # Stored block 1 = pages 5 and 9: its token 5 is page 9's token 1, K and V alike.
    assert torch.equal(staging[1, 2, 0, 5], ks[2][9, 1]) and torch.equal(staging[1, 2, 1, 5], vs[2][9, 1])
    fresh = [torch.zeros_like(c) for c in caches]
    assert scatter_paged(staging, fresh, lay, fmt, [0, 1, -1, 4]) == 2
    for c, f in zip(caches, fresh, strict=True):
        assert torch.equal(f[[0, 1, 4]], c[[7, 2, 9]]) and not f[[2, 3, 5]].any()
    # Read as if it were per-token K|V (what the shape alone suggests), the same pages give other numbers.
    wrong = lay.staging(2)
    gather_paged(list(caches), lay, PagedFormat("BHNC", block_size=n), [7, 2, 5, 9], wrong)
    assert not torch.equal(wrong, staging)


def test_a_head_interior_that_no_strided_view_reads_is_gathered_through_its_index() -> None:
    """Tiles as AMX kernels pack them (here: pairs of tokens interleaved per dim, K then V, shuffled by tile):
    no strided view reads them, the page's index does, both ways."""
    n, d, heads, pages = 4, 3, 2, 10
    rng = torch.Generator().manual_seed(7)
    offsets = torch.randperm(2 * n * d, generator=rng).view(2, n, d)
    interior = HeadInterior.from_offsets("cpu_attn/amx", offsets)
    assert not interior.strided
    lay = layout(block_tokens=8, head_dim=d)
    fmt = PagedFormat("BHNC", block_size=n, interior=interior)
    with pytest.raises(InvalidArgument, match="no strided view"):
        fmt.parts(torch.zeros(pages, heads, n, 2 * d))
    ks = [torch.randn(pages, n, heads, d) for _ in range(lay.num_layers)]
    vs = [torch.randn(pages, n, heads, d) for _ in range(lay.num_layers)]
    caches = []
    for k, v in zip(ks, vs, strict=True):
        head_pages = torch.empty(pages, heads, 2 * n * d)
        head_pages[:, :, offsets[0].reshape(-1)] = k.permute(0, 2, 1, 3).reshape(pages, heads, -1)
        head_pages[:, :, offsets[1].reshape(-1)] = v.permute(0, 2, 1, 3).reshape(pages, heads, -1)
        caches.append(head_pages.view(pages, heads, n, 2 * d))
    staging = lay.staging(2)
    assert gather_paged(caches, lay, fmt, [7, 2, 5, 9], staging) == 2
    assert torch.equal(staging[1, 2, 0, 5], ks[2][9, 1]) and torch.equal(staging[1, 2, 1, 5], vs[2][9, 1])
    assert torch.equal(staging[0, 1, 0, :4], ks[1][7]) and torch.equal(staging[0, 1, 1, 4:], vs[1][2])
    fresh = [torch.zeros_like(c) for c in caches]
    assert scatter_paged(staging, fresh, lay, fmt, [0, 1, -1, 4]) == 2
    for c, f in zip(caches, fresh, strict=True):
        assert torch.equal(f[[0, 1, 4]], c[[7, 2, 9]]) and not f[[2, 3, 5]].any()
    # Pages the engine holds already are skipped, all of them too; nothing to write writes nothing.
    assert scatter_paged(staging, fresh, lay, fmt, [-1, -1]) == 1
    assert scatter_paged(staging, fresh, lay, fmt, []) == 0
    assert not fresh[0][[2, 3, 5]].any()


def test_a_head_interior_must_place_every_element_once() -> None:
    offsets = torch.arange(2 * 4 * 2).view(2, 4, 2)
    assert HeadInterior.from_offsets("plain", offsets).k == (0, 2, 1)
    twice = offsets.clone()
    twice[1, 0, 0] = 0
    with pytest.raises(InvalidArgument, match="two elements"):
        HeadInterior.from_offsets("broken", twice)
    past = offsets.clone()
    past[1, 3, 1] = 2 * 4 * 2
    with pytest.raises(InvalidArgument, match="two elements at one place, or none"):
        HeadInterior.from_offsets("past", past)
    with pytest.raises(InvalidArgument, match="order BHNC"):
        PagedFormat("2BNHD", interior=HeadInterior.from_offsets("plain", offsets))


def test_paged_rejects_partial_blocks_and_foreign_shapes() -> None:
    lay = layout(block_tokens=8)
    caches = [torch.zeros(4, 2, 4, 8) for _ in range(3)]  # BHNC: 4 pages of 4 tokens, 2 heads, 2 x 4 dims
    with pytest.raises(InvalidArgument, match="whole number"):
        gather_paged(caches, lay, PagedFormat(block_size=4), [0, 1, 2], lay.staging(2))
    with pytest.raises(InvalidArgument, match="pages"):
        gather_paged(caches, lay, PagedFormat(block_size=3), [0], lay.staging(2))
    with pytest.raises(InvalidArgument, match="layout wants"):
        gather_paged(caches, layout(head_dim=8), PagedFormat(block_size=4), [0, 1], lay.staging(2))
    with pytest.raises(InvalidArgument, match="paged order"):
        PagedFormat("2BNHX")
    with pytest.raises(InvalidArgument, match="dims"):
        PagedFormat("BHNC").canonical(torch.zeros(2, 2, 2, 2, 2))


@dataclasses.dataclass
class DictStore:
    """A plain in-memory BlockStore for the byte moves (the real store is tested in integration)."""

    blocks: dict[str, bytes] = dataclasses.field(default_factory=dict)

    def match_prefix(self, keys: object) -> int:
        raise NotImplementedError

    def exists_many(self, keys: object) -> list[bool]:
        raise NotImplementedError

    def flush(self) -> None:
        pass  # every put here is visible at once

    def put_many(self, items: object) -> None:
        for key, tensor in items:  # type: ignore[attr-defined]
            self.blocks.setdefault(key, tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())

    def get_many_into(self, keys: list[str], buffers: list[torch.Tensor], **kw: object) -> list[int | None]:
        out: list[int | None] = []
        for key, buf in zip(keys, buffers, strict=True):
            data = self.blocks.get(key)
            flat = buf.view(torch.uint8).reshape(-1)
            if data is None or (kw.get("exact_size") and len(data) != flat.numel()):
                out.append(None)
                continue
            flat[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            out.append(len(data))
        return out


def test_load_counts_leading_whole_blocks_only() -> None:
    lay = layout()
    store = DictStore()
    staging = lay.staging(3).normal_()
    keys = lay.keys(list(range(24)))
    assert save_blocks(store, keys, staging) == 3
    back = lay.staging(3)
    assert load_blocks(store, keys, back) == 3 and torch.equal(back, staging)
    store.blocks[keys[1]] = b"short"
    assert load_blocks(store, keys, lay.staging(3)) == 1  # a block of the wrong size ends the prefix
    del store.blocks[keys[0]]
    assert load_blocks(store, keys, lay.staging(3)) == 0
    with pytest.raises(InvalidArgument):
        load_blocks(store, keys, lay.staging(2))
