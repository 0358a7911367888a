"""The Prometheus rendering of backend figures (unit level; the e2e suites scrape real servers)."""

from __future__ import annotations

from glm53.server.metrics import _flatten, _per_layer


def test_per_layer_figures_become_one_labelled_series_per_field():
    engine = {"steps": 3, "offload": {"cache": {"hit_rate": 0.4, "per_layer": [
        {"layer": "model.layers.3.mlp", "slots": 2, "hits": 5, "hit_rate": 0.25},
        {"layer": "model.layers.4.mlp", "slots": 30, "hits": 0, "hit_rate": None},
    ]}}}
    assert dict(_flatten(engine)) == {"steps": 3, "offload_cache_hit_rate": 0.4}  # lists are not flattened
    assert dict(_per_layer(engine)) == {
        "offload_cache_per_layer_slots": [("model.layers.3.mlp", 2), ("model.layers.4.mlp", 30)],
        "offload_cache_per_layer_hits": [("model.layers.3.mlp", 5), ("model.layers.4.mlp", 0)],
        "offload_cache_per_layer_hit_rate": [("model.layers.3.mlp", 0.25)],  # a layer without picks has no rate
    }
    assert list(_per_layer({"plain": [1, 2], "other": [{"name": "x", "v": 1}]})) == []
