"""A live worker's GET /metrics (worker/metrics.py) parsed with prometheus_client's own parser: every
model-server protocol family with its type and labels, values that follow a run, and adapter residency
(gpu in a device slot, cpu in host memory only, gone once unloaded).

The worker is the real HTTP app over a real engine (tiny random model, max_num_seqs=2, max_loras=1). To
read the gauges while requests are in flight without depending on timing, the test parks the engine loop
between two steps (a command that waits on an event): the loop's snapshot, which /metrics serves, then
stays at that step until the event is set.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapters.peft_format import validate_peft_adapter
from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from gateway.workers.http_client import HttpEngineClient
from tests.engine.lora_peft import load_hf_base, make_peft_adapter
from tests.gateway.conftest import ThreadedServer
from wire.checkpoint import ModelConfig
from wire.protocol import WORKER_SECRET_HEADER, AdapterSpec, GenerateRequest
from wire.sampling import SamplingParams
from worker.capabilities import WorkerCapabilities
from worker.server import WorkerService, build_worker_app

SECRET = "metrics-secret"
HEADERS = {WORKER_SECRET_HEADER: SECRET}
LORA_ARGS = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
LONG = 400  # output tokens: far more steps than the test needs to observe a request in flight

FAMILIES = {  # name -> (type, label names)
    "vllm:num_requests_running": ("gauge", set()),
    "vllm:num_requests_waiting": ("gauge", set()),
    "vllm:kv_cache_usage_perc": ("gauge", set()),
    "vllm:cache_config_info": ("gauge", {"block_size", "num_gpu_blocks", "cache_dtype"}),
    "vllm:lora_requests_info": ("gauge", {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}),
    "vllm:lora_adapter_loaded": ("gauge", {"adapter_name", "level", "pinned", "rank"}),
    "loraplex_worker_weight_bytes": ("gauge", set()),
    "loraplex_worker_kv_cache_bytes": ("gauge", set()),
    "loraplex_worker_prefix_cache_hits": ("counter", set()),
    "loraplex_worker_adapter_slot_loads": ("counter", set()),
    "loraplex_worker_faulted_steps": ("counter", set()),
    "loraplex_worker_isolated_request_failures": ("counter", set()),
    "loraplex_worker_structured_outputs_checked": ("counter", set()),
    "loraplex_worker_structured_output_guard_failures": ("counter", set()),
    "loraplex_worker_grammar_broken_evicted": ("counter", set()),
}


@pytest.fixture(scope="module")
def worker(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics-adapters")
    base = load_hf_base(llama_dir)
    model_config = ModelConfig.from_pretrained(llama_dir)
    specs = []
    for i, name in enumerate(("a", "b")):
        path = make_peft_adapter(base, root / name, seed=10 + i, **LORA_ARGS).path
        sha = validate_peft_adapter(path, model_config, name=name, max_lora_rank=8).sha256
        specs.append(AdapterSpec(name, sha, str(path)))
    llm = AsyncLLM.from_config(EngineConfig(model=str(llama_dir), num_kv_blocks=256, block_size=4, max_num_seqs=2,
                                            max_loras=1, max_lora_rank=8))
    service = WorkerService(llm, "tiny", WorkerCapabilities.of_engine(llm.engine.config))
    server = ThreadedServer(build_worker_app(service, SECRET)).start()
    yield server, llm, service, specs
    server.stop()
    llm.shutdown()


def scrape(url: str, headers: dict[str, str] | None = None) -> dict:
    """name -> Metric, as prometheus_client's parser reads the worker's answer."""
    resp = httpx.get(url + "/metrics", headers=HEADERS if headers is None else headers)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(resp.text)}


def value(families: dict, name: str) -> float:
    (sample,) = families[name].samples
    return sample.value


def residency(families: dict) -> dict[str, tuple[str, str, str]]:
    """adapter name -> (level, pinned, rank)."""
    return {s.labels["adapter_name"]: (s.labels["level"], s.labels["pinned"], s.labels["rank"])
            for s in families["vllm:lora_adapter_loaded"].samples}


def lora_info(families: dict) -> dict[str, str]:
    (sample,) = families["vllm:lora_requests_info"].samples
    return sample.labels


def request(rid: str, adapter: AdapterSpec | None, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, [5, 6, 7, 8, 9], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                ignore_eos=True), adapter=adapter)


async def until(url: str, predicate, timeout_s: float = 60.0) -> dict:
    """Scrape until predicate(families) holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        families = await asyncio.to_thread(scrape, url)
        if predicate(families):
            return families
        assert loop.time() < deadline, "the metrics never reached the expected state"
        await asyncio.sleep(0.01)


