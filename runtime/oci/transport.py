"""The registry connection under every verb: sessions, TLS, authentication, retries and errors.

Owns: `Transport` (one registry, `HOST[:PORT]`: a requests session per thread; the scheme -- https with the
system store (requests' certifi bundle, or REQUESTS_CA_BUNDLE) or a CA file (`ca=`: --ca /
PRECAST_REGISTRY_CA), plain http only when asked (`plain_http=True`: --plain-http; or PRECAST_REGISTRY_PLAIN_HTTP
naming the registry, `plain_http_asked`) or for a loopback host (localhost,
127.0.0.1, [::1]) whose https handshake fails while http answers, as docker does --; `request`, one
request answered through the registry's authentication challenge and retried; `stop`, the event that
makes transfers in flight give up), `RegistryError` and `Interrupted` (one line naming the registry, the
repository or blob, and the fix) and what counts as transient. runtime/oci/client.py builds the
distribution API's verbs on it.

Authentication: the registry's challenge decides -- Basic with the credentials runtime/oci/auth.py
finds, or Bearer: a token from the challenge's realm for its service and scope (anonymous when no
credentials are found; an identity token is exchanged as an OAuth2 refresh token), cached per
repository and fetched again when a request asks for another scope -- for the union of the scopes asked,
so a push's pull,push token is not narrowed by a pull's challenge on another thread. Retries: a connection
lost, a timeout, 429 or 5xx is retried RETRIES times with doubling waits (PRECAST_REGISTRY_RETRIES; a transfer
goes on from the bytes it has), then one line saying that running the command again resumes. A host
never reached is not retried: unknown host and connection refused are said at once (`unreachable`
tells those apart from a refusal by a registry that answered).
"""
from __future__ import annotations

import os
import threading
import time

import requests
import urllib3

from ..errors import UserError
from .auth import ENV_CA, ENV_PLAIN, Credentials, find_credentials, login_hint, parse_challenge

RETRIES = 4
_TRANSIENT = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
              urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)


