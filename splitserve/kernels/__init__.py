"""Compute kernels, each beside the plain-torch reference it is tested against.

``cpu_ops``: one C++ extension for CPUs, compiled on first use, with paged decode
attention (reference: ``splitserve.engine.attention.decode_attention``), the KV
write (``attention.write_kv``), and the Llama layer's fused element-wise
operations: RMSNorm with the residual add, rotary, SiLU-and-multiply (references:
``splitserve.engine.models.rms_norm``, ``.rotary_embedding`` and ``.llama``).

``triton_attention`` (the ``triton`` extra, imported on first use): the KV write, split-K paged decode
attention and varlen paged prefill attention (references: ``attention.write_kv``, ``decode_attention``,
``prefill_attention``), behind ``--attention-backend triton``. ``triton_ops``: RMSNorm (with the residual
add), rotary, SiLU-and-multiply, and block gather/scatter for KV connectors (reference:
``splitserve.kvtransfer.blocks``). On a CPU both run only under ``TRITON_INTERPRET=1`` (the tests).
"""
