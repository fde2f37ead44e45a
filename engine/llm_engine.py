"""The engine loop: schedule -> execute -> update, plus request intake and abort."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from engine.config import EngineConfig, ModelConfig
from engine.fault_isolation import EngineFault, IsolatedStep, StepIsolator
from engine.loader import read_generation_config
from engine.lora_slots import LoRASlots
from engine.output_processor import OutputProcessor
from engine.plan import SampledToken
from engine.request import AdapterRef, Request, RequestStatus
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.structured_output import StructuredOutputManager
from tokenization.tokenizer import Tokenizer
from wire.errors import ErrorCode, RequestError
from wire.protocol import AdapterResidency, GenerateDelta
from wire.sampling import MAX_SEED, InvalidSamplingParams, SamplingParams

log = logging.getLogger(__name__)

PromptType = str | dict | list[int]
StepOutput = GenerateDelta | RequestError  # per request and step: its delta, or the error that ended it


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_usage: float
    num_preemptions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_evicted_blocks: int
    prefix_cache_blocks: int
    prefix_waits: int = 0  # admissions put off while a running request computed their prefix
    lora_slot_loads: int = 0  # adapters copied into a device slot
    lora_slot_evictions: int = 0  # resident adapters replaced to make room
    lora_host_loads: int = 0  # adapter directories read into host memory (first loads and reloads)
    lora_host_evictions: int = 0
    lora_resident_adapters: tuple[str, ...] = ()  # names of the adapters now in device slots
    weight_bytes: int = 0  # resident bytes of the model's weights (quantized weights count packed)
    block_size: int = 0  # tokens per KV block
    kv_cache_dtype: str = ""  # the KV cache's dtype (float32, bfloat16, int8)
    kv_cache_bytes: int = 0  # resident bytes of the KV cache
    lora_running_adapters: tuple[str, ...] = ()  # names of the adapters of running requests (sorted)
    lora_waiting_adapters: tuple[str, ...] = ()  # ... of waiting requests
    faulted_steps: int = 0  # steps whose first run raised (engine.fault_isolation)
    isolated_failures: int = 0  # requests failed alone by a fault attributed to them
    lora_residency: tuple[AdapterResidency, ...] = ()  # every adapter in a device slot or in host memory
    structured_checked: int = 0  # finished constrained outputs the guard validated
    structured_guard_failures: int = 0  # ... that failed it (each one a grammar bug; the request got an error)
    grammar_ignored_formats: tuple[tuple[str, int], ...] = ()  # unknown `format` values kept as annotations
    grammar_broken_evicted: int = 0  # cached grammars dropped because a matcher found them broken


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        gen = read_generation_config(config.model)
        eos = gen.get("eos_token_id", self.model_config.eos_token_ids)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        self.tokenizer = Tokenizer(config.model, extra_eos_ids=eos_ids)
        self.outputs = OutputProcessor(self.tokenizer)
        dtype = config.torch_dtype(self.model_config)
        # NOTE: adapters are validated against the dtype this engine computes in, not the checkpoint's.
        as_run = replace(self.model_config, torch_dtype=str(dtype).removeprefix("torch."))
        self.lora = LoRASlots(config, as_run, dtype, config.device)
        self.structured = StructuredOutputManager(config.model, self.tokenizer.eos_token_ids)
        self.runner = ModelRunner(config, self.model_config, lora=self.lora, grammar_masker=self.structured.fill)
        self.scheduler = Scheduler(
            config, self.runner.num_blocks, self.runner.max_model_len,
            # The grammar gate only looks; the LoRA gate pins a slot for what it admits, so it goes last.
            gates=(self.structured.admission_gate, self.lora.admission_gate),
            on_release=self._on_release, holdings_check=self.lora.check_integrity,
        )
        self.isolator = StepIsolator(self.runner)

    # ----- intake -----------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *, priority: int = 0,
                    adapter: AdapterRef | str | None = None, cache_salt: str = "") -> list[int]:
        """Queue a request; n > 1 becomes n sequences sharing the prompt (and its cached prefix).

        `adapter`: the name of a loaded adapter (its current content) or that content's AdapterRef.
        `cache_salt`: the salt its prompt is cached under (wire.protocol.prefix_namespace).
        Returns the prompt's token ids. Raises ValueError (naming the problem) for a prompt that can
        never be served or an adapter that is not loaded; then nothing of the request stays queued.
        """
        if self.outputs.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        adapter = self.lora.resolve(adapter)
        token_ids = self._tokenize(prompt)
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
        _check_params(params, vocab)
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        added = []
        try:
            for i, cid in enumerate(child_ids):
                child_params = params
                if params.n > 1 and params.seed is not None:
                    child_params = _with_seed(params, (params.seed + i) % (MAX_SEED + 1))
                req = Request(cid, list(token_ids), child_params, self.tokenizer.eos_token_ids, priority=priority,
                              adapter=adapter, cache_salt=cache_salt)
                self.structured.submit(req)  # GrammarError (a ValueError) refuses the request here
                self.scheduler.add_request(req)
                self.lora.track(req)
                added.append(cid)
        except ValueError:
            for cid in added:
                self.scheduler.finish_request(cid, RequestStatus.FINISHED_ABORTED)
            raise
        self.outputs.add(request_id, token_ids, params, child_ids)
        return token_ids

    def _tokenize(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return [int(t) for t in prompt]

    def abort_request(self, request_id: str) -> GenerateDelta | None:
        """End a request (all its samples) now; returns its final delta, or None if unknown."""
        for cid in self.outputs.child_ids(request_id):
            self.scheduler.finish_request(cid, RequestStatus.FINISHED_ABORTED)
        return self.outputs.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def fail_request(self, request_id: str, error: RequestError) -> RequestError | None:
        """Fail a request (all its samples) now, releasing all it holds. Returns `error` for this request
        id, or None if the request is unknown or already over."""
        for cid in self.outputs.child_ids(request_id):
            self.scheduler.finish_request(cid, RequestStatus.FINISHED_ERROR)
        return error.for_request(request_id) if self.outputs.drop(request_id) else None

    def fail_all(self, error: RequestError) -> list[StepOutput]:
        """Fail every request in flight (after a fault no request can be blamed for), releasing all they
        hold; returns `error` once for each of them."""
        failed: list[StepOutput] = [e for rid in self.outputs.parent_ids()
                                    if (e := self.fail_request(rid, error)) is not None]
        for rid in list(self.scheduler.requests):  # anything the output processor does not know of
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
        return failed

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One iteration. Returns, for each request that changed, its delta (new tokens and text) or
        the RequestError that ended it; a request's last item is a finished delta or an error.

        A fault while running the step fails only the requests it is attributed to (engine.fault_isolation);
        one it cannot attribute raises EngineFault, after which the engine must not serve on."""
        plan = self.scheduler.schedule()
        ran = self.isolator.execute(plan)  # the plan less the requests at fault, if any
        updates = self.scheduler.update(ran.plan, ran.output)
        return self._make_outputs(updates, ran)

    def _make_outputs(self, updates: list[tuple[Request, SampledToken]],
                      ran: IsolatedStep | None = None) -> list[StepOutput]:
        # NOTE: a constrained output that fails its guard never reaches a delta: its request fails instead.
        failures = [(rid, RequestError(ErrorCode.ENGINE_ERROR, reason))
                    for rid, reason in self.structured.guard(updates)]
        failures += self._step_faults(ran)
        if failures:
            unguarded = {rid for rid, _ in failures}
            updates = [(req, sampled) for req, sampled in updates if req.request_id not in unguarded]
        deltas, stop_hits = self.outputs.process(updates)
        outputs: list[StepOutput] = list(deltas)
        for child_id, stop in stop_hits:
            self.scheduler.finish_request(child_id, RequestStatus.FINISHED_STOPPED, stop)
        for child_id, reason in self.lora.take_load_failures():
            log.warning("request %s: %.300s", child_id, reason)  # the reason's file paths stay in the log
            req = self.scheduler.requests.get(child_id)
            name = req.adapter.name if req is not None and req.adapter is not None else "?"
            failures.append((child_id, RequestError(ErrorCode.ADAPTER_UNAVAILABLE,
                                                    f"adapter {name!r} could not be reloaded from its files")))
        for req, reason in self.structured.poll():  # the grammar's own one-line reason names the schema fault
            failures.append((req.request_id, RequestError(ErrorCode.INVALID_REQUEST, reason)))
        for child_id, error in failures:
            parent_id = self.outputs.parent_of(child_id)
            failed = self.fail_request(parent_id, error) if parent_id is not None else None
            if failed is not None:
                outputs.append(failed)
        if ran is not None and ran.failed:
            self._check_after_fault()
        return outputs

    def _step_faults(self, ran: IsolatedStep | None) -> list[tuple[str, RequestError]]:
        """The requests this step's faults are attributed to, with what their tenants are told (the
        detail was logged where the fault was caught)."""
        failures = [(rid, RequestError(ErrorCode.ENGINE_ERROR, "the engine failed while running this request"))
                    for rid in (ran.failed if ran is not None else ())]
        for rid, gate, error in self.scheduler.take_admission_faults():
            log.warning("request %s could not be admitted: %.300s", rid, error)
            if gate == self.lora.admission_gate:
                failures.append((rid, RequestError(ErrorCode.ADAPTER_UNAVAILABLE,
                                                   "the adapter cannot be loaded into this engine")))
            else:
                failures.append((rid, RequestError(ErrorCode.ENGINE_ERROR,
                                                   "the engine failed while admitting this request")))
        return failures

    def _check_after_fault(self) -> None:
        """After failing requests for a fault: everything they held must be back (else stop serving)."""
        try:
            self.scheduler.check_integrity()
        except AssertionError as e:
            raise EngineFault(f"engine state is inconsistent after a fault: {e}") from e

    def _on_release(self, req: Request) -> None:
        self.lora.on_release(req)
        self.structured.forget(req.request_id)

    def shutdown(self) -> None:
        """Stop the engine's background threads (the adapter reader, the grammar compile pool). Call once
        no step runs any more; the engine serves nothing after it."""
        self.lora.close()
        self.structured.shutdown()

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        pc = kv.prefix_cache
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=kv.pool.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            kv_usage=kv.usage(),
            num_preemptions=self.scheduler.stats.num_preemptions,
            prefix_waits=self.scheduler.stats.num_prefix_waits,
            prefix_query_tokens=pc.stats.query_tokens if pc else 0,
            prefix_hit_tokens=pc.stats.hit_tokens if pc else 0,
            prefix_evicted_blocks=pc.stats.evicted_blocks if pc else 0,
            prefix_cache_blocks=pc.num_blocks if pc else 0,
            lora_slot_loads=self.lora.stats.slot_loads,
            lora_slot_evictions=self.lora.stats.slot_evictions,
            lora_host_loads=self.lora.host.stats.host_loads,
            lora_host_evictions=self.lora.host.stats.host_evictions,
            lora_resident_adapters=tuple(ref.name for ref in self.lora.resident_adapters()),
            weight_bytes=self.runner.weight_bytes,
            block_size=self.config.block_size,
            kv_cache_dtype=str(self.runner.kv_dtype).removeprefix("torch."),
            kv_cache_bytes=self.runner.kv_cache_bytes,
            lora_running_adapters=_adapter_names(self.scheduler.running),
            lora_waiting_adapters=_adapter_names(self.scheduler.waiting),
            lora_residency=tuple(self.lora.residency()),
            faulted_steps=self.isolator.stats.faulted_steps,
            isolated_failures=self.isolator.stats.failed_requests,
            structured_checked=self.structured.guard_stats.checked,
            structured_guard_failures=self.structured.guard_stats.failed,
            grammar_ignored_formats=tuple(sorted(self.structured.compiler.stats.ignored_formats.items())),
            grammar_broken_evicted=self.structured.compiler.stats.evicted_broken,
        )

    # ----- adapters ---------------------------------------------------------------------------------

    def load_adapter(self, name: str, path, *, sha256: str | None = None) -> AdapterRef:
        """Validate a PEFT adapter directory against this model and register it under `name`.

        Idempotent for the same name and content; new content under a known name serves new requests
        while in-flight ones keep the old. Raises adapters.errors.AdapterError (a ValueError naming the
        problem) and leaves nothing loaded when the adapter cannot be served. Thread-safe.
        """
        return self.lora.load_adapter(name, path, sha256=sha256)

    def unload_adapter(self, name: str) -> AdapterRef:
        """Refuse new requests for `name`; requests already using it finish. ValueError if unknown."""
        return self.lora.unload_adapter(name)

    def pin_adapter(self, name: str, pinned: bool = True) -> None:
        """Keep `name` in its device slot and host memory once loaded there (never evicted)."""
        self.lora.pin_adapter(name, pinned)

    def wait_for_adapter_loads(self, timeout: float) -> None:
        """Sleep up to `timeout` s while nothing runs and waiting requests wait only on adapter reads."""
        deadline = time.monotonic() + timeout
        while not self.scheduler.running and self.lora.has_pending_loads() and time.monotonic() < deadline:
            time.sleep(0.002)


def _adapter_names(requests) -> tuple[str, ...]:
    return tuple(sorted({r.adapter.name for r in requests if r.adapter is not None}))


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)


def _check_params(params: SamplingParams, vocab_size: int) -> None:
    """What SamplingParams cannot check without the model: token ids within its vocabulary. The seed is
    checked again here, since a seed the sampler's generator refuses would fail inside a step."""
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise InvalidSamplingParams("seed", f"seed must be in [0, 2**64 - 1], got {params.seed}")
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidSamplingParams(name, f"{name} names token id {bad}, outside the vocabulary "
                                              f"(0..{vocab_size - 1})")
