"""A real OCI registry for the tests: Debian's docker-registry (CNCF distribution) on 127.0.0.1.

`Registry.start(folder, auth=..., tls=...)` writes a config file, starts /usr/bin/docker-registry on a
free port with its storage in `folder`, and waits until it answers; `stop()` ends it. `make_ca` makes a
self-signed CA and a server certificate for 127.0.0.1 with the openssl command; `htpasswd` writes a
bcrypt htpasswd file. `Relay` is a TCP relay in front of a registry that counts the bytes the registry
sends, can pass at most `rate` bytes a second, and can be cut (the registry going away mid-transfer, as
the client sees it).
"""
from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import ssl
from pathlib import Path

BINARY = "/usr/bin/docker-registry"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def htpasswd(path: Path, user: str, password: str) -> Path:
    import bcrypt
    path.write_text(f"{user}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)).decode()}\n")
    return path


def make_ca(folder: Path) -> dict:
    """{ca, cert, key}: a CA made here and a certificate it signed for 127.0.0.1 / localhost."""
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key, key, csr, cert = (folder / n for n in ("ca.pem", "ca.key", "server.key", "server.csr", "server.pem"))
    ext = folder / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                   "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    run = lambda *a: subprocess.run(["openssl", *map(str, a)], check=True, capture_output=True)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "2",
        "-subj", "/CN=precast test CA", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, "-days", "2",
        "-extfile", ext)
    return {"ca": ca, "cert": cert, "key": key}


class Registry:
    def __init__(self, folder: Path, port: int, proc: subprocess.Popen, scheme: str):
        self.folder, self.port, self.proc, self.scheme = folder, port, proc, scheme
        self.host = f"127.0.0.1:{port}"

    @classmethod
    def start(cls, folder: Path, auth: Path | None = None, tls: dict | None = None) -> "Registry":
        folder.mkdir(parents=True, exist_ok=True)
        port = free_port()
        lines = ["version: 0.1", "log: {level: error, accesslog: {disabled: true}}",
                 f"storage: {{filesystem: {{rootdirectory: {folder / 'storage'}}}, delete: {{enabled: true}}}}",
                 "http:", f"  addr: 127.0.0.1:{port}", "  secret: precast-tests"]
        if tls:
            lines += [f"  tls: {{certificate: {tls['cert']}, key: {tls['key']}}}"]
        if auth:
            lines += [f"auth: {{htpasswd: {{realm: precast-tests, path: {auth}}}}}"]
        (folder / "config.yml").write_text("\n".join(lines) + "\n")
        log = open(folder / "registry.log", "wb")
        proc = subprocess.Popen([BINARY, "serve", str(folder / "config.yml")], stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL)
        reg = cls(folder, port, proc, "https" if tls else "http")
        context = ssl.create_default_context(cafile=str(tls["ca"])) if tls else None
        deadline = time.time() + 20
        while True:
            try:
                urllib.request.urlopen(f"{reg.scheme}://{reg.host}/v2/", timeout=2, context=context)
                return reg
            except urllib.error.HTTPError:          # 401: up, and asking for credentials
                return reg
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    reg.stop()
                    raise RuntimeError(f"docker-registry did not start: {(folder / 'registry.log').read_text()[-800:]}")
                time.sleep(0.05)

    def blob_path(self, digest: str) -> Path:
        hexd = digest.removeprefix("sha256:")
        return self.folder / "storage/docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Relay:
    """127.0.0.1:PORT relaying to `target` (host, port), at most `rate` bytes/s per connection (None: as fast as
    it goes); `received`: bytes the target sent through it; `cut()` closes every connection and refuses new
    ones until `resume()`."""

    def __init__(self, target: tuple[str, int], rate: int | None = None):
        self.target, self.rate, self.received = target, rate, 0
        self._count = threading.Lock()
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(64)
        self.port = self.server.getsockname()[1]
        self.open = threading.Event()
        self.open.set()
        self.conns: list[socket.socket] = []
        self.done = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.done.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if not self.open.is_set():
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            self.conns += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _pipe(self, src, dst, downstream):
        try:
            while True:
                data = src.recv(16384 if downstream and self.rate else 1 << 20)
                if not data:
                    break
                dst.sendall(data)
                if downstream:
                    with self._count:
                        self.received += len(data)
                    if self.rate:
                        time.sleep(len(data) / self.rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self):
        self.open.clear()
        for s in self.conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        self.conns.clear()

    def resume(self):
        self.open.set()

    def close(self):
        """Stop relaying; the port then refuses connections (as a registry that is gone)."""
        self.done.set()
        self.cut()
        try:
            self.server.shutdown(socket.SHUT_RDWR)      # wakes the accept() in flight, which would keep the port open
        except OSError:
            pass
        self.server.close()
