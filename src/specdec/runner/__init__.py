"""The runner layer, below the engine and the drafters (both run models): KV block accounting
(`kv_cache`), the paged model runner (`model_runner`) and the CUDA-graph helper (`cuda_graph`).
Never samples or draws randomness.
"""

from specdec.runner.kv_cache import BlockAllocator, BlockHolder
from specdec.runner.model_runner import PagedModelRunner, StepInput

__all__ = ["BlockAllocator", "BlockHolder", "PagedModelRunner", "StepInput"]
