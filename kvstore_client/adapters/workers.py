"""Prefill and decode workers of a Hugging Face model on the store (Mooncake's P/D split, on CPU torch).

:class:`PrefillWorker` takes token ids, asks the store for the longest stored
prefix, loads those blocks where that is predicted faster than computing them
(:mod:`kvstore_client.adapters.costs`), computes only the rest, stores every new
full block (and the partial last block, for the decode side), and returns the
first token with its timings. A failed, partial or slow load falls back to
computing what did not arrive; a store that cannot be reached costs speed,
never the request.

:class:`DecodeWorker`, usually in another process, loads a request's KV from the
store (full blocks, then the tail block the prefill stored or, failing that,
recomputes the tail), generates greedily from the first token, and stores the
full blocks its output completes so that the next turn of a conversation finds
them. KV that is gone is recomputed, or with ``on_missing="error"`` raises
:class:`NotFound`: never garbage tokens.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvstore.errors import InvalidArgument, KVStoreError, NotFound
from kvstore_client.adapters.costs import LoadCostModel, LoadPlan, PrefillCostModel, plan_load
from kvstore_client.adapters.hf import blocks_from_cache, cache_from_blocks
from kvstore_client.adapters.layout import BlockStore, KVLayout, load_blocks, save_blocks

log = logging.getLogger(__name__)

LoadPolicy = Literal["auto", "always", "never"]


def _tokens(token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise InvalidArgument("a prompt needs at least one token")
    if int(ids.min()) < 0:
        raise InvalidArgument(f"token ids must be non-negative, got {int(ids.min())}")
    return ids


@dataclass(slots=True)
class PrefillResult:
    first_token: int
    prompt_tokens: int
    matched_tokens: int
    """Tokens of the prompt's longest stored prefix (whole blocks)."""
    loaded_tokens: int
    """Tokens whose KV came from the store and was used."""
    computed_tokens: int
    decision: str
    """``load``, ``recompute: <why>`` or ``miss``."""
    lookup_s: float
    load_s: float
    build_s: float
    """Turning the loaded blocks into the engine's cache."""
    compute_s: float
    ttft_s: float
    """Lookup, load and compute: the time to the first token."""
    save_s: float = 0.0
    stored_blocks: int = 0
    """Blocks handed to the store after the first token (new full blocks, and the tail)."""
    predicted_s: float = 0.0
    predicted_recompute_s: float = 0.0
    logits: torch.Tensor | None = field(default=None, repr=False)
    """The last position's logits (kept with ``keep_logits``)."""

    def record(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__slots__ if k != "logits"}
        for k, v in out.items():
            if isinstance(v, float):
                out[k] = round(v, 6)
        return out


@dataclass(slots=True)
class DecodeResult:
    tokens: list[int]
    """Generated tokens, the prefill's first token first."""
    loaded_tokens: int
    recomputed_tokens: int
    tail: str
    """``transferred``, ``recomputed`` or ``none`` (the prompt ends on a block boundary)."""
    load_s: float
    prepare_s: float
    """Load and recompute: the time until the cache is ready to decode."""
    step_s: list[float]
    """Time of each generated token after the first: the times between tokens."""
    stored_blocks: int = 0
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def tbt_s(self) -> float:
        return sum(self.step_s) / len(self.step_s) if self.step_s else 0.0

    def record(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens, "loaded_tokens": self.loaded_tokens, "recomputed_tokens": self.recomputed_tokens,
            "tail": self.tail, "load_s": round(self.load_s, 6), "prepare_s": round(self.prepare_s, 6),
            "tbt_s": round(self.tbt_s, 6),
            "stored_blocks": self.stored_blocks,
        }  # fmt: skip


