"""The SGLang-compatible stub backend: app.py serves, rules.py plays SGLang's rules,
faults.py the scripted faults. `python -m gateway.testing.stub` runs it."""

from gateway.testing.stub.app import Received, StubBackend, main
from gateway.testing.stub.rules import GENERATION_PATHS, MASK_TOP_K_MESSAGE, TOP_K_ALL

__all__ = ["GENERATION_PATHS", "MASK_TOP_K_MESSAGE", "TOP_K_ALL", "Received", "StubBackend", "main"]
