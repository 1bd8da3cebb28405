"""The nginx configuration the nginx test and bench/services.py start nginx-light with: master and
workers in the foreground, everything under one directory, a static root on a loopback port
(bench/services.py imports it with tests/ on ``sys.path``)."""

from __future__ import annotations

from pathlib import Path

_TEMPLATE = """
daemon off;
master_process on;
worker_processes {workers};
pid {dir}/nginx.pid;
error_log {dir}/error.log;
events {{ worker_connections {connections}; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {dir}/www;
        location / {{ }}
    }}
}}
"""


def nginx_conf(root: Path, port: int, *, workers: int, connections: int) -> str:
    """nginx.conf text serving ``root/www`` on 127.0.0.1:``port``, its state under ``root``."""
    return _TEMPLATE.format(dir=root, port=port, workers=workers, connections=connections)
