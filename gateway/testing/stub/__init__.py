"""The SGLang-compatible stub backend. app.py puts together the routes, each SGLang surface in
its own module (generation.py, engine_ops.py, server_info.py) over core.py's state and
plumbing; rules.py plays SGLang's rules, faults.py the scripted faults, cli.py runs it as a
process: `python -m gateway.testing.stub`."""

from gateway.testing.stub.app import Received, StubBackend
from gateway.testing.stub.cli import main
from gateway.testing.stub.rules import GENERATION_PATHS, MASK_TOP_K_MESSAGE, TOP_K_ALL

__all__ = ["GENERATION_PATHS", "MASK_TOP_K_MESSAGE", "TOP_K_ALL", "Received", "StubBackend", "main"]
