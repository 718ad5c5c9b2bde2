"""Tables sharded by rows across the ranks of a torch.distributed process group (NCCL between
GPUs, gloo on CPUs): ``ShardedHostEmbedding`` and ``ShardedHostEmbeddingBag``, and
``full_state_dict`` to load a sharded checkpoint into the single-process modules."""

from .checkpoint import full_state_dict
from .sharded import ShardedHostEmbedding, ShardedHostEmbeddingBag

__all__ = ["ShardedHostEmbedding", "ShardedHostEmbeddingBag", "full_state_dict"]
