"""splitserve's gRPC contract, version 1: ``inference.proto`` and ``worker.proto``.

The ``*_pb2.py``, ``*_pb2_grpc.py`` and ``*_pb2.pyi`` modules beside this file
are generated from the .proto files at install time (or by ``make protos``)
and are never edited or committed::

    from splitserve.v1 import inference_pb2, inference_pb2_grpc
"""
