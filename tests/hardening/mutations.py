# ruff: noqa: E501 - the anchors are verbatim source lines
"""Remove one protection at a time and check that the hardening tests notice (run by hand).

    .venv/bin/python -m tests.hardening.mutations [INDEX ...]

Each mutation edits a temporary copy of gateway/ and tests/ (never the working tree), runs
the tests named for it, and must make them fail. A mutation whose anchor text is no longer
in the source is reported as "anchor moved" rather than silently skipped. Results of this
session are in docs/hardening.md, section 6.

Mutations run on the pure build only: they patch sources, and a compiled module (setup.py)
would run instead of the patched source beside it. The copy takes the .py files and never
an extension module or build record, and its tests import that copy whichever interpreter
runs this (PYTHONPATH; .venv's or .venv-compiled's). The compiled build runs the same
hardening tests unpatched (scripts/check.sh).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-m", "not slow"]

# (name, file, text to find, replacement, tests that must fail)
MUTATIONS = [
    (
        "vertex read with pydantic lax booleans (pre-fix)",
        "gateway/contract/policy.py",
        "read_flag = _truthy if raw else lax_bool",
        "read_flag = lax_bool",
        [
            "tests/hardening/test_differential.py",
            "tests/hardening/test_corpus.py",
            "tests/hardening/test_policy_bypasses.py",
        ],
    ),
    (
        "lax bool forgets 'yes'/'on'",
        "gateway/contract/lax.py",
        '_TRUE_STRINGS: Final = frozenset({"true", "t", "y", "yes", "on", "1"})',
        '_TRUE_STRINGS: Final = frozenset({"true", "t", "y", "1"})',
        ["tests/hardening/test_differential.py", "tests/hardening/test_corpus.py"],
    ),
    (
        "top_k above TOP_K_ALL counted finite",
        "gateway/contract/profiles.py",
        "return self.top_k >= TOP_K_ALL",
        "return self.top_k == TOP_K_ALL",
        ["tests/hardening/test_differential.py", "tests/hardening/test_corpus.py"],
    ),
    (
        "greedy shortcut removed (over-refusal)",
        "gateway/contract/policy.py",
        'if greedy and not (generate and params.get("is_normalized")):',
        'if False and greedy and not (generate and params.get("is_normalized")):',
        ["tests/hardening/test_differential.py", "tests/hardening/test_corpus.py"],
    ),
    (
        "single-request list mask read per item",
        "gateway/contract/policy.py",
        "flags = [bool(values)] if batch_size is None else [bool(v) for v in values]",
        "flags = [bool(v) for v in values] or [False]",
        ["tests/hardening/test_differential.py", "tests/hardening/test_corpus.py"],
    ),
    (
        "Connection-named headers forwarded",
        "gateway/edge/headers.py",
        "            drop = _connection_drop(items, names, drop)\n        out = [item for item, name in zip(items, names, strict=True) if name not in drop]\n        if self._authorization",
        "            pass\n        out = [item for item, name in zip(items, names, strict=True) if name not in drop]\n        if self._authorization",
        [
            "tests/hardening/test_bad_inputs.py::test_hop_by_hop_and_forwarding_headers_on_a_generation_request"
        ],
    ),
    (
        "Content-Encoding accepted",
        "gateway/contract/inspection.py",
        'if content_encoding is not None and content_encoding.strip().lower() not in ("", "identity"):',
        "if False:",
        [
            "tests/hardening/test_bad_inputs.py::test_encodings_and_media_types_are_415",
            "tests/hardening/test_corpus.py",
        ],
    ),
    (
        "body size cap removed",
        "gateway/edge/proxy.py",
        "if length is not None and length > settings.max_body:",
        "if False:",
        [
            "tests/hardening/test_bad_inputs.py::test_declared_length_over_the_cap_is_413_before_the_body"
        ],
    ),
    (
        "chunked size cap removed",
        "gateway/edge/server.py",
        "        if self._size > self._limit:\n            self._overflowed()\n",
        "        if False:\n            self._overflowed()\n",
        [
            "tests/hardening/test_bad_inputs.py::test_chunked_body_growing_over_the_cap_is_413_mid_read_with_bounded_memory"
        ],
    ),
    (
        "body read deadline removed",
        "gateway/edge/proxy.py",
        "async with asyncio.timeout(settings.body_timeout):",
        "async with asyncio.timeout(None):",
        ["tests/hardening/test_faults.py::test_slow_body_is_408_at_the_deadline"],
    ),
    (
        "handler cancellation off",
        "gateway/edge/server.py",
        "            task.cancel()  # the client left: the handler closes its upstream request",
        "            pass",
        [
            "tests/hardening/test_faults.py::test_client_disconnect_closes_upstream_and_leaks_nothing"
        ],
    ),
    (
        "no backpressure: response buffered",
        "gateway/edge/relay.py",
        "        if sink.writing_paused and not done:\n",
        "        if False:\n",
        [
            "tests/hardening/test_faults.py::test_client_that_stops_reading_a_64mb_response_pauses_the_upstream"
        ],
    ),
    (
        "replay after send (any failure counted as a connect failure)",
        "gateway/edge/upstream.py",
        "            self.active -= 1\n            _shut(proto)\n            raise\n",
        "            self.active -= 1\n            _shut(proto)\n            raise ConnectFailed('replayed')\n",
        [
            "tests/hardening/test_faults.py::test_reset_after_send_is_never_replayed_even_with_spare_backends"
        ],
    ),
    (
        "upstream truncation not made visible",
        "gateway/edge/proxy.py",
        "                request.abort()\n                return None",
        "                request.end()\n                return None",
        [
            "tests/hardening/test_faults.py::test_backend_process_dying_mid_stream_breaks_the_transfer",
            "tests/hardening/test_faults.py::test_backend_short_body_is_a_broken_transfer",
        ],
    ),
    (
        "upstream keep-alive longer than the backend's",
        "gateway/app.py",
        "keepalive_s=cfg.timeouts.upstream_keepalive_s,",
        "keepalive_s=cfg.timeouts.upstream_keepalive_s * 10,",
        ["tests/hardening/test_faults.py::test_keepalive_race_worst_case_never_reaches_a_client"],
    ),
    (
        "pool-exhaustion fast path removed",
        "gateway/fleet/pool.py",
        "and (cap is None or b.inflight < cap)",
        "and True",
        [
            "tests/hardening/test_faults.py::test_pool_exhaustion_is_a_quick_503_and_does_not_eject_the_backend"
        ],
    ),
    (
        "parser refusals left unanswered",
        "gateway/edge/server.py",
        "            self._write_refusal()\n            self._close(linger=True)\n",
        "            self._close(linger=True)\n",
        ["tests/hardening/test_errors.py"],
    ),
    (
        "upstream not closed when the client goes away",
        "gateway/edge/proxy.py",
        "                upstream.close()",
        "                pass",
        [
            "tests/hardening/test_faults.py::test_client_disconnect_closes_upstream_and_leaks_nothing",
            "tests/hardening/test_faults.py::test_client_leaving_a_silent_stream_closes_the_upstream_at_once",
        ],
    ),
    (
        "a task leaked per request",
        "gateway/edge/proxy.py",
        "        self.inflight += 1\n",
        "        self.inflight += 1\n        asyncio.get_running_loop().create_task(asyncio.sleep(3600))\n",
        ["tests/hardening/test_load.py::test_no_leaks_over_five_rounds"],
    ),
    (
        "a descriptor leaked per request",
        "gateway/edge/proxy.py",
        "        self.inflight += 1\n",
        "        self.inflight += 1\n        self._leak = getattr(self, '_leak', []) + [open('/dev/null')]\n",
        ["tests/hardening/test_load.py::test_no_leaks_over_five_rounds"],
    ),
    (
        "X-Request-Id not echoed on relayed replies",
        "gateway/edge/headers.py",
        "        out.append((REQUEST_ID, request_id))\n        return out\n\n    @staticmethod",
        "        return out\n\n    @staticmethod",
        ["tests/hardening/test_load.py::test_exactly_once_accounting"],
    ),
    # -- Hardening II --------------------------------------------------------------------
    (
        # Two layers, removed together: bytes while no response is expected are refused
        # before the parser, and a message that begins after the final head is refused by
        # it (either alone keeps a stray response from answering the next request).
        "bytes arriving on an idle upstream connection are parsed",
        "gateway/edge/relay.py",
        (
            "        if data and not self.expecting:\n            self._refuse()\n            return\n",
            "        if self.phase is not Phase.HEAD:\n            # A second response",
        ),
        ("", "        if False:\n            # A second response"),
        ["tests/hardening/test_stray_responses.py"],
    ),
    (
        "a second response in one read is queued",
        "gateway/edge/relay.py",
        "        if self.phase is not Phase.HEAD:\n",
        "        if False:\n",
        ["tests/hardening/test_stray_responses.py"],
    ),
    (
        # Two layers, removed together: the count of interim heads, and the bytes of an
        # unfinished head (200,000 interim heads are 8 MB of head).
        "interim responses not capped",
        "gateway/edge/relay.py",
        (
            "            if self.interim > http1.MAX_INTERIM_RESPONSES:",
            "            if self._head_bytes > http1.HEAD_FACTOR * self._max_field:",
        ),
        ("            if False:", "            if False:"),
        ["tests/hardening/test_protocol_edges.py::test_interim_and_switching_responses"],
    ),
    (
        "101 relayed",
        "gateway/edge/upstream.py",
        "            if proto.status == 101:",
        "            if False:",
        ["tests/hardening/test_protocol_edges.py::test_interim_and_switching_responses"],
    ),
    (
        # The listener's refusal names only the status; llhttp's own messages quote no
        # bytes, so the only way a secret gets in is the bytes themselves.
        "parser refusals logged with the refused bytes",
        "gateway/edge/server.py",
        "            self._refuse(cause.status if isinstance(cause, _Refuse) else 400)\n            return\n",
        '            log.debug("refused %r", data)\n            self._refuse(cause.status if isinstance(cause, _Refuse) else 400)\n            return\n',
        ["tests/hardening/test_log_secrets.py"],
    ),
    (
        "EMFILE counted against the backend",
        "gateway/edge/upstream.py",
        "            if is_local(exc):",
        "            if False:",
        ["tests/hardening/test_descriptors.py::test_out_of_descriptors_never_ejects_a_backend"],
    ),
    (
        "client connections not capped",
        "gateway/edge/server.py",
        "        if listener.full():",
        "        if False:",
        [
            "tests/hardening/test_descriptors.py::test_default_limit_refuses_excess_connections_and_keeps_serving"
        ],
    ),
    (
        "workers read the operator's file",
        "gateway/ops/supervisor.py",
        '        return ["--config", str(self.snapshot), "--worker-index", str(w.index)]',
        '        return ["--config", str(self._config_path), "--worker-index", str(w.index)]',
        ["tests/hardening/test_supervisor.py"],
    ),
    (
        "workers hold no lifeline",
        "gateway/app.py",
        "        hold_lifeline(orphaned)\n",
        "",
        ["tests/hardening/test_supervisor.py::test_workers_exit_when_the_supervisor_is_killed"],
    ),
    (
        "drain waits the grace twice",
        "gateway/app.py",
        "            await self._http_server.shutdown(_CANCEL_WAIT_S)",
        "            await asyncio.sleep(self.cfg.timeouts.shutdown_grace_s)\n            await self._http_server.shutdown(_CANCEL_WAIT_S)",
        [
            "tests/hardening/test_protocol_edges.py::test_drain_cuts_streams_at_the_grace_not_twice_it"
        ],
    ),
    (
        "Content-Encoding read from its first line only",
        "gateway/edge/proxy.py",
        '            None if encodings is None else ", ".join(encodings),',
        "            None if encodings is None else encodings[0],",
        ["tests/hardening/test_protocol_edges.py::test_content_encoding_on_any_line_is_refused"],
    ),
    (
        "100 Continue for HTTP/1.0",
        "gateway/edge/proxy.py",
        "            request.version >= (1, 1)  # HTTP/1.0 has no 100 (RFC 9110 s.10.1.1)",
        "            True",
        ["tests/hardening/test_protocol_edges.py::test_100_continue_only_for_http_1_1"],
    ),
    (
        "orjson-sensitive bodies read by simdjson",
        "gateway/contract/inspection.py",
        "or ORJSON_SENSITIVE.match(parsed):",
        "or False:",
        [
            "tests/contract/test_jsonview.py::test_bodies_orjson_cannot_allocate_for_are_refused_like_orjson"
        ],
    ),
    (
        "skim accepts leading zeros",
        "gateway/contract/skim.py",
        'if b",zd" in opened or b",zz" in opened:',
        "if False:",
        ["tests/contract/test_skim.py::test_slices_agree_with_orjson_on_random_lists"],
    ),
    (
        "skim forgets the lengths it removed",
        "gateway/contract/inspection.py",
        "                obj[key] = Head(first_of(value), length + extra)",
        "                pass",
        ["tests/contract/test_skim.py::test_the_view_keeps_every_shape"],
    ),
    (
        "inspection budget never refuses",
        "gateway/edge/budget.py",
        "        if cost > self.limit:\n            raise TooCostly",
        "        if False:\n            raise TooCostly",
        [
            "tests/hardening/test_inspection_memory.py::test_a_body_too_costly_to_inspect_is_413_and_a_busy_budget_503"
        ],
    ),
    (
        "large bodies parsed whole (no skim)",
        "gateway/edge/large_bodies.py",
        "    skimmed = await skim(body, SHAPE_ONLY) if skimmable and not sensitive else None",
        "    skimmed = None",
        ["tests/hardening/test_inspection_memory.py"],
    ),
    # -- the RL fleet --------------------------------------------------------------------
    (
        "control routes open to anyone",
        "gateway/edge/control.py",
        '            return "key"\n        if not relayed and self.trusted_address(peer):',
        '            return "key"\n        return "anyone"\n        if not relayed and self.trusted_address(peer):',
        ["tests/edge/test_control.py::test_only_operators_control_the_fleet"],
    ),
    (
        "control call sent to one backend",
        "gateway/edge/fleet_control.py",
        "            urls = [b.url for b in self._pool.backends]\n",
        "            urls = [b.url for b in self._pool.backends][:1]\n",
        ["tests/edge/test_control.py::test_each_control_call_reaches_every_backend_once"],
    ),
    (
        "paused engines still routable",
        "gateway/fleet/pool.py",
        "            and not b.paused\n            and not b.asleep\n",
        "",
        [
            "tests/edge/test_control.py::test_paused_engines_get_no_new_requests_and_weight_versions_are_tracked"
        ],
    ),
    (
        "registered workers routable before their first probe",
        "gateway/fleet/membership.py",
        'probation=cfg.discovery == "registry" and cfg.health.enabled,',
        "probation=False,",
        ["tests/edge/test_registry.py::test_a_new_worker_waits_for_its_first_probe"],
    ),
    (
        "workers do not share the fleet (each keeps its own registry and states)",
        "gateway/fleet/shared.py",
        "path = os.environ.get(STATE_ENV)",
        "path = None",
        ["tests/ops/test_workers_share.py"],
    ),
    (
        "a fleet change is answered before the other workers adopted it",
        "gateway/fleet/shared.py",
        "while behind := await asyncio.to_thread(self._acked, generation):",
        "while False and (behind := await asyncio.to_thread(self._acked, generation)):",
        ["tests/ops/test_workers_share.py"],
    ),
    (
        "concurrent fleet changes merged without the lock",
        "gateway/fleet/shared.py",
        "        fcntl.flock(lock, fcntl.LOCK_EX)\n",
        "        pass\n",
        ["tests/fleet/test_shared.py::test_concurrent_changes_from_two_workers_all_land"],
    ),
    (
        "mask requests routed to any backend, whatever its profile admits",
        "gateway/edge/proxy.py",
        (
            "                    return Needs(None, mask)\n",
            "                return Needs(wanted.version, mask, wanted.adapters)\n",
        ),
        (
            "                    return Needs(None, None)\n",
            "                return Needs(wanted.version, None, wanted.adapters)\n",
        ),
        ["tests/fleet/test_capability.py"],
    ),
    (
        "backends never learn their release (every one stays strict)",
        "gateway/fleet/health.py",
        "                self._pool.learn(backend, info)",
        "                pass",
        ["tests/fleet/test_capability.py"],
    ),
    (
        "0.5.20+ profile forgets its cap",
        "gateway/contract/profiles.py",
        "                if not (k == 1 or 1 < k <= cap):",
        "                if not (k == 1 or 1 < k):",
        ["tests/real_sglang/test_real_sglang.py", "tests/contract/test_profiles.py"],
    ),
    (
        "a mask request asking for weights ignores its mask",
        "gateway/fleet/capability.py",
        "        if self.version is not None and backend.weight_version != self.version:\n            return False\n",
        "        if self.version is not None:\n            return backend.weight_version == self.version\n",
        ["tests/fleet/test_capability.py"],
    ),
    (
        "a restarted backend keeps the release it ran before",
        "gateway/fleet/health.py",
        "                self._pool.forget(backend)  # the strictest profile until it says again",
        "                pass",
        ["tests/fleet/test_capability.py"],
    ),
    (
        "access-log writer blocks on a stalled reader (no poll)",
        "gateway/ops/logs.py",
        "                if poll is not None and not poll.poll(0):",
        "                if False:",
        ["tests/ops/test_logs.py"],
    ),
    (
        "a drop cuts a line written in part",
        "gateway/ops/logs.py",
        'start = buf.find(b"\\n") + 1 if self._partial else 0\n        if start <= 0 and self._partial:\n            return  # the partial line is all there is',
        "start = 0",
        ["tests/ops/test_logs.py"],
    ),
    (
        "a mid-body parse error leaves the body waiting",
        "gateway/edge/relay.py",
        "            self.fail(kind(type(exc).__name__))\n            self.abort()\n            return\n",
        "            return\n",
        ["tests/edge/test_upstream.py", "tests/hardening/test_faults.py"],
    ),
    (
        "a parser error escapes the upstream client unmapped",
        "gateway/edge/relay.py",
        "            self.fail(kind(type(exc).__name__))\n",
        "            self.fail(exc)\n",
        ["tests/edge/test_upstream.py"],
    ),
    (
        "config errors show a credential's value",
        "gateway/config/loading.py",
        "elif tuple(loc[:2]) in _SECRET_PATHS or isinstance(value, (dict, list)):",
        "elif False:",
        ["tests/test_cli.py"],
    ),
    (
        "the mask --check-config prints is accepted as a secret",
        "gateway/config/models.py",
        "    if value.get_secret_value() == _MASK:",
        "    if False:",
        ["tests/test_cli.py"],
    ),
    (
        "a non-UTF-8 User-Agent reaches the JSON encoder",
        "gateway/edge/proxy.py",
        "exchange.user_agent = agent if agent.isascii() else _printable(agent)",
        "exchange.user_agent = agent",
        ["tests/ops/test_logs.py"],
    ),
    (
        "a templated route's path logged as sent",
        "gateway/edge/proxy.py",
        'shown = "" if route is None else route.path if "{" in route.path else path',
        'shown = "" if route is None else path',
        ["tests/ops/test_logs.py"],
    ),
    # -- the request path's own client protocol ---------------------------------------------
    (
        "head deadline not armed at connect",
        "gateway/edge/server.py",
        "        listener.connections.add(self)\n        self._arm_deadline()\n",
        "        listener.connections.add(self)\n",
        ["tests/hardening/test_faults.py::test_slowloris_headers_are_cut_at_the_deadline"],
    ),
    (
        "Transfer-Encoding accepted on HTTP/1.0",
        "gateway/edge/server.py",
        "            if version < HTTP_11:\n                raise _Refuse(400)",
        "            if False:\n                raise _Refuse(400)",
        [
            "tests/hardening/test_bad_inputs.py::test_http_1_0_with_transfer_encoding_is_refused_whole"
        ],
    ),
    (
        "head size unbounded",
        "gateway/edge/server.py",
        "            if self._head_size > self._listener.head_max:",
        "            if False:",
        [
            "tests/hardening/test_bad_inputs.py::test_an_unending_head_is_cut_at_its_cap_with_bounded_memory"
        ],
    ),
    (
        "no lingering close after a refusal",
        "gateway/edge/server.py",
        "        if not linger or not transport.can_write_eof():",
        "        if True:",
        [
            "tests/hardening/test_bad_inputs.py::test_chunked_body_growing_over_the_cap_is_413_mid_read_with_bounded_memory"
        ],
    ),
    (
        "upstream head size unbounded",
        "gateway/edge/relay.py",
        "            if self._head_bytes > http1.HEAD_FACTOR * self._max_field:",
        "            if False:",
        ["tests/edge/test_upstream.py::test_every_failure_is_one_of_the_gateways_types"],
    ),
    (
        "a paused backend never resumes when the client drains",
        "gateway/edge/relay.py",
        "        sink.on_resume(self._resume_reading)\n",
        "",
        [
            "tests/hardening/test_faults.py::test_a_client_that_pauses_reading_gets_the_whole_response"
        ],
    ),
    # -- Hardening III: the request path's protocols --------------------------------------
    (
        "the next pipelined request starts while replies sit unread",
        "gateway/edge/server.py",
        (
            "        if self._active is None and not self.write_paused:",
            "            if not self.write_paused:\n                self._begin(self._queue.popleft())",
        ),
        (
            "        if self._active is None:",
            "            if True:\n                self._begin(self._queue.popleft())",
        ),
        [
            "tests/hardening/test_protocol_review.py::test_a_client_that_pipelines_and_never_reads_holds_bounded_memory"
        ],
    ),
    (
        "no deadline for a client that leaves its reply unread",
        "gateway/edge/server.py",
        "        if timeout is not None and self._send_timer is None and self.transport is not None:",
        "        if False:",
        [
            "tests/hardening/test_protocol_review.py::test_a_client_that_leaves_a_reply_unread_is_reset_and_the_upstream_closed"
        ],
    ),
    (
        "the send deadline resets a slow reader that makes progress",
        "gateway/edge/server.py",
        "        if unsent < self._unsent:",
        "        if False:",
        [
            "tests/hardening/test_protocol_review.py::test_a_slow_reader_that_keeps_reading_is_not_reset"
        ],
    ),
    (
        "ttfb restarted by every byte of the head",
        "gateway/edge/relay.py",
        "        return (self._sent_at if self.phase is Phase.HEAD else self._last_read) + timeout",
        "        return self._last_read + timeout",
        [
            "tests/hardening/test_protocol_review.py::test_ttfb_is_a_deadline_for_the_head_not_a_silence"
        ],
    ),
    (
        "the read a head begins in counts toward its cap",
        "gateway/edge/server.py",
        "            self._head_size = 0 if self._began else self._head_size + len(data)",
        "            self._head_size = self._head_size + len(data)",
        ["tests/hardening/test_protocol_review.py::test_a_long_valid_pipeline_gets_every_answer"],
    ),
    (
        "a transfer coding under chunked accepted on a request",
        "gateway/edge/server.py",
        '            if not http1.only_chunked(headers.getall("Transfer-Encoding")):',
        "            if False:",
        ["tests/hardening/test_protocol_review.py::test_framing_rfc_9112_refuses_is_refused"],
    ),
    (
        "no Host, or two, accepted",
        "gateway/edge/server.py",
        "        if hosts > 1 or (hosts == 0 and version >= HTTP_11):",
        "        if False:",
        ["tests/hardening/test_protocol_review.py::test_framing_rfc_9112_refuses_is_refused"],
    ),
    (
        "repeated spaces in the request line accepted",
        "gateway/edge/server.py",
        '        if line[:end].count(b" ") != 2 or b"  " in line[:end]:',
        "        if False:",
        ["tests/hardening/test_protocol_review.py::test_framing_rfc_9112_refuses_is_refused"],
    ),
    (
        "the request line of a request behind a body goes unchecked",
        "gateway/edge/server.py",
        "        self._cursor = start + self._body_here if start >= 0 else -1",
        "        self._cursor = -1",
        [
            "tests/hardening/test_protocol_review.py::test_pipelined_requests_after_bodies_still_get_the_request_line_check"
        ],
    ),
    (
        "a backend's transfer coding under chunked relayed",
        "gateway/edge/relay.py",
        "            if not http1.only_chunked(codings):",
        "            if False:",
        ["tests/hardening/test_protocol_review.py::test_a_transfer_coding_under_chunked_is_a_502"],
    ),
    (
        "a 204 keeps the backend's Content-Length",
        "gateway/edge/server.py",
        "        if status == 204 or status < 200:",
        "        if False:",
        ["tests/hardening/test_protocol_review.py::test_a_204_never_carries_a_content_length"],
    ),
    (
        "the reason phrase re-encoded",
        "gateway/edge/relay.py",
        '        self.reason = self._reason.decode("utf-8", "surrogateescape")',
        '        self.reason = self._reason.decode("latin-1")',
        ["tests/hardening/test_protocol_review.py::test_the_reason_phrase_passes_as_sent"],
    ),
    # -- Hardening III ---------------------------------------------------------------------
    (
        "an addressed call may name any path",
        "gateway/edge/fleet_control.py",
        "        methods = ADDRESSABLE_ROUTES.get(found[1])\n",
        '        methods = ADDRESSABLE_ROUTES.get(found[1], frozenset({"GET", "POST", "PUT"}))\n',
        [
            "tests/edge/test_addressed.py::test_no_spelling_of_a_generation_route_reaches_an_engine_through_an_address"
        ],
    ),
    (
        "an addressed call forwarded as spelled, not as checked",
        "gateway/edge/fleet_control.py",
        '            target = path + "?" + query if query else path\n',
        '            target = raw_path[len("/workers/") + len(worker) :]\n',
        [
            "tests/edge/test_addressed.py::test_the_per_engine_paths_still_reach_the_one_engine_named"
        ],
    ),
    (
        "a relayed request trusted for its proxy's address",
        "gateway/edge/control.py",
        "        if not relayed and self.trusted_address(peer):",
        "        if self.trusted_address(peer):",
        [
            "tests/edge/test_addressed.py::test_a_relayed_caller_is_not_trusted_by_its_proxys_address"
        ],
    ),
    (
        "no warning when a loopback proxy meets loopback trust",
        "gateway/cli.py",
        "    if worker_index is None and (",
        "    if False and (",
        [
            "tests/edge/test_addressed.py::test_a_warning_at_start_when_loopback_is_both_a_proxy_and_trusted"
        ],
    ),
    (
        "a damaged shared document read as it is",
        "gateway/fleet/shared.py",
        "    return validate(doc)\n",
        "    return doc\n",
        [
            "tests/ops/test_shared_damage.py::test_a_damaged_state_file_is_logged_once_rebuilt_and_shared_again"
        ],
    ),
    (
        "shared-state problems logged every time",
        "gateway/fleet/shared.py",
        "        if last is not None and now - last < self.every_s:",
        "        if False:",
        [
            "tests/ops/test_shared_damage.py::test_a_change_that_cannot_be_shared_fails_says_so_and_the_workers_converge"
        ],
    ),
    (
        "a damaged document never rebuilt by the workers that read it",
        "gateway/fleet/shared.py",
        "                if doc is None and self._damaged is not None and self._doc is not None:",
        "                if False:",
        [
            "tests/ops/test_shared_damage.py::test_a_damaged_state_file_is_logged_once_rebuilt_and_shared_again"
        ],
    ),
    (
        "a change that could not be shared answered as shared",
        "gateway/fleet/membership.py",
        "        await self._sharing.run(self.shared.record(change))",
        "        with contextlib.suppress(Exception):\n            await self._sharing.run(self.shared.record(change))",
        [
            "tests/ops/test_shared_damage.py::test_a_change_that_cannot_be_shared_fails_says_so_and_the_workers_converge"
        ],
    ),
    (
        "a failed write leaves its temporary file",
        "gateway/fleet/shared.py",
        "        with contextlib.suppress(OSError):\n            os.unlink(tmp)\n",
        "        pass\n",
        [
            "tests/ops/test_shared_damage.py::test_a_change_that_cannot_be_shared_fails_says_so_and_the_workers_converge"
        ],
    ),
    (
        "workers keep states the document does not name (an unshared change lingers)",
        "gateway/fleet/engines.py",
        '        b.paused = st.get("paused", False)\n        b.asleep = st.get("asleep", False)\n',
        '        b.paused = st.get("paused", b.paused)\n        b.asleep = st.get("asleep", b.asleep)\n',
        [
            "tests/ops/test_shared_damage.py::test_a_change_that_cannot_be_shared_fails_says_so_and_the_workers_converge"
        ],
    ),
    (
        "a sibling's document undoes a change being recorded",
        "gateway/fleet/shared.py",
        "        if self.pending > (1 if mine else 0):",
        "        if False:",
        [
            "tests/fleet/test_shared.py::test_a_siblings_document_never_undoes_a_change_being_recorded"
        ],
    ),
    (
        "generations counted from the file, not above what the workers adopted",
        "gateway/fleet/shared.py",
        '                doc["generation"] = max(int(doc["generation"]), self._highest() + 1)',
        '                doc["generation"] = int(doc["generation"]) + (change is None)',
        [
            "tests/fleet/test_shared.py::test_a_document_restored_from_an_older_copy_still_reaches_every_worker"
        ],
    ),
    (
        "a registration retried through the worker that holds it is not shared again",
        "gateway/edge/registry_api.py",
        "    change = Change(added={url: registry.extras(url)})\n",
        "    change = Change(added={url: registry.extras(url)}) if _ else _UNCHANGED\n",
        [
            "tests/ops/test_shared_damage.py::test_a_change_that_cannot_be_shared_fails_says_so_and_the_workers_converge"
        ],
    ),
    # -- Hardening III: discovery errors, alerts and zero series (docs/hardening.md section 10)
    (
        "the API's Status message dropped from the log",
        "gateway/fleet/discovery.py",
        "        error = cls(cause_of_status(status), verb, status, api_message(payload))",
        '        error = cls(cause_of_status(status), verb, status, "")',
        [
            "tests/fleet/test_discovery_errors.py::test_a_forbidden_list_names_the_user_and_the_missing_permission",
        ],
    ),
    (
        "a 403 read as any bad answer (no forbidden cause)",
        "gateway/fleet/discovery.py",
        "    if status == 403:\n        return FORBIDDEN\n",
        "",
        [
            "tests/fleet/test_discovery_errors.py::test_a_forbidden_list_names_the_user_and_the_missing_permission"
        ],
    ),
    (
        "the API's message neither cut nor kept on one line",
        "gateway/fleet/discovery.py",
        '    text = " ".join("".join(c if c.isprintable() else " " for c in message[:1000]).split())\n    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."',
        "    return message",
        [
            "tests/fleet/test_discovery_errors.py::test_the_apis_message_is_one_bounded_line_and_nothing_else_is_taken"
        ],
    ),
    (
        "an unreadable token file counted as unreachable",
        "gateway/edge/clients.py",
        "                raise ApiError(\n                    UNAUTHORIZED,\n                    verb,",
        "                raise ApiError(\n                    UNREACHABLE,\n                    verb,",
        [
            "tests/fleet/test_discovery_errors.py::test_a_token_file_that_cannot_be_read_is_unauthorized"
        ],
    ),
    (
        "no zero series for the causes a source can report",
        ("gateway/ops/metrics.py", "gateway/fleet/discovery.py"),
        (
            "            by_cause = {**dict.fromkeys(d.causes, 0), **d.errors}",
            "        self.errors = dict.fromkeys(self.causes, 0)",
        ),
        ("            by_cause = dict(d.errors)", "        self.errors = {}"),
        [
            "tests/fleet/test_discovery_errors.py::test_every_cause_of_the_configured_source_is_exported_at_zero"
        ],
    ),
    (
        "the failing gauge stuck at 0",
        "gateway/ops/metrics.py",
        "            failing.add_metric([d.name], 0.0 if d.failing is None else 1.0)",
        "            failing.add_metric([d.name], 0.0)",
        [
            "tests/fleet/test_discovery_errors.py::test_an_api_server_that_goes_away_is_unreachable_until_it_comes_back"
        ],
    ),
    (
        "/readyz does not name the failing discovery",
        "gateway/app.py",
        "        failing = describe_failure(self.fleet.discovery)",
        "        failing = None",
        [
            "tests/fleet/test_discovery_errors.py::test_an_unaccepted_token_is_unauthorized_and_never_logged"
        ],
    ),
    (
        "the supervisor's /readyz drops its workers' reasons",
        "gateway/ops/supervisor.py",
        "            reason += f\"; worker {', '.join(map(str, indexes))}: {text}\"",
        "            pass",
        [
            "tests/ops/test_workers.py::test_the_supervisors_readyz_says_why_its_workers_are_not_ready"
        ],
    ),
    (
        "a 410 waits like a failure instead of relisting at once",
        "gateway/fleet/discovery.py",
        "            if error.cause == GONE and not self._gone_again:",
        "            if False:",
        [
            "tests/fleet/test_discovery_errors.py::test_an_expired_watch_relists_at_once_logged_at_info_and_counted"
        ],
    ),
    (
        "410 after 410 relisted in a tight loop",
        "gateway/fleet/discovery.py",
        "            if error.cause == GONE and not self._gone_again:",
        "            if error.cause == GONE:",
        [
            "tests/fleet/test_discovery_errors.py::test_retries_back_off_exponentially_with_jitter_up_to_the_cap"
        ],
    ),
    (
        "retries not exponential",
        "gateway/fleet/discovery.py",
        "        step = min(self._retry_max, self._retry_base * 2.0 ** min(streak - 1, 60))",
        "        step = min(self._retry_max, self._retry_base)",
        [
            "tests/fleet/test_discovery_errors.py::test_retries_back_off_exponentially_with_jitter_up_to_the_cap"
        ],
    ),
    (
        "retries not capped",
        "gateway/fleet/discovery.py",
        "        step = min(self._retry_max, self._retry_base * 2.0 ** min(streak - 1, 60))",
        "        step = self._retry_base * 2.0 ** min(streak - 1, 60)",
        [
            "tests/fleet/test_discovery_errors.py::test_retries_back_off_exponentially_with_jitter_up_to_the_cap"
        ],
    ),
    (
        "retries without jitter",
        "gateway/fleet/discovery.py",
        "        return step / 2 + self._jitter() * step / 2",
        "        return step",
        [
            "tests/fleet/test_discovery_errors.py::test_retries_back_off_exponentially_with_jitter_up_to_the_cap"
        ],
    ),
    (
        "a working watch does not reset the backoff",
        "gateway/fleet/discovery.py",
        '                self._worked()\n                name = (item.get("metadata") or {}).get("name")',
        '                name = (item.get("metadata") or {}).get("name")',
        [
            "tests/fleet/test_discovery_errors.py::test_retries_back_off_exponentially_with_jitter_up_to_the_cap"
        ],
    ),
    (
        "a malformed list item ends the discovery task",
        "gateway/fleet/discovery.py",
        "            except (ValueError, KeyError, TypeError, AttributeError) as exc:",
        "            except (ValueError, KeyError) as exc:",
        [
            "tests/fleet/test_discovery_errors.py::test_a_malformed_list_is_a_bad_response_and_discovery_keeps_asking"
        ],
    ),
    (
        "DNS: no such name counted as unreachable",
        "gateway/fleet/discovery.py",
        "            cause = EMPTY if exc.errno in _NO_NAME else UNREACHABLE",
        "            cause = UNREACHABLE",
        [
            "tests/fleet/test_discovery_errors.py::test_dns_failures_carry_a_cause_in_the_log_the_metrics_and_readyz"
        ],
    ),
    (
        "DNS: an answer that is not an address taken as a backend",
        "gateway/fleet/discovery.py",
        "            ips = [str(ipaddress.ip_address(a)) for a in addresses]",
        "            ips = list(addresses)",
        [
            "tests/fleet/test_discovery_errors.py::test_dns_failures_carry_a_cause_in_the_log_the_metrics_and_readyz"
        ],
    ),
    (
        "every ejection counted as a flap (a dead backend flaps again and again)",
        "gateway/fleet/pool.py",
        "            if b.recovered:\n                b.flaps += 1",
        "            if True:\n                b.flaps += 1",
        [
            "tests/fleet/test_flapping.py::test_a_dead_backend_is_ejected_again_and_again_but_flaps_once"
        ],
    ),
    (
        "a passing probe is no proof of life (a flapping backend never flaps)",
        "gateway/fleet/pool.py",
        "    def probe_ok(self, b: Backend) -> None:\n        b.recovered = True\n",
        "    def probe_ok(self, b: Backend) -> None:\n",
        [
            "tests/fleet/test_flapping.py::test_a_backend_that_passes_probes_but_fails_requests_flaps"
        ],
    ),
    (
        "EjectionFlapping counts every ejection again",
        "deploy/monitoring/rules.yaml",
        "            increase(sglang_gateway_backend_flaps_total[15m])",
        "            increase(sglang_gateway_backend_ejections_total[15m])",
        ["tests/ops/test_monitoring.py::test_rules_unit_tests_pass"],
    ),
    (
        "DiscoveryDenied alerts on a routine restart (unreachable, gone)",
        "deploy/monitoring/rules.yaml",
        '{cause=~"unauthorized|forbidden"}',
        '{cause=~"unauthorized|forbidden|unreachable|gone"}',
        ["tests/ops/test_monitoring.py::test_rules_unit_tests_pass"],
    ),
    (
        "DiscoveryFailing without its 10 minutes",
        "deploy/monitoring/rules.yaml",
        "        for: 10m\n",
        "",
        ["tests/ops/test_monitoring.py::test_rules_unit_tests_pass"],
    ),
    (
        "no zero series for the refusals every backend shares",
        "gateway/ops/metrics.py",
        '        for rule, reason in REJECTION_REASONS:\n            self.rejections.inc((rule, reason, ""), 0.0)',
        '        for rule, reason in ():\n            self.rejections.inc((rule, reason, ""), 0.0)',
        [
            "tests/ops/test_observability.py::test_every_refusal_is_exported_at_zero_before_the_first"
        ],
    ),
    (
        "no zero series for a profile's mask refusals",
        "gateway/ops/metrics.py",
        "                for reason in b.profile.reasons():",
        "                for reason in ():",
        [
            "tests/ops/test_observability.py::test_every_refusal_is_exported_at_zero_before_the_first"
        ],
    ),
    (
        "a profile forgets a reason it refuses with",
        "gateway/contract/profiles.py",
        '            case MaskRule.CAPPED | MaskRule.STRICT:\n                top_k = ("unbounded_top_k", "top_k_above_cap")',
        '            case MaskRule.CAPPED | MaskRule.STRICT:\n                top_k = ("unbounded_top_k",)',
        ["tests/contract/test_profiles.py::test_a_profile_names_every_reason_it_refuses_with"],
    ),
    (
        "an example config names another namespace",
        "config/dns.yaml",
        "    name: sglang-workers.sglang.svc.cluster.local",
        "    name: sglang-workers.llm.svc.cluster.local",
        ["tests/test_cli.py::test_example_configs_name_the_namespace_the_manifests_use"],
    ),
    # -- Kubernetes PD discovery: pods by role label (gateway/fleet/pods.py) --------------
    (
        "a pod matching both role selectors given the first role",
        "gateway/fleet/pods.py",
        "        if len(roles) > 1:",
        "        if False:",
        [
            "tests/fleet/test_pd_discovery.py::test_a_pod_matching_both_selectors_or_with_a_bad_annotation_is_refused_once"
        ],
    ),
    (
        "a refused pod counted again on every event and relist",
        "gateway/fleet/pods.py",
        "        if self._refused.get(name) == cause:",
        "        if False:",
        [
            "tests/fleet/test_pd_discovery.py::test_a_pod_matching_both_selectors_or_with_a_bad_annotation_is_refused_once"
        ],
    ),
    (
        "the bootstrap-port annotation not read",
        "gateway/fleet/pods.py",
        '            extras["bootstrap_port"] = port',
        '            extras["bootstrap_port"] = None',
        [
            "tests/fleet/test_pd_discovery.py::test_pods_of_both_roles_are_paired_and_a_deleted_or_unready_pod_leaves_its_role"
        ],
    ),
    (
        "a pod that changed role but not URL not retyped",
        "gateway/fleet/pods.py",
        "            self._last = None",
        "            pass",
        [
            "tests/fleet/test_pd_discovery.py::test_pods_of_both_roles_are_paired_and_a_deleted_or_unready_pod_leaves_its_role"
        ],
    ),
    (
        "an unready pod kept in its role",
        "gateway/fleet/pods.py",
        "        if not ready(item):",
        "        if False:",
        [
            "tests/fleet/test_pd_discovery.py::test_pods_of_both_roles_are_paired_and_a_deleted_or_unready_pod_leaves_its_role"
        ],
    ),
    (
        "the API's selector names only the prefill pods",
        "gateway/config/models.py",
        "    for key in sorted(prefill.keys() & decode.keys()):",
        "    for key in sorted(prefill.keys()):",
        [
            "tests/fleet/test_pd_discovery.py::test_pods_of_both_roles_are_paired_and_a_deleted_or_unready_pod_leaves_its_role"
        ],
    ),
    # -- Hardening III: loop stalls with large bodies ------------------------------
    (
        "large-body scans never pause for the loop",
        "gateway/contract/scan.py",
        '    coroutine goes on."""\n    await asyncio.sleep(0)\n',
        '    coroutine goes on."""\n',
        [
            "tests/hardening/test_inspection_memory.py::test_two_64_mib_bodies_at_once_never_stall_the_loop_for_long",
            "tests/contract/test_skim.py::test_no_step_of_the_skim_holds_the_loop_for_long",
        ],
    ),
    (
        "a large body joined on the loop",
        "gateway/contract/scan.py",
        "JOIN_IN_THREAD: Final = 8 << 20",
        "JOIN_IN_THREAD: Final = 8 << 40",
        [
            "tests/hardening/test_inspection_memory.py::test_two_64_mib_bodies_at_once_never_stall_the_loop_for_long"
        ],
    ),
    (
        "a fast upload read whole in one turn",
        "gateway/edge/server.py",
        "_READ_PER_TURN: Final = 1 << 20",
        "_READ_PER_TURN: Final = 1 << 40",
        ["tests/hardening/test_inspection_memory.py::test_a_fast_upload_is_read_a_mebibyte_a_turn"],
    ),
    (
        "a stretch search loses a sign at a window's seam",
        "gateway/contract/skim.py",
        "            at = stop - 1 if stop < end and body[stop - 1] == 0x2D else stop  # '-'",
        "            at = stop",
        ["tests/contract/test_skim_slices.py::test_the_sliced_skim_answers_as_the_skim_before_it"],
    ),
    (
        "a long slice judged by a shorter last element",
        "gateway/contract/skim.py",
        "_LONGEST_LAST_ELEMENT: Final = 8 + 20",
        "_LONGEST_LAST_ELEMENT: Final = 8 + 10",
        ["tests/contract/test_skim_slices.py::test_long_slices_are_judged_as_whole_ones"],
    ),
    # -- who may do what in a cluster (membership, abort by rid, the fleet) --------
    (
        "membership refused from the engines' network",
        "gateway/edge/fleet_control.py",
        '            if access.member(request.remote, relayed=via_proxy):\n                return "member"',
        '            if False:\n                return "member"',
        [
            "tests/edge/test_rights.py::test_engines_register_list_and_leave_from_their_network_with_no_header"
        ],
    ),
    (
        "the engines' network acts on the fleet",
        "gateway/edge/fleet_control.py",
        "        if route.path in MEMBERSHIP_ROUTES:\n",
        "        if True:\n",
        ["tests/edge/test_rights.py::test_the_engines_network_never_acts_on_the_fleet"],
    ),
    (
        "a relayed request trusted for membership by its proxy's address",
        "gateway/edge/control.py",
        "        return not relayed and peer_in(peer, self.members)",
        "        return peer_in(peer, self.members)",
        ["tests/edge/test_rights.py::test_membership_is_refused_elsewhere_naming_the_setting"],
    ),
    (
        "a client may not abort its rid",
        "gateway/edge/fleet_control.py",
        "            if _may_generate(call):\n                return _CLIENT",
        "            if False:\n                return _CLIENT",
        ["tests/edge/test_rights.py::test_a_generation_client_aborts_its_rid_with_no_header"],
    ),
    (
        "a client's abort body unchecked",
        "gateway/edge/fleet_control.py",
        "        if caller == _CLIENT and not names_one_rid(body):",
        "        if False:",
        ["tests/edge/test_rights.py::test_a_client_abort_of_more_than_one_rid_is_an_operators"],
    ),
    (
        "a client's abort_all read as a strict bool",
        "gateway/edge/control.py",
        '        and parsed.get("abort_all", False) is False',
        '        and parsed.get("abort_all", False) is not True',
        ["tests/edge/test_rights.py::test_a_client_abort_of_more_than_one_rid_is_an_operators"],
    ),
    (
        "a client's prefix abort allowed",
        "gateway/edge/control.py",
        '        and parsed.get("prefix", False) is False',
        "        and True",
        ["tests/edge/test_rights.py::test_a_client_abort_of_more_than_one_rid_is_an_operators"],
    ),
    (
        "a client's empty rid allowed",
        "gateway/edge/control.py",
        '        and rid != ""',
        "        and True",
        ["tests/edge/test_rights.py::test_a_client_abort_of_more_than_one_rid_is_an_operators"],
    ),
    (
        "a client's abort body of any size parsed",
        "gateway/edge/control.py",
        "    if len(body) > CLIENT_ABORT_MAX_BYTES:\n        return False",
        "    if False:\n        return False",
        ["tests/edge/test_rights.py::test_a_client_abort_of_more_than_one_rid_is_an_operators"],
    ),
    (
        "control.client_abort ignored",
        "gateway/edge/fleet_control.py",
        "            if not access.client_abort:",
        "            if False:",
        ["tests/edge/test_rights.py::test_client_abort_can_be_turned_off"],
    ),
    (
        "a client abort needs no client key",
        "gateway/edge/fleet_control.py",
        '    return keys.check(call.request.headers.get("Authorization")) is None',
        "    return True",
        ["tests/edge/test_rights.py::test_a_client_key_grants_the_abort_of_a_rid_and_nothing_else"],
    ),
    (
        "a bad membership network accepted",
        "gateway/config/models.py",
        "    # Empty by default: only operators change the membership.\n    trusted_cidrs: list[Cidr]",
        "    # Empty by default: only operators change the membership.\n    trusted_cidrs: list[str]",
        ["tests/edge/test_rights.py::test_a_bad_membership_network_is_a_clear_startup_error"],
    ),
    # -- fan-out, LoRA routing, prefill/decode workers ------------
    (
        "a prefix abort goes to the owner of that rid alone",
        "gateway/edge/fleet_control.py",
        'if parsed.get("prefix") not in (None, False):',
        "if False:",
        ["tests/edge/test_fanout.py::test_a_prefix_abort_reaches_every_engine"],
    ),
    (
        "a LoRA request goes to any engine",
        "gateway/fleet/capability.py",
        "if self.adapters and not self.adapters <= backend.adapters:",
        "if False:",
        ["tests/edge/test_fanout.py::test_a_lora_request_goes_only_to_engines_that_loaded_it"],
    ),
    (
        "a failed load is recorded as done",
        "gateway/edge/control.py",
        "        if not r.ok or backend is None:",
        "        if backend is None:",
        ["tests/edge/test_fanout.py::test_a_failed_load_is_not_recorded_on_that_engine"],
    ),
    (
        "adapters loaded engine-direct are never found",
        "gateway/edge/adapters.py",
        "held = {r.url: names for r in results if (names := listed_adapters(r)) is not None}",
        "held = {}",
        ["tests/edge/test_fanout.py::test_an_adapter_loaded_engine_direct_is_found"],
    ),
    (
        "every miss reads the engines at once",
        "gateway/edge/adapters.py",
        "wait = self._last + REFRESH_EVERY_S - loop.time()",
        "wait = 0.0",
        ["tests/edge/test_fanout.py::test_unknown_names_are_read_for_at_most_every_interval"],
    ),
    (
        "an unparsed body's adapter is not seen",
        "gateway/contract/keyscan.py",
        "_WITH_ADAPTERS: Final = Keys((MASK_KEY, LORA_KEY))",
        "_WITH_ADAPTERS: Final = Keys((MASK_KEY,))",
        ["tests/edge/test_fanout.py::test_large_and_unparsed_bodies_are_routed_by_their_adapter"],
    ),
    (
        "an unparsed chat body's base:adapter model is not seen",
        "gateway/contract/keyscan.py",
        "    return _MODEL_VALUE.match(body, colon + 1, end) is None",
        "    return False",
        [
            "tests/edge/test_fanout.py::"
            "test_unparsed_chat_bodies_are_routed_by_the_adapter_their_model_names"
        ],
    ),
    (
        "the quote walk skips the model key",
        "gateway/contract/keyscan.py",
        "        if keys.model and _names_adapter(body, past):",
        "        if False:",
        ["tests/contract/test_fast_path.py::test_adapter_keys_share_the_walk"],
    ),
    (
        "a prefill worker takes plain traffic",
        "gateway/fleet/pool.py",
        "            and (b.plain if role is None else b.worker_type == role)\n        )",
        "            and (True if role is None else b.worker_type == role)\n        )",
        ["tests/edge/test_fanout.py::test_a_prefill_worker_never_gets_plain_traffic"],
    ),
    (
        "a prefill-only fleet answers as if no backend were healthy",
        "gateway/edge/proxy.py",
        "if (disaggregated := only_disaggregated(pool)) is not None:",
        "if (disaggregated := None) is not None:",
        ["tests/edge/test_fanout.py::test_only_prefill_and_decode_workers_answer_503"],
    ),
    # -- the engines' own truth (weight versions, the fleet's loads) -------------
    (
        "weights read from an engine only when it joins",
        "gateway/fleet/engines.py",
        "    if version is None or backend.version_writes != since:",
        "    if version is None or backend.version_writes != since or backend.weight_version is not None:",
        [
            "tests/edge/test_fleet_truth.py::test_an_engine_updated_behind_the_gateway_is_seen_within_one_probe_interval"
        ],
    ),
    (
        "a weight read older than an update replaces it",
        "gateway/fleet/engines.py",
        "    if version is None or backend.version_writes != since:",
        "    if version is None:",
        [
            "tests/edge/test_fleet_truth.py::test_a_weight_read_older_than_an_update_does_not_undo_it"
        ],
    ),
    (
        "an engine back at old weights becomes the latest",
        "gateway/fleet/engines.py",
        "    newer = before is not None and version not in pool.versions_seen",
        "    newer = before is not None",
        [
            "tests/edge/test_fleet_truth.py::test_an_engine_back_at_weights_the_fleet_had_does_not_become_the_latest"
        ],
    ),
    (
        "the shared document reasserts a version an engine moved on from",
        "gateway/fleet/membership.py",
        "        engines.adopt(self.pool, doc, before=before)",
        "        engines.adopt(self.pool, doc)",
        [
            "tests/fleet/test_shared.py::test_a_worker_keeps_what_an_engine_reported_when_a_sibling_shares_a_change"
        ],
    ),
    (
        "the fleet's loads as a list of engine answers",
        "gateway/edge/fleet_control.py",
        "        if route.path in fleet_reads.LOADS_PATHS:",
        "        if False:",
        ["tests/edge/test_fleet_truth.py::test_the_fleets_loads_read_like_one_engines"],
    ),
    (
        "an engine answering without loads counts as idle",
        "gateway/edge/fleet_reads.py",
        '        loads = body.get("loads") if isinstance(body, dict) else None',
        '        loads = body.get("loads", []) if isinstance(body, dict) else None',
        ["tests/edge/test_fleet_truth.py::test_a_fleet_load_short_of_an_engine_is_a_502_naming_it"],
    ),
    (
        "the fleet's weight version claimed while the engines disagree",
        "gateway/edge/fleet_reads.py",
        "    fleet = served.pop() if len(served) == 1 else None",
        "    fleet = pool.latest_version",
        [
            "tests/edge/test_fleet_truth.py::test_an_engine_updated_behind_the_gateway_is_seen_within_one_probe_interval"
        ],
    ),
    (
        "an older release asked at the renamed path on every probe",
        "gateway/edge/clients.py",
        "                legacy[url] = None\n",
        "                pass\n",
        [
            "tests/edge/test_fleet_truth.py::test_an_older_release_is_read_at_its_own_path_after_one_404"
        ],
    ),
    # -- SMG's surfaces (probes, engine metrics, worker changes) ----------
    (
        "readiness ready without a healthy worker",
        "gateway/edge/surfaces.py",
        "        if not healthy:\n            return call.reply(503, _NO_WORKERS, Outcome.NO_BACKEND)",
        "        if False:\n            return call.reply(503, _NO_WORKERS, Outcome.NO_BACKEND)",
        [
            "tests/edge/test_smg_surfaces.py::test_liveness_is_the_process_and_readiness_a_healthy_worker"
        ],
    ),
    (
        "readiness ignores the drain",
        "gateway/edge/surfaces.py",
        "        if self.draining():",
        "        if False:",
        [
            "tests/edge/test_smg_surfaces.py::test_liveness_is_the_process_and_readiness_a_healthy_worker"
        ],
    ),
    (
        "engine metrics without the worker label",
        "gateway/edge/engine_metrics.py",
        "            labelled = _labelled(line, end, ours)",
        "            labelled = line",
        [
            "tests/edge/test_smg_surfaces.py::test_engine_metrics_merges_every_engine_with_its_worker_label"
        ],
    ),
    (
        "engine metrics repeat a family per engine",
        "gateway/edge/engine_metrics.py",
        "            fam = families[name] = _Family(name)",
        "            fam = families[name + str(len(families))] = _Family(name)",
        [
            "tests/edge/test_smg_surfaces.py::test_engine_metrics_merges_every_engine_with_its_worker_label"
        ],
    ),
    (
        "an engine's scrape without a deadline",
        "gateway/edge/engine_metrics.py",
        "    deadline = limits.timeout_s\n",
        "    deadline = limits.timeout_s * 40\n",
        [
            "tests/edge/test_smg_surfaces.py::test_a_dead_and_a_silent_engine_are_reported_and_the_rest_answered"
        ],
    ),
    (
        "an engine's text read without its byte bound",
        "gateway/edge/engine_metrics.py",
        "                    if size > limits.max_bytes_per_engine:",
        "                    if False:",
        ["tests/edge/test_smg_surfaces.py::test_an_engine_over_its_byte_bound_is_left_out"],
    ),
    (
        "one failing engine fails the whole answer",
        "gateway/edge/surfaces.py",
        "        if all(s.text is None for s in scrapes):",
        "        if any(s.text is None for s in scrapes):",
        [
            "tests/edge/test_smg_surfaces.py::test_a_dead_and_a_silent_engine_are_reported_and_the_rest_answered"
        ],
    ),
    (
        "every scraper reads every engine again",
        "gateway/edge/engine_metrics.py",
        "        if running is None or running.done() or self._running_for != members:",
        "        if True:",
        ["tests/edge/test_smg_surfaces.py::test_concurrent_scrapes_share_one_read_of_each_engine"],
    ),
    (
        "engine metrics for any caller",
        "gateway/edge/surfaces.py",
        "        if (refused := self._operator(call)) is not None:",
        "        if (refused := None) is not None:",
        ["tests/edge/test_smg_surfaces.py::test_engine_metrics_are_an_operators"],
    ),
    (
        "PATCH takes a per-worker credential",
        "gateway/edge/registry_api.py",
        "    fleet_wide = [k for k in fields if k in _FLEET_WIDE]",
        "    fleet_wide: list[str] = []",
        ["tests/edge/test_smg_surfaces.py::test_patch_changes_what_smg_lets_a_client_change"],
    ),
    (
        "PUT moves a worker to another url",
        "gateway/edge/registry_api.py",
        "        if not isinstance(url, str) or _normal(url) != backend.url:",
        "        if not isinstance(url, str):",
        ["tests/edge/test_smg_surfaces.py::test_put_replaces_the_registration_under_the_same_url"],
    ),
    (
        "consistent_hashing keeps the default hash header",
        "gateway/config/models.py",
        '        if name not in BALANCER_NAMES and header is not None and "hash_header" not in data:',
        "        if False:",
        [
            "tests/fleet/test_balancers.py::test_sglang_router_policy_names_are_taken_as_the_closest_balancer",
            "tests/edge/test_smg_surfaces.py::test_consistent_hashing_routes_by_the_smg_routing_key",
        ],
    ),
    (
        "cache_aware taken as least_inflight",
        "gateway/config/models.py",
        "    if name in SMG_UNSUPPORTED:\n        raise ValueError(",
        '    if name in SMG_UNSUPPORTED:\n        return "least_inflight"\n        raise ValueError(',
        [
            "tests/fleet/test_balancers.py::test_an_smg_policy_with_no_equivalent_is_refused_saying_so"
        ],
    ),
    (
        "launch-router ignores the flags it does not know",
        "gateway/launch_router.py",
        "    if unknown:\n        flags",
        "    if False:\n        flags",
        ["tests/test_launch_router.py::test_a_flag_it_cannot_honour_exits_2_listing_what_it_takes"],
    ),
    (
        "launch-router starts with PD disaggregation",
        "gateway/launch_router.py",
        "        if flag in _REFUSED:",
        "        if flag in ():",
        ["tests/test_launch_router.py::test_a_flag_it_cannot_honour_exits_2_listing_what_it_takes"],
    ),
    # -- pause holds and owner routing without a parse ------------------------------
    (
        "a paused fleet's generations wait only queue_timeout_s",
        "gateway/edge/proxy.py",
        "        hold_s = settings.pause_hold if self.inspected else settings.queue_timeout",
        "        hold_s = settings.queue_timeout",
        [
            "tests/edge/test_pause_hold.py::test_a_generation_sent_during_a_pause_is_held_then_served"
        ],
    ),
    (
        "a held client that leaves stays counted as held",
        "gateway/fleet/pool.py",
        "                self._left_hold()",
        "                pass",
        ["tests/edge/test_pause_hold.py::test_a_held_client_that_leaves_is_dropped_at_once"],
    ),
    (
        "held generations handed out newest first",
        "gateway/fleet/pool.py",
        "        for h in holds:",
        "        for h in reversed(holds):",
        ["tests/edge/test_pause_hold.py::test_held_generations_go_out_in_arrival_order"],
    ),
    (
        "holds not bounded by the paused engines' slots",
        "gateway/fleet/pool.py",
        "        elif cap is not None and self.holding >= cap * engines:",
        "        elif False:",
        [
            "tests/edge/test_pause_hold.py::test_holds_are_bounded_by_the_slots_the_paused_engines_will_have"
        ],
    ),
    (
        "held bodies not charged to the memory bound",
        "gateway/fleet/pool.py",
        "            and not self.hold_memory.try_hold(hold_bytes)",
        "            and False",
        ["tests/edge/test_pause_hold.py::test_a_held_body_takes_from_the_memory_bound"],
    ),
    (
        "engines that fail while held do not end the hold",
        "gateway/fleet/pool.py",
        "                self._serve_holds()  # an engine held requests wait for came or went",
        "                pass",
        [
            "tests/edge/test_pause_hold.py::test_held_generations_whose_engines_fail_are_answered_at_once"
        ],
    ),
    (
        "unparsed bodies' rids not recorded",
        "gateway/contract/inspection.py",
        "        found = top_level_rids(body)",
        "        found = []",
        ["tests/edge/test_rid_owners.py"],
    ),
    (
        "unparsed large bodies' rids not recorded",
        "gateway/edge/large_bodies.py",
        "        found = await top_level_rids_sliced(body)",
        "        found = []",
        ["tests/edge/test_rid_owners.py"],
    ),
    (
        "the rid walk takes a nested rid key for the top-level one",
        "gateway/contract/rids.py",
        "    return balance == want",
        "    return True",
        ["tests/contract/test_rids.py"],
    ),
    (
        "the rid walk misses an escaped rid key",
        "gateway/contract/rids.py",
        '        return bool(orjson.loads(body[start : end + 1]) == "rid")',
        "        return False",
        ["tests/contract/test_rids.py"],
    ),
    (
        "the rid walk ends a string at an escaped quote",
        "gateway/contract/rids.py",
        "        if (at - 1 - k) % 2 == 0:",
        "        if True:",
        ["tests/contract/test_rids.py"],
    ),
    (
        "past its budget the rid walk overlooks an escaped key",
        "gateway/contract/rids.py",
        '            if (yield (RID_KEY, at, n)) >= 0 or (yield (b"\\\\u", at, n)) >= 0:',
        "            if (yield (RID_KEY, at, n)) >= 0:",
        ["tests/contract/test_rids.py"],
    ),
    (
        "a Head is read as the one element it holds",
        "gateway/contract/shapes.py",
        "    if isinstance(value, Head):\n        return value.length",
        "    if isinstance(value, Head):\n        return 1",
        ["tests/contract/test_jsonview.py"],
    ),
    (
        "the batch shape misses an input_ids batch read through a Head",
        "gateway/contract/policy.py",
        "        return size if size > 0 and length_of(first_of(value)) >= 0 else None",
        "        return size if isinstance(value, list) and length_of(first_of(value)) >= 0 else None",
        ["tests/contract/test_jsonview.py"],
    ),
    (
        "the prefix index forgets the block sizes, so its byte bound never evicts",
        "gateway/fleet/prefix_index.py",
        "                size = ends[i] - (ends[i - 1] if i else 0)",
        "                size = 0",
        ["tests/fleet/test_cache_aware.py"],
    ),
    (
        "the pool never passes on the cache size an engine reports",
        "gateway/fleet/pool.py",
        "                prefix.report(b.url, info.cache_tokens)",
        "                prefix.report(b.url, None)",
        ["tests/fleet/test_cache_routing.py"],
    ),
    (
        "the learnt bytes per token never move from the first guess",
        "gateway/fleet/cache_aware.py",
        "            self._bytes_per_token = learnt\n",
        "            pass\n",
        ["tests/fleet/test_cache_aware.py"],
    ),
    (
        "new work is placed by load alone, however pressed the caches",
        "gateway/fleet/cache_aware.py",
        "        return calmest if calm > self._scale else least",
        "        return least",
        ["tests/fleet/test_cache_aware.py"],
    ),
    (
        "the balance rule is asked against the placement instead of the least loaded",
        "gateway/fleet/cache_aware.py",
        "rules.balance.overloaded(best.inflight, lightest.inflight)",
        "rules.balance.overloaded(best.inflight, least.inflight)",
        ["tests/fleet/test_cache_aware.py"],
    ),
    (
        "pressure is rescaled without its scale",
        "gateway/fleet/cache_aware.py",
        "                pressure[u] /= scale",
        "                pressure[u] /= 1.0",
        ["tests/fleet/test_cache_aware.py"],
    ),
    (
        "an engine's pool is taken as its cache with a hierarchical cache on",
        "gateway/contract/profiles.py",
        'data.get("enable_hierarchical_cache") is True or ',
        "",
        ["tests/contract/test_profiles.py"],
    ),
]


