"""Sampling: parameters, logits processing shared by target and draft, Gumbel-max, logprobs.

Never creates noise itself: every random value comes from `specdec.rng`.
"""

from specdec.sampling.context import LogitsContext, LogitsRules
from specdec.sampling.logprobs import Logprobs, compute_logprobs
from specdec.sampling.params import SamplingParams
from specdec.sampling.processing import filter_threshold, process_logits, scale_logits
from specdec.sampling.sampler import gumbel_argmax_ref, sample, sample_ref
from specdec.sampling.structured import StructuredOutputsParams
from specdec.sampling.tensors import SampleOutput, SamplingTensors

__all__ = [
    "LogitsContext",
    "LogitsRules",
    "Logprobs",
    "SampleOutput",
    "SamplingParams",
    "SamplingTensors",
    "StructuredOutputsParams",
    "compute_logprobs",
    "filter_threshold",
    "gumbel_argmax_ref",
    "process_logits",
    "sample",
    "sample_ref",
    "scale_logits",
]
