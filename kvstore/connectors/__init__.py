"""Connectors that put kvstore behind serving engines.

``kvstore.connectors.prefix_cache`` is the engine-independent part (lookup, load and save of a
model's latent rows by prompt prefix, with counters); ``kvstore.connectors.vllm`` is vLLM's
``KVConnectorBase_V1`` over it, imported only inside vLLM (it needs vLLM and torch).
"""