def main(argv: list[str]) -> int:
    only = set(argv)
    survived = 0
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        for part in ("gateway", "tests", "config", "deploy", "pyproject.toml"):
            src = ROOT / part
            if src.is_dir():
                shutil.copytree(
                    src,
                    copy / part,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", "_build.json"),
                )
            else:
                shutil.copy(src, copy / part)
        env = {**os.environ, "SGLANG_GATEWAY_EXPECT_BUILD": "pure"}  # tests/conftest.py
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), env.get("PYTHONPATH")]))
        for i, (name, path, old, new, tests) in enumerate(MUTATIONS):
            if only and str(i) not in only:
                continue
            # One edit, or several at once: tuples of anchors and replacements, and of files
            # (one for all anchors, or one per anchor).
            olds = old if isinstance(old, tuple) else (old,)
            news = new if isinstance(new, tuple) else (new,)
            paths = path if isinstance(path, tuple) else (path,) * len(olds)
            originals = {p: (copy / p).read_text() for p in set(paths)}
            mutated = dict(originals)
            moved = False
            for p, anchor, replacement in zip(paths, olds, news, strict=True):
                if anchor not in mutated[p]:
                    moved = True
                    break
                mutated[p] = mutated[p].replace(anchor, replacement, 1)
            if moved:
                print(f"[{i}] {name}: anchor moved, not run")
                continue
            for p, text in mutated.items():
                (copy / p).write_text(text)
            try:
                run = subprocess.run(
                    [*PYTEST, *tests],
                    cwd=copy,
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=False,
                    env=env,
                )
            finally:
                for p, text in originals.items():
                    (copy / p).write_text(text)
            failed = [ln for ln in run.stdout.splitlines() if ln.startswith("FAILED")]
            verdict = "caught" if run.returncode != 0 else "SURVIVED"
            survived += run.returncode == 0
            print(f"[{i}] {name}: {verdict}")
            for line in failed[:2]:
                print(f"      {line[:160]}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
