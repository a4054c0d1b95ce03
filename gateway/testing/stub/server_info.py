"""What an engine says about itself: health, model and server info, the model list, its
load (/v1/loads and the older /get_load), its Prometheus metrics, and a PD half's rooms."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from aiohttp import web

from gateway.testing.stub.core import StubCore, _Json
from gateway.testing.stub.rules import (
    json_response,
)

_LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})

_DISAGG_COUNTS = (
    "prefill_bootstrap_queue_reqs",
    "prefill_inflight_queue_reqs",
    "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs",
    "decode_retracted_queue_reqs",
)

_MAX_TOTAL_TOKENS = 1 << 20  # the KV pool it claims: large enough never to be the limit

_MAX_RUNNING_REQUESTS = 1024


class ServerInfoRoutes(StubCore):
    """SGLang's information surface, which probes and schedulers read."""

    async def _pd_state(self, request: web.Request) -> web.StreamResponse:
        """The rooms this half of a pair took part in, for a check across processes."""
        pd = self.pd
        assert pd is not None
        state = {"role": pd.role, "rooms": pd.rooms, "failed": pd.failed}
        return json_response(state | {"handed_over": pd.handed_over})

    async def _health(self, request: web.Request) -> web.StreamResponse:
        if self.health_delay_s > 0:
            await asyncio.sleep(self.health_delay_s)
        return web.Response(status=self.health_status)

    async def _model_info(self, request: web.Request) -> web.StreamResponse:
        return json_response(
            {
                "model_path": self.model,
                "tokenizer_path": self.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
            }
        )

    async def _server_info(self, request: web.Request) -> web.StreamResponse:
        if self.server_info_status != 200:
            return json_response({"detail": "scripted"}, self.server_info_status)
        cap = {"sampling_mask_max_tokens": self.sampling_mask_max_tokens}
        return json_response(
            (cap if self.release.patch >= 20 else {})
            | {
                "version": self.version,
                "model_path": self.model,
                "tokenizer_path": self.model,
                "served_model_name": self.model,
                "speculative_algorithm": self.speculative_algorithm,
                "sampling_backend": "flashinfer",
                "disaggregation_mode": "null",
                "context_length": 32768,
                "dp_size": 1,
                "enable_hierarchical_cache": False,
                "disable_radix_cache": not self._kv_tokens_cached(),
                # scheduler_info's, merged in at the top (utils/common.py build_server_info)
                "max_total_num_tokens": self._kv_tokens(),
                "internal_states": [{"last_gen_throughput": 0.0}],
            }
        )

    def _kv_tokens_cached(self) -> int:
        cache = self.prefix_cache
        return cache.capacity_tokens if cache is not None else 0

    def _kv_tokens(self) -> int:
        # The radix cache lives in the KV pool: a stub with a cache claims that as its pool.
        return self._kv_tokens_cached() or _MAX_TOTAL_TOKENS

    async def _models(self, request: web.Request) -> web.StreamResponse:
        card = {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": self.model,
            "max_model_len": 32768,
        }
        # SGLang lists each loaded LoRA adapter as a model whose parent is the base model.
        adapters = [
            card | {"id": name, "root": path, "parent": self.model, "max_model_len": None}
            for name, path in self.adapters.items()
        ]
        return json_response({"object": "list", "data": [card, *adapters]})

    def _load(self) -> _Json:
        """This engine's one DP rank as SGLang's LoadSnapshot has it (load_snapshot.py), the
        requests counted one per batch item as its scheduler counts them."""
        items = sum(run.size for run in self._runs)
        waiting = self._waiting_items
        core: _Json = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": items - waiting,
            "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": 0,
            "num_used_tokens": 0,
            "num_total_tokens": 0,
            "num_active_tokens": 0,
        }
        if self.release.patch >= 23:
            core["num_prealloc_ready_tokens"] = 0
        return core | {
            "max_total_num_tokens": self._kv_tokens(),
            "max_running_requests": _MAX_RUNNING_REQUESTS,
            "token_usage": 0.0,
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.0,
            "utilization": round(min(1.0, items / _MAX_RUNNING_REQUESTS), 4),
            "total_prefill_uncached_tokens": 0,
            "total_prefill_busy_us": 0,
            "decode_moments": None,
        }

    async def _loads(self, request: web.Request) -> web.StreamResponse:
        # GET /v1/loads?include=core,...&dp_rank=N (entrypoints/v1_loads.py, 0.5.19).
        include_q = request.query.get("include")
        include = {s.strip() for s in include_q.split(",")} if include_q else None
        if include is not None and not include <= _LOAD_SECTIONS:
            bad = "{" + ", ".join(repr(s) for s in sorted(include - _LOAD_SECTIONS)) + "}"
            message = f"Invalid include sections: {bad}. Valid options: {sorted(_LOAD_SECTIONS)}"
            body = {"object": "error", "message": message, "type": "400", "param": None}
            return json_response(body | {"code": 400}, 400)
        dp_rank = request.query.get("dp_rank")
        load = self._load()
        sections: frozenset[str] | set[str] = (
            _LOAD_SECTIONS if include is None or "all" in include else include
        )
        # SGLang always builds these three; spec and lora only with those features on.
        if "memory" in sections:
            memory = {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0}
            load["memory"] = memory | {"token_capacity": self._kv_tokens()}
        if "disagg" in sections:
            load["disaggregation"] = {
                "mode": "null",
                **dict.fromkeys(_DISAGG_COUNTS, 0),
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            }
        if "queues" in sections:
            load["queues"] = {
                "waiting": self._waiting_items,
                "grammar": 0,
                "paused": 0,
                "retracted": 0,
                "prealloc_ready": 0,
            }
        loads = [load] if dp_rank is None or dp_rank.strip() == "0" else []
        return json_response(
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": self.version,
                "accelerator": None,  # SGLang's device name; None where it has none
                "num_accelerators": 1,
                "loads": loads,
            }
        )

    async def _get_load(self, request: web.Request) -> web.StreamResponse:
        # The deprecated list-shaped shim of 0.5.18-0.5.19, built from the same snapshot.
        if self.release.patch >= 23:
            return json_response({"detail": "Not Found"}, 404)
        load = self._load()
        return json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                    "num_waiting_reqs": load["num_waiting_reqs"],
                    "num_tokens": load["num_total_tokens"],
                    "num_pending_tokens": load["num_total_tokens"] - load["num_used_tokens"],
                    "ts_tic": time.perf_counter(),
                }
            ]
        )

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        label = f'{{model_name="{self.model}"}}'
        lines = [
            "# TYPE sglang:num_running_reqs gauge",
            f"sglang:num_running_reqs{label} {float(self._running)}",
            "# TYPE sglang:num_queue_reqs gauge",
            f"sglang:num_queue_reqs{label} 0.0",
            "# TYPE sglang:generation_tokens_total counter",
            f"sglang:generation_tokens_total{label} {float(self._generated_tokens)}",
            "# TYPE sglang:num_requests_total counter",
            f"sglang:num_requests_total{label} {float(self.generations_seen)}",
        ]
        if (cache := self.prefix_cache) is not None:
            lines += [
                "# TYPE sglang:prompt_tokens_total counter",
                f"sglang:prompt_tokens_total{label} {float(cache.prompt_tokens_total)}",
                "# TYPE sglang:cached_tokens_total counter",
                f"sglang:cached_tokens_total{label} {float(cache.cached_tokens_total)}",
            ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
