"""Configs and launchers: the fast upstream, the nginx anchor, sglang-router, the gateway.

One upstream process (nginx, 1 worker, pinned to the load cores) listens on one port per
upstream *kind*; each kind answers POST /generate differently (canned JSON, a 4 MB file,
an SSE file, a rate-limited SSE file, a 64 MB file), so each proxy under test is started
per kind, in front of that port. Every kind also answers the operational GETs (/health,
/model_info, /server_info, ...) that the gateway's and the router's health checks call.
"""

from __future__ import annotations

import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench import bodies, common
from bench.procs import Proc, gateway_argv, pinned, router_python

KINDS = ("canned", "resp4m", "sse200", "sseslow", "respbig")
_OPS_JSON = '{"model_path":"bench","tokenizer_path":null,"is_generation":true,"status":"ok"}'


@dataclass
class Upstream:
    proc: Proc
    ports: dict[str, int]
    impl: str  # "nginx" or "python"


def _nginx_common(tmp: Path, name: str) -> str:
    t = tmp / f"{name}-temp"
    t.mkdir(parents=True, exist_ok=True)
    return f"""
worker_processes 1;
daemon off;
master_process on;
pid {tmp}/{name}.pid;
error_log {tmp}/{name}-error.log warn;
worker_rlimit_nofile 65536;
events {{ worker_connections 30000; multi_accept on; }}
"""


