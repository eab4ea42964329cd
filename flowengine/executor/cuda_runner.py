"""The CUDA model runner: device-resident steps, CUDA graphs, KV cache by profiling.

Beyond `ModelRunner` (which it extends, so the StepPlan protocol is the same):

* inputs: persistent pinned staging buffers, one non-blocking copy per step
  (input_batch.py, staging_buffer.py);
* decode tokens from the device: each request owns a *token slot* in `last_sampled`
  ([num_slots] int64 on the device); sampling scatters every sampled id into its
  request's slot, and a later step that computes that token gathers its input id from
  the slot on the device. The host learns the token from the step's result, read
  asynchronously (pending_step.py), so step N+1 can be launched before step N's
  tokens reach the host (DESIGN.md §5). Until then the host copy of the request holds
  a placeholder;
* decode-only steps replay CUDA graphs (cuda_graphs.py) padded to a captured size;
  mixed steps (prefill chunks with decodes) replay the mixed graphs, padded to a
  captured token count (FULL mode; `cudagraph_mode`);
* sampling on the device with the shared Sampler: one device-to-host copy per step.

`launch(plan, sampler)` is the device path; `execute_model(plan)` (logits out, the
caller samples) stays available for callers that sample themselves.

Pipeline parallelism (`pp`, a stage of more than one): the stage path of ModelRunner
(`run_model`: receive, this stage's layers, send; NCCL between the stages' GPUs), run
through `execute_model` (the Executor samples on the last stage's host path), eagerly:
no CUDA graphs, no on-device sampling or token slots in use (cuda_stage.py says why).
Stages before the last return no logits; the memory profile runs the stage's part.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flowengine.config import CacheConfig
from flowengine.distributed.pp_group import SINGLE_STAGE, PipelineStage
from flowengine.distributed.tp_group import SINGLE_RANK, TensorParallelGroup
from flowengine.executor.cuda_graphs import (
    CAPTURE_SIZES,
    DecodeCudaGraphs,
    MixedCudaGraphs,
    capture_sizes_for,
    mixed_capture_sizes,
    padded_batch_size,
)
from flowengine.executor.cuda_stage import StageProfileModel, stage_runs_eagerly
from flowengine.executor.input_batch import (
    PLACEHOLDER_TOKEN_ID,
    InputBatch,
    RequestState,
    StepInputs,
)
from flowengine.executor.memory_profile import MemoryProfile, profile_memory
from flowengine.executor.model_runner import ModelOutput, ModelRunner
from flowengine.executor.pending_step import PendingStep, copy_to_host
from flowengine.executor.spec_verify import verification_rows
from flowengine.messages import GrammarOutput, StepPlan
from flowengine.model.attention.backend import AttentionBackend
from flowengine.model.model_config import ModelConfig
from flowengine.sample.grammar_bitmask import apply_plan_bitmask
from flowengine.sample.sampler import Sampler

logger = logging.getLogger(__name__)

CUDAGRAPH_MODES = ("FULL", "FULL_DECODE_ONLY")
# FLOWENGINE_DEVICE_TIMERS=1: each launched step records a timing CUDA event after its
# inputs' copy and times its copy-to-host event, so the executor actor's timers report
# the device's time per step in the served run itself (ExecutorActor.timers:
# device_us_per_step, gap_us_per_step). Off by default: two event records per step.
# A wait inside a step (its sampling launched late, e.g. after a grammar bitmask) counts
# as that step's device time, not as a gap.
DEVICE_TIMERS = os.environ.get("FLOWENGINE_DEVICE_TIMERS", "0") not in ("", "0")


@dataclass(frozen=True, slots=True)
class LaunchedForward:
    """A step whose forward is enqueued and whose sampling is not (launch_forward).

    sample_req_ids: the requests that sample, in row order; sample_slots: their token
    slots, [len(sample_req_ids)] int64 on the device; logits: [len(sample_req_ids),
    vocab] float32 on the device, None when the step samples nothing.
    """

    step_id: int
    sample_req_ids: list[str]
    sample_slots: torch.Tensor | None
    logits: torch.Tensor | None
    start_event: torch.cuda.Event | None = None  # FLOWENGINE_DEVICE_TIMERS


class CudaModelRunner(ModelRunner):
    """`ModelRunner` with the device path. Runs on CUDA; on the CPU (tests) everything
    but the graphs and the asynchronous copies works the same.

    Args: those of ModelRunner (pass cache_config=None to size the KV cache by
    `profile_memory()` first, then call `initialize_kv_cache`), plus
        enforce_eager: never capture CUDA graphs.
        capture_sizes: candidate decode graph sizes (default vLLM's list); those up to
            the first >= max_num_seqs and <= max_num_batched_tokens are captured.
        cudagraph_mode: vLLM's names: "FULL" (default; decode graphs and mixed-step
            graphs, cuda_graphs.MixedCudaGraphs) or "FULL_DECODE_ONLY" (decode and
            verification graphs only; mixed steps eager). The environment variable
            FLOWENGINE_CUDAGRAPH_MODE, when set, overrides the argument (side-by-side
            benchmarks of the served path).

    Attributes:
        decode_batch_sizes: ascending sizes that decode-only steps are padded to (the
            captured graph sizes; empty: no padding). May be set on a runner without
            graphs, e.g. to exercise padding eagerly on the CPU.
        graphs: the captured DecodeCudaGraphs, or None.
        verify_query_len, verify_batch_sizes, verify_graphs: the same for verification
            steps of speculative decoding (`capture_verification_graphs`): a step with
            more than one and at most verify_query_len tokens per request is padded to
            the nearest size (requests) x verify_query_len (tokens).
        mixed_sizes, mixed_graphs: token counts that mixed steps (some request computes
            more than one token; not a verification step) are padded to, and their
            MixedCudaGraphs (empty / None: mixed steps run eagerly). mixed_sizes may be
            set without graphs, to exercise the padding eagerly on the CPU.
        last_sampled: [num_slots] int64 device tensor, each request's latest sampled id.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig | None,
        device: torch.device,
        dtype: torch.dtype,
        load_format: str = "auto",
        model_path: str | None = None,
        *,
        attn_backend: AttentionBackend | None = None,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        seed: int = 0,
        enforce_eager: bool = False,
        capture_sizes: Sequence[int] = CAPTURE_SIZES,
        tp: TensorParallelGroup = SINGLE_RANK,
        quantization: str | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        pp: PipelineStage = SINGLE_STAGE,
        cudagraph_mode: str = "FULL",
    ) -> None:
        cudagraph_mode = os.environ.get("FLOWENGINE_CUDAGRAPH_MODE", cudagraph_mode)
        if cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {CUDAGRAPH_MODES}, "
                             f"got {cudagraph_mode!r}")
        self.cudagraph_mode = cudagraph_mode
        self.enforce_eager = enforce_eager
        self.capture_sizes = capture_sizes_for(max_num_seqs, max_num_batched_tokens,
                                               capture_sizes)
        self.decode_batch_sizes: list[int] = []
        self.graphs: DecodeCudaGraphs | None = None
        # Speculative decoding: steps of at most verify_query_len tokens per request are
        # padded to verify_batch_sizes (requests) and replay verify_graphs when captured.
        self.verify_query_len = 0
        self.verify_batch_sizes: list[int] = []
        self.verify_graphs: DecodeCudaGraphs | None = None
        self.mixed_sizes: list[int] = []
        self.mixed_graphs: MixedCudaGraphs | None = None
        self._pending: list[PendingStep] = []
        self._step_start: torch.cuda.Event | None = None  # the launching step's (DEVICE_TIMERS)
        # launch() and a PendingStep's result() may run in different threads (the
        # Executor actor's launcher and resolver): both change request states under this lock.
        self._lock = threading.RLock()
        self._slots: dict[str, int] = {}
        self._free_slots: list[int] = []
        self.last_sampled = torch.zeros(0, dtype=torch.int64, device=device)
        super().__init__(model_config, cache_config, device, dtype, load_format, model_path,
                         attn_backend=attn_backend, max_num_batched_tokens=max_num_batched_tokens,
                         max_num_seqs=max_num_seqs, seed=seed, tp=tp,
                         quantization=quantization, kv_cache_dtype=kv_cache_dtype, pp=pp)
        self._grow_slots(2 * max_num_seqs)

    # ------------------------------------------------------------------ setup
    def _make_input_batch(self, block_size: int) -> InputBatch:
        # Room for padded decode steps, so the buffers never move once graphs exist.
        largest = max(self.capture_sizes, default=0)
        max_blocks_per_req = -(-self.model_config.max_model_len // block_size)
        return InputBatch(block_size, max_blocks_per_req, self.device,
                          max(self.max_num_batched_tokens, largest),
                          max(self.max_num_seqs, largest))

    def profile_memory(self, block_size: int) -> MemoryProfile:
        """Peak memory of the largest step (see memory_profile.profile_memory); call
        before initialize_kv_cache. Raises RuntimeError if the device is not CUDA."""
        if self.device.type != "cuda":
            raise RuntimeError("profile_memory needs a CUDA device; on the CPU give "
                               "kv_cache_memory_bytes or num_kv_blocks")
        c = self.model_config
        model = self.model
        if self.pp.size > 1:
            # The stage's layers, from a received tensor unless first, no logits unless last.
            model = StageProfileModel(model, self.pp, c.hidden_size, self.dtype)
        return profile_memory(
            model, num_layers=len(self.pp.layer_range(c.num_layers)),
            kv_block_shape=(2, 1, block_size, c.num_kv_heads // self.tp.world_size,
                            c.head_dim), dtype=self.kv_cache_dtype,
            max_num_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            max_model_len=c.max_model_len)

    def capture_cuda_graphs(self) -> None:
        """Capture decode graphs for every size of `capture_sizes`. Does nothing with
        enforce_eager, off CUDA, or with an attention backend other than Triton (the
        torch reference syncs with the host), or for a stage of a pipeline of more than
        one stage (eager, cuda_stage.py). Call after initialize_kv_cache.

        Raises RuntimeError when the KV cache is missing or a capture fails."""
        if self.enforce_eager or self.device.type != "cuda" or stage_runs_eagerly(self.pp):
            return
        backend = self.model.model.layers[0].self_attn.attn_backend
        if getattr(backend, "name", None) != "triton":
            logger.warning("attention backend %r cannot be captured in CUDA graphs; decode "
                           "runs eagerly", getattr(backend, "name", backend))
            return
        if not self.kv_caches:
            raise RuntimeError("capture_cuda_graphs needs the KV cache: call "
                               "initialize_kv_cache first")
        if not self.capture_sizes:
            return
        self.input_batch.growable = False
        graphs = DecodeCudaGraphs(self.model, self.kv_caches, self.input_batch, backend,
                                  self.model_config.max_model_len, self.capture_sizes)
        graphs.capture()
        self.graphs = graphs
        self.decode_batch_sizes = list(self.capture_sizes)
        if self.cudagraph_mode == "FULL":
            sizes = mixed_capture_sizes(self.max_num_seqs, self.max_num_batched_tokens)
            mixed = MixedCudaGraphs(self.model, self.kv_caches, self.input_batch, backend,
                                    self.model_config.max_model_len, sizes,
                                    self.max_num_seqs)
            mixed.capture()
            self.mixed_graphs = mixed
            self.mixed_sizes = sizes

    def capture_verification_graphs(self, num_speculative_tokens: int) -> None:
        """Capture verification graphs of k + 1 tokens per request for the decode graph
        sizes whose token count fits max_num_batched_tokens (speculative decoding; call
        after the proposer is attached, so EAGLE-3's auxiliary outputs are captured
        too). Does nothing without decode graphs. Raises RuntimeError when a capture
        fails."""
        if self.graphs is None:
            return
        q = num_speculative_tokens + 1
        sizes = [b for b in self.capture_sizes if b * q <= self.input_batch.max_num_tokens]
        if not sizes:
            return
        backend = self.model.model.layers[0].self_attn.attn_backend
        graphs = DecodeCudaGraphs(self.model, self.kv_caches, self.input_batch, backend,
                                  self.model_config.max_model_len, sizes, tokens_per_req=q)
        graphs.capture()
        self.verify_graphs = graphs
        self.verify_query_len = q
        self.verify_batch_sizes = sizes

    # ------------------------------------------------------------------ token slots
    def _grow_slots(self, num_slots: int) -> None:
        old = self.last_sampled
        self.last_sampled = torch.zeros(num_slots, dtype=torch.int64, device=self.device)
        self.last_sampled[:old.shape[0]] = old
        self._free_slots.extend(range(num_slots - 1, old.shape[0] - 1, -1))

    def _acquire_slot(self, req_id: str) -> int:
        slot = self._slots.get(req_id)
        if slot is None:
            if not self._free_slots:
                self._grow_slots(2 * self.last_sampled.shape[0])
            slot = self._slots[req_id] = self._free_slots.pop()
        return slot

    def update_states(self, plan: StepPlan) -> None:
        """ModelRunner.update_states, plus token slots: released for finished requests,
        given to new ones (a request resent in full keeps its slot)."""
        for req_id in plan.finished_req_ids:
            slot = self._slots.pop(req_id, None)
            if slot is not None:
                self._free_slots.append(slot)
        super().update_states(plan)
        for new in plan.new_reqs:
            self.requests[new.req_id].token_slot = self._acquire_slot(new.req_id)

    # ------------------------------------------------------------------ steps
    def _forward(self, plan: StepPlan) -> tuple[list[RequestState], StepInputs | None,
                                                 torch.Tensor | None]:
        """Apply the plan and run the model: (scheduled states, inputs, hidden states
        [T_padded, hidden_size]); inputs and hidden are None for an empty step."""
        self.update_states(plan)
        states = [self.requests[req_id] for req_id in plan.scheduled_req_ids]
        num_scheduled = plan.num_scheduled_tokens
        if len(num_scheduled) != len(states):
            raise ValueError(
                f"step {plan.step_id} has {len(num_scheduled)} num_scheduled_tokens for "
                f"{len(states)} scheduled requests"
            )
        if not states:
            return states, None, None
        pad_to = pad_reqs_to = graphs = None
        longest = max(num_scheduled)
        if self.decode_batch_sizes and longest == 1:
            pad_to = padded_batch_size(len(states), self.decode_batch_sizes)
            graphs = self.graphs
        elif self.verify_batch_sizes and 1 < longest <= self.verify_query_len:
            # A verification step (drafts): b requests -> b * (k + 1) token rows.
            pad_reqs_to = padded_batch_size(len(states), self.verify_batch_sizes)
            if pad_reqs_to is not None:
                pad_to = pad_reqs_to * self.verify_query_len
                graphs = self.verify_graphs
        elif self.mixed_sizes and longest > 1:
            # A mixed step: padded to the nearest captured token count.
            pad_to = padded_batch_size(sum(num_scheduled), self.mixed_sizes)
            if pad_to is not None:
                pad_reqs_to = min(pad_to, self.max_num_seqs)
                graphs = self.mixed_graphs
        extra = {} if pad_reqs_to is None else {"pad_reqs_to": pad_reqs_to}
        inputs = self.input_batch.prepare(states, num_scheduled, pad_to=pad_to, **extra)
        if DEVICE_TIMERS and self.device.type == "cuda":
            self._step_start = torch.cuda.Event(enable_timing=True)
            self._step_start.record()
        if inputs.attn_metadata.max_seq_len > self.model_config.max_model_len:
            raise ValueError(
                f"step {plan.step_id} reaches {inputs.attn_metadata.max_seq_len} tokens in one "
                f"request, beyond max_model_len {self.model_config.max_model_len}"
            )
        if inputs.gather_dst is not None:
            # Decode inputs sampled in an earlier step that the host may not know yet.
            inputs.input_ids.index_copy_(
                0, inputs.gather_dst, self.last_sampled.index_select(0, inputs.gather_src))
        aux = None
        if pad_to is not None and graphs is not None:
            size = (pad_to if pad_reqs_to is None or graphs is self.mixed_graphs
                    else pad_reqs_to)
            hidden = graphs.replay(size)
            aux = graphs.aux_outputs(size)
        else:
            hidden, aux = self.run_model(inputs)
        if self.draft_runner is not None:
            # Draft model: its KV in lockstep; EAGLE / Medusa: the step's hidden states.
            self.draft_runner.forward(inputs, states, hidden, aux)
        if self.pp.is_last:  # the other stages' `hidden` is what they sent on
            self.collect_prompt_logprobs(states, num_scheduled, inputs, hidden)
        for state, num in zip(states, num_scheduled, strict=True):
            state.num_computed_tokens += num
        return states, inputs, hidden

    @torch.inference_mode()
    def execute_model(self, plan: StepPlan) -> ModelOutput:
        """As ModelRunner.execute_model (logits out; the caller samples and calls
        append_sampled; a pipeline stage before the last returns logits None, its
        hidden states sent on). Resolves launched steps first, so the host knows every
        token."""
        with self._lock:
            self.flush()
            states, inputs, hidden = self._forward(plan)
        if inputs is None or hidden is None:
            return ModelOutput([], torch.empty(0, self.model_config.vocab_size,
                                               device=self.device))
        if not self.pp.is_last:
            return ModelOutput(inputs.sample_req_ids, None)
        # Speculative decoding: the drafts' rows too (the Executor sends plans with
        # drafts here, not to launch).
        logits_indices, drafts = verification_rows(states, inputs)
        logits = self.model.compute_logits(hidden.index_select(0, logits_indices))
        return ModelOutput(inputs.sample_req_ids, logits, drafts)

    @torch.inference_mode()
    def launch(self, plan: StepPlan, sampler: Sampler) -> PendingStep:
        """Enqueue one step on the device: forward, logits of the sampling rows, sampling,
        the sampled ids into their requests' token slots, and their copy to the host.

        Returns at once (no host sync unless a sampled request uses penalties while an
        earlier step is unresolved: penalties read token values). Each sampled request
        gets a placeholder token until the returned PendingStep's result() is read.
        Raises ValueError for an inconsistent plan, as execute_model, or for a plan
        whose bitmask is pending (use launch_forward and launch_sampling).
        """
        if plan.pending_structured_output_tokens:
            raise ValueError(f"step {plan.step_id} waits for its GrammarOutput: launch it "
                             "with launch_forward, then launch_sampling")
        with self._lock:
            return self._launch_sampling(self._launch_forward(plan), sampler, plan)

    @torch.inference_mode()
    def launch_forward(self, plan: StepPlan) -> LaunchedForward:
        """The first half of `launch`: enqueue the forward and the logits of the
        sampling rows, and return them for `launch_sampling`, which must follow before
        the next plan. For a plan with pending_structured_output_tokens, whose grammar
        bitmask arrives after the forward was launched. Raises as launch."""
        with self._lock:
            return self._launch_forward(plan)

    @torch.inference_mode()
    def launch_sampling(self, forward: LaunchedForward, sampler: Sampler,
                        grammar: StepPlan | GrammarOutput) -> PendingStep:
        """The second half of `launch`: mask the launched forward's logits with
        `grammar`'s bitmask (its structured_output_req_ids and grammar_bitmask: the
        step's GrammarOutput, or the plan itself), then sample as `launch`.
        Raises ValueError when `grammar` is of another step."""
        if grammar.step_id != forward.step_id:
            raise ValueError(f"the grammar bitmask of step {grammar.step_id} given to "
                             f"step {forward.step_id}")
        with self._lock:
            return self._launch_sampling(forward, sampler, grammar)

    def _launch_forward(self, plan: StepPlan) -> LaunchedForward:
        if self.pp.size > 1:
            raise ValueError("a pipeline stage runs its steps through execute_model (the "
                             "last stage samples on the host path), not launch")
        self._step_start = None
        _, inputs, hidden = self._forward(plan)
        if inputs is None or hidden is None or not inputs.sample_req_ids:
            return LaunchedForward(plan.step_id, [], None, None)
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        return LaunchedForward(plan.step_id, inputs.sample_req_ids, inputs.sample_slots, logits,
                               self._step_start)

    def _launch_sampling(self, forward: LaunchedForward, sampler: Sampler,
                         grammar: StepPlan | GrammarOutput) -> PendingStep:
        logits = forward.logits
        if logits is None:
            return PendingStep.empty(forward.step_id)
        sampled_states = [self.requests[rid] for rid in forward.sample_req_ids]
        if any(s.reads_token_values for s in sampled_states) and any(
                s.placeholder_indices for s in sampled_states):
            self.flush()
        # Structured outputs: the bitmask (filled from accepted tokens only, so no
        # placeholder is involved), applied before sampling and logprobs.
        apply_plan_bitmask(logits, forward.sample_req_ids, grammar.structured_output_req_ids,
                           grammar.grammar_bitmask)
        output = sampler(logits, sampled_states)  # a RequestState is a sampling state
        self.last_sampled.index_copy_(0, forward.sample_slots, output.sampled_token_ids)
        host_output, event = copy_to_host(output, timing=forward.start_event is not None)
        placeholders = []
        for state in sampled_states:
            index = len(state.token_ids)
            state.token_ids.append(PLACEHOLDER_TOKEN_ID)
            state.placeholder_indices.append(index)
            placeholders.append((state, index))
        pending = PendingStep(forward.step_id, forward.sample_req_ids, placeholders,
                              host_output, event, on_done=self._pending.remove, lock=self._lock,
                              start_event=forward.start_event)
        self._pending.append(pending)
        return pending

    def flush(self) -> None:
        """Resolve every launched step (waits for their tokens)."""
        with self._lock:
            for pending in list(self._pending):
                pending.result()

    @property
    def num_pending_steps(self) -> int:
        return len(self._pending)