def _short(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."


READ_GRACE_S, MIN_RATE = 120.0, 50_000     # an answer read into memory: done within 120 s + 1 s per 50 kB


def read_body(r: requests.Response, limit: int, what: str) -> bytes:
    """Up to `limit` bytes of a streamed answer; a connection that breaks on the way, or drips (a byte a second
    restarts the socket's timeout for ever), is one line."""
    deadline = time.monotonic() + READ_GRACE_S + limit / MIN_RATE
    parts, got = [], 0
    try:
        while got < limit:
            chunk = r.raw.read1(min(1 << 20, limit - got), decode_content=True)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
            if time.monotonic() > deadline:
                raise RegistryError(f"{what}: the registry sent {got} bytes in {READ_GRACE_S + limit / MIN_RATE:.0f} s "
                                    "and is still sending: too slow, stopped; try again")
    except (*_TRANSIENT, requests.RequestException) as e:
        raise RegistryError(f"{what}: the connection broke while it was read ({type(e).__name__}); try again") \
            from None
    return b"".join(parts)


class RegistryError(UserError):
    """A registry refused, lost or damaged something: one line naming it and the fix."""


class Interrupted(RegistryError):
    """The registry went away (after the retries): running the command again resumes."""


class Unreachable(RegistryError):
    """No registry answered at all: the host does not resolve, nothing listens, or the connection failed.
    `reason`: that, in a few words."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def plain_http_asked(registry: str, env=os.environ) -> bool:
    """Whether PRECAST_REGISTRY_PLAIN_HTTP asks plain HTTP for `registry` (HOST[:PORT]): "1" / "true" / "*" for
    every registry, else a comma-separated list of registries (docker's insecure-registries, as a variable)."""
    text = (env.get(ENV_PLAIN) or "").strip()
    if text.lower() in ("1", "true", "yes", "*"):
        return True
    return registry in {h.strip().removeprefix("http://").rstrip("/") for h in text.split(",") if h.strip()}


def _transient_status(code: int) -> bool:
    return code == 429 or 500 <= code < 600


class Transport:
    """One registry, `HOST[:PORT]`; safe to share between threads (each thread has its own session)."""

    def __init__(self, registry: str, *, loopback: bool = False, plain_http: bool = False, ca: str | None = None,
                 env=os.environ, retries: int | None = None):
        self.registry, self.loopback, self.env = registry, loopback, env
        self.ca = ca or env.get(ENV_CA) or None
        if self.ca and not os.path.isfile(self.ca):
            raise RegistryError(f"--ca / {ENV_CA} {self.ca}: no such file (give the CA certificate in PEM form "
                                "that signed the registry's certificate)")
        self.verify = self.ca or True     # per request too: requests lets REQUESTS_CA_BUNDLE override a session's
        self.scheme = "http" if plain_http or plain_http_asked(registry, env) else None
        self.retries = retries if retries is not None else int(env.get("PRECAST_REGISTRY_RETRIES") or RETRIES)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._reached = False
        self._basic: tuple[str, str] | None = None
        self._tokens: dict[str, tuple[frozenset, str]] = {}   # repository -> (the scope's atoms asked for, token)
        self._found: tuple[Credentials | None, list[str]] | None = None
        self.stop = threading.Event()                      # set: transfers in flight give up (parallel)

    # ---- connection -------------------------------------------------------------------------------
    @property
    def session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            s.verify = self.verify
            s.headers["User-Agent"] = "precast"
        return s

    def url(self, path: str) -> str:
        if self.scheme is None:
            with self._lock:
                if self.scheme is None:
                    self.scheme = self._probe()
        return f"{self.scheme}://{self.registry}{path}"

    def _probe(self) -> str:
        """'https', or 'http' for a loopback registry that speaks only plain HTTP."""
        try:
            self.session.get(f"https://{self.registry}/v2/", timeout=(10, 30), verify=self.verify)
            return "https"
        except requests.RequestException as e:
            if not self.loopback:
                raise self._connection_error(e, "https") from None
            try:
                r = self.session.get(f"http://{self.registry}/v2/", timeout=(10, 30), verify=self.verify)
            except requests.RequestException:
                raise self._connection_error(e, "https") from None
            if r.status_code == 400 and "https" in r.text.lower():      # a TLS server: the https error stands
                raise self._connection_error(e, "https") from None
            return "http"

    def _connection_error(self, e: Exception, scheme: str | None = None) -> RegistryError:
        text = str(e)
        if isinstance(e, requests.exceptions.SSLError):
            why = "certificate verify failed" if "CERTIFICATE_VERIFY_FAILED" in text else text.split("(")[-1][:120]
            return RegistryError(f"{self.registry}: TLS failed ({why}): give the CA that signed the registry's "
                                 f"certificate with --ca FILE or {ENV_CA}" + ("" if self.ca else
                                 "; a registry that speaks plain HTTP needs --plain-http"))
        if any(s in text for s in ("NameResolution", "Name or service not known", "getaddrinfo", "nodename nor "
                                   "servname", "No address associated", "Temporary failure in name resolution")):
            return Unreachable(f"{self.registry}: unknown host (its name does not resolve): check the host in the "
                               "reference", "unknown host")
        if "refused" in text.lower():
            return Unreachable(f"{self.registry}: connection refused: no registry listens there; check the host "
                               "and port, and that the registry runs", "connection refused")
        return Unreachable(f"{self.registry}: cannot connect ({type(e).__name__}: {text[:160]})", type(e).__name__)

    def request(self, method: str, path_or_url: str, repo: str, *, ok=(200,), headers=None, data=None,
                stream: bool = False, missing: str | None = None, what: str = "") -> requests.Response:
        """One request with authentication (a 401 answered once per challenge) and retries; a status
        outside `ok` raises RegistryError (`missing`: the words for a 404). `data`: bytes, or a
        callable giving a fresh body for each try."""
        url = path_or_url if "://" in path_or_url else self.url(path_or_url)
        answered = set()
        for attempt in range(self.retries + 1):
            if self.stop.is_set():
                raise Interrupted(f"{self.registry}: stopped (another transfer failed)")
            try:
                r = self.session.request(method, url, headers={**(headers or {}), **self._authorization(repo)},
                                         data=data() if callable(data) else data, stream=stream,
                                         timeout=(10, 120), verify=self.verify, allow_redirects=True)
            except requests.exceptions.SSLError as e:
                raise self._connection_error(e) from None
            except _TRANSIENT as e:
                if not self._reached:
                    raise self._connection_error(e) from None
                self._wait(attempt, what or path_or_url, e)
                continue
            except requests.RequestException as e:    # a redirect loop, a redirect to file://, a malformed URL
                raise RegistryError(f"{self.registry}: {what or path_or_url}: {type(e).__name__} ({_short(e)}); "
                                    "the registry's answer cannot be followed") from None
            self._reached = True
            if r.status_code == 401 and r.headers.get("WWW-Authenticate"):
                challenge = r.headers["WWW-Authenticate"]
                asked = _asked(challenge)
                if asked in answered:        # the token or password we gave was not enough for it
                    raise self._denied(r, repo)
                answered.add(asked)
                r.close()
                self._answer(challenge, repo)
                continue
            if _transient_status(r.status_code) and attempt < self.retries:
                r.close()
                self._wait(attempt, what or path_or_url, f"HTTP {r.status_code}")
                continue
            if r.status_code in ok:
                return r
            r.close()
            if r.status_code in (401, 403):
                raise self._denied(r, repo)
            if r.status_code == 404 and missing:
                raise RegistryError(missing)
            raise RegistryError(f"{self.registry}/{repo}: {method} {what or path_or_url} answered HTTP {r.status_code}"
                                f"{_error_text(r)}")
        raise Interrupted(f"{self.registry}: {what or path_or_url}: the registry kept failing ({self.retries + 1} "
                          "tries); run the same command again: it resumes where it stopped")

    def _wait(self, attempt: int, what: str, e) -> None:
        if attempt >= self.retries:
            raise Interrupted(f"{self.registry} went away during {what} ({type(e).__name__ if not isinstance(e, str) else e}; "
                              f"{self.retries + 1} tries): run the same command again: it resumes where it stopped")
        time.sleep(0.5 * 2 ** attempt)

    # ---- authentication --------------------------------------------------------------------------
    def _credentials(self) -> tuple[Credentials | None, list[str]]:
        with self._lock:
            if self._found is None:
                self._found = find_credentials(self.registry, self.env)
            return self._found

    def _authorization(self, repo: str) -> dict:
        if repo in self._tokens:
            return {"Authorization": f"Bearer {self._tokens[repo][1]}"}
        if self._basic:
            return {"Authorization": requests.auth._basic_auth_str(*self._basic)}
        return {}

    def _answer(self, challenge: str, repo: str) -> None:
        scheme, params = parse_challenge(challenge)
        creds, tried = self._credentials()
        if scheme == "basic":
            if creds is None or creds.identity_token:
                raise RegistryError(f"{self.registry} asks for a user name and password and none were found (looked "
                                    f"in {', '.join(tried)}): {login_hint(self.registry)}")
            self._basic = (creds.username, creds.secret)
            return
        if scheme != "bearer" or not params.get("realm"):
            raise RegistryError(f"{self.registry}: unsupported authentication challenge {challenge[:80]!r}")
        held = self._tokens.get(repo)         # a push's token is not narrowed by a pull's challenge beside it
        atoms = _atoms(params.get("scope") or f"repository:{repo}:pull") | (held[0] if held else frozenset())
        query = {k: v for k, v in (("service", params.get("service")), ("scope", _scopes(atoms))) if v}
        try:
            if creds is not None and creds.identity_token:
                r = self.session.post(params["realm"], data={**query, "scope": " ".join(query["scope"]),
                                                             "grant_type": "refresh_token",
                                                             "refresh_token": creds.secret, "client_id": "precast"},
                                      timeout=(10, 60), verify=self.verify)
            else:
                r = self.session.get(params["realm"], params=query, timeout=(10, 60), verify=self.verify,
                                     auth=(creds.username, creds.secret) if creds else None)
        except requests.RequestException as e:
            raise RegistryError(f"{self.registry}: the token service {params['realm']} cannot be reached "
                                f"({type(e).__name__})") from None
        if r.status_code in (401, 403):
            raise self._denied(r, repo, token_service=params["realm"])
        try:
            token = (r.json() if r.ok and r.headers.get("Content-Type", "").startswith("application/json") else {})
        except (ValueError, RecursionError):
            token = {}
        token = (token.get("token") or token.get("access_token")) if isinstance(token, dict) else None
        if not isinstance(token, str):
            token = None
        if not token:
            raise RegistryError(f"{self.registry}: the token service {params['realm']} answered HTTP {r.status_code} "
                                "without a token")
        with self._lock:                      # keep a broader token another thread stored meanwhile
            now = self._tokens.get(repo)
            if now is None or atoms >= now[0] or not now[0] >= atoms:
                self._tokens[repo] = (atoms, token)

    def _denied(self, r: requests.Response, repo: str, token_service: str | None = None) -> RegistryError:
        creds, tried = self._credentials()
        if creds is None:
            what = f"asks for credentials and none were found (looked in {', '.join(tried)})"
        else:
            who = creds.source + ("" if creds.identity_token else f", user {creds.username!r}")
            what = (f"denied access with the credentials from {who}" if r.status_code == 403 else
                    f"refused the credentials from {who}")
        return RegistryError(f"{self.registry}/{repo}: {what} (HTTP {r.status_code}"
                             f"{' from ' + token_service if token_service else ''}): "
                             + ("check that the account may push/pull this repository, or " if creds else "")
                             + login_hint(self.registry))


def _atoms(scope: str) -> frozenset:
    """A challenge's scope as one item per action: 'repository:a/b:pull,push' -> {'repository:a/b:pull',
    'repository:a/b:push'} (several scopes are space-separated)."""
    out = set()
    for item in scope.split():
        head, _, actions = item.rpartition(":")
        out |= {f"{head}:{a}" for a in actions.split(",") if a} if head else {item}
    return frozenset(out)


def _scopes(atoms) -> list[str]:
    """The token request's `scope` values: one per resource, its actions joined ('repository:a/b:pull,push')."""
    grouped: dict[str, list[str]] = {}
    for atom in sorted(atoms):
        head, _, action = atom.rpartition(":")
        grouped.setdefault(head, []).append(action)
    return [f"{head}:{','.join(actions)}" for head, actions in grouped.items()]


def _asked(challenge: str) -> tuple:
    """What a challenge asks for -- scheme, realm, service, scope -- without its `error` (a bearer registry
    adds error="insufficient_scope" once a token fell short: the same request, answered already)."""
    scheme, params = parse_challenge(challenge)
    return scheme, params.get("realm"), params.get("service"), params.get("scope")


def _error_text(r: requests.Response) -> str:
    try:
        errors = r.json().get("errors") or []
        return ": " + "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors[:2]) if errors else ""
    except (ValueError, AttributeError, TypeError, RecursionError):    # a registry's error body, whatever it is
        return ""
