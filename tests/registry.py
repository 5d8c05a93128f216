"""A real OCI registry for the tests: Debian's docker-registry (CNCF distribution) on 127.0.0.1.

`Registry.start(folder, auth=..., tls=...)` writes a config file, starts /usr/bin/docker-registry on a
free port with its storage in `folder`, and waits until it answers; `stop()` ends it. `make_ca` makes a
self-signed CA and a server certificate for 127.0.0.1 with the openssl command; `htpasswd` writes a
bcrypt htpasswd file. `TokenServer` is the token service of a registry started with `token=` (distribution's
docs/spec/auth/token.md: Basic credentials in, a JWT signed with a key whose certificate is the registry's
`rootcertbundle` out). `Relay` is a TCP relay in front of a registry that counts the bytes the registry
sends, can pass at most `rate` bytes a second, and can be cut (the registry going away mid-transfer, as
the client sees it).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import ssl
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
    def start(cls, folder: Path, auth: Path | None = None, tls: dict | None = None,
              token: TokenServer | None = None) -> "Registry":
        folder.mkdir(parents=True, exist_ok=True)
        port = free_port()
        lines = ["version: 0.1", "log: {level: error, accesslog: {disabled: true}}",
                 f"storage: {{filesystem: {{rootdirectory: {folder / 'storage'}}}, delete: {{enabled: true}}}}",
                 "http:", f"  addr: 127.0.0.1:{port}", "  secret: precast-tests"]
        if tls:
            lines += [f"  tls: {{certificate: {tls['cert']}, key: {tls['key']}}}"]
        if auth:
            lines += [f"auth: {{htpasswd: {{realm: precast-tests, path: {auth}}}}}"]
        if token:
            lines += [f"auth: {{token: {{realm: '{token.url}', service: {token.service}, issuer: {token.issuer}, "
                      f"rootcertbundle: {token.cert}}}}}"]
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


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    """http://127.0.0.1:PORT/token: a registry's token service (distribution's docs/spec/auth/token.md and jwt.md).
    A GET with the challenge's `service` and `scope` and Basic credentials found in `users` gets a JWT granting
    the scope's actions; without credentials, one granting nothing (an anonymous token: the registry then says
    401); with wrong ones, 401. A POST exchanges a refresh token (`refresh[token]`: user) for one, OAuth2's
    way. The JWT is RS256, signed by the openssl command with a key made here, its `kid` header the libtrust
    key id of that key (how distribution finds it among its `rootcertbundle`'s certificates). `seen`: (user or
    None, [scopes]) per request."""

    service, issuer = "precast-registry", "precast-token-server"

    def __init__(self, folder: Path, users: dict[str, str]):
        folder.mkdir(parents=True, exist_ok=True)
        self.key, self.cert, self.users, self.seen = folder / "token.key", folder / "token.pem", users, []
        self.refresh = {f"refresh-{user}": user for user in users}     # identity tokens, as `docker login` keeps
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(self.key),
                        "-out", str(self.cert), "-days", "2", "-subj", "/CN=precast token signer"],
                       check=True, capture_output=True)
        pem = subprocess.run(["openssl", "x509", "-in", str(self.cert), "-pubkey", "-noout"], check=True,
                             capture_output=True, text=True).stdout
        spki = base64.b64decode("".join(line for line in pem.splitlines() if "-----" not in line))
        b32 = base64.b32encode(hashlib.sha256(spki).digest()[:30]).decode()     # libtrust's keyIDFromCryptoKey
        self.kid = ":".join(b32[i:i + 4] for i in range(0, len(b32), 4))
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                user, password = None, None
                auth = self.headers.get("Authorization", "")
                if auth.startswith("Basic "):
                    user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
                scopes = query.get("scope", [])
                server.seen.append((user, scopes))
                if user is not None and server.users.get(user) != password:
                    return self._send(401, {"errors": [{"code": "UNAUTHORIZED", "message": "wrong password"}]})
                token = server.token(user or "", scopes if user else [])
                self._send(200, {"token": token, "access_token": token, "expires_in": 300})

            def do_POST(self):         # OAuth2 (docs/spec/auth/oauth.md): a refresh token (an identity token) in
                form = urllib.parse.parse_qs(self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode())
                scopes = " ".join(form.get("scope", [])).split()
                user = server.refresh.get((form.get("refresh_token") or [""])[0])
                server.seen.append((user, scopes))
                if form.get("grant_type") != ["refresh_token"] or user is None:
                    return self._send(401, {"error": "invalid_grant"})
                self._send(200, {"access_token": server.token(user, scopes), "expires_in": 300})

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/token"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def token(self, subject: str, scopes: list[str]) -> str:
        access = []
        for scope in scopes:            # type:name:actions (a name may hold ':' -- a host:port)
            kind, rest = scope.split(":", 1)
            name, actions = rest.rsplit(":", 1)
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "kid": self.kid}
        claims = {"iss": self.issuer, "sub": subject, "aud": self.service, "exp": now + 300, "nbf": now - 10,
                  "iat": now, "jti": uuid.uuid4().hex, "access": access}
        signed = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(self.key)], input=signed.encode(),
                             check=True, capture_output=True).stdout      # RSASSA-PKCS1-v1_5 with SHA-256: RS256
        return f"{signed}.{_b64url(sig)}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Relay:
    """BIND:PORT (127.0.0.1, or another loopback address that precast does not take for one, as a registry
    elsewhere on the network would be) relaying to `target` (host, port), at most `rate` bytes/s per connection
    (None: as fast as it goes); `received`: bytes the target sent through it; `cut()` closes every connection and
    refuses new ones until `resume()`."""

    def __init__(self, target: tuple[str, int], rate: int | None = None, bind: str = "127.0.0.1"):
        self.target, self.rate, self.received, self.bind = target, rate, 0, bind
        self._count = threading.Lock()
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind((bind, 0))
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
        return f"{self.bind}:{self.port}"

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
