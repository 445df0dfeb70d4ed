"""Sampling: the sampler parameters, logit ops and the rejection step in MLX, the fused kernels, and (test/tool code) the NumPy oracle and the kernel emulation."""
