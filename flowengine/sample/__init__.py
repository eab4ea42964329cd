"""Sampling on the device: logits -> token ids and logprobs (DESIGN.md §1, Sampler)."""

from flowengine.sample.metadata import SamplingMetadata, SamplingState, step_seed
from flowengine.sample.output import LogprobsTensors, SamplerOutput
from flowengine.sample.sampler import Sampler

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingState",
    "step_seed",
]
