"""What every splitserve gRPC server shares: start-up (health, reflection), the
exception -> status mapping, proto <-> domain conversion, and worker membership."""
