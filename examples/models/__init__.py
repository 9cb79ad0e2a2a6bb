"""The model code the main job, the benchmark and the estimator share; it imports none of them.

model.py                the Llama-style Transformer (dense or MoE blocks), its presets, the loss, init
chunked_loss.py         the head (LMHead) and its loss a chunk of tokens at a time, each chunk checkpointed
moe.py                  the routed mixture-of-experts layer: top-k, grouped GEMM, all-to-all over ep
vocab_parallel_loss.py  cross entropy of vocabulary-sharded logits (tensor parallelism's loss)
"""
