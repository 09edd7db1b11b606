"""Triton kernels and their pure-torch references, one module per conversion family."""
