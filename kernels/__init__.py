"""Triton page-copy and slot-assignment kernels with their torch references (``hicache.kernels``)."""
