"""Conformance suites as base classes: each implementation subclasses one and passes it whole.

``codecs.TierConformance`` (every tier of ``kvstore.tiers``), ``attention.AttentionConformance``
(every decode-attention backend), ``store.StoreConformance`` (every session-store backend).
"""
