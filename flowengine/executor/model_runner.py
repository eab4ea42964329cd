"""The model runner: weights, KV cache and per-request state of one executor.

Follows the StepPlan protocol of flowengine/messages.py: a request arrives in full once
(`new_reqs`, replacing any earlier state of that id, e.g. after preemption), then only
as deltas (`cached_reqs`: new block ids, num_computed_tokens before the step);
`finished_req_ids` drop state. Sampled tokens come back through `append_sampled`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowengine.config import CacheConfig
from flowengine.distributed.pp_group import SINGLE_STAGE, PipelineStage
from flowengine.distributed.tp_group import SINGLE_RANK, TensorParallelGroup
from flowengine.executor import cpu_hugepages
from flowengine.executor.input_batch import BlockIds, InputBatch, RequestState, StepInputs
from flowengine.executor.prompt_logprobs import compute_prompt_logprobs, prompt_logprob_rows
from flowengine.executor.spec_verify import verification_rows
from flowengine.messages import StepPlan
from flowengine.model.attention.backend import AttentionBackend
from flowengine.model.loader import load_model
from flowengine.model.model_config import ModelConfig


@dataclass
class ModelOutput:
    """Next-token logits of one step.

    req_ids: the requests whose scheduled tokens reach their last known token (partial
    prefill chunks are absent), in batch order. logits: [len(req_ids), vocab] float32;
    None on tensor-parallel ranks other than 0 (rank 0 gathers the vocabulary slices)
    and on pipeline stages other than the last.
    draft_token_ids: speculative decoding: each request's draft tokens (None when no
    request of the step has any); logits then has 1 + len(drafts) rows per request, in
    order (spec_verify.py).
    """

    req_ids: list[str]
    logits: torch.Tensor | None
    draft_token_ids: list[list[int]] | None = None


class ModelRunner:
    """Runs the model for StepPlans.

    Args:
        model_config: the architecture (its max_model_len bounds positions).
        cache_config: KV cache geometry; allocates num_blocks blocks per layer. None
            defers the KV cache (and input buffers) to `initialize_kv_cache`, e.g. to
            size it by profiling a forward first.
        device, dtype: where and in which dtype weights, activations and KV cache live.
        load_format: as `load_model` ("auto", "safetensors", "gguf", "dummy").
        model_path: weights location when not model_config.model_path; a .gguf file is
            read through the GGUF loader.
        attn_backend: defaults to the registry's backend for `device`.
        max_num_batched_tokens, max_num_seqs: initial input-buffer capacity.
        tp: the tensor-parallel group; the runner holds this rank's shard of the
            weights and its num_kv_heads / N heads of the KV cache.
        quantization: as `load_model` (None, "gguf", "int8"; CPU only).
        pp: the pipeline stage; the runner holds the stage's layers and their KV cache
            only, receives the previous stage's hidden states and sends its own to the
            next (`run_model`); only the last stage computes logits.
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
        tp: TensorParallelGroup = SINGLE_RANK,
        quantization: str | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        pp: PipelineStage = SINGLE_STAGE,
    ) -> None:
        self.model_config = model_config
        self.tp = tp
        self.pp = pp
        self.cache_config = cache_config
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_cache_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
        gguf_file = model_path if model_path is not None and model_path.endswith(".gguf") else None
        if model_path is not None and gguf_file is None and model_path != model_config.model_path:
            raise ValueError(
                f"model_path {model_path} differs from model_config.model_path "
                f"{model_config.model_path}; build the ModelConfig from the weights' directory"
            )
        self.model = load_model(model_config, load_format, dtype, self.device,
                                gguf_file=gguf_file, attn_backend=attn_backend, seed=seed,
                                tp=tp, quantization=quantization, pp=pp)
        if self.device.type == "cpu":  # weights on huge pages if opted in (cpu_hugepages.py)
            cpu_hugepages.rehome_module(self.model)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        # Speculative decoding's draft model (executor/draft_runner.py), EAGLE / Medusa
        # heads (executor/eagle_runner.py), or None.
        self.draft_runner = None
        if cache_config is not None:
            self.initialize_kv_cache(cache_config)

    def initialize_kv_cache(self, cache_config: CacheConfig) -> None:
        """Allocate the KV cache (one zeroed [2, num_blocks, block_size, num_kv_heads / N,
        head_dim] tensor per layer of the pipeline stage, in kv_cache_dtype: the model dtype, or float8_e4m3fn
        for --kv-cache-dtype fp8) and the input buffers."""
        self.cache_config = cache_config
        model_config = self.model_config
        if model_config.is_encoder_only:
            # An encoder attends within the step (whole prompts, bidirectional): no KV
            # cache tensors; the scheduler's blocks only account the step's tokens.
            self.kv_caches = []
            self.input_batch = self._make_input_batch(cache_config.block_size)
            return
        shape = (2, cache_config.num_blocks, cache_config.block_size,
                 model_config.num_kv_heads // self.tp.world_size, model_config.head_dim)
        # Zeroed, not empty: see the NOTE in TorchAttentionBackend._decode.
        layers = len(self.pp.layer_range(model_config.num_layers))
        if self.device.type == "cpu":  # on huge pages if opted in (cpu_hugepages.py)
            self.kv_caches = cpu_hugepages.zeros([shape] * layers, self.kv_cache_dtype)
        else:
            self.kv_caches = [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                              for _ in range(layers)]
        self.input_batch = self._make_input_batch(cache_config.block_size)

    def _make_input_batch(self, block_size: int) -> InputBatch:
        max_blocks_per_req = -(-self.model_config.max_model_len // block_size)
        return InputBatch(block_size, max_blocks_per_req, self.device,
                          self.max_num_batched_tokens, self.max_num_seqs)

    @staticmethod
    def kv_cache_bytes_per_block(model_config: ModelConfig, block_size: int,
                                 dtype: torch.dtype, tensor_parallel_size: int = 1,
                                 num_layers: int | None = None) -> int:
        """Bytes one KV block takes over all layers (K and V) on one rank (which holds
        num_kv_heads / tensor_parallel_size heads, and under pipeline parallelism
        `num_layers` of the model's layers), to size num_blocks."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        num_kv_heads = model_config.num_kv_heads // tensor_parallel_size
        num_layers = model_config.num_layers if num_layers is None else num_layers
        return (2 * num_layers * block_size * num_kv_heads
                * model_config.head_dim * itemsize)

    def get_request_state(self, req_id: str) -> RequestState:
        """The executor's state of a live request (token ids, params, EOS). KeyError if unknown."""
        return self.requests[req_id]

    def append_sampled(self, req_id: str, token_ids: list[int]) -> None:
        """Record tokens sampled for `req_id` so that later steps can feed them."""
        self.requests[req_id].token_ids.extend(token_ids)

    def apply_verified(self, req_id: str, token_ids: list[int]) -> None:
        """Speculative decoding: replace the request's draft tokens by the verified
        `token_ids` (accepted drafts + one sampled token) and roll back the rejected
        drafts' KV: num_computed_tokens, and block-table entries past
        ceil(num_computed_tokens / block_size), the scheduler's rule
        (KVCacheManager.trim)."""
        state = self.requests[req_id]
        k = state.num_draft_tokens
        state.num_draft_tokens = 0
        if k:
            del state.token_ids[-k:]
            state.num_computed_tokens -= k - (len(token_ids) - 1)
            block_size = self.input_batch.block_size
            num_blocks_kept = -(-state.num_computed_tokens // block_size)
            del state.block_ids[num_blocks_kept:]
        state.token_ids.extend(token_ids)

    def update_states(self, plan: StepPlan) -> None:
        """Apply a plan's request changes (finished, new, cached) to the executor state.

        Raises ValueError for a cached request the executor does not hold.
        """
        for req_id in plan.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in plan.new_reqs:
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                eos_token_id=new.eos_token_id,
                block_ids=BlockIds(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in plan.cached_reqs:
            state = self.requests.get(cached.req_id)
            if state is None:
                raise ValueError(
                    f"step {plan.step_id} continues request {cached.req_id} that this "
                    "executor does not hold; it must first arrive in new_reqs"
                )
            state.block_ids.extend(cached.new_block_ids)
            if cached.new_token_ids:
                # Pipeline parallelism: the tokens the last stage sampled, from the
                # step's first output position on (CachedRequestData); idempotent on
                # the stage that sampled them.
                start = max(cached.num_computed_tokens, state.num_prompt_tokens)
                state.token_ids[start:start + len(cached.new_token_ids)] = cached.new_token_ids
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.draft_token_ids:
                # Computed after the last known token, replaced by apply_verified.
                state.token_ids.extend(cached.draft_token_ids)
                state.num_draft_tokens = len(cached.draft_token_ids)

    @torch.inference_mode()
    def execute_model(self, plan: StepPlan) -> ModelOutput:
        """Apply the plan, run one forward, return logits of the requests that sample.

        Raises ValueError for an inconsistent plan (unknown request, tokens or blocks
        missing); the state changes of the plan are applied even then.
        """
        self.update_states(plan)
        states = [self.requests[req_id] for req_id in plan.scheduled_req_ids]
        if len(plan.num_scheduled_tokens) != len(states):
            raise ValueError(
                f"step {plan.step_id} has {len(plan.num_scheduled_tokens)} num_scheduled_tokens "
                f"for {len(states)} scheduled requests"
            )
        if not states:
            return ModelOutput([], torch.empty(0, self.model_config.vocab_size,
                                               device=self.device))
        inputs = self.input_batch.prepare(states, plan.num_scheduled_tokens)
        if inputs.attn_metadata.max_seq_len > self.model_config.max_model_len:
            raise ValueError(
                f"step {plan.step_id} reaches {inputs.attn_metadata.max_seq_len} tokens in one "
                f"request, beyond max_model_len {self.model_config.max_model_len}"
            )
        hidden, aux = self.run_model(inputs)
        if not self.pp.is_last:
            # Its hidden states went to the next stage; the last stage samples.
            for state, num in zip(states, plan.num_scheduled_tokens, strict=True):
                state.num_computed_tokens += num
            return ModelOutput(inputs.sample_req_ids, None)
        if self.draft_runner is not None:
            # The draft model's KV in lockstep (draft_runner.py); EAGLE / Medusa keep
            # the step's hidden states (eagle_runner.py).
            self.draft_runner.forward(inputs, states, hidden, aux)
        logits_indices, drafts = verification_rows(states, inputs)
        logits = self.model.compute_logits(hidden.index_select(0, logits_indices))
        self.collect_prompt_logprobs(states, plan.num_scheduled_tokens, inputs, hidden)
        for state, num in zip(states, plan.num_scheduled_tokens, strict=True):
            state.num_computed_tokens += num
        return ModelOutput(inputs.sample_req_ids, logits, drafts)

    def run_model(self, inputs: StepInputs) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The target's forward over `inputs`: (final-norm hidden states [T, hidden],
        and the auxiliary layer inputs EAGLE-3 reads, else None).

        Under pipeline parallelism (which refuses speculative decoding, so no aux) this
        stage's part: the previous stage's [2, T, hidden_size] hidden states and
        residual received first (unless first), this stage's sent on (unless last,
        which returns the final hidden states; the others return what they sent). T is
        the step's token count on every stage, so no shape travels."""
        pp = self.pp
        if pp.size > 1:
            intermediate = None
            if not pp.is_first:
                shape = (2, inputs.input_ids.shape[0], self.model_config.hidden_size)
                intermediate = pp.recv_prev(shape, self.dtype, self.device)
            out = self.model.forward_stage(inputs.input_ids, inputs.positions,
                                           self.kv_caches, inputs.attn_metadata, intermediate)
            if not pp.is_last:
                pp.send_next(out)
            return out, None
        if self.draft_runner is not None and self.draft_runner.aux_hidden_state_layers:
            aux: list[torch.Tensor] = []
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                inputs.attn_metadata, aux_hidden_states=aux)
            return hidden, aux
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                          inputs.attn_metadata), None

    @torch.inference_mode()
    def execute_pooling(self, plan: StepPlan, pooling_type: str) -> tuple[list[str], torch.Tensor]:
        """The pooling runner's step: apply the plan, run one forward over whole prompts,
        pool each request's token states (flowengine/pooling/pooler.py).

        Returns (req_ids in batch order, [len(req_ids), hidden_size] float32). Raises
        ValueError for an inconsistent plan, or a request scheduled for less than its
        whole prompt (the pooling runner runs without chunked prefill and prefix
        caching, so a prompt is always computed in one step).
        """
        from flowengine.pooling.pooler import pool

        self.update_states(plan)
        states = [self.requests[req_id] for req_id in plan.scheduled_req_ids]
        if len(plan.num_scheduled_tokens) != len(states):
            raise ValueError(
                f"step {plan.step_id} has {len(plan.num_scheduled_tokens)} num_scheduled_tokens "
                f"for {len(states)} scheduled requests")
        for state, num in zip(states, plan.num_scheduled_tokens, strict=True):
            if state.num_computed_tokens != 0 or num != len(state.token_ids):
                raise ValueError(
                    f"step {plan.step_id} computes tokens {state.num_computed_tokens}.."
                    f"{state.num_computed_tokens + num} of pooling request {state.req_id} "
                    f"({len(state.token_ids)} tokens): a pooled prompt must be computed "
                    "whole in one step (chunked prefill and prefix caching off)")
        if not states:
            return [], torch.empty(0, self.model_config.hidden_size)
        inputs = self.input_batch.prepare(states, plan.num_scheduled_tokens)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                            inputs.attn_metadata)
        qsl = inputs.attn_metadata.query_start_loc_cpu[:len(states) + 1]
        pooled = pool(hidden, qsl, pooling_type)  # type: ignore[arg-type]
        for state, num in zip(states, plan.num_scheduled_tokens, strict=True):
            state.num_computed_tokens += num
        return [s.req_id for s in states], pooled

    def collect_prompt_logprobs(self, states: list[RequestState], num_scheduled: list[int],
                                inputs: StepInputs, hidden: torch.Tensor) -> None:
        """Append the prompt logprobs of this step's prompt positions to the states
        that ask for them (before num_computed_tokens advances). A no-op, with no
        device work, when none asks."""
        qsl = inputs.attn_metadata.query_start_loc_cpu
        for i, state in enumerate(states):
            if state.prompt_logprobs is None:
                continue
            positions = prompt_logprob_rows(state.num_computed_tokens, num_scheduled[i],
                                            state.num_prompt_tokens)
            if not positions:
                continue
            start = int(qsl[i]) - state.num_computed_tokens
            rows = torch.tensor([start + p for p in positions], dtype=torch.int64)
            targets = torch.tensor(state.token_ids[positions.start + 1:positions.stop + 1],
                                   dtype=torch.int64)
            k = state.sampling_params.prompt_logprobs
            lps = compute_prompt_logprobs(
                hidden, self.model.compute_logits, rows.to(self.device),
                targets.to(self.device), self.model_config.vocab_size if k == -1 else k)
            if lps is not None:
                state.prompt_logprobs.extend(lps)
