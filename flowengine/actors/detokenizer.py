"""Detokenizer actor: engine outputs → text deltas, stop strings (DESIGN.md §1, §7)."""

from __future__ import annotations

from collections import Counter

from flowengine.actors.base import Channel, InprocChannel
from flowengine.engine.input_processor import ProcessedPrompt
from flowengine.engine.output_processor import OutputProcessor
from flowengine.messages import AbortRequest, EngineOutputs, SchedulerStats


class DetokenizerActor:
    """Wraps `OutputProcessor(stream=True)`.

    Args:
        output_processor: per-request detokenizer and stop-string state.
        outputs: inbox of `EngineOutputs` from the scheduler.
        requests: where stop-string matches go, as `AbortRequest`s (frees blocks).
        streamer_inbox: where `RequestOutput` deltas go.

    Registration (`register`) goes through an in-process inbox that is drained before
    each batch of engine outputs, so a request is always known before its first token.
    """

    def __init__(
        self,
        output_processor: OutputProcessor,
        outputs: Channel,
        requests: Channel,
        streamer_inbox: Channel,
    ) -> None:
        self.processor = output_processor
        self.outputs = outputs
        self.requests = requests
        self.streamer_inbox = streamer_inbox
        self.control = InprocChannel()
        self.stats = SchedulerStats()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_by_reason: Counter[str] = Counter()

    def register(self, processed: ProcessedPrompt) -> None:
        self.control.send(("add", processed))

    def forget(self, request_id: str) -> None:
        self.control.send(("abort", request_id))

    def _drain_control(self) -> None:
        while (item := self.control.try_recv()) is not None:
            op, arg = item
            if op == "add":
                self.processor.add_request(arg)
                self.prompt_tokens_total += len(arg.prompt_token_ids)
            else:
                self.processor.abort(arg)

    async def run(self) -> None:
        while True:
            msg: EngineOutputs = await self.outputs.recv_async()
            self._drain_control()
            if msg.stats is not None:
                self.stats = msg.stats
            for delta in msg.outputs:
                self.generation_tokens_total += len(delta.new_token_ids)
                if delta.finish_reason is not None:
                    self.finished_by_reason[delta.finish_reason] += 1
            outs, to_stop = self.processor.process(msg.outputs)
            if to_stop:
                await self.requests.send_async(AbortRequest(to_stop))
            if outs:
                await self.streamer_inbox.send_async(outs)
