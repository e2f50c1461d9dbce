"""SAAP (sparse attention with asymmetric partitions): the index (k-means over de-roped keys, a query MLP per KV
head), its training from recorded keys and queries, the build at prefill, and the pure-PyTorch sparse decode.

``rope`` de-ropes; ``collect`` records; ``train`` fits; ``index`` saves, loads and validates; ``build`` clusters a
prompt's keys; ``decode`` is the reference that the Triton kernel (``runtime/kernels/saap.py``) must match.
"""
from .build import ClusterState, assign_keys, build_clusters
from .decode import attended_keys, saap_decode, saap_decode_states, select_clusters, selectivity
from .index import SaapIndex, SaapIndexError, load_index, model_identity
from .rope import RopeSpec, apply_rope, remove_rope, rope_spec_from_config

__all__ = ["ClusterState", "RopeSpec", "SaapIndex", "SaapIndexError", "apply_rope", "assign_keys", "attended_keys",
           "build_clusters", "load_index", "model_identity", "remove_rope", "rope_spec_from_config", "saap_decode",
           "saap_decode_states", "select_clusters", "selectivity"]
