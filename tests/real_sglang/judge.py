"""Judge request bodies with a released SGLang's own code, in a process of its own.

    python tests/real_sglang/judge.py <extracted wheel dir>  < bodies.jsonl  > verdicts.jsonl

The wheel's `sglang/` package is imported with every module it needs but this machine lacks
(torch, triton, CUDA kernels, ...) replaced by placeholders, and with SGLang's own GPU-side
packages (kernels, layers, model executor, ...) replaced too: what runs is the request
handling (`GenerateReqInput` validated as FastAPI validates it, its
`normalize_batch_and_arguments`, the batch split `obj[i]`, `SamplingParams` with its
normalisation and `verify`), and the scheduler's sampling-mask admission, taken from the
release's `scheduler.py` source: the `if` blocks of `handle_generate_request` that test
`return_sampling_mask`, run with a request built from the real SamplingParams. No GPU, no
model, no network. The placeholders live only in this process.

Chat bodies (`{"chat": true, ...}`) go through the release's ChatCompletionRequest (pydantic,
lax), its serving layer's `_validate_request`, the streaming checks of the conversion to an
internal request (read from serving_chat.py), `to_sampling_params`, and the same admission.

Input lines: {"body": <base64>, "chat": bool}. Output lines, one per input:
  {"verdict": "invalid", "why": ...}   SGLang refuses the body before any admission
  {"verdict": "refused", "why": msg}   the scheduler's mask admission refuses an item
  {"verdict": "served", "masks": [top_k of each mask item]}
"""

from __future__ import annotations

import ast
import base64
import importlib
import importlib.abc
import importlib.machinery
import json
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

# SGLang's own packages that build GPU state at import time: never needed to read a request.
_STUBBED = (
    "sglang.kernels",
    "sglang.srt.distributed",
    "sglang.srt.configs",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.dllm",
    "sglang.srt.layers",
    "sglang.srt.model_executor",
    "sglang.srt.mem_cache",
    "sglang.srt.lora",
    "sglang.srt.multimodal",
    "sglang.srt.speculative",
    "sglang.srt.disaggregation",
    "sglang.srt.utils.hf_transformers_patches",  # patches transformers, absent here
    "sglang.srt.function_call",  # tool-call parsers: chat requests here carry no tools
)


