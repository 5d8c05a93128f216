"""Registry references: `oci://HOST[:PORT]/REPO[:TAG|@sha256:DIGEST]`, parsed strictly.

Owns: `Ref` (host, port, repository, tag, digest; its text form and the registry's base URL parts),
`parse_ref` (one UserError naming the part that is wrong and what it should look like) and `is_ref`
(whether a command-line argument is a registry reference rather than a path). The grammar is the
OCI distribution spec's: a repository is lower-case path components `[a-z0-9]+([._-]|__|-+)...`
joined by '/', a tag `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`, a digest `sha256:` and 64 lower-case hex
digits. Standard library only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UserError

SCHEME = "oci://"
_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
                   r"|\[[0-9A-Fa-f:.]+\]")
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
LOOPBACK = ("localhost", "127.0.0.1", "[::1]")
EXAMPLE = "oci://ghcr.io/acme/sd15-engines:v1"


@dataclass(frozen=True)
class Ref:
    host: str                    # as written, lower-cased: "ghcr.io", "127.0.0.1", "[::1]"
    port: int | None
    repository: str              # "acme/sd15-engines"
    tag: str | None = None
    digest: str | None = None    # "sha256:<64 hex>"

    @property
    def registry(self) -> str:
        """HOST[:PORT], as registries, `docker login` and credential files name it."""
        return f"{self.host}:{self.port}" if self.port else self.host

    @property
    def reference(self) -> str | None:
        """What the manifest is fetched by: the digest when given (it pins the bytes), else the tag."""
        return self.digest or self.tag

    @property
    def loopback(self) -> bool:
        return self.host in LOOPBACK

    def with_reference(self, tag: str | None = None, digest: str | None = None) -> "Ref":
        return Ref(self.host, self.port, self.repository, tag, digest)

    def __str__(self) -> str:
        return f"{SCHEME}{self.registry}/{self.repository}" + (f":{self.tag}" if self.tag else "") + (
            f"@{self.digest}" if self.digest else "")


def is_ref(text) -> bool:
    return isinstance(text, str) and text.startswith(SCHEME)


def parse_ref(text: str, need_reference: bool = True, what: str = "reference") -> Ref:
    """`text` as a Ref; UserError naming the part when it is not one. `need_reference`: a tag or digest
    must be given (push and pull name one; a remote cache names only the repository)."""
    def bad(part: str, why: str):
        raise UserError(f"{text!r}: not a registry {what}: {part} {why} (expected oci://HOST[:PORT]/REPO[:TAG|"
                        f"@sha256:DIGEST], e.g. {EXAMPLE})")
    if not is_ref(text):
        bad("the scheme", "is not oci://")
    rest = text[len(SCHEME):]
    where, slash, path = rest.partition("/")
    if not slash or not path:
        bad("the repository", "is missing (after HOST/)")
    host, port = where, None
    m = re.fullmatch(r"(.*?)(?::([0-9]*))?", where) if not where.startswith("[") else \
        re.fullmatch(r"(\[[^\]]*\])(?::([0-9]*))?", where)
    if m:
        host, port_text = m.group(1), m.group(2)
        if port_text is not None:
            if not port_text or not 0 < int(port_text) < 65536:
                bad("the port", f"{port_text!r} is not a port number (1-65535)")
            port = int(port_text)
    if not host or not _HOST.fullmatch(host):
        bad("the host", f"{host!r} is not a host name or address")
    digest = tag = None
    if "@" in path:
        path, _, digest = path.partition("@")
        if not _DIGEST.fullmatch(digest):
            bad("the digest", f"{digest!r} is not sha256: and 64 lower-case hex digits")
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, _, tag = path.rpartition(":")
        if not _TAG.fullmatch(tag):
            bad("the tag", f"{tag!r} is not 1-128 letters, digits, '_', '.' or '-' (not starting with '.' or '-')")
    for part in path.split("/"):
        if not _COMPONENT.fullmatch(part):
            bad("the repository", f"{path!r} has the part {part!r}: lower-case letters and digits, "
                                  "joined by '.', '_', '__' or '-'")
    if len(f"{host}/{path}") > 255:
        bad("the repository", "is longer than 255 characters with its host")
    if need_reference and not (tag or digest):
        bad("the tag", "is missing (add :TAG or @sha256:DIGEST)")
    return Ref(host.lower(), port, path, tag, digest)