class _Engine:
    """What both workers share: the model, its layout, the store, and the forward pass."""

    def __init__(self, model: Any, layout: KVLayout, store: BlockStore | None) -> None:
        self.model = model
        self.layout = layout
        self.store = store
        self.config = model.config
        self.device = next(model.parameters()).device
        # Pinned staging lets copies to and from a GPU run without a bounce through pageable memory.
        self.pin = self.device.type == "cuda"
        self._check_layout()

    def _check_layout(self) -> None:
        with torch.inference_mode():
            out = self.model(
                torch.zeros((1, 1), dtype=torch.long, device=self.device), use_cache=True, logits_to_keep=1
            )
        layers = out.past_key_values.layers
        k = layers[0].keys
        lay = self.layout
        if len(layers) != lay.num_layers or tuple(k.shape[1:]) != (lay.num_kv_heads, 1, lay.head_dim):
            raise InvalidArgument(
                f"the model's cache ({len(layers)} layers of {tuple(k.shape)}) does not match the layout"
                f" ({lay.num_layers} layers, {lay.num_kv_heads} KV heads, head dim {lay.head_dim})"
            )
        if k.dtype != lay.torch_dtype:
            raise InvalidArgument(f"the model's cache is {k.dtype}, the layout {lay.dtype}")

    def forward(self, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """Logits of the last position and the grown cache, for ``ids`` after what ``cache`` holds."""
        with torch.inference_mode():
            out = self.model(ids.to(self.device).unsqueeze(0), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float().cpu(), out.past_key_values

    def save(self, cache: Any, token_ids: torch.Tensor, first_block: int, *, tail: bool, hand_off: bool = False) -> int:
        """Store blocks ``first_block ..`` of the cache's full blocks (and the partial tail): blocks handed over.
        ``hand_off``: another worker loads them next (a prefill's to its decode): they are made visible
        to every client before this returns (``flush``: a store client in ``cached`` put mode answers
        a put before the master knows of it)."""
        if self.store is None:
            return 0
        lay = self.layout
        cached = cache.get_seq_length()
        ids = token_ids[:cached]
        keys = lay.keys(ids)
        stored = 0
        try:
            if first_block < len(keys):
                staging = lay.staging(len(keys) - first_block, pin=self.pin)
                blocks_from_cache(cache, lay, first_block * lay.block_tokens, staging)
                stored += save_blocks(self.store, keys[first_block:], staging)
            tail_key = lay.tail_key(ids) if tail else None
            if tail_key is not None:
                start = len(keys) * lay.block_tokens
                staging = lay.staging(1, tokens=cached - start, pin=self.pin)
                blocks_from_cache(cache, lay, start, staging)
                stored += save_blocks(self.store, [tail_key], staging)
            if hand_off and stored:
                self.store.flush()
        except KVStoreError as exc:
            # A full or unreachable store costs the next request its hit, never this one its answer.
            log.warning("storing KV blocks failed: %s", exc)
        return stored


class PrefillWorker(_Engine):
    """Prefill with the store: load the stored prefix where that pays, compute the rest, store the new blocks.

    ``load_policy``: ``auto`` decides per request by the cost models; ``always`` loads every
    stored block; ``never`` recomputes (the baseline). ``store_new=False`` makes a consumer
    that loads but stores nothing. The cost models learn from every prefill
    and load this worker does; :meth:`calibrate` gives them their first samples.
    """

    def __init__(
        self,
        model: Any,
        layout: KVLayout,
        store: BlockStore | None,
        *,
        load_policy: LoadPolicy = "auto",
        store_new: bool = True,
        store_tail: bool = True,
        min_deadline_s: float = 0.05,
    ) -> None:
        super().__init__(model, layout, store)
        if load_policy not in ("auto", "always", "never"):
            raise InvalidArgument(f"load_policy must be auto, always or never, got {load_policy!r}")
        self.load_policy = load_policy
        self.store_new = store_new
        self.store_tail = store_tail
        self.min_deadline_s = min_deadline_s
        self.prefill_cost = PrefillCostModel()
        self.load_cost = LoadCostModel()
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-kv-load")
        self._abandoned = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)

    # -- calibration -------------------------------------------------------------------------
    def calibrate(self, tokens: int = 512, *, probe_blocks: int = 4) -> dict[str, float]:
        """Fit the prefill model on a few forward passes, and measure the store with a probe block.

        Prefills of ``tokens/4``, ``tokens/2`` and ``tokens`` from nothing, and ``tokens/4`` after
        ``tokens/2`` cached, each twice. The probe puts ``probe_blocks`` blocks under a key
        of this worker's own and reads them back; a store that fails the probe keeps the prior.
        """
        if tokens < 8:
            raise InvalidArgument(f"calibration needs at least 8 tokens, got {tokens}")
        g = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, self.config.get_text_config().vocab_size, (tokens,), generator=g)
        for _ in range(2):  # twice: the model keeps each shape's fastest time, not its first call's
            for n in (tokens // 4, tokens // 2, tokens):
                t = time.perf_counter()
                _, cache = self.forward(ids[:n], None)
                self.prefill_cost.observe(n, 0, time.perf_counter() - t)
                if n == tokens // 2:
                    t = time.perf_counter()
                    self.forward(ids[n : n + tokens // 4], cache)
                    self.prefill_cost.observe(tokens // 4, n, time.perf_counter() - t)
        if self.store is not None and probe_blocks > 0:
            self._probe(probe_blocks)
        a, b, c = self.prefill_cost.coefficients
        return {"fixed_s": a, "per_token_s": b, "per_token_pair_s": c,
                "load_latency_s": self.load_cost.latency_s, "load_GBps": self.load_cost.bytes_per_s / 1e9}  # fmt: skip

    def _probe(self, blocks: int) -> None:
        assert self.store is not None
        lay = self.layout
        probe = lay.staging(blocks).zero_()
        # Zeros under keys of the layout's own: every worker of this layout shares them (later puts are no-ops).
        tag = hashlib.sha256(lay.namespace.encode()).hexdigest()[:16]
        keys = [f"kvstore-probe/{tag}/{lay.block_tokens}/{i}" for i in range(blocks)]
        try:
            save_blocks(self.store, keys, probe)
            for _ in range(3):
                t = time.perf_counter()
                self.store.match_prefix(keys[:1])
                self.load_cost.observe_latency(time.perf_counter() - t)
                t = time.perf_counter()
                got = load_blocks(self.store, keys, probe)
                if got == blocks:
                    self.load_cost.observe(blocks * lay.block_bytes(), time.perf_counter() - t)
        except KVStoreError as exc:
            log.warning("store probe failed, keeping the prior load model: %s", exc)

    # -- prefill -----------------------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int] | torch.Tensor, *, keep_logits: bool = False) -> PrefillResult:
        """Compute the first token of a prompt, loading what the store holds where that pays."""
        ids = _tokens(token_ids)
        lay = self.layout
        n = ids.numel()
        start = time.perf_counter()
        keys = lay.keys(ids)
        matched = 0
        decision = "miss"
        if self.store is not None and keys and self.load_policy != "never":
            try:
                matched = self.store.match_prefix(keys)
            except KVStoreError as exc:
                decision = f"recompute: lookup failed ({type(exc).__name__})"
        elif self.load_policy == "never":
            decision = "recompute: policy"
        lookup_s = time.perf_counter() - start
        if matched:
            self.load_cost.observe_latency(lookup_s)
        plan = plan_load(n, matched, lay.block_tokens, lay.block_bytes(), self.prefill_cost, self.load_cost)
        if matched and self.load_policy == "always":
            tokens = min(matched * lay.block_tokens, n - 1)
            plan = LoadPlan(matched, tokens, plan.predicted_s, plan.recompute_s, plan.load_s)
        if matched:
            decision = "load" if plan.blocks else "recompute: predicted faster"
        t = time.perf_counter()
        loaded_blocks, staging, why = self._load(keys[: plan.blocks], plan) if plan.blocks else (0, None, "")
        load_s = time.perf_counter() - t
        if why:
            decision = f"recompute: {why}" if loaded_blocks == 0 else f"load: {loaded_blocks} of {plan.blocks} ({why})"
        past = min(loaded_blocks * lay.block_tokens, n - 1)
        t = time.perf_counter()
        cache = cache_from_blocks(
            [staging[:loaded_blocks]] if staging is not None else [], lay, self.config, past, self.device
        )
        build_s = time.perf_counter() - t
        t = time.perf_counter()
        logits, cache = self.forward(ids[past:], cache)
        compute_s = time.perf_counter() - t
        self.prefill_cost.observe(n - past, past, compute_s)
        first = int(torch.argmax(logits))
        ttft_s = time.perf_counter() - start
        t = time.perf_counter()
        # Blocks the store already holds (matched) are not sent again; the tail always is.
        first_new = max(loaded_blocks, matched)
        stored = self.save(cache, ids, first_new, tail=self.store_tail, hand_off=True) if self.store_new else 0
        return PrefillResult(
            first_token=first, prompt_tokens=n, matched_tokens=matched * lay.block_tokens, loaded_tokens=past,
            computed_tokens=n - past, decision=decision, lookup_s=lookup_s, load_s=load_s, build_s=build_s,
            compute_s=compute_s,
            ttft_s=ttft_s, save_s=time.perf_counter() - t, stored_blocks=stored, predicted_s=plan.predicted_s,
            predicted_recompute_s=plan.recompute_s, logits=logits if keep_logits else None,
        )  # fmt: skip

    def _load(self, keys: Sequence[str], plan: LoadPlan) -> tuple[int, torch.Tensor | None, str]:
        """Load ``keys`` within the plan's deadline: (leading blocks loaded, staging, why it fell short)."""
        assert self.store is not None
        store = self.store
        staging = self.layout.staging(
            len(keys), pin=self.pin
        )  # fresh per load: an abandoned load may still write into it
        deadline = max(plan.deadline_s, self.min_deadline_s) if self.load_policy == "auto" else None
        started = time.perf_counter()
        future = self._loader.submit(load_blocks, store, keys, staging)
        try:
            loaded = future.result(timeout=deadline)
        except FutureTimeout:
            with self._lock:
                self._abandoned += 1
            # Slower than recomputing would be: remember it, so the next plan knows.
            self.load_cost.observe(len(keys) * self.layout.block_bytes(), time.perf_counter() - started)
            return 0, None, f"load slower than {deadline:.3f} s"
        except KVStoreError as exc:
            return 0, None, f"load failed ({type(exc).__name__}: {exc})"
        if loaded:
            self.load_cost.observe(loaded * self.layout.block_bytes(), time.perf_counter() - started)
        why = "" if loaded == len(keys) else f"block {loaded} missing"
        return loaded, staging, why


class DecodeWorker(_Engine):
    """Decode with the store: load the request's KV, generate greedily, store the blocks the output completes.

    ``tail``: ``transfer`` loads the partial last block the prefill stored (and recomputes it
    when it is not there); ``recompute`` always recomputes it.
    """

    def __init__(
        self,
        model: Any,
        layout: KVLayout,
        store: BlockStore | None,
        *,
        tail: Literal["transfer", "recompute"] = "transfer",
        on_missing: Literal["recompute", "error"] = "recompute",
        save_output: bool = True,
    ) -> None:
        super().__init__(model, layout, store)
        if tail not in ("transfer", "recompute"):
            raise InvalidArgument(f"tail must be transfer or recompute, got {tail!r}")
        if on_missing not in ("recompute", "error"):
            raise InvalidArgument(f"on_missing must be recompute or error, got {on_missing!r}")
        self.tail = tail
        self.on_missing = on_missing
        self.save_output = save_output
        eos = model.generation_config.eos_token_id
        self.eos: set[int] = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    def decode(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        first_token: int,
        max_new_tokens: int,
        *,
        keep_logits: bool = False,
        tail: Literal["transfer", "recompute"] | None = None,
    ) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens (the first one included) after the prompt ``token_ids``.

        ``tail`` overrides the worker's choice for the prompt's partial last block for this request.
        """
        ids = _tokens(token_ids)
        tail_mode = self.tail if tail is None else tail
        if tail_mode not in ("transfer", "recompute"):
            raise InvalidArgument(f"tail must be transfer or recompute, got {tail_mode!r}")
        if max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        lay = self.layout
        n = ids.numel()
        keys = lay.keys(ids)
        t = time.perf_counter()
        staging = lay.staging(len(keys), pin=self.pin)
        loaded = load_blocks(self.store, keys, staging) if self.store is not None and keys else 0
        if loaded < len(keys) and self.on_missing == "error":
            raise NotFound(
                f"the KV of this {n}-token prompt is not in the store: block {loaded} of {len(keys)}"
                f" (key {keys[loaded]}) is missing"
            )
        parts = [staging[:loaded]]
        cached = loaded * lay.block_tokens
        tail_state = "none" if n == len(keys) * lay.block_tokens else "recomputed"
        tail_key = lay.tail_key(ids)
        if loaded == len(keys) and tail_key is not None and tail_mode == "transfer" and self.store is not None:
            tail_staging = lay.staging(1, tokens=n - cached, pin=self.pin)
            if load_blocks(self.store, [tail_key], tail_staging) == 1:
                parts.append(tail_staging)
                cached = n
                tail_state = "transferred"
        load_s = time.perf_counter() - t
        cache = cache_from_blocks(parts, lay, self.config, cached, self.device)
        recomputed = n - cached
        if recomputed:
            _, cache = self.forward(ids[cached:], cache)
        prepare_s = time.perf_counter() - t
        out = [int(first_token)]
        logits_out: list[torch.Tensor] = []
        steps: list[float] = []
        while len(out) < max_new_tokens and out[-1] not in self.eos:
            t = time.perf_counter()
            logits, cache = self.forward(torch.tensor([out[-1]]), cache)
            out.append(int(torch.argmax(logits)))
            steps.append(time.perf_counter() - t)
            if keep_logits:
                logits_out.append(logits)
        stored = 0
        if self.save_output:
            seq = torch.cat([ids, torch.tensor(out[:-1], dtype=torch.long)])
            stored = self.save(cache, seq, len(keys), tail=False)
        return DecodeResult(out, cached, recomputed, tail_state, load_s, prepare_s, steps, stored, logits_out)
