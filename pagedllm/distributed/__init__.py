"""Tensor parallelism over torch.distributed: the process groups (parallel_state.py) and the
collectives the sharded layers and the step broadcast use (communication.py)."""
