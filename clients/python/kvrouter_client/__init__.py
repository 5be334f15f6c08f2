"""Client SDK for kvrouterd (gateways and engines)."""

__all__: list[str] = []
