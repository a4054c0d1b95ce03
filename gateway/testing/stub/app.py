"""The stub backend that speaks SGLang 0.5.19's HTTP surface, for tests and local runs.

It reproduces the shapes the gateway cares about (see docs/sglang-contract.md): generation
responses, error bodies, SSE streams written event by event, and SGLang's own sampling-mask
admission rule, coded independently of the gateway so that the two can check each other.
Faults are scripted per request with ``X-Stub-*`` headers or per instance with attributes.

SGLang's rules live in rules.py (with where they only approximate SGLang), the faults it
plays in faults.py, the token logprobs it reports in logprobs.py.

RL frameworks read it as they read an engine: `/generate` with `return_logprob` answers
`meta_info.output_token_logprobs` / `input_token_logprobs` ([logprob, token_id, text]
triples, fixed by the prompt's ids), aborted generations answer as fully as finished ones,
`/v1/loads` counts the batch items running now, and `/get_weight_version` follows the
weight updates (see docs/sglang-contract.md s.7 and s.9 for the shapes).
A long-lived stub (compose, `sglang-gateway stub`) remembers only its last `--keep` requests,
each body cut to `--keep-body-bytes`, so its memory stays bounded.
"""

from __future__ import annotations

from aiohttp import web

from gateway.testing.stub.core import Received, _Handler
from gateway.testing.stub.engine_ops import EngineOpsRoutes
from gateway.testing.stub.generation import GenerationRoutes
from gateway.testing.stub.server_info import ServerInfoRoutes

__all__ = ["Received", "StubBackend"]


class StubBackend(GenerationRoutes, EngineOpsRoutes, ServerInfoRoutes):
    """An SGLang look-alike; attributes mirror the constructor and may be changed at run time.

    The ``X-Stub-*`` request headers script any route; the constructor's ``delay_s``,
    ``fail_status`` and ``drop`` script the generation routes only, so that health probes and
    info calls keep working while generation fails. Every request lands in ``received``, then
    in exactly one of ``completed``, ``cancelled`` (the client went away) or ``dropped`` (the
    stub cut the connection on purpose).
    """

    # --- lifecycle -----------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._middleware, self._lora_gate], client_max_size=1 << 30
        )
        routes: list[tuple[str, str, _Handler]] = [
            ("POST", "/generate", self._generate),
            ("PUT", "/generate", self._generate),
            ("POST", "/v1/chat/completions", self._chat),
            ("POST", "/invocations", self._chat),
            ("POST", "/v1/completions", self._completions),
            ("POST", "/v1/responses", self._responses),
            ("POST", "/vertex_generate", self._vertex),
            ("GET", "/health", self._health),
            ("GET", "/health_generate", self._health),
            ("GET", "/model_info", self._model_info),
            ("GET", "/get_model_info", self._model_info),
            ("GET", "/server_info", self._server_info),
            ("GET", "/get_server_info", self._server_info),
            ("GET", "/v1/models", self._models),
            ("POST", "/abort_request", self._abort_request),
            ("POST", "/pause_generation", self._engine_op),
            ("POST", "/continue_generation", self._engine_op),
            ("POST", "/update_weights_from_disk", self._engine_op),
            ("POST", "/release_memory_occupation", self._engine_op),
            ("POST", "/resume_memory_occupation", self._engine_op),
            ("POST", "/start_profile", self._engine_op),
            ("POST", "/stop_profile", self._engine_op),
            ("POST", "/init_weights_update_group", self._engine_op),
            ("POST", "/update_weights_from_distributed", self._engine_op),
            ("POST", "/update_weights_from_tensor", self._engine_op),
            ("POST", "/destroy_weights_update_group", self._engine_op),
            ("POST", "/weights_checker", self._engine_op),
            ("POST", "/load_lora_adapter", self._lora),
            ("POST", "/unload_lora_adapter", self._lora),
            ("POST", "/load_lora_adapter_from_tensors", self._lora),
            ("GET", "/v1/loads", self._loads),
            ("GET", "/get_loads", self._loads),
            ("GET", "/get_load", self._get_load),
            ("GET", "/get_weight_version", self._weight_version),
            ("GET", "/weight_version", self._weight_version),
            ("GET", "/flush_cache", self._flush_cache),
            ("POST", "/flush_cache", self._flush_cache),
            ("GET", "/metrics", self._metrics),
        ]
        if self.pd is not None:
            routes.append(("GET", "/stub/pd", self._pd_state))
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        app.on_response_prepare.append(self._stamp)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._stopping = False
        keepalive = 75.0 if self.idle_close_s is None else self.idle_close_s
        # A short shutdown timeout: tests stop the stub with streams still hanging open.
        runner = web.AppRunner(
            self.make_app(),
            handler_cancellation=True,
            keepalive_timeout=keepalive,
            access_log=None,
            shutdown_timeout=0.1,
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self._port = int(runner.addresses[0][1])
        if self.pd is not None:
            await self.pd.start(host)
        return self._port

    async def stop(self) -> None:
        if self._runner is not None:
            self._stopping = True
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self.pd is not None:
            await self.pd.stop()
