"""What the router and the workers share, free of torch, gRPC and the protos.

============================  ===============================================================
``model_info``                ModelConfig (config.json), finding a model directory, its fingerprint
``sampling_params``           SamplingParams, validated when built
``prompt``                    the one check of a prompt's token ids
``block_hash``                the chained KV block hash (prefix caching, prefix-aware routing)
``load``                      WorkerLoad: a worker's queues and KV usage
``types``                     FinishReason, WorkerRole, WorkerState, KVConnectorKind
``errors``                    the domain errors, each naming the gRPC status it maps to
``log_fields``                structured logs: a request's and a transfer's ids on every line about it
============================  ===============================================================

The router imports only this package, the protos and ``splitserve.rpc``; the
engine imports only this package of the three. ``tests/unit/test_architecture.py``
keeps it that way.
"""
