"""The vLLM connector's scheduler side: in vLLM's scheduler process, it looks prompts up in the store
and plans each step's loads and saves for the workers (:class:`KVStoreConnectorMetadata`). It never
touches KV bytes; the workers' side (:mod:`kvstore_client.adapters.vllm_worker`) moves them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvstore.errors import KVStoreError
from kvstore.events import EngineBlock
from kvstore_client.adapters.layout import leading_blocks
from kvstore_client.adapters.vllm_config import ConnectorSettings
from kvstore_client.adapters.vllm_inspect import block_extras
from kvstore_client.adapters.vllm_metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore_client.adapters.vllm_metrics import KVStoreConnectorStats, StatsCounter
from kvstore_client.adapters.vllm_store import GuardedStore, repair

SCHEME_PERIOD_S = 10.0
"""How often the scheduler's stats repeat the key scheme (``vllm:kvstore_layout_info``)."""


@dataclass(slots=True)
class _Request:
    """What the scheduler side remembers of a running request."""

    tokens: list[int]
    pages: list[int]
    saved_blocks: int
    """Leading blocks the store holds (found by the lookup, loaded, or saved by this connector)."""
    extras: list[bytes] | None
    live: Any = None
    """vLLM's own request, whose tokens grow as it decodes (``save_decode``); None: the prompt only."""
    hashed: Any = None
    """vLLM's own request, for its block hashes (``label_blocks``); None: saves are not labelled."""