def _temp_paths(tmp: Path, name: str) -> str:
    t = tmp / f"{name}-temp"
    return "".join(
        f"  {kind}_temp_path {t}/{kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )


def upstream_nginx_conf(
    tmp: Path, files: bodies.Files, ports: dict[str, int], sse_slow_rate: int
) -> str:
    gen = bodies.canned_generate().decode()
    chat = bodies.canned_chat().decode()
    for text in (gen, chat):
        assert "'" not in text and "$" not in text and len(text) < 4000

    def file_server(kind: str, path: Path, *, sse: bool = False, rate: int = 0) -> str:
        # nginx's static module refuses POST (405): turn that into an internal GET of the file.
        extra = ""
        if sse:
            extra += "      default_type text/event-stream;\n"
            extra += "      add_header Cache-Control no-cache;\n"
            # What an SSE deployment configures on nginx: no response buffering.
            extra += "      add_header X-Accel-Buffering no;\n"
            # SGLang streams with Transfer-Encoding: chunked. nginx sends a static file with a
            # Content-Length unless a body filter runs: appending an empty body (the addition
            # module) drops the length without scanning the bytes, so the stream goes out
            # chunked, as SGLang's does.
            extra += "      add_after_body /_empty;\n      addition_types text/event-stream;\n"
        if rate:
            extra += f"      limit_rate {rate};\n      sendfile off;\n"
        return f"""
  server {{
    listen 127.0.0.1:{ports[kind]} backlog=4096;
    location = /generate {{ error_page 405 =200 /_files/{path.name}; return 405; }}
    location /_files/ {{
      internal;
      alias {path.parent}/;
{extra}    }}
    location = /_empty {{ internal; return 200 ""; }}
    location / {{ return 200 '{_OPS_JSON}'; }}
  }}
"""

    return (
        _nginx_common(tmp, "upstream")
        + f"""
http {{
  access_log off;
  server_tokens off;
  sendfile on;
  tcp_nopush on;
  tcp_nodelay on;
  keepalive_timeout 300s;
  keepalive_requests 100000000;
  client_max_body_size 0;
  types {{ }}
  default_type application/json;
{_temp_paths(tmp, "upstream")}
  server {{
    listen 127.0.0.1:{ports["canned"]} backlog=4096;
    location = /generate {{ return 200 '{gen}'; }}
    location = /v1/chat/completions {{ return 200 '{chat}'; }}
    location / {{ return 200 '{_OPS_JSON}'; }}
  }}
{file_server("resp4m", files.resp_4m)}
{file_server("sse200", files.sse_200, sse=True)}
{file_server("sseslow", files.sse_slow, sse=True, rate=sse_slow_rate)}
{file_server("respbig", files.resp_64m)}
}}
"""
    )


def sse_slow_rate(files: bodies.Files, seconds: float) -> int:
    """Bytes per second so that the slow SSE file takes about `seconds` to stream."""
    return max(64, math.ceil(files.sse_slow.stat().st_size / seconds))


def start_upstream(
    tmp: Path, files: bodies.Files, cpus: str | None, sse_slow_s: float, *, use_nginx: bool
) -> Upstream:
    ports = {kind: common.free_port() for kind in KINDS}
    rate = sse_slow_rate(files, sse_slow_s)
    if use_nginx:
        conf = tmp / "upstream.conf"
        conf.write_text(upstream_nginx_conf(tmp, files, ports, rate))
        nginx = shutil.which("nginx")
        assert nginx is not None
        argv = [nginx, "-c", str(conf), "-p", str(tmp), "-e", str(tmp / "upstream-error.log")]
        impl = "nginx"
    else:
        spec = ",".join(f"{k}={p}" for k, p in ports.items())
        argv = [
            sys.executable,
            "-m",
            "bench.pyupstream",
            "--ports",
            spec,
            "--files",
            str(files.small.parent),
            "--sse-slow-s",
            str(sse_slow_s),
        ]
        impl = "python"
    proc = Proc("upstream", pinned(cpus, argv), tmp / "upstream.log")
    proc.start()
    for port in ports.values():
        if not common.wait_port(port, 10):
            proc.stop()
            raise RuntimeError(f"upstream ({impl}) did not start:\n{proc.log_tail()}")
    return Upstream(proc, ports, impl)


# -- the proxies under test ---------------------------------------------------------------


def nginx_proxy_conf(
    tmp: Path, name: str, port: int, upstream_port: int, body_buffer: str = "2m"
) -> str:
    return (
        _nginx_common(tmp, name)
        + f"""
http {{
  access_log off;
  server_tokens off;
  tcp_nodelay on;
  keepalive_timeout 300s;
  keepalive_requests 100000000;
  client_max_body_size 0;
  client_body_buffer_size {body_buffer};  # 2m: the 1 MB bodies stay in memory, no temp file
{_temp_paths(tmp, name)}
  upstream backend {{
    server 127.0.0.1:{upstream_port};
    keepalive 1024;
    keepalive_requests 100000000;
    keepalive_timeout 300s;
  }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto $scheme;
      proxy_read_timeout 900s;
      proxy_buffer_size 64k;
      proxy_buffers 16 64k;
      proxy_busy_buffers_size 128k;
      proxy_max_temp_file_size 0;  # never spool a response to disk: stream it
    }}
  }}
}}
"""
    )


def nginx_proxy(
    tmp: Path, kind: str, upstream_port: int, cpus: str | None, body_buffer: str = "2m"
) -> Proc:
    name = f"nginx-proxy-{kind}"
    port = common.free_port()
    conf = tmp / f"{name}.conf"
    conf.write_text(nginx_proxy_conf(tmp, name, port, upstream_port, body_buffer))
    nginx = shutil.which("nginx")
    assert nginx is not None
    argv = [nginx, "-c", str(conf), "-p", str(tmp), "-e", str(tmp / f"{name}-error.log")]
    return Proc("nginx", pinned(cpus, argv), tmp / f"{name}.log", port=port)


def router_proxy(tmp: Path, kind: str, upstream_port: int, cpus: str | None) -> Proc:
    py = router_python()
    assert py is not None
    port = common.free_port()
    argv = [
        str(py),
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        f"http://127.0.0.1:{upstream_port}",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # One worker: a routing policy has nothing to choose, and cache_aware would only
        # add its prefix-tree bookkeeping to every request.
        "--policy",
        "round_robin",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(common.free_port()),
        "--log-level",
        "warn",
    ]
    return Proc("sglang-router", pinned(cpus, argv), tmp / f"router-{kind}.log", port=port)


def gateway_proxy(
    tmp: Path,
    kind: str,
    upstream_port: int,
    cpus: str | None,
    *,
    workers: int,
    label: str,
    skip_parse: bool = False,
    access_log: bool = True,
) -> Proc:
    port = common.free_port()
    admin = common.free_port()
    cfg = tmp / f"{label}-{kind}.yaml"
    # The default config, as users run it (access log on, written to the log file like a
    # container's stdout), but for the ports and a short drain on stop; the variants change
    # one setting each.
    extra = "" if access_log else "logging: {access_log: false}\n"
    if skip_parse:
        extra += "policy: {skip_parse_without_mask_key: true}\n"
    cfg.write_text(
        f"""listen: {{host: 127.0.0.1, port: {port}}}
admin: {{host: 127.0.0.1, port: {admin}}}
backends:
  static: [http://127.0.0.1:{upstream_port}]
timeouts: {{shutdown_grace_s: 1}}
{extra}"""
    )
    argv = [*gateway_argv(), "--config", str(cfg)]
    if workers > 1:
        argv += ["--workers", str(workers)]
    proc = Proc(label, pinned(cpus, argv), tmp / f"{label}-{kind}.log", port=port)
    proc.extra["admin_port"] = admin
    return proc
