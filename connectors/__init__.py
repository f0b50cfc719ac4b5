"""Connectors that put kvstore behind serving engines.

``kvstore.connectors.prefix_cache`` is the engine-independent part (lookup, load and save of a
model's latent rows by prompt prefix, with counters) over ``kvstore.connectors.store_client`` (a
local store folder, or a running ``kvstore serve`` with an API key); ``kvstore.connectors.vllm`` is vLLM's
``KVConnectorBase_V1`` over it, imported only inside vLLM (it needs vLLM and torch), and
``kvstore.connectors.vllm_worker`` its worker side (loads into and saves from vLLM's paged cache;
torch only, so it runs where vLLM does not).
``kvstore.connectors.save_writer`` takes the vLLM connector's saves off the serving step (a
background writer with a bounded queue). ``kvstore.connectors.hot_tier`` keeps recently loaded or
saved rows in host memory in front of the store (an LRU within ``hot_bytes``). ``kvstore.connectors.page_cache`` keeps pages by an engine's page keys over the same client, and
``kvstore.connectors.sglang`` is SGLang's ``HiCacheStorage`` over it (it needs torch; SGLang's own
base class when SGLang is installed).
"""
