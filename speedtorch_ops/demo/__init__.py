"""The main job: skip-gram with negative sampling, the embedding tables and their optimizer state
in host memory (pinned on a GPU machine, where the GPU holds only a batch's rows and a row cache),
on an embedded corpus with planted structure. On a GPU both tables train as one
speedtorch_ops.HostEmbeddingCollection with a GPU row cache, its step captured in a CUDA graph
(--engine collection, the default there; --graph); on the CPU through the SpeedTorch-compatible
factories, ModelFactory and OptimizerFactory (--engine factories, the default there).

The corpus is generated deterministically: the vocabulary is split into clusters of
--cluster-size words; each sentence draws most of its words from one cluster and the rest from
the whole vocabulary (Zipf-like noise). Words of a cluster co-occur, so a trained embedding puts
them next to each other: the quality score is the share of each word's nearest neighbours
(cosine, centre embeddings) that are in its own cluster (chance: about cluster_size / vocab).

    python -m speedtorch_ops.demo                      # CPU when no GPU is present
    python -m speedtorch_ops.demo --vocab 4000000 --dim 128 --batch 8192 --device cuda \
        --gpu-budget-mb 2048 --baseline                 # table bigger than the GPU budget
"""
