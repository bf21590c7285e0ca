"""Tensor parallelism: the sharding rules (config.py), the communicator (comm.py), the exact vocab-parallel
reductions (vocab.py) and N simulated ranks on the CPU (simulated.py). docs/tensor_parallel.md explains them."""
