"""The engine operations: abort_request, pause and continue, weight updates, memory release,
profiling, LoRA adapters (loading them, and refusing a generation that names one not
loaded), the weight version and the cache flush."""

from __future__ import annotations

import orjson
from aiohttp import web

from gateway.testing.stub.core import StubCore, _Handler
from gateway.testing.stub.rules import (
    GENERATION_PATHS,
    Reject,
    json_response,
    lax_bool,
    parse,
)


class EngineOpsRoutes(StubCore):
    """SGLang's engine-operation surface, as RL frameworks drive it."""

    async def _abort_request(self, request: web.Request) -> web.StreamResponse:
        # SGLang answers 200 with no body whether or not the rid was found.
        body = await request.read()
        parsed = parse(body) if body else {}
        sent = parsed if isinstance(parsed, dict) else {}
        message = sent.get("abort_message")
        text = message if isinstance(message, str) else "Abort request"
        if lax_bool(sent.get("abort_all")):
            self._abort_runs(list(self._runs), text)
        elif isinstance(rid := sent.get("rid"), str) and lax_bool(sent.get("prefix")):
            # Miles' SGLang build: every request whose rid starts with this one (upstream's
            # scheduler matches by prefix too, once the tokenizer knows the exact rid).
            self._abort_runs(
                [r for r in self._runs if any(x.startswith(rid) for x in r.rids)], text
            )
        elif isinstance(rid := sent.get("rid"), str):
            self._abort_runs([r for r in self._runs if rid in r.rids], text)
        return web.Response()

    async def _engine_op(self, request: web.Request) -> web.StreamResponse:
        # SGLang answers its engine operations with {"success": ..., "message": ...}.
        path = request.path
        body = await request.read()
        parsed = parse(body) if body else {}
        sent = parsed if isinstance(parsed, dict) else {}
        if self.engine_op_status is not None:
            failed = {"success": False, "message": f"{path[1:]} failed on port {self._port}"}
            return json_response(failed, self.engine_op_status)
        if path == "/pause_generation":
            mode = sent.get("mode", "abort")
            if mode not in ("abort", "retract", "in_place"):
                raise Reject(f"mode must be abort, retract or in_place, not {mode!r}")
            if mode == "abort":  # running requests end; retract and in_place keep them
                self._abort_runs(list(self._runs))
            self.pause_mode = mode
            self._unpaused.clear()
        elif path == "/continue_generation":
            self.pause_mode = None
            self._unpaused.set()
        elif path == "/release_memory_occupation":
            if self._running - self._waiting > 0:
                # SGLang asserts that no request is running before it frees the memory.
                return json_response(
                    {"success": False, "message": "cannot release memory: requests running"},
                    400,
                )
            self.asleep = True
        elif path == "/resume_memory_occupation":
            self.asleep = False
        elif path.startswith("/update_weights") and isinstance(sent.get("weight_version"), str):
            self.weight_version = sent["weight_version"]
        return json_response({"success": True, "message": f"{path[1:]} done on port {self._port}"})

    async def _lora(self, request: web.Request) -> web.StreamResponse:
        # SGLang's LoadLoRAAdapterReqInput / UnloadLoRAAdapterReqInput, answered with its
        # LoRAUpdateOutput: 200 with every adapter now loaded, or 400 saying why not.
        # LoadLoRAAdapterFromTensorsReqInput names no path: SGLang records "__tensor__"
        # (io_struct.py, to_ref), and takes the adapter's config and tensors in the body.
        sent = parse(await request.read())
        from_tensors = request.path == "/load_lora_adapter_from_tensors"
        name = sent.get("lora_name")
        path = "__tensor__" if from_tensors else sent.get("lora_path")
        loading = request.path != "/unload_lora_adapter"
        # Upstream names the tensors serialized_named_tensors; Miles' SGLang build
        # (sglang-miles) serialized_tensors: either stands for them here.
        tensors = sent.get("serialized_named_tensors", sent.get("serialized_tensors"))
        if from_tensors and not (isinstance(sent.get("config_dict"), dict) and tensors):
            raise Reject("config_dict and serialized_named_tensors are required", parse=True)
        if not isinstance(name, str) or (loading and not isinstance(path, str)):
            fields = "lora_name and lora_path" if loading else "lora_name"
            raise Reject(f"{fields} must be strings", parse=True)
        failure: str | None = None
        if self.engine_op_status is not None:
            failure = f"{request.path[1:]} failed on port {self._port}"
        elif loading and name in self.adapters:
            failure = f"Failed to load LoRA adapter {name} because it is already loaded"
        elif not loading and name not in self.adapters:
            failure = f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}"
        if failure is not None:
            refused = {"success": False, "error_message": failure, "loaded_adapters": None}
            return json_response(refused, self.engine_op_status or 400)
        if loading:
            assert isinstance(path, str)
            self.adapters[name] = path
        else:
            del self.adapters[name]
        done = {"success": True, "error_message": None, "loaded_adapters": dict(self.adapters)}
        return json_response(done)

    @web.middleware
    async def _lora_gate(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Refuse a generation that names an adapter this engine has not loaded, in SGLang's
        words (its LoRA registry): 400, or in-band on a /generate stream."""
        if request.path not in GENERATION_PATHS:
            return await handler(request)
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return await handler(request)
        if not isinstance(body, dict):
            return await handler(request)
        lora = body.get("lora_path")
        model = body.get("model")
        if request.path != "/generate" and isinstance(model, str) and ":" in model:
            lora = model.split(":", 1)[1].strip() or lora  # base:adapter wins
        names = [lora] if isinstance(lora, str) and lora else lora if isinstance(lora, list) else []
        for name in names:
            if name is not None and name not in self.adapters:
                message = (
                    f"The following requested LoRA adapters are not loaded: {name}\n"
                    f"Loaded adapters: {list(self.adapters)}."
                )
                if request.path == "/generate" and lax_bool(body.get("stream")):
                    return await self._stream(request, [{"error": {"message": message}}])
                raise Reject(message)
        return await handler(request)

    async def _weight_version(self, request: web.Request) -> web.StreamResponse:
        """GET /get_weight_version and /weight_version. Upstream SGLang answers them 404
        (0.5.18-0.5.19: deprecated, "use /model_info"; 0.5.23: no such route); the SGLang
        that slime ships patches them back to {"weight_version": ...}
        (THUDM/slime docker/patch/latest/sglang.patch), and slime's engine reads it
        (slime/backends/sglang_utils/sglang_engine.py `get_weight_version`). The stub plays
        the patched engine unless `weight_version_route` is off."""
        if self.weight_version_route:
            return json_response({"weight_version": self.weight_version})
        if self.release.patch >= 23:
            return json_response({"detail": "Not Found"}, 404)
        message = (
            "Endpoint '/get_weight_version' or '/weight_version' is deprecated. "
            "Please use '/model_info' instead."
        )
        body = {"object": "error", "message": message, "type": "404", "param": None}
        return json_response(body | {"code": 404}, 404)

    async def _flush_cache(self, request: web.Request) -> web.StreamResponse:
        if self._runs or self.pause_mode == "in_place":
            # SGLang flushes only an idle engine (and never one paused in place).
            return web.Response(
                status=400,
                text="Cache not flushed. Please check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be "
                "performed.)\n",
            )
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details.\n")
