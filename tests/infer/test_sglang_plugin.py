"""Meshy's SGLang plugin without SGLang: it is registered where SGLang looks for plugins, an engine that
would need it refuses to start without it, and it leaves SGLang's own requests alone."""

import pytest

from meshy.dataplane import SchemaError
from meshy.dataplane.weights import Published, Transport
from meshy.infer import sglang_plugin
from meshy.infer.sglang_engine import SGLangEngine

PUBLISHED = Published(3, Transport.COLLECTIVE, '{"config": {}, "buckets": {}, "tensors": []}', "", 0, 0.0)


def test_the_plugin_is_registered_where_sglang_loads_plugins_from(monkeypatch):
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    sglang_plugin.check_loaded()
    monkeypatch.setenv("SGLANG_PLUGINS", "someone-else, meshy")
    sglang_plugin.check_loaded()


def test_an_engine_that_receives_broadcasts_refuses_to_start_where_sglang_would_not_load_the_plugin(monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "someone-else")
    with pytest.raises(SchemaError, match="weight_sync_rank: .*Meshy's SGLang plugin.*SGLANG_PLUGINS"):
        SGLangEngine(PUBLISHED, device="cpu", weight_sync_rank=1)


def test_sglang_s_own_requests_go_to_sglang_untouched():
    calls = []
    own = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "g", "load_format": None}
    result = sglang_plugin.receive_broadcast(lambda updater, **request: calls.append(request) or "its own", "u", **own)
    assert result == "its own" and calls == [own]
