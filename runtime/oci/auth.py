"""Registry credentials: where they are looked for, in which order, and the registry's challenge.

Owns: `find_credentials` (the first source that has credentials for a registry, and the list of the
sources looked in, for the error that says how to log in), `Credentials`, `parse_challenge` (a
WWW-Authenticate header: Basic or Bearer with realm / service / scope) and `login_hint`.

The order, first match wins:
1. PRECAST_REGISTRY_USERNAME and PRECAST_REGISTRY_PASSWORD (both, or neither): for CI jobs that hold a token
   in a secret (GHCR: any user name and a token with packages scope).
2. REGISTRY_AUTH_FILE: the auth file podman, skopeo and buildah read (the same JSON as Docker's `auths`).
3. Docker's config file, $DOCKER_CONFIG/config.json else ~/.docker/config.json (what `docker login` and
   `oras login` write): `credHelpers[HOST]` (a credential helper for this registry), then `auths[HOST]`
   (base64 "user:password" in `auth`, or `username` / `password`, or an `identitytoken`), then `credsStore`
   (the helper for every registry). A helper is run as `docker-credential-NAME get` with the registry on
   stdin, Docker's protocol; a helper answering "not found" is no credentials, one missing from PATH is
   said in the error.
Nothing found: anonymous (a public registry hands out anonymous bearer tokens). Standard library only.
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

ENV_USER, ENV_PASSWORD, ENV_CA = "PRECAST_REGISTRY_USERNAME", "PRECAST_REGISTRY_PASSWORD", "PRECAST_REGISTRY_CA"
ENV_PLAIN = "PRECAST_REGISTRY_PLAIN_HTTP"   # "1" (every registry) or HOST[:PORT],...: plain HTTP, as --plain-http
TOKEN_USER = "<token>"          # a helper's or auths' identity token: an OAuth2 refresh token, not a password
_DOCKER_HUB = {"docker.io", "index.docker.io", "registry-1.docker.io"}


@dataclass(frozen=True)
class Credentials:
    username: str
    secret: str
    source: str                 # where they came from, in words (errors name it)

    @property
    def identity_token(self) -> bool:
        return self.username == TOKEN_USER


def login_hint(registry: str) -> str:
    return (f"log in with `docker login {registry}` (or `oras login`, `podman login`), or set {ENV_USER} and "
            f"{ENV_PASSWORD}")


def _key(name: str) -> str:
    """A config key or registry as one spelling: no scheme, no path; Docker Hub's names as docker.io."""
    host = re.sub(r"^[a-z]+://", "", name.strip().lower()).split("/", 1)[0]
    return "docker.io" if host in _DOCKER_HUB else host


def docker_config_path(env=os.environ) -> Path:
    folder = env.get("DOCKER_CONFIG")
    return Path(folder) / "config.json" if folder else Path.home() / ".docker" / "config.json"


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"{path}: unreadable credentials file ({e}); fix it or point DOCKER_CONFIG / "
                        "REGISTRY_AUTH_FILE elsewhere") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object (a Docker config / auth file)")
    return data


def _from_auths(auths, registry: str, where: str) -> Credentials | None:
    if not isinstance(auths, dict):
        return None
    entry = next((v for k, v in auths.items() if _key(k) == _key(registry)), None)
    if not isinstance(entry, dict):
        return None
    if entry.get("identitytoken"):
        return Credentials(TOKEN_USER, str(entry["identitytoken"]), f"{where} (auths identitytoken)")
    if entry.get("auth"):
        try:
            user, sep, password = base64.b64decode(str(entry["auth"]), validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            sep = ""
        if not sep:
            raise UserError(f"{where}: auths[{registry!r}].auth is not base64 of USER:PASSWORD; log in again "
                            f"with `docker login {registry}`")
        return Credentials(user, password, f"{where} (auths)")
    if entry.get("username") and entry.get("password"):
        return Credentials(str(entry["username"]), str(entry["password"]), f"{where} (auths)")
    return None


def _from_helper(name: str, registry: str, tried: list[str]) -> Credentials | None:
    exe = shutil.which(f"docker-credential-{name}")
    if exe is None:
        tried.append(f"credential helper docker-credential-{name} (not found on PATH)")
        return None
    tried.append(f"credential helper docker-credential-{name}")
    try:
        proc = subprocess.run([exe, "get"], input=registry, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(f"credential helper docker-credential-{name} failed for {registry} ({e})") from None
    if proc.returncode != 0:
        if "not found" in (proc.stdout + proc.stderr).lower():
            return None
        raise UserError(f"credential helper docker-credential-{name} failed for {registry}: "
                        f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:] or ['exit ' + str(proc.returncode)]}")
    try:
        answer = json.loads(proc.stdout)
        return Credentials(str(answer["Username"]), str(answer["Secret"]), f"credential helper docker-credential-{name}")
    except (ValueError, KeyError, TypeError, RecursionError):
        raise UserError(f"credential helper docker-credential-{name} answered something other than "
                        "{\"Username\", \"Secret\"} JSON") from None


def find_credentials(registry: str, env=os.environ) -> tuple[Credentials | None, list[str]]:
    """(the credentials for `registry` (HOST[:PORT]) or None, the sources looked in, in order)."""
    tried = [f"{ENV_USER}/{ENV_PASSWORD}"]
    user, password = env.get(ENV_USER), env.get(ENV_PASSWORD)
    if bool(user) != bool(password):
        raise UserError(f"{ENV_USER if not user else ENV_PASSWORD} is not set but "
                        f"{ENV_USER if user else ENV_PASSWORD} is: set both, or neither")
    if user:
        return Credentials(user, password, f"{ENV_USER}/{ENV_PASSWORD}"), tried
    if env.get("REGISTRY_AUTH_FILE"):
        path = Path(env["REGISTRY_AUTH_FILE"])
        tried.append(f"REGISTRY_AUTH_FILE {path}")
        found = _from_auths((_read_json(path) or {}).get("auths"), registry, f"REGISTRY_AUTH_FILE {path}")
        if found:
            return found, tried
    path = docker_config_path(env)
    tried.append(str(path))
    config = _read_json(path) or {}
    helpers = config.get("credHelpers") if isinstance(config.get("credHelpers"), dict) else {}
    helper = next((v for k, v in helpers.items() if _key(k) == _key(registry)), None)
    found = (_from_helper(str(helper), registry, tried) if helper else None) or _from_auths(
        config.get("auths"), registry, str(path))
    if found is None and config.get("credsStore"):
        found = _from_helper(str(config["credsStore"]), registry, tried)
    return found, tried


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """('bearer' | 'basic' | ..., {realm, service, scope, ...}) from a WWW-Authenticate header."""
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'([A-Za-z_]+)="([^"]*)"', rest)}
    return scheme.lower(), params
