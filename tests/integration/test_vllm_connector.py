"""The vLLM connector against vLLM's own classes: a real v1 Scheduler, real Requests and KV cache
configs, the worker side on CPU tensors in vLLM's paged layout, and a real cluster behind it.

These drive the scheduler step by step, where a real engine (``test_vllm_engine.py``) cannot
be steered: a block lost between lookup and load, async loads, preemption. As in vLLM's own
connector unit tests, a step's forward pass is stood in for: the test writes each scheduled
token's K and V (values derived from the token and its position) into its page slots through
the CPU attention backend's own kernel (``cpu_attn_reshape_and_cache``, so pages hold what a
real forward pass leaves there), calls the connector's layer hooks, and hands the scheduler a
ModelRunnerOutput. Runs in the vLLM environment (``scripts/vllm-env.sh``); skips elsewhere.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed (see the README: vLLM and SGLang)")

from vllm import SamplingParams  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvstore_cli.cluster import LocalCluster  # noqa: E402
from kvstore_client.adapters.vllm import KVStoreConnector, KVStoreConnectorMetadata  # noqa: E402
from kvstore_client.store import Store  # noqa: E402

PAGE = 16
BLOCK = 32  # two vLLM pages per stored block
HEADS, DIM, LAYERS, PAGES = 2, 32, 2, 64
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
EOS = 2


init_none_hash(sha256)  # vLLM's prefix-cache hashing, as its engine sets it up


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(1, dram="64MiB") as c:
        yield c


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": HEADS * 2 * DIM,
        "intermediate_size": 128, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "num_key_value_heads": HEADS, "head_dim": DIM, "vocab_size": 512, "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }))  # fmt: skip
    return path


class Engine:
    """A real vLLM Scheduler and a worker-side connector over CPU paged KV tensors."""

    def __init__(
        self, model_dir: Path, master: str, *, role: str = "kv_both", load_async: bool = False,
        kv_events: Any = None, **more: Any,
    ) -> None:  # fmt: skip
        model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=0)
        extra = {"master": master, "block_tokens": BLOCK, "load_async": load_async, **more}
        self.config = VllmConfig(
            model_config=model,
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=2048,
                                             enable_chunked_prefill=True, is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=PAGE, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVStoreConnector", kv_connector_module_path="kvstore_client.adapters.vllm",
                kv_role=role, kv_connector_extra_config=extra, kv_load_failure_policy="recompute",
            ),
            device_config=DeviceConfig("cpu"),
            **({"kv_events_config": kv_events} if kv_events is not None else {}),
        )  # fmt: skip
        spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32)
        kv_config = KVCacheConfig(num_blocks=PAGES, kv_cache_tensors=[],
                                  kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)])  # fmt: skip
        self.config.cache_config.num_gpu_blocks = PAGES
        self.scheduler = Scheduler(
            vllm_config=self.config, kv_cache_config=kv_config, log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config), block_size=PAGE,
        )  # fmt: skip
        assert isinstance(self.scheduler.connector, KVStoreConnector)  # vLLM's factory loaded ours
        self.worker = KVStoreConnector(self.config, KVConnectorRole.WORKER, kv_config)
        # vLLM's standardized per-layer view [B, H, N, C]; the CPU backend fills each head's N * C as it likes.
        self.kv = {name: torch.zeros(PAGES, HEADS, PAGE, 2 * DIM) for name in LAYER_NAMES}
        self.worker.register_kv_caches(self.kv)
        self.isa = _get_attn_isa(torch.float32, PAGE, DIM, "auto")

    def add(self, request_id: str, tokens: list[int], max_tokens: int = 4) -> Request:
        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, EOS)
        request = Request(request_id=request_id, prompt_token_ids=tokens, sampling_params=params,
                          pooling_params=None, block_hasher=get_request_block_hasher(PAGE, sha256))  # fmt: skip
        self.scheduler.add_request(request)
        return request

    def step(self, *, before_load: Any = None) -> tuple[Any, set[int]]:
        """One scheduler step and a stand-in forward pass; returns the output and the load errors reported."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, KVStoreConnectorMetadata)
        if before_load is not None:
            before_load(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        for layer, name in enumerate(LAYER_NAMES):
            self.worker.wait_for_layer_load(name)
            self._write_scheduled(out, layer)
            self.worker.save_kv_layer(name, self.kv[name], None)
        self.worker.wait_for_save()
        errors = self.worker.get_block_ids_with_load_errors()
        _, recving = self.worker.get_finished(set())
        self.worker.clear_connector_metadata()
        reqs = [*(r.req_id for r in out.scheduled_new_reqs), *out.scheduled_cached_reqs.req_ids]
        kv_out = KVConnectorOutput(finished_recving=recving, invalid_block_ids=errors) if errors or recving else None
        runner = ModelRunnerOutput(req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)},
                                   sampled_token_ids=[[7] for _ in reqs], kv_connector_output=kv_out)  # fmt: skip
        self.scheduler.update_from_output(out, runner)
        return out, errors

    def _write_scheduled(self, out: Any, layer: int) -> None:
        """Write the K|V of every token this step computes: a pure function of (token, position, layer)."""
        for req_id, count in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = request.num_computed_tokens - count  # schedule() has already counted this step's tokens
            pages = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            positions = range(start, min(start + count, len(request.prompt_token_ids)))
            if not positions:
                continue
            kv = torch.stack([kv_value(request.prompt_token_ids[pos], pos, layer) for pos in positions])
            slots = torch.tensor([pages[pos // PAGE] * PAGE + pos % PAGE for pos in positions])
            k_cache, v_cache = self.kv[LAYER_NAMES[layer]].view(PAGES, HEADS, 2 * PAGE, DIM).chunk(2, dim=2)
            key, value = kv[..., :DIM].contiguous(), kv[..., DIM:].contiguous()
            ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, self.isa,
                                           k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")  # fmt: skip

    def prompt_kv(self, request: Request, tokens: int, layer: int) -> torch.Tensor:
        """[tokens, heads, K|V] of a request's prompt, read from its pages as the backend laid them out."""
        pages = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
        assert self.worker._format is not None
        kv = self.kv[LAYER_NAMES[layer]]
        k, v = self.worker._format.read(kv, torch.arange(kv.shape[0]))  # [pages, tokens, heads, dim] each
        return torch.stack([torch.cat((k[pages[p // PAGE], p % PAGE], v[pages[p // PAGE], p % PAGE]), -1)
                            for p in range(tokens)])  # fmt: skip

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.connector.shutdown()


def kv_value(token: int, pos: int, layer: int) -> torch.Tensor:
    base = torch.arange(HEADS * 2 * DIM, dtype=torch.float32).reshape(HEADS, 2 * DIM)
    return base * 0.001 + token + pos * 1000 + layer * 1e6


def run_until_prefilled(engine: Engine, request: Request, limit: int = 20) -> None:
    for _ in range(limit):
        if request.num_computed_tokens >= len(request.prompt_token_ids):
            return
        engine.step()
    raise AssertionError(f"request not prefilled in {limit} steps")


@pytest.fixture
def engines(model_dir: Path, cluster: LocalCluster) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def computed_elsewhere(
    engines: list[Engine], model_dir: Path, master: str, tokens: list[int], **consumer: Any
) -> tuple[Engine, Request, Engine]:
    """A producer engine that prefilled ``tokens`` (its blocks now stored), and a fresh consumer engine."""
    producer = Engine(model_dir, master)
    engines.append(producer)
    request = producer.add(f"producer-{len(engines)}", tokens)
    run_until_prefilled(producer, request)
    producer.worker.flush_saves()  # saves are put by a background thread, after the step
    engines.append(Engine(model_dir, master, **consumer))
    return producer, request, engines[-1]


def test_a_second_engine_loads_what_the_first_computed(
    engines: list[Engine], model_dir: Path, cluster: LocalCluster
) -> None:
    tokens = [(i * 37) % 500 + 3 for i in range(150)]  # 4 full stored blocks of 32, and 22 tokens more
    # Chunked prefill: 64 tokens a step, blocks saved as they complete; the consumer caches nothing locally.
    producer, first, consumer = computed_elsewhere(engines, model_dir, cluster.master_address, tokens)
    with Store.connect(cluster.master_address) as store:
        assert store.match_prefix(producer.worker.layout.keys(tokens)) == 4
    second = consumer.add("b", [*tokens, 99, 98])
    out, errors = consumer.step()
    assert not errors and second.num_computed_tokens >= 128
    assert out.num_scheduled_tokens["b"] == min(64, 152 - 128)  # only the rest is computed
    assert consumer.scheduler.connector.get_num_new_matched_tokens(second, 0) == (128, False)  # no side effect
    for layer in range(LAYERS):
        assert torch.equal(consumer.prompt_kv(second, 128, layer), producer.prompt_kv(first, 128, layer))


def test_the_stores_kv_events_name_saved_blocks_by_vllms_own_hashes(engines: list[Engine], model_dir: Path) -> None:
    """With label_blocks, each stored block's KV event carries vLLM's block hash of its last page (as
    vLLM's own events give it), its parent's and its tokens; decoded here by vLLM's own KVEventBatch."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored as VllmBlockStored
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    tokens = [(i * 29) % 500 + 7 for i in range(140)]  # 4 stored blocks of 32 tokens (8 vLLM pages)
    with LocalCluster(1, dram="64MiB", kv_events=True) as c:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(c.kv_events[0][0])
        try:
            time.sleep(0.3)  # the subscription reaches the publisher
            producer = Engine(model_dir, c.master_address, label_blocks=True)
            engines.append(producer)
            request = producer.add("labelled", tokens)
            run_until_prefilled(producer, request)
            assert producer.worker.flush_saves()
            decoder = msgspec.msgpack.Decoder(KVEventBatch)
            stored: dict[str, Any] = {}
            keys = producer.worker.layout.keys(tokens)
            deadline = time.monotonic() + 15
            while len(stored) < 4 and time.monotonic() < deadline:
                if sub.poll(200):
                    _, _, payload = sub.recv_multipart()
                    theirs = decoder.decode(payload)  # vLLM's own classes
                    raw = msgspec.msgpack.decode(payload)[1]
                    for event, fields in zip(theirs.events, raw, strict=True):
                        if isinstance(event, VllmBlockStored) and fields["object_key"] in keys:
                            stored[fields["object_key"]] = event
        finally:
            sub.close(linger=0)
            ctx.term()
    k = BLOCK // PAGE
    hashes = request.block_hashes
    for i, key in enumerate(keys):
        event = stored[key]
        assert event.block_hashes == [maybe_convert_block_hash(hashes[(i + 1) * k - 1])]
        assert event.parent_block_hash == (maybe_convert_block_hash(hashes[i * k - 1]) if i else None)
        assert event.token_ids == tokens[i * BLOCK : (i + 1) * BLOCK] and event.block_size == BLOCK
        assert event.medium == "cpu"


def test_the_conductor_follows_vllms_own_kv_events_in_store_keys(engines: list[Engine], model_dir: Path) -> None:
    """A real vLLM Scheduler publishes its KV events (its own ZmqEventPublisher); the conductor's
    follower turns them into the connector's store keys: the blocks a prompt filled are held, and
    none once the engine resets its prefix cache."""
    import asyncio
    import socket

    from vllm.config import KVEventsConfig

    from server.conductor.engine_events import EngineEvents

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    # vLLM binds a wildcard endpoint (and connects to any other: then a subscriber would have to bind).
    pub_port, replay_port = port(), port()
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{pub_port}",
                            replay_endpoint=f"tcp://*:{replay_port}")  # fmt: skip
    pub, replay = f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
    tokens = [(i * 13) % 500 + 9 for i in range(140)]
    with LocalCluster(1, dram="64MiB") as c:
        engine = Engine(model_dir, c.master_address, kv_events=events)
        engines.append(engine)
        keys = engine.worker.layout.keys(tokens)

        async def follow() -> tuple[int, int]:
            follower = EngineEvents(pub, replay, engine.worker.layout.namespace, BLOCK)
            follower.start()
            try:
                request = engine.add("evented", tokens)
                run_until_prefilled(engine, request)
                deadline = time.monotonic() + 15
                while follower.held(keys) < 4 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                held = follower.held(keys)
                while engine.scheduler.requests:  # decode to the end: its pages return to the free pool
                    engine.step()
                assert engine.scheduler.reset_prefix_cache()
                engine.step()  # the next step's output carries the reset's AllBlocksCleared
                deadline = time.monotonic() + 15
                while follower.held(keys) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                return held, follower.held(keys)
            finally:
                await follower.close()

        assert asyncio.run(follow()) == (4, 0)


def test_a_full_hit_leaves_the_last_token_to_compute(
    engines: list[Engine], model_dir: Path, cluster: LocalCluster
) -> None:
    tokens = [(i * 11) % 500 + 5 for i in range(64)]
    _, _, consumer = computed_elsewhere(engines, model_dir, cluster.master_address, tokens)
    request = consumer.add("full-b", tokens)
    out, _ = consumer.step()
    assert out.num_scheduled_tokens["full-b"] == 1 and request.num_computed_tokens == 64


def test_a_block_lost_before_the_load_is_recomputed(
    engines: list[Engine], model_dir: Path, cluster: LocalCluster
) -> None:
    tokens = [(i * 53) % 500 + 7 for i in range(96)]
    producer, _, consumer = computed_elsewhere(engines, model_dir, cluster.master_address, tokens)
    request = consumer.add("lost-b", tokens)
    keys = producer.worker.layout.keys(tokens)

    def lose_block_one(meta: KVStoreConnectorMetadata) -> None:
        assert [spec.req_id for spec in meta.loads] == ["lost-b"]
        with Store.connect(cluster.master_address) as store:
            assert store.remove(keys[1])

    _, errors = consumer.step(before_load=lose_block_one)
    pages = consumer.scheduler.kv_cache_manager.get_block_ids("lost-b")[0]
    assert errors == set(pages[2:6])  # blocks 1 and 2 (pages 2..5): everything after the hole
    assert request.num_computed_tokens == 32  # vLLM rewound to the end of block 0 and computes the rest
    run_until_prefilled(consumer, request)
    for layer in range(LAYERS):
        expected = torch.stack([kv_value(t, p, layer) for p, t in enumerate(tokens)])
        assert torch.equal(consumer.prompt_kv(request, 96, layer), expected)


def test_async_loads_finish_between_steps(engines: list[Engine], model_dir: Path, cluster: LocalCluster) -> None:
    tokens = [(i * 29) % 500 + 9 for i in range(80)]
    _, _, consumer = computed_elsewhere(engines, model_dir, cluster.master_address, tokens, load_async=True)
    request = consumer.add("async-b", tokens)
    assert consumer.scheduler.connector.get_num_new_matched_tokens(request, 0) == (64, True)
    consumer.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # parked while the load runs
    deadline = time.monotonic() + 30
    while request.status != RequestStatus.RUNNING or request.num_computed_tokens < 80:
        assert time.monotonic() < deadline, "the async load never finished"
        time.sleep(0.02)
        consumer.step()
    for layer in range(LAYERS):
        expected = torch.stack([kv_value(t, p, layer) for p, t in enumerate(tokens)])
        assert torch.equal(consumer.prompt_kv(request, 80, layer), expected)


def test_a_consumer_saves_nothing_and_keys_follow_the_model(
    engines: list[Engine], model_dir: Path, cluster: LocalCluster
) -> None:
    tokens = [(i * 17) % 500 + 11 for i in range(70)]
    consumer = Engine(model_dir, cluster.master_address, role="kv_consumer")
    engines.append(consumer)
    run_until_prefilled(consumer, consumer.add("c", tokens))
    with Store.connect(cluster.master_address) as store:
        assert store.match_prefix(consumer.worker.layout.keys(tokens)) == 0
    assert (
        consumer.worker.layout.namespace
        != consumer.worker.layouts[0].__class__("other-model", LAYERS, HEADS, DIM, "float32", BLOCK).namespace
    )


def lookup_request(request_id: str, tokens: list[int], **fields: Any) -> Request:
    params = SamplingParams(max_tokens=4)
    params.update_from_generation_config({}, EOS)
    return Request(request_id=request_id, prompt_token_ids=tokens, sampling_params=params, pooling_params=None,
                   **fields)  # fmt: skip


def test_requests_whose_kv_differs_share_none_of_it(
    engines: list[Engine], model_dir: Path, cluster: LocalCluster
) -> None:
    """A LoRA adapter, a cache salt or an image changes the KV: such requests get none of the plain prompt's
    blocks (an image only from the block it sits in on)."""
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    tokens = [(i * 41) % 500 + 13 for i in range(130)]  # 4 stored blocks of 32
    _, _, consumer = computed_elsewhere(engines, model_dir, cluster.master_address, tokens)
    lookup = consumer.scheduler.connector.get_num_new_matched_tokens

    def image(at: int, name: str) -> list[MultiModalFeatureSpec]:
        return [MultiModalFeatureSpec(data=None, modality="image", identifier=name,
                                      mm_position=PlaceholderRange(offset=at, length=8))]  # fmt: skip

    assert lookup(lookup_request("plain", tokens), 0) == (128, False)
    assert lookup(lookup_request("lora", tokens, lora_request=LoRARequest("a", 1, "/adapters/a")), 0) == (0, False)
    assert lookup(lookup_request("salt", tokens, cache_salt="tenant-a"), 0) == (0, False)
    assert lookup(lookup_request("image", tokens, mm_features=image(70, "cat")), 0) == (64, False)  # block 2
    assert lookup(lookup_request("image-late", tokens, mm_features=image(100, "cat")), 0) == (96, False)  # block 3
    # (A salted request stores blocks its salt finds again: test_vllm_engine.py, through a real engine.)


def test_ranks_and_pipeline_stages_name_their_own_blocks(model_dir: Path) -> None:
    from types import SimpleNamespace

    from kvstore_client.adapters import vllm_inspect as connector

    names = [f"model.layers.{i}.self_attn.attn" for i in range(8)]
    config = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=8)))
    stages = connector.stage_layers(names, config, 2)
    assert stages == [(0, 4, 8), (4, 4, 8)]
    assert connector.worker_layers(names[4:], 2, stages) == (4, 8)
    with pytest.raises(connector.InvalidArgument, match="no pipeline stage"):
        connector.worker_layers(names[3:7], 2, stages)
    with pytest.raises(connector.InvalidArgument, match="not contiguous"):
        connector.worker_layers([names[0], names[2]], 2, stages)
