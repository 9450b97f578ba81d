"""The engine core: a pure, steppable model of vLLM V1's scheduler. No I/O, no clock, no asyncio.

Drive it with explicit simulated time (seconds)::

    core = EngineCore(EngineConfig())
    core.add_request(SimRequest("r1", "a b c".split(), max_tokens=4, block_size=16), now=0.0)
    plan = core.schedule(now)            # decide the batch; plan.duration = modelled step time (s)
    produced = core.complete(plan, now + plan.duration)   # requests that emitted one token each
    # or: produced, duration = core.step(now)

Scheduling, one step (after ``vllm/v1/core/sched/scheduler.py``):

1. Running requests in FCFS order each get their next tokens (1 for decode, the rest of the prompt —
   capped by the remaining ``max_num_batched_tokens`` budget — for a prefill: chunked prefill).
   When the KV cache has too few free blocks, the *last* running request is preempted (its blocks
   freed, put back at the head of the queue, recomputed later: preemption by recompute), until
   the allocation fits.
2. If nothing was preempted, waiting requests are admitted in arrival order (FCFS, head-of-line
   blocking) while the budget, ``max_num_seqs`` and the free blocks allow. At admission the prefix
   cache is consulted: the longest run of the prompt's leading full blocks whose chained hash is
   cached is reused and not recomputed (at least one token is always computed). With
   ``reserve_full_prompt`` (default, vLLM's ``scheduler_reserve_full_isl``, on by default in vLLM
   0.32) a request is admitted only when the blocks of its whole prompt fit, not just its first
   chunk (over-admitted long prompts were preempted later: against CPU vLLM 0.32 the model counted
   16 preemptions where vLLM had 6 before this check, see ``simulate/vllm_fidelity.py``).

Blocks that will be full once a step's tokens are computed are published in the prefix cache when
the step is scheduled (as vLLM V1's ``allocate_slots`` does), so requests admitted in the same step
— simultaneous arrivals with a shared system prompt, the ``n`` choices of one request — share one
prefill. An abort during the step withdraws the blocks it published for uncomputed tokens.

Completing a step advances each scheduled request, samples one token for every request whose
prompt is fully computed, and finishes requests that reach ``max_tokens`` or a stop string (their
blocks return to the free queue as cached blocks).

Step time (seconds, see :mod:`sim_engine.config` for every constant's source)::

    step = slowdown * ( base
                        + sum over decode seqs  (per_seq + context_tokens * per_context_token)
                        + sum over prefill seqs (per_seq + n_new * prefill_per_token
                                                 + n_new * (n_computed + n_new / 2) * attention_pair) )
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sim_engine.config import EngineConfig
from sim_engine.errors import (
    ContextLengthError,
    EngineCapacityError,
    InvalidRequestError,
)
from sim_engine.kv_cache import KVCacheManager
from sim_engine.request import SimRequest, Status
from sim_engine.stats import EngineStats
from sim_engine.tokenizer import WordSource


@dataclass
class StepPlan:
    """One scheduled step: ``scheduled`` = [(request, new tokens)], ``duration`` in simulated s."""

    scheduled: list[tuple[SimRequest, int]] = field(default_factory=list)
    duration: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    preempted: list[SimRequest] = field(default_factory=list)


class EngineCore:
    """Continuous-batching engine model over a :class:`KVCacheManager`. See the module docstring."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config.validate()
        c = config
        self.kv = KVCacheManager(c.num_gpu_blocks, c.block_size, c.enable_prefix_caching)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.stats = EngineStats()
        self.last_arrival = 0.0  # latest add_request time (simulated s)
        self.words = WordSource(c.seed)
        # step-time constants in seconds
        self._base = c.base_step_ms / 1e3
        self._per_seq = c.per_seq_ms / 1e3
        self._per_ctx = c.per_context_token_ns / 1e9
        self._prefill_tok = c.prefill_per_token_ms / 1e3
        self._attn_pair = c.prefill_attention_ns_per_pair / 1e9

    # ---- admission -------------------------------------------------------------------------
    def validate(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise :class:`InvalidRequestError` subclasses when a request could never be served."""
        c = self.config
        if num_prompt_tokens < 1:
            raise InvalidRequestError("the prompt is empty: at least one token is needed", param="prompt")
        if max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        total = num_prompt_tokens + max_tokens
        if total > c.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {c.max_model_len} tokens. However, you requested "
                f"{total} tokens ({num_prompt_tokens} in the messages, {max_tokens} in the completion). "
                f"Please reduce the length of the messages or completion.",
                param="max_tokens",
            )
        if self.kv.blocks_for(total) > c.num_gpu_blocks:
            raise EngineCapacityError(
                f"the request needs {self.kv.blocks_for(total)} KV-cache blocks but the cache holds only "
                f"{c.num_gpu_blocks}",
                param="max_tokens",
            )

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """Output length for a request without max_tokens: the configured default, capped by context."""
        return max(1, min(self.config.default_max_tokens, self.config.max_model_len - num_prompt_tokens))

    def add_request(self, req: SimRequest, now: float) -> None:
        """Queue ``req`` (FCFS). Raises :class:`InvalidRequestError` (see :meth:`validate`) or on a
        duplicate id."""
        self.validate(req.num_prompt_tokens, req.max_tokens)
        if req.request_id in self.requests:
            raise InvalidRequestError(
                f"request id {req.request_id!r} is already in flight", param="request_id"
            )
        req.arrival = now
        self.last_arrival = max(self.last_arrival, now)
        req.word_offset = self.words.start()
        req.status = Status.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str, now: float) -> SimRequest | None:
        """Stop a request at once and free its blocks. Returns it, or None when unknown/finished."""
        req = self.requests.get(request_id)
        if req is None or req.status == Status.FINISHED:
            return None
        if req.status == Status.WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:  # pragma: no cover - defensive
                pass
        else:
            self.running.remove(req)
            # blocks published for this step's tokens were never computed: withdraw them
            done = req.num_computed_tokens // self.config.block_size
            for j in range(done, req.num_registered):
                self.kv.uncache_block(req.blocks[j])
            req.num_registered = min(req.num_registered, done)
        self._finish(req, "abort", now)
        return req

    # ---- scheduling ------------------------------------------------------------------------
    def has_work(self) -> bool:
        """True while any request is running or waiting."""
        return bool(self.running or self.waiting)

    def _preempt(self, req: SimRequest) -> None:
        self.kv.free(req.blocks)
        req.blocks = []
        req.num_computed_tokens = 0
        req.num_registered = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def _register(self, req: SimRequest, upto_tokens: int) -> None:
        """Publish in the prefix cache the request's blocks that are full once its first
        ``upto_tokens`` tokens are computed (vLLM V1 caches them when it allocates the step, so a
        request scheduled in the same step already hits them)."""
        full = min(upto_tokens // self.config.block_size, len(req.hashes))
        if full > req.num_registered:
            kv, blocks, hashes = self.kv, req.blocks, req.hashes
            if kv.events is not None and kv.event_tokens:   # KV-cache events: with parent and tokens
                bs = self.config.block_size
                for j in range(req.num_registered, full):
                    kv.cache_block(blocks[j], hashes[j], hashes[j - 1] if j else None,
                                   req.prompt[j * bs:(j + 1) * bs])
            else:
                for j in range(req.num_registered, full):
                    kv.cache_block(blocks[j], hashes[j])
            req.num_registered = full

    def schedule(self, now: float) -> StepPlan:
        """Choose this step's batch (see the module docstring). Allocates blocks; O(batch)."""
        kv, bs = self.kv, self.config.block_size
        budget = self.config.max_num_batched_tokens
        plan = StepPlan()
        running = self.running
        i = 0
        scheduled = plan.scheduled
        while i < len(running) and budget > 0:
            req = running[i]
            done = req.num_computed_tokens
            n = req.num_tokens - done
            n = min(n, budget)
            upto = done + n
            need = -(-upto // bs) - len(req.blocks)
            if need > 0:  # (a decode step mostly needs no new block)
                victim = None
                while need > kv.num_free:
                    victim = running.pop()
                    self._preempt(victim)
                    plan.preempted.append(victim)
                    if victim is req:
                        break
                if victim is req:
                    break
                got = kv.allocate(need)
                assert got is not None  # need <= num_free was just ensured
                req.blocks += got
            nreg = req.num_registered
            if upto // bs > nreg and len(req.hashes) > nreg:
                self._register(req, upto)
            scheduled.append((req, n))
            budget -= n
            i += 1
        if not plan.preempted:
            self._admit(plan, budget, now)
        plan.duration = self._step_time(plan)
        return plan

    def _admit(self, plan: StepPlan, budget: int, now: float) -> None:
        kv, bs, stats = self.kv, self.config.block_size, self.stats
        max_seqs = self.config.max_num_seqs
        full_isl, max_len = self.config.reserve_full_prompt, self.config.max_model_len
        while self.waiting and budget > 0 and len(self.running) < max_seqs:
            req = self.waiting[0]
            hits = kv.lookup(req.hashes, (req.num_tokens - 1) // bs)
            cached = len(hits) * bs
            n = min(req.num_tokens - cached, budget)
            need = -(-(cached + n) // bs) - len(hits)
            free = kv.num_free - kv.count_unreferenced(hits)
            if need > free:
                break  # FCFS: the head waits until enough blocks free up
            if full_isl and -(-min(req.num_tokens, max_len) // bs) - len(hits) > free:
                break  # vLLM's scheduler_reserve_full_isl: the whole prompt must fit, not only this chunk
            kv.touch(hits)
            req.blocks = hits + (kv.allocate(need) or [])
            req.num_computed_tokens = cached
            req.num_registered = len(hits)
            self._register(req, cached + n)
            if req.first_scheduled is None:
                req.first_scheduled = now
                req.num_cached_tokens = cached
                stats.prefix_cache_queries += req.num_tokens
                stats.prefix_cache_hits += cached
                stats.queue_time.observe(max(0.0, now - req.arrival))
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            plan.scheduled.append((req, n))
            budget -= n

    def _step_time(self, plan: StepPlan) -> float:
        if not plan.scheduled:
            return 0.0
        t = self._base
        per_seq, per_ctx, pre_tok, pair = self._per_seq, self._per_ctx, self._prefill_tok, self._attn_pair
        for req, n in plan.scheduled:
            done = req.num_computed_tokens
            if n == 1 and req.output and done == req.num_tokens - 1:
                t += per_seq + (done + 1) * per_ctx
                plan.num_decode_seqs += 1
            else:
                t += per_seq + n * pre_tok + n * (done + n / 2) * pair
                plan.num_prefill_tokens += n
        return t * self.config.slowdown

    # ---- completing a step -----------------------------------------------------------------
    def complete(self, plan: StepPlan, now: float) -> list[SimRequest]:
        """Apply a scheduled step that ended at ``now``. Returns the requests that emitted a token
        this step (each exactly one: ``req.output[-1]``); finished ones have ``finish_reason`` set."""
        stats, words = self.stats, self.words
        table, table_n = words.table, words.TABLE
        running_st = Status.RUNNING
        stats.steps += 1
        stats.busy_time += plan.duration
        produced: list[SimRequest] = []
        finished = False
        for req, n in plan.scheduled:
            if req.status != running_st:
                continue  # aborted during the step
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk that does not finish the prompt
            word = table[(req.word_offset + len(req.output)) % table_n]  # WordSource.word, inlined
            req.append_output(word)
            stats.generation_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
                stats.ttft.observe(now - req.arrival)
            else:
                stats.itl.observe(now - req.last_token_time)  # type: ignore[operator]
            if not req.counted_prompt:
                req.counted_prompt = True
                stats.prompt_tokens += req.num_prompt_tokens
            req.last_token_time = now
            produced.append(req)
            if req.stop and self._hit_stop(req, word):
                self._finish(req, "stop", now)
                finished = True
            elif len(req.output) >= req.max_tokens:
                self._finish(req, "length", now)
                finished = True
        if finished:
            self.running = [r for r in self.running if r.status == Status.RUNNING]
        return produced

    def _hit_stop(self, req: SimRequest, word: str) -> bool:
        req.text.append(" " + word)
        longest = max(len(s) for s in req.stop)
        tail = "".join(req.text[-(longest + 1) :])
        for s in req.stop:
            if s in tail:
                req.stop_matched = s
                return True
        return False

    def _finish(self, req: SimRequest, reason: str, now: float) -> None:
        self.kv.free(req.blocks)
        req.blocks = []
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = now
        self.stats.request_success[reason] = self.stats.request_success.get(reason, 0) + 1
        if reason != "abort":
            self.stats.e2e.observe(now - req.arrival)
        self.requests.pop(req.request_id, None)

    def step(self, now: float) -> tuple[list[SimRequest], float]:
        """Schedule and complete one step starting at ``now``; returns (produced, duration in s)."""
        plan = self.schedule(now)
        return self.complete(plan, now + plan.duration), plan.duration

    # ---- views -----------------------------------------------------------------------------
    def state(self) -> dict:
        """JSON-ready snapshot for ``GET /sim/state`` and tests."""
        kv, s = self.kv, self.stats
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "total_blocks": kv.num_blocks,
            "free_blocks": kv.num_free,
            "used_blocks": kv.num_used,
            "cached_blocks": kv.num_cached,
            "kv_cache_usage": kv.usage,
            "block_size": kv.block_size,
            "running_ids": [r.request_id for r in self.running],
            "waiting_ids": [r.request_id for r in self.waiting],
            "in_flight": sorted(self.requests),
            "preemptions": s.num_preemptions,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "evictions": kv.evictions,
            "steps": s.steps,
            "busy_time_s": s.busy_time,
            "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens,
            "request_success": dict(s.request_success),
        }

    def queued_tokens(self) -> int:
        """Tokens held in KV by running requests plus prompt tokens still waiting (SGLang's num_tokens)."""
        return sum(r.num_computed_tokens for r in self.running) + sum(r.num_tokens for r in self.waiting)
