"""The Triton kernels: forward, backward (dQ and dK/dV passes), their tiles, split lists and tensor descriptors."""
