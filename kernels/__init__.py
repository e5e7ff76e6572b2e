"""Compute kernels, each beside the plain-torch reference it is tested against.

``cpu_paged_attention``: paged decode attention in C++ for CPUs, compiled on
first use; the reference is ``splitserve.engine.attention.decode_attention``.
"""
