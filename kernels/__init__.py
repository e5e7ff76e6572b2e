"""Compute kernels, each beside the plain-torch reference it is tested against.

``cpu_ops``: one C++ extension for CPUs, compiled on first use, with paged decode
attention (reference: ``splitserve.engine.attention.decode_attention``), the KV
write (``attention.write_kv``), and the Llama layer's fused element-wise
operations: RMSNorm with the residual add, rotary, SiLU-and-multiply (references:
``splitserve.engine.models.rms_norm``, ``.rotary_embedding`` and ``.llama``).
"""
