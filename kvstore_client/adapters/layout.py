"""KV layouts: how one rank's KV cache becomes store objects, and back.

A :class:`KVLayout` describes the KV cache of one model on one tensor-parallel rank
(layers, KV heads, head dim, dtype, tokens per block). An object holds one prefix
block of ``block_tokens`` tokens for every layer, layer-major::

    object  = layer 0 | layer 1 | ... | layer L-1      (layer_bytes each)
    layer l = K[tokens, kv_heads, head_dim] | V[tokens, kv_heads, head_dim]

so layer ``l`` is the byte range :meth:`KVLayout.layer_range` and can be read or
written on its own. Token-major order inside a layer is vLLM's paged order; an
engine whose tensors differ (Hugging Face's head-major cache) transposes on the
way, in one tensor copy per layer for all blocks of a request, never per block.

Blocks travel through a *staging* tensor ``[blocks, layers, 2, tokens, kv_heads,
head_dim]``: the store reads into and writes from ``staging[i]`` (a contiguous
view, handed to ``get_many_into`` / ``put_many`` without a copy). Keys come from
:func:`block_keys` under :attr:`KVLayout.namespace`, which spells out the model,
dtype, shape, tensor-parallel rank and layout version, so two layouts never share
a key; the trailing partial block of a prompt has its own key (:func:`tail_key`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey, block_keys, tail_key, validate_namespace

LAYOUT_VERSION = 2
"""Bumped whenever the byte order of an object or the spelling of its namespace changes: old objects then
never match. Version 1 held vLLM CPU pages as the backend wrote them (K transposed), not in this order."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}

CANONICAL_ORDER = "B2NHD"
"""Dimensions of one layer's slice of the staging tensor, in vLLM's letters: block, K/V, token, head, head dim."""


