"""One rank's execution: load the model, size and hold the KV cache, plan each step's batch,
run the forward (eagerly or from CUDA graphs), sample; and the tensor-parallel worker processes."""
