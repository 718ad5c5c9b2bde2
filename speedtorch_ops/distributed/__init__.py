"""Tables sharded by rows across the ranks of a torch.distributed process group (NCCL between
GPUs, gloo on CPUs): ``ShardedHostEmbedding`` and ``ShardedHostEmbeddingBag``,
``ShardedEmbeddingDict`` (several of them routed in one exchange per phase), and
``full_state_dict`` to load a sharded checkpoint into the single-process modules; and
``ShardedHostEmbeddingBagCollection``, the table-batched collection split by rows, whose step
a CUDA graph can capture whole."""

from .checkpoint import full_state_dict
from .collection import ShardedHostEmbeddingBagCollection
from .sharded import ShardedEmbeddingDict, ShardedHostEmbedding, ShardedHostEmbeddingBag

__all__ = ["ShardedHostEmbedding", "ShardedHostEmbeddingBag", "ShardedEmbeddingDict",
           "ShardedHostEmbeddingBagCollection", "full_state_dict"]
