"""Tables sharded by rows across the ranks of a torch.distributed process group (NCCL between
GPUs, gloo on CPUs): ``ShardedHostEmbedding`` and ``ShardedHostEmbeddingBag``,
``ShardedEmbeddingCollection`` (several of them routed in one exchange per phase), and
``full_state_dict`` to load a sharded checkpoint into the single-process modules."""

from .checkpoint import full_state_dict
from .sharded import ShardedEmbeddingCollection, ShardedHostEmbedding, ShardedHostEmbeddingBag

__all__ = ["ShardedHostEmbedding", "ShardedHostEmbeddingBag", "ShardedEmbeddingCollection",
           "full_state_dict"]
