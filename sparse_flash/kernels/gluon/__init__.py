"""The warp-specialised Hopper kernels in Gluon: forward, dQ and dK/dV, their shared pipeline pieces and merges."""