class BlockStore(Protocol):
    """What the adapters need of a store (``kvstore_client.Store`` is one)."""

    def match_prefix(self, keys: Sequence[Any]) -> int: ...

    def exists_many(self, keys: Sequence[Any]) -> list[bool]: ...

    def get_many_into(
        self, keys: Sequence[Any], buffers: Sequence[Any], *, verify: bool = False, exact_size: bool = False
    ) -> list[int | None]: ...

    def get_range_many_into(
        self, keys: Sequence[Any], start: int, length: int, buffers: Sequence[Any]
    ) -> list[int | None]: ...

    def put_many(self, items: Iterable[tuple[Any, Any]]) -> Any: ...

    def flush(self) -> None:
        """Return once every put of this client is visible to every other (a hand-off calls it)."""
        ...


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise InvalidArgument(f"dtype {dtype} has no KV layout; use one of {', '.join(DTYPES)}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One rank's KV cache and the byte form of its blocks. Immutable; checked at construction."""

    model: str
    """Identity of the weights (a name, or a fingerprint of config and seed): KV of other weights differs."""
    num_layers: int
    num_kv_heads: int
    """KV heads held by this rank."""
    head_dim: int
    dtype: str
    """One of :data:`DTYPES`."""
    block_tokens: int
    """Tokens per stored block."""
    tp_rank: int = 0
    tp_size: int = 1
    first_layer: int = 0
    """The model's index of ``layer 0`` here: a pipeline stage holds layers ``first_layer ..`` only."""
    model_layers: int = 0
    """Layers of the whole model (0: ``num_layers``, one stage holds them all)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidArgument(f"model must be a non-empty str, got {self.model!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
        if type(self.first_layer) is not int or type(self.model_layers) is not int or self.first_layer < 0:
            raise InvalidArgument(f"first_layer and model_layers must be ints >= 0, got {self.first_layer!r}")
        if self.first_layer + self.num_layers > self.total_layers:
            raise InvalidArgument(
                f"layers {self.first_layer}..{self.first_layer + self.num_layers - 1} are past the model's"
                f" {self.total_layers}"
            )
        if type(self.tp_rank) is not int or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        try:
            validate_namespace(self.namespace)
        except InvalidArgument as exc:  # a model name too long for keys, or with a control character
            raise InvalidArgument(f"model {self.model[:60]!r} cannot be part of a key namespace: {exc}") from None

    # -- identity --------------------------------------------------------------------------
    @property
    def total_layers(self) -> int:
        return self.model_layers or self.num_layers

    @property
    def namespace(self) -> str:
        """The key namespace, in front of every key: every field that changes an object's bytes, and the
        layout version, as ``kv<version>/<model>/<dtype>/<layers>L-<kv heads>H-<head dim>D/tp<rank>of<size>``,
        where ``<layers>`` is the model's layer count, followed by ``[<first>-<last>]`` on a pipeline stage
        that holds only those layers.

        So ``kvstore keys --prefix kv2/<model>/`` lists one model's blocks. Only the model is free text
        (it may hold ``/``), and the segments after it never do, so no two field lists spell the same string.
        """
        layers = f"{self.total_layers}L"
        if self.num_layers != self.total_layers:
            layers += f"[{self.first_layer}-{self.first_layer + self.num_layers - 1}]"
        return (
            f"kv{LAYOUT_VERSION}/{self.model}/{self.dtype}/"
            f"{layers}-{self.num_kv_heads}H-{self.head_dim}D/tp{self.tp_rank}of{self.tp_size}"
        )

    def keys(self, token_ids: Any, extras: Sequence[bytes] | None = None) -> list[BlockKey]:
        """One key per full block of ``token_ids``, chained by prefix; ``extras[i]`` is whatever else
        changes block ``i``'s KV (an adapter, a salt, an image in it: see :func:`block_keys`)."""
        return block_keys(token_ids, self.block_tokens, self.namespace, extras=extras)

    def tail_key(self, token_ids: Any, extras: Sequence[bytes] | None = None) -> BlockKey | None:
        """The key of the trailing partial block (None when the last block is full)."""
        return tail_key(token_ids, self.block_tokens, self.namespace, extras=extras)

    # -- sizes -----------------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def layer_bytes(self, tokens: int | None = None) -> int:
        """Bytes of one layer (K and V) of a block of ``tokens`` tokens (a full block by default)."""
        n = self.block_tokens if tokens is None else tokens
        return 2 * n * self.num_kv_heads * self.head_dim * self.itemsize

    def block_bytes(self, tokens: int | None = None) -> int:
        """Bytes of one object: every layer of a block of ``tokens`` tokens (a full block by default)."""
        return self.num_layers * self.layer_bytes(tokens)

    def layer_range(self, layer: int, tokens: int | None = None) -> tuple[int, int]:
        """(start, length) in bytes of ``layer`` inside an object."""
        if not 0 <= layer < self.num_layers:
            raise InvalidArgument(f"layer must be in [0, {self.num_layers}), got {layer}")
        size = self.layer_bytes(tokens)
        return layer * size, size

    def staging(self, num_blocks: int, tokens: int | None = None, *, pin: bool = False) -> torch.Tensor:
        """An uninitialised ``[blocks, layers, 2, tokens, kv_heads, head_dim]`` tensor to move blocks through."""
        n = self.block_tokens if tokens is None else tokens
        shape = (num_blocks, self.num_layers, 2, n, self.num_kv_heads, self.head_dim)
        return torch.empty(shape, dtype=self.torch_dtype, pin_memory=pin)


# -- moving blocks between staging and the store ----------------------------------------------


def save_blocks(store: BlockStore, keys: Sequence[str], staging: torch.Tensor) -> int:
    """Put ``staging[i]`` under ``keys[i]`` in one batch; returns the number of blocks handed to the store."""
    if len(keys) > staging.shape[0]:
        raise InvalidArgument(f"{len(keys)} keys but staging holds {staging.shape[0]} blocks")
    if keys:
        store.put_many(zip(keys, staging[: len(keys)].unbind(0), strict=True))
    return len(keys)


def leading_blocks(sizes: Sequence[int | None], size: int | None = None) -> int:
    """How many results arrived before the first miss (None), or with ``size`` before the first of
    another size."""
    for i, got in enumerate(sizes):
        if got is None or (size is not None and got != size):
            return i
    return len(sizes)


def load_blocks(store: BlockStore, keys: Sequence[str], staging: torch.Tensor) -> int:
    """Read ``keys`` into ``staging[i]`` in one batch; returns how many *leading* blocks arrived whole.

    A block that is missing, or whose stored size is not the layout's, ends the prefix:
    what follows it is of no use to a causal model.
    """
    if len(keys) > staging.shape[0]:
        raise InvalidArgument(f"{len(keys)} keys but staging holds {staging.shape[0]} blocks")
    if not keys:
        return 0
    sizes = store.get_many_into(keys, staging[: len(keys)].unbind(0), exact_size=True)
    return leading_blocks(sizes)


def load_layer(store: BlockStore, keys: Sequence[str], layout: KVLayout, layer: int, staging: torch.Tensor) -> int:
    """Read one layer of ``keys`` into ``staging[i, layer]`` (each a contiguous view), the rest untouched.

    Returns how many leading blocks gave their layer. A reader can so pull layer by layer and
    start computing on the first layers while the later ones are on the way.
    """
    if len(keys) > staging.shape[0]:
        raise InvalidArgument(f"{len(keys)} keys but staging holds {staging.shape[0]} blocks")
    if not keys:
        return 0
    start, length = layout.layer_range(layer, tokens=staging.shape[3])
    sizes = store.get_range_many_into(keys, start, length, [staging[i, layer] for i in range(len(keys))])
    return leading_blocks(sizes)


# -- Hugging Face DynamicCache: per layer [batch, kv_heads, tokens, head_dim] ---------------------


def gather_hf(
    layers_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout, start: int, out: torch.Tensor
) -> None:
    """Copy tokens ``start ..`` of a batch-1 head-major cache into ``out`` (a staging tensor).

    ``out`` is ``[n, layers, 2, t, heads, dim]``: n blocks of t tokens from ``start`` on.
    One copy per layer and K/V, covering all n blocks.
    """
    n, _, _, t = out.shape[:4]
    _check_layers(layers_kv, layout)
    for layer, (k, v) in enumerate(layers_kv):
        if k.shape[0] != 1:
            raise InvalidArgument(f"only batch 1 caches map to blocks, got batch {k.shape[0]}")
        if start + n * t > k.shape[2]:
            raise InvalidArgument(f"cache holds {k.shape[2]} tokens; blocks need {start + n * t}")
        for part, src in enumerate((k, v)):
            # [heads, n*t, dim] -> [n, t, heads, dim]
            block = src[0, :, start : start + n * t].reshape(layout.num_kv_heads, n, t, layout.head_dim)
            out[:, layer, part].copy_(block.permute(1, 2, 0, 3))


def hf_layers_from(
    parts: Sequence[torch.Tensor], layout: KVLayout, tokens: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) ``[1, heads, tokens, dim]`` from staging tensors laid end to end in token order.

    ``tokens`` (default: all) keeps the first tokens only. One copy per layer, K/V and part, on the
    parts' device (so a GPU does the transposes once the staged bytes are there).
    """
    total = sum(p.shape[0] * p.shape[3] for p in parts)
    n = total if tokens is None else tokens
    if not 0 <= n <= total:
        raise InvalidArgument(f"{n} tokens asked of blocks holding {total}")
    shape = (1, layout.num_kv_heads, n, layout.head_dim)
    device = parts[0].device if parts else torch.device("cpu")
    out = []
    for layer in range(layout.num_layers):
        kv = (
            torch.empty(shape, dtype=layout.torch_dtype, device=device),
            torch.empty(shape, dtype=layout.torch_dtype, device=device),
        )
        at = 0
        for p in parts:
            blocks, t = p.shape[0], p.shape[3]
            take = min(blocks * t, n - at)
            if take <= 0:
                break
            whole, rest = divmod(take, t)
            for part in range(2):
                src = p[:, layer, part]  # [blocks, t, heads, dim]
                dst = kv[part][0, :, at : at + whole * t].view(layout.num_kv_heads, whole, t, layout.head_dim)
                dst.copy_(src[:whole].permute(2, 0, 1, 3))
                if rest:
                    kv[part][0, :, at + whole * t : at + take].copy_(src[whole, :rest].transpose(0, 1))
            at += take
        out.append(kv)
    return out


def _check_layers(layers_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout) -> None:
    if len(layers_kv) != layout.num_layers:
        raise InvalidArgument(f"cache has {len(layers_kv)} layers, layout {layout.num_layers}")
    k = layers_kv[0][0]
    if k.dtype != layout.torch_dtype or k.shape[1] != layout.num_kv_heads or k.shape[3] != layout.head_dim:
        raise InvalidArgument(
            f"cache layer is {tuple(k.shape)} {k.dtype}; layout wants [1, {layout.num_kv_heads}, tokens,"
            f" {layout.head_dim}] {layout.dtype}"
        )


# -- paged caches (vLLM): per layer a tensor over pages, tokens, heads and K/V in some order ----------------


@dataclass(frozen=True, slots=True, eq=False)
class HeadInterior:
    """Where K and V of one head sit inside its page when the tensor's shape does not say it.

    Some backends declare a ``[..., N, C]`` head page but fill it otherwise: vLLM's CPU attention keeps K
    transposed (``[head_dim, tokens]``) and then V (``[tokens, head_dim]``) in the ``N * C`` elements with
    its vector kernels, and packs both in tiles with its AMX kernels. Built from where a backend's own
    kernel really wrote known values (:meth:`from_offsets`), never from a reading of the shape.
    """

    name: str
    """What it was read from, for messages (``cpu_attn/vec``)."""
    index: torch.Tensor
    """``[2 * N * D]`` long: the element of the head page holding K (then V) of token ``n``, dim ``d`` at
    ``part * N * D + n * D + d``; a permutation of the page's elements."""
    k: tuple[int, int, int] | None
    """For K and V each, ``(offset, token stride, dim stride)`` in elements from the head page's first
    element, where the part is affine in token and dim (read then through a strided view, no copy)."""
    v: tuple[int, int, int] | None

    @property
    def strided(self) -> bool:
        return self.k is not None and self.v is not None

    @classmethod
    def from_offsets(cls, name: str, offsets: torch.Tensor) -> HeadInterior:
        """From ``offsets[part, token, dim]``: the element of the head page holding K (part 0) or V (1).

        Raises :class:`InvalidArgument` unless every element of the page holds exactly one of them.
        """
        if offsets.dim() != 3 or offsets.shape[0] != 2:
            raise InvalidArgument(f"{name}: offsets must be [2, tokens, head_dim], got {tuple(offsets.shape)}")
        flat = offsets.reshape(-1).to(torch.long)
        if flat.numel() != int(torch.unique(flat).numel()) or int(flat.min()) < 0 or int(flat.max()) >= flat.numel():
            raise InvalidArgument(f"{name}: the probed page puts two elements at one place, or none")
        parts: list[tuple[int, int, int] | None] = []
        for part in range(2):
            grid = offsets[part].to(torch.long)
            base = int(grid[0, 0])
            s_n = int(grid[1, 0] - base) if grid.shape[0] > 1 else 0
            s_d = int(grid[0, 1] - base) if grid.shape[1] > 1 else 0
            n = torch.arange(grid.shape[0]).view(-1, 1)
            d = torch.arange(grid.shape[1]).view(1, -1)
            parts.append((base, s_n, s_d) if torch.equal(grid, base + n * s_n + d * s_d) else None)
        return cls(name, flat.contiguous(), parts[0], parts[1])


@dataclass(frozen=True, slots=True)
class PagedFormat:
    """The dimension order of an engine's per-layer paged KV tensor, and what is inside a head's page.

    Letters as vLLM's: ``B`` page (block), ``N`` token in the page, ``H`` KV head, ``D`` head
    dim, ``2`` K or V, and ``C`` a fused K|V dimension of ``2 * head_dim`` (K first).
    ``"BHNC"`` is vLLM's standardized per-layer view ``[B, H, N, C]`` (v0.2x on);
    ``"2BNHD"`` older vLLM FlashAttention ``[2, num_blocks, block_size, kv_heads, head_dim]``;
    ``"B2NHD"`` FlashInfer's ``[num_blocks, 2, block_size, kv_heads, head_dim]``.
    With an ``interior`` the order names only the pages and heads (``"BHNC"``); each head's ``N * C``
    elements are laid out as the interior says.
    """

    order: str = "BHNC"
    block_size: int = 16
    """Tokens per engine page; a stored block spans ``block_tokens // block_size`` pages."""
    interior: HeadInterior | None = None

    def __post_init__(self) -> None:
        if sorted(self.order.replace("C", "2D")) != sorted(CANONICAL_ORDER) or self.order.count("C") > 1:
            raise InvalidArgument(
                f"paged order must name B, N, H and D, and K/V as 2 or fused into C; got {self.order!r}"
            )
        if type(self.block_size) is not int or self.block_size <= 0:
            raise InvalidArgument(f"block_size must be a positive int, got {self.block_size!r}")
        if self.interior is not None and self.order != "BHNC":
            raise InvalidArgument(f"a head page interior needs the order BHNC, got {self.order!r}")

    def canonical(self, kv: torch.Tensor) -> torch.Tensor:
        """A ``[pages, 2, page_tokens, heads, dim]`` view of one layer's tensor (no copy); formats with
        an interior have no such single view: use :meth:`parts`."""
        if self.interior is not None:
            raise InvalidArgument(f"pages of {self.interior.name} hold K and V in different orders; use parts()")
        order = self.order
        if kv.dim() != len(order):
            raise InvalidArgument(f"a paged KV tensor in order {order} has {len(order)} dims, got {tuple(kv.shape)}")
        if "C" in order:
            at = order.index("C")
            if kv.shape[at] % 2:
                raise InvalidArgument(f"a fused K|V dimension must be even, got {kv.shape[at]}")
            kv = kv.unflatten(at, (2, kv.shape[at] // 2))
            order = order[:at] + "2D" + order[at + 1 :]
        return kv.permute([order.index(c) for c in CANONICAL_ORDER])

    def page_shape(self, kv: torch.Tensor) -> tuple[int, int, int, int]:
        """``(pages, page_tokens, heads, head_dim)`` of one layer's tensor."""
        if self.interior is None:
            pages, _, n, heads, dim = self.canonical(kv).shape
            return pages, n, heads, dim
        if kv.dim() != 4 or kv.shape[3] % 2:
            raise InvalidArgument(f"a BHNC paged KV tensor has 4 dims and an even C, got {tuple(kv.shape)}")
        pages, heads, n, c = kv.shape
        if kv.stride(3) != 1 or kv.stride(2) != c:
            raise InvalidArgument(f"{self.interior.name}: each head's page must be contiguous, strides {kv.stride()}")
        if self.interior.index.numel() != n * c:
            raise InvalidArgument(
                f"{self.interior.name}: probed for pages of {self.interior.index.numel()} elements, the tensor's"
                f" hold {n * c}"
            )
        return pages, n, heads, c // 2

    def parts(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer's tensor as two ``[pages, page_tokens, heads, dim]`` views (no copy).

        Only where a strided view can read them: see :meth:`read` and :meth:`write` for any format."""
        if self.interior is None:
            view = self.canonical(kv)
            return view[:, 0], view[:, 1]
        pages, n, heads, dim = self.page_shape(kv)
        if self.interior.k is None or self.interior.v is None:
            raise InvalidArgument(f"{self.interior.name}: no strided view reads this page interior; use read()")
        out = []
        for off, s_n, s_d in (self.interior.k, self.interior.v):
            size, stride = (pages, n, heads, dim), (kv.stride(0), s_n, kv.stride(1), s_d)
            out.append(kv.as_strided(size, stride, kv.storage_offset() + off))
        return out[0], out[1]

    def read(self, kv: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the pages ``ids`` of one layer's tensor, each ``[len(ids), page_tokens, heads, dim]``."""
        if self.interior is None or self.interior.strided:
            k, v = self.parts(kv)
            return k.index_select(0, ids), v.index_select(0, ids)
        _, n, heads, dim = self.page_shape(kv)
        index = self.interior.index.to(kv.device)
        pages = kv.index_select(0, ids).view(len(ids), heads, 2 * n * dim).index_select(2, index)
        both = pages.view(len(ids), heads, 2, n, dim).permute(2, 0, 3, 1, 4)
        return both[0], both[1]

    def write(self, kv: torch.Tensor, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k`` and ``v`` (each ``[len(ids), page_tokens, heads, dim]``) into the pages ``ids``, in place."""
        if self.interior is None or self.interior.strided:
            for view, src in zip(self.parts(kv), (k, v), strict=True):
                view.index_copy_(0, ids, src)
            return
        _, n, heads, dim = self.page_shape(kv)
        if not len(ids):
            return
        both = torch.stack((k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)), 2).reshape(len(ids), heads, 2 * n * dim)
        pages = torch.empty_like(both)  # every element written: the index is a permutation of the page
        pages.index_copy_(2, self.interior.index.to(kv.device), both)
        kv.index_copy_(0, ids, pages.view(len(ids), heads, n, 2 * dim))

    def pages_per_block(self, layout: KVLayout) -> int:
        if layout.block_tokens % self.block_size:
            raise InvalidArgument(
                f"a stored block of {layout.block_tokens} tokens is not a whole number of {self.block_size}-token pages"
            )
        return layout.block_tokens // self.block_size


def _paged_ids(
    kv_caches: Sequence[torch.Tensor], layout: KVLayout, fmt: PagedFormat, page_ids: Sequence[int]
) -> tuple[torch.Tensor, int]:
    if len(kv_caches) != layout.num_layers:
        raise InvalidArgument(f"{len(kv_caches)} KV tensors for a layout of {layout.num_layers} layers")
    k = fmt.pages_per_block(layout)
    if len(page_ids) % k:
        raise InvalidArgument(f"{len(page_ids)} pages is not a whole number of {k}-page blocks")
    first = kv_caches[0]
    pages, *shape = fmt.page_shape(first)
    for layer, kv in enumerate(kv_caches[1:], 1):  # every layer checked before any is written
        if fmt.page_shape(kv) != (pages, *shape) or (kv.dtype, kv.device) != (first.dtype, first.device):
            raise InvalidArgument(
                f"paged KV tensor of layer {layer} is {tuple(kv.shape)} {kv.dtype} on {kv.device}; layer 0's is"
                f" {tuple(first.shape)} {first.dtype} on {first.device}"
            )
    want = [fmt.block_size, layout.num_kv_heads, layout.head_dim]
    if shape != want or first.dtype != layout.torch_dtype:
        raise InvalidArgument(
            f"paged KV tensor is {tuple(first.shape)} {first.dtype} in order {fmt.order};"
            f" the layout wants pages of 2 x {tuple(want)} {layout.dtype}"
        )
    ids = torch.as_tensor(list(page_ids), dtype=torch.long, device=first.device)
    if ids.numel() and int(ids.max()) >= pages:
        raise InvalidArgument(f"page {int(ids.max())} is past the {pages} pages of the KV tensor")
    return ids, k


def gather_paged(
    kv_caches: Sequence[torch.Tensor], layout: KVLayout, fmt: PagedFormat, page_ids: Sequence[int], out: torch.Tensor
) -> int:
    """Copy the pages ``page_ids`` (``pages_per_block`` per stored block, in token order) into ``out``.

    Returns the number of blocks written: ``len(page_ids) // pages_per_block``. One gather per layer and K/V.
    """
    ids, k = _paged_ids(kv_caches, layout, fmt, page_ids)
    n = len(page_ids) // k
    if n > out.shape[0]:
        raise InvalidArgument(f"{n} blocks but staging holds {out.shape[0]}")
    shape = (n, k, fmt.block_size, layout.num_kv_heads, layout.head_dim)
    for layer, kv in enumerate(kv_caches):
        for part, pages in enumerate(fmt.read(kv, ids)):  # [n*k, page, heads, dim]: a block's pages in a row
            out[:n, layer, part].view(shape).copy_(pages.view(shape))
    return n


def scatter_paged(
    staging: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    layout: KVLayout,
    fmt: PagedFormat,
    page_ids: Sequence[int],
) -> int:
    """Copy blocks of ``staging`` into the engine's pages ``page_ids``, in place. Returns the blocks written.

    A page id of -1 skips that page (one the engine holds already, shared with other requests).
    """
    ids, k = _paged_ids(kv_caches, layout, fmt, page_ids)
    n = len(page_ids) // k
    if n > staging.shape[0]:
        raise InvalidArgument(f"{n} blocks but staging holds {staging.shape[0]}")
    keep = ids >= 0
    every = bool(keep.all())
    shape = (n * k, fmt.block_size, layout.num_kv_heads, layout.head_dim)
    for layer, kv in enumerate(kv_caches):
        parts = [staging[:n, layer, part].reshape(shape).to(kv.device) for part in range(2)]
        if every:
            fmt.write(kv, ids, parts[0], parts[1])
        else:
            fmt.write(kv, ids[keep], parts[0][keep], parts[1][keep])
    return n