class ParkedLoop:
    """Park the engine loop between two steps until release() (its snapshot holds still meanwhile)."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm
        self.event = threading.Event()
        self.parked = threading.Event()

    def park(self) -> None:
        def wait(engine) -> None:
            self.parked.set()
            self.event.wait(60)

        self.future = self.llm.call_in_loop(wait)

    async def wait_parked(self) -> None:
        assert await asyncio.to_thread(self.parked.wait, 30)

    async def release(self) -> None:
        self.event.set()
        await self.future


def test_every_protocol_family_has_its_type_and_labels(worker):
    server, llm, _, _ = worker
    families = scrape(server.url)
    for name, (kind, labels) in FAMILIES.items():
        assert families[name].type == kind, name
        for sample in families[name].samples:
            assert set(sample.labels) == labels, name
    (config,) = families["vllm:cache_config_info"].samples
    dtype = str(llm.engine.runner.kv_dtype).removeprefix("torch.")
    assert config.labels == {"block_size": "4", "num_gpu_blocks": "256", "cache_dtype": dtype} and config.value == 1
    assert lora_info(families)["max_lora"] == "1"
    assert value(families, "loraplex_worker_weight_bytes") == llm.engine.runner.weight_bytes > 0
    assert value(families, "loraplex_worker_kv_cache_bytes") == llm.engine.runner.kv_cache_bytes > 0
    assert 0.0 <= value(families, "vllm:kv_cache_usage_perc") <= 1.0


def test_metrics_need_the_secret_as_header_or_bearer_token_unless_public(worker):
    server, _, service, _ = worker
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/metrics", headers={"authorization": "Bearer wrong"}).status_code == 401
    assert "vllm:num_requests_running" in scrape(server.url, {"authorization": f"Bearer {SECRET}"})
    public = ThreadedServer(build_worker_app(service, SECRET, public_metrics=True)).start()
    try:
        assert "vllm:num_requests_running" in scrape(public.url, {})
        assert httpx.get(public.url + "/state").status_code == 401  # only /metrics is public
    finally:
        public.stop()


def test_gauges_and_residency_follow_a_live_run(worker):
    server, llm, _, (a, b) = worker
    client = HttpEngineClient(server.url, SECRET)

    async def drain(req: GenerateRequest) -> None:
        async for _ in client.generate(req):
            pass

    async def run() -> None:
        parked = ParkedLoop(llm)
        long_a = [asyncio.create_task(drain(request(f"a{i}", a, LONG))) for i in range(2)]
        await until(server.url, lambda f: value(f, "vllm:num_requests_running") == 2)
        long_b = [asyncio.create_task(drain(request(f"b{i}", b, LONG))) for i in range(2)]
        await until(server.url, lambda f: value(f, "vllm:num_requests_waiting") == 2)
        parked.park()
        await parked.wait_parked()
        during = await asyncio.to_thread(scrape, server.url)
        await parked.release()
        assert value(during, "vllm:num_requests_running") == 2  # max_num_seqs
        assert value(during, "vllm:num_requests_waiting") == 2
        assert value(during, "vllm:kv_cache_usage_perc") > 0
        info = lora_info(during)
        assert (info["running_lora_adapters"], info["waiting_lora_adapters"]) == (a.sha256, b.sha256)
        # max_loras=1: a holds the one slot; b was read into host memory and waits for the slot.
        assert residency(during) == {a.sha256: ("gpu", "false", "4"), b.sha256: ("cpu", "false", "4")}
        for task in long_b + long_a:  # aborts (the stream closes), waiting ones first
            task.cancel()
        await asyncio.gather(*long_b, *long_a, return_exceptions=True)
        after = await until(server.url, lambda f: value(f, "vllm:num_requests_running") == 0
                            and value(f, "vllm:num_requests_waiting") == 0)
        assert lora_info(after)["running_lora_adapters"] == lora_info(after)["waiting_lora_adapters"] == ""

        await drain(request("b-short", b, 2))  # b takes the slot: a drops to host memory
        families = await until(server.url, lambda f: residency(f).get(b.sha256, ("",))[0] == "gpu")
        assert residency(families) == {a.sha256: ("cpu", "false", "4"), b.sha256: ("gpu", "false", "4")}
        assert value(families, "loraplex_worker_adapter_slot_evictions") >= 1

        # Unloading b while a request runs on it keeps its slot until that request ends, then frees it.
        running_b = asyncio.create_task(drain(request("b-long", b, LONG)))
        await until(server.url, lambda f: value(f, "vllm:num_requests_running") == 1)
        unloaded = await asyncio.to_thread(httpx.post, server.url + "/adapters/unload", headers=HEADERS,
                                           json={"sha256": b.sha256})
        assert unloaded.json() == {"unloaded": True}
        still = await asyncio.to_thread(scrape, server.url)
        assert residency(still)[b.sha256][0] == "gpu"
        state = (await asyncio.to_thread(httpx.get, server.url + "/state", headers=HEADERS)).json()
        assert b.sha256 not in state["resident_adapters"]  # new requests would load it again
        running_b.cancel()
        await asyncio.gather(running_b, return_exceptions=True)
        gone = await until(server.url, lambda f: b.sha256 not in residency(f))
        assert residency(gone) == {a.sha256: ("cpu", "false", "4")}
        again = await asyncio.to_thread(httpx.post, server.url + "/adapters/unload", headers=HEADERS,
                                        json={"sha256": b.sha256})
        assert again.json() == {"unloaded": False}
        await asyncio.to_thread(httpx.post, server.url + "/adapters/unload", headers=HEADERS,
                                json={"sha256": a.sha256})
        assert residency(await asyncio.to_thread(scrape, server.url)) == {}
        await drain(request("a-again", a, 2))  # an unloaded adapter is loaded again by the next request
        assert residency(await asyncio.to_thread(scrape, server.url)) == {a.sha256: ("gpu", "false", "4")}
        await client.close()

    asyncio.run(run())
    assert llm.integrity_failures == 0  # every idle spell proved slots, pins and blocks accounted for


STRICT = {"type": "object", "properties": {"must": {"type": "integer"}}, "required": ["must"],
          "additionalProperties": False}


def test_structured_output_counters_follow_the_guard(worker, monkeypatch):
    """Unknown formats are counted per format; every finished constrained output is checked; a planted
    grammar bug (every schema compiled to "any object", the guard keeping the real one) shows up as guard
    failures, and each of those requests ended in an error, never in its output."""
    import grammar.compiler
    from grammar import NormalizedSchema, NormalizeReport
    from wire.protocol import RequestError

    server, llm, _, _ = worker
    client = HttpEngineClient(server.url, SECRET)

    async def finish(rid: str, schema: dict, seed: int) -> str:
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=seed, json_schema=schema)
        try:
            async for delta in client.generate(GenerateRequest(rid, [5, 6, 7], params)):
                if delta.samples and delta.samples[0].finish_reason:
                    return delta.samples[0].finish_reason
        except RequestError:
            return "error"
        return "none"

    async def run() -> None:
        before = await asyncio.to_thread(scrape, server.url)
        reasons = [await finish(f"fmt{i}", {"type": "string", "format": "int64", "maxLength": 3}, i)
                   for i in range(3)]
        assert "stop" in reasons
        after = await until(server.url, lambda f: value(f, "loraplex_worker_structured_outputs_checked")
                            >= value(before, "loraplex_worker_structured_outputs_checked") + reasons.count("stop"))
        formats = {s.labels["format"]: s.value for s in after["loraplex_worker_grammar_ignored_formats"].samples}
        assert formats.get("int64", 0) >= 1

        monkeypatch.setattr(grammar.compiler, "normalize_schema",
                            lambda schema, *a, **k: NormalizedSchema({"type": "object"}, NormalizeReport()))
        loose = [await finish(f"loose{s}", {**STRICT, "title": f"t{s}"}, s) for s in range(12)]
        assert "error" in loose  # the guard caught outputs the loose grammar let through
        failed = value(before, "loraplex_worker_structured_output_guard_failures") + loose.count("error")
        families = await until(server.url, lambda f: value(f, "loraplex_worker_structured_output_guard_failures")
                               == failed)
        assert value(families, "loraplex_worker_structured_output_guard_failures") == \
            llm.engine.structured.guard_stats.failed
        await client.close()

    asyncio.run(run())
