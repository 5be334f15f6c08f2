"""The SDK reads numbers from text in ASCII decimal only, as the daemon does (issue #28 item 10)."""

from __future__ import annotations

import pytest

from kvrouter_client._fanout import resolve_all
from kvrouter_client._streams import MAX_BATCH_BYTES, advertised_limit


@pytest.mark.parametrize("target", ["localhost:٥٠٠٥١", "localhost:²", "localhost:5_0051", "localhost: 50051"])
def test_a_fan_out_target_port_is_ascii(target):
    with pytest.raises(ValueError, match="expected host:port"):
        resolve_all(target)


def test_an_advertised_batch_limit_is_ascii():
    from kvrouter_client._streams import BATCH_METADATA

    assert advertised_limit({BATCH_METADATA: "65536"}) == 65536  # type: ignore[arg-type]
    assert advertised_limit({BATCH_METADATA: str(MAX_BATCH_BYTES * 2)}) == MAX_BATCH_BYTES  # type: ignore[arg-type]
    for value in ("٦٥٥٣٦", "²", " 65536", "6_5536", "-1"):
        assert advertised_limit({BATCH_METADATA: value}) == 0, value  # type: ignore[arg-type]
