"""The model layer: family adapters, loading, bundled models, dtypes, the layer runner, batched decoding, sampling.

Knows nothing of caches or requests; imports only :mod:`kvrag.kernels` below it."""
