"""Which LoRA adapters a generation request names, read as SGLang reads them.

SGLang serves a request with an adapter only on an engine that loaded it (its LoRA
registry refuses any other name with 400), so the gateway must send such a request to an
engine that holds every adapter it names (gateway/fleet/capability.py, Needs).

- `/generate`: `lora_path`, one name, or one per batch item (`null` items use the base
  model). An empty string on a single request is no adapter (SGLang tests it for truth).
- the OpenAI chat and completion routes: `model` written `base:adapter` names the adapter
  (everything after the first colon, blanks stripped; SGLang's `_parse_model_parameter`),
  and wins over an explicit `lora_path`, read as on `/generate`.

Names that are not strings are not adapters the gateway can route by: SGLang refuses the
request itself wherever it goes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gateway.contract.routes import Kind

# The key a body must spell literally (or with escapes) to name an adapter on any route.
LORA_KEY: Final = b"lora_path"
_NONE: Final[list[str]] = []  # never written to: callers extend their own list with it


def requested_adapters(kind: Kind, body: Mapping[str, Any]) -> list[str]:
    """The adapter names a parsed body asks for (none for the base model)."""
    if kind is not Kind.GENERATE:
        if kind is not Kind.CHAT and kind is not Kind.COMPLETIONS:
            return []
        model = body.get("model")
        if isinstance(model, str) and ":" in model:
            adapter = model.split(":", 1)[1].strip()
            if adapter:
                return [adapter]
    lora = body.get("lora_path")
    if lora is None:
        return _NONE
    if isinstance(lora, str):
        return [lora] if lora else []
    if isinstance(lora, list):
        return [name for name in lora if isinstance(name, str)]
    return []