class _Base:
    def __init_subclass__(cls, **kwargs: Any) -> None:
        pass

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class Placeholder(types.ModuleType):
    """Any attribute, call, subscript or union of a module that is not here."""

    def __getattr__(self, name: str) -> Any:
        if name == "__version__":
            return "0.0.0"
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        child = Placeholder(f"{self.__name__}.{name}")
        setattr(self, name, child)
        return child

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return Placeholder("call")

    def __iter__(self) -> Any:
        return iter(())

    def __or__(self, other: Any) -> Any:
        return self

    def __ror__(self, other: Any) -> Any:
        return self

    def __getitem__(self, key: Any) -> Any:
        return self

    def __mro_entries__(self, bases: Any) -> tuple[type, ...]:
        return (_Base,)

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.any_schema()


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return Placeholder(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


class _Stubbed(importlib.abc.MetaPathFinder):
    """First on the path: SGLang's GPU-side packages."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if any(name == s or name.startswith(s + ".") for s in _STUBBED):
            return importlib.machinery.ModuleSpec(name, _Loader(), is_package=True)
        return None


class _Missing(importlib.abc.MetaPathFinder):
    """Last on the path: whatever nothing else could find."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".", maxsplit=1)[0] == "sglang":
            return None
        return importlib.machinery.ModuleSpec(name, _Loader(), is_package=True)


def _admission(scheduler_py: Path) -> str:
    """The scheduler's sampling-mask checks as the source of a function of (self, req): the
    top-level `if` blocks testing `return_sampling_mask` of the scheduler method that holds
    most of them (handle_generate_request in 0.5.19; it moved in later releases), with the
    plain assignments of that method the checks read (0.5.18 names its condition first)."""
    tree = ast.parse(scheduler_py.read_text())
    best: list[ast.stmt] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        checks = [
            n
            for n in node.body
            if isinstance(n, ast.If) and "return_sampling_mask" in ast.unparse(n.test)
        ]
        if len(checks) <= len([b for b in best if isinstance(b, ast.If)]):
            continue
        read = {n.id for c in checks for n in ast.walk(c.test) if isinstance(n, ast.Name)}
        assigned = [
            n
            for n in node.body
            if isinstance(n, ast.Assign)
            and all(isinstance(t, ast.Name) and t.id in read for t in n.targets)
        ]
        best = sorted([*assigned, *checks], key=lambda n: n.lineno)
    if not best:
        raise SystemExit(f"no sampling-mask admission found in {scheduler_py}")
    body = "\n".join(ast.unparse(node) for node in best)
    return "def admission(self, req):\n" + textwrap.indent(body, "    ") + "\n    return None\n"


def main() -> None:
    root = Path(sys.argv[1])
    cap = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    sys.meta_path.insert(0, _Stubbed())
    sys.meta_path.append(_Missing())
    sys.path.insert(0, str(root))
    import msgspec
    from pydantic import TypeAdapter

    # io_struct builds msgpack codecs for the scheduler's IPC over every message type,
    # tensors included; the placeholders are no types msgspec takes, and the codecs are
    # never used here. SamplingParams itself stays a real msgspec Struct.
    msgspec.msgpack.Decoder = lambda *args, **kwargs: None  # type: ignore[assignment,misc]
    msgspec.msgpack.Encoder = lambda *args, **kwargs: None  # type: ignore[assignment,misc]

    io_struct = importlib.import_module("sglang.srt.managers.io_struct")
    sampling = importlib.import_module("sglang.srt.sampling.sampling_params")
    top_k_all = sampling.TOP_K_ALL
    adapter = TypeAdapter(io_struct.GenerateReqInput)

    class Refused(Exception):
        pass

    class Req:
        def __init__(self, params: Any, mask: bool) -> None:
            self.sampling_params = params
            self.return_sampling_mask = mask
            self.time_stats = Placeholder("time_stats")

        def set_finish_with_abort(self, message: str, **kwargs: Any) -> None:
            raise Refused(message)

    class Backend:
        """The scheduler's settings the checks read: a plain server (no speculative
        decoding, no disaggregation, the default cap)."""

        disaggregation_mode = "null"
        server_args = types.SimpleNamespace(sampling_mask_max_tokens=cap)

        @staticmethod
        def _reject_sampling_mask_request(req: Any, message: str) -> None:
            raise Refused(message)

        class spec_algorithm:
            @staticmethod
            def is_none() -> bool:
                return True

        def __getattr__(self, name: str) -> Any:
            return Placeholder(name)

    scope: dict[str, Any] = {
        "TOP_K_ALL": top_k_all,
        "DisaggregationMode": types.SimpleNamespace(NULL="null"),
        "get_exec": lambda: types.SimpleNamespace(
            kernel=types.SimpleNamespace(sampling_backend="flashinfer")
        ),
        "envs": Placeholder("envs"),
    }
    scheduler_py = root / "sglang/srt/managers/scheduler.py"
    exec(_admission(scheduler_py), scope)
    admission = scope["admission"]
    backend = Backend()

    chat = _Chat(root)

    def run(item: Any, mask: bool, params: dict[str, Any]) -> list[int]:
        """One item through SamplingParams and the scheduler's checks; its mask's top_k."""
        sp = sampling.SamplingParams(**params)
        sp.normalize(None)
        sp.verify(32000)
        admission(backend, Req(sp, mask))
        return [sp.top_k] if mask else []

    for line in sys.stdin:
        sent = json.loads(line)
        body = base64.b64decode(sent["body"])
        if sent.get("chat"):
            verdict = chat.judge(body, run, Refused)
        else:
            verdict = _judge(body, adapter, run, Refused)
        print(json.dumps(verdict))
        sys.stdout.flush()


def _judge(body: bytes, adapter: Any, run: Any, refused: type[Exception]) -> dict[str, Any]:
    import orjson
    from pydantic import ValidationError

    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return {"verdict": "invalid", "why": f"json: {exc}"}
    if not isinstance(data, dict):
        return {"verdict": "invalid", "why": "not an object"}
    try:
        obj = adapter.validate_python(data)
        obj.normalize_batch_and_arguments()
        items = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
        masks = []
        for item in items:
            masks += run(item, bool(item.return_sampling_mask), item.sampling_params or {})
    except refused as exc:
        return {"verdict": "refused", "why": str(exc)}
    except ValidationError as exc:
        return {"verdict": "invalid", "why": f"validation: {exc.errors()[0]['type']}"}
    except (ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:
        return {"verdict": "invalid", "why": f"{type(exc).__name__}: {str(exc)[:120]}"}
    return {"verdict": "served", "masks": masks}


class _Nothing:
    """A serving-layer setting this test does not set: off, empty, absent."""

    def __bool__(self) -> bool:
        return False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return None

    def __iter__(self) -> Any:
        return iter(())

    def __getattr__(self, name: str) -> Any:
        return _Nothing()


class _Serving:
    """What the chat serving layer's checks read of `self`: a plain text model with no
    tools, parsers or special model handling; anything else reads as off."""

    def __init__(self) -> None:
        server = types.SimpleNamespace(context_length=32768, allow_auto_truncate=False)
        self.tokenizer_manager = types.SimpleNamespace(
            server_args=server, model_config=types.SimpleNamespace(is_multimodal=False)
        )

    @staticmethod
    def _effective_tools(request: Any) -> list[Any]:
        return list(request.tools or [])

    def __getattr__(self, name: str) -> Any:
        return _Nothing()


class _Chat:
    """The release's chat route, as far as it decides whether a request is served."""

    def __init__(self, root: Path) -> None:
        protocol = importlib.import_module("sglang.srt.entrypoints.openai.protocol")
        serving = importlib.import_module("sglang.srt.entrypoints.openai.serving_chat")
        self.request_type = protocol.ChatCompletionRequest
        if hasattr(serving, "get_model"):
            # Later releases read the model's settings from a process-wide context that
            # only a running server publishes.
            model = types.SimpleNamespace(context_length=32768, is_multimodal=False)
            serving.get_model = lambda: model
        self.validate = serving.OpenAIServingChat._validate_request
        self.serving = _Serving()
        self.streaming = self._streaming_checks(root / "sglang/srt/entrypoints/openai")

    @staticmethod
    def _streaming_checks(folder: Path) -> Any:
        tree = ast.parse((folder / "serving_chat.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) == "request.stream":
                text = ast.unparse(node)
                if "return_meta_info is not supported with streaming" in text:
                    scope: dict[str, Any] = {}
                    source = "def check(request):\n" + textwrap.indent(text, "    ")
                    exec(source, scope)
                    return scope["check"]
        raise SystemExit("no streaming checks found in serving_chat.py")

    def judge(self, body: bytes, run: Any, refused: type[Exception]) -> dict[str, Any]:
        import orjson
        from pydantic import ValidationError

        try:
            request = self.request_type.model_validate(orjson.loads(body))
        except (ValidationError, orjson.JSONDecodeError, TypeError) as exc:
            return {"verdict": "invalid", "why": f"request: {type(exc).__name__}"}
        try:
            error = self.validate(self.serving, request)
            if error is not None:
                # A mask rule of the serving layer (return_meta_info) refuses the mask.
                kind = "refused" if error.startswith("return_sampling_mask") else "invalid"
                return {"verdict": kind, "why": error}
            self.streaming(request)
            params = request.to_sampling_params(stop=[], model_generation_config={})
            masks = run(request, bool(request.return_sampling_mask), params)
        except refused as exc:
            return {"verdict": "refused", "why": str(exc)}
        except (ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:
            return {"verdict": "invalid", "why": f"{type(exc).__name__}: {str(exc)[:120]}"}
        return {"verdict": "served", "masks": masks}


if __name__ == "__main__":
    main()