class KVStoreConnectorScheduler:
    """The connector's scheduler side, for vLLM's scheduler-side hooks.

    Only vLLM's scheduler calls it, from one thread, so its per-request maps need no lock. A request
    enters them at its lookup (``_asked``, ``_store_hit``, ``_extras``) or allocation (``_loads``,
    ``_live``, ``_hashed``), moves to ``_requests`` when it is first scheduled, and leaves them all
    when it finishes."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.store = GuardedStore(settings.master, timeout_s=settings.lookup_timeout_s, put_mode=settings.put_mode)
        self.stats = StatsCounter()
        self._asked: dict[str, int] = {}  # request -> the local hit it was last asked about
        self._store_hit: dict[str, int] = {}  # request -> leading prompt blocks the store holds
        self._extras: dict[str, list[bytes] | None] = {}
        self._loads: dict[str, LoadSpec] = {}
        self._requests: dict[str, _Request] = {}
        self._live: dict[str, Any] = {}  # request -> vLLM's request, from its allocation to its first step
        self._hashed: dict[str, Any] = {}  # the same, kept for its block hashes (label_blocks)
        self._scheme_due = 0.0  # when the next report carries the key scheme

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the store can give: whole stored blocks of the prompt,
        held under every rank's and stage's namespace, never the last token (vLLM computes it to sample)."""
        tokens = list(request.prompt_token_ids or [])
        bt = self.settings.block_tokens
        extras = self._extras.get(request.request_id)
        if request.request_id not in self._extras:
            extras = self._extras[request.request_id] = block_extras(request, len(tokens) // bt, bt)
        if not self.settings.is_consumer or not tokens:
            return 0, False
        if not self.store.available():
            self.stats.add("skipped_ops")
            return 0, False
        self.stats.add("lookups")
        try:
            # Sizes, not only presence: a block of another size under our key is no hit (and is removed).
            hit = len(tokens) // bt
            for lay in self.settings.layouts:
                keys = lay.keys(tokens, extras)
                sizes = self.store.client.sizes(keys)
                hit = min(hit, leading_blocks(sizes, lay.block_bytes()))
                self.stats.add("repaired_blocks", repair(self.store.client, keys, sizes, lay.block_bytes()))
        except KVStoreError as exc:
            self.stats.add("lookup_failures")
            self.store.failed(exc, f"looking up request {request.request_id}")
            return 0, False
        self.store.breaker.success()
        self._store_hit[request.request_id] = hit
        hit_tokens = min(hit * bt, request.num_tokens - 1)
        self._asked[request.request_id] = num_computed_tokens  # the hit the count is relative to
        if hit_tokens <= num_computed_tokens:
            return 0, False
        return hit_tokens - num_computed_tokens, self.settings.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.settings.save_decode:
            self._live[request.request_id] = request
        if self.settings.label_blocks:
            self._hashed[request.request_id] = request
        if num_external_tokens <= 0:
            return
        local = self._asked.get(request.request_id, 0)
        pages = list(blocks.get_block_ids()[0])
        bt, k, page_tokens = self.settings.block_tokens, self.settings.pages_per_block, self.settings.page_tokens
        first, end = local // bt, -(-(local + num_external_tokens) // bt)
        load_pages = []
        for page in range(first * k, end * k):
            owned = local // page_tokens <= page < -(-(local + num_external_tokens) // page_tokens)
            load_pages.append(pages[page] if owned and page < len(pages) else -1)
        tokens = list(request.prompt_token_ids)[: end * bt]
        extras = self._extras.get(request.request_id)
        self._loads[request.request_id] = LoadSpec(
            request.request_id, tokens, first, load_pages, end - first, extras[:end] if extras else None
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        for new in scheduler_output.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids or [])
            # Blocks the store holds already (a local prefix hit on them included) are not put again.
            known = self._store_hit.pop(new.req_id, 0)
            extras = self._extras.pop(new.req_id, None)
            live = self._live.pop(new.req_id, None)
            self._requests[new.req_id] = _Request(
                tokens, list(new.block_ids[0]), known, extras, live, self._hashed.pop(new.req_id, None)
            )
            self._plan_save(meta, new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_pages = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_pages is not None:
                state.pages = list(new_pages[0])  # a resumed request's whole block list
            elif new_pages is not None:
                state.pages.extend(new_pages[0])
            self._plan_save(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _plan_save(self, meta: KVStoreConnectorMetadata, req_id: str, computed: int, out: Any) -> None:
        """Save the blocks this step completes that the store does not hold yet: the prompt's, and with
        ``save_decode`` those its answer fills too (the next turn of a conversation starts with them)."""
        state = self._requests[req_id]
        if not self.settings.is_producer or not self.store.breaker.is_closed:
            return
        bt, k = self.settings.block_tokens, self.settings.pages_per_block
        tokens = state.tokens if state.live is None else state.live.all_token_ids
        done = min(computed + out.num_scheduled_tokens.get(req_id, 0), len(tokens)) // bt
        if done <= state.saved_blocks or done * k > len(state.pages):
            return
        if state.extras is not None and len(state.extras) <= done:  # blocks of the answer: their extras too
            state.extras = block_extras(state.live, done, bt)
        first = state.saved_blocks
        pages = state.pages[first * k : done * k]
        extras = state.extras[:done] if state.extras else None
        labels = engine_labels(state.hashed, tokens, first, done, bt, k) if state.hashed is not None else None
        meta.saves.append(SaveSpec(req_id, list(tokens[: done * bt]), first, pages, done - first, extras, labels))
        state.saved_blocks = done

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        for known in (self._requests, self._asked, self._loads, self._store_hit, self._extras, self._live,
                      self._hashed):  # fmt: skip
            known.pop(request.request_id, None)
        return False, None  # saves copy the pages inside the step: they are free to go

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        """The lookups counted since the last report, and every :data:`SCHEME_PERIOD_S` the key scheme
        (a router reads it from ``/metrics``)."""
        scheme: dict[str, Any] | None = None
        now = time.monotonic()
        if now >= self._scheme_due:
            self._scheme_due = now + SCHEME_PERIOD_S
            lay = self.settings.layouts[0]
            scheme = {"namespace": lay.namespace, "block_tokens": lay.block_tokens, "block_bytes": lay.block_bytes()}
        return self.stats.take(scheme)

    def shutdown(self) -> None:
        self.store.close()


def engine_labels(
    request: Any, tokens: Sequence[int], first: int, done: int, bt: int, k: int
) -> list[EngineBlock] | None:
    """vLLM's names of store blocks ``first .. done - 1`` of ``request``: each block's last page's
    block hash (as vLLM's KV events give it: ``maybe_convert_block_hash``), the page's before it as
    its parent, and its ``bt`` tokens. None when vLLM has not hashed them all (a block of the answer
    not full yet)."""
    hashes = request.block_hashes
    if len(hashes) < done * k:
        return None
    return [
        EngineBlock(
            maybe_convert_block_hash(hashes[(i + 1) * k - 1]),
            maybe_convert_block_hash(hashes[i * k - 1]) if i else None,
            list(tokens[i * bt : (i + 1) * bt]),
            bt,
        )
        for i in range(first, done)
    ]
