"""Container image references: registry names only, never a transport or a path.

podman reads `docker-archive:/some/file`, `oci:/dir`, `dir:…`, `containers-storage:…` as places on
the node to read an image from. A root agent that passed such a string on would read files a tenant
names, and an archive's tags would rename images other tenants run. So a job names an image the way
a registry does (`[registry[:port]/]path[:tag][@sha256:…]`, the distribution grammar), and nothing
else: a name that starts with a transport is refused even where the grammar would read it as a
short name (`oci:latest`), with a message that says how to write a registry image instead.

`canonical` spells a reference the one way the pool compares and stores it: the registry always
written (docker.io when none is), `library/` for docker.io's official images, `:latest` when neither
tag nor digest is given. A short name is never searched in several registries: it means docker.io.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from computepool.core.errors import InvalidInput

MAX_REF_LEN = 255
DEFAULT_REGISTRY = "docker.io"
# every transport containers/image knows (podman pull/run would read these as places, not names)
TRANSPORTS = frozenset(
    {
        "containers-storage",
        "dir",
        "docker",
        "docker-archive",
        "docker-daemon",
        "oci",
        "oci-archive",
        "ostree",
        "sif",
        "tarball",
    }
)
_DOMAIN_PART = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_DOMAIN = rf"{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*(?::[0-9]{{1,5}})?"
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REF = re.compile(
    rf"^(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_PATH_PART}(?:/{_PATH_PART})*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(?:@(?P<digest>sha256:[a-f0-9]{64}))?$"
)
DIGEST = re.compile(r"^sha256:[a-f0-9]{64}$")
_FORM = "[registry[:port]/]name[:tag][@sha256:<64 hex digits>], e.g. docker.io/library/python:3.12"


@dataclass(frozen=True)
class ImageName:
    """One parsed reference; `registry` is None where the reference named none (docker.io then)."""

    registry: str | None
    path: str
    tag: str | None
    digest: str | None

    @property
    def repository(self) -> str:
        """Registry and path, spelled canonically: what an allowed-registry entry is matched against."""
        registry = self.registry or DEFAULT_REGISTRY
        if registry == DEFAULT_REGISTRY and "/" not in self.path:
            return f"{registry}/library/{self.path}"
        return f"{registry}/{self.path}"

    @property
    def canonical(self) -> str:
        tag = self.tag if self.tag is not None or self.digest is not None else "latest"
        return self.repository + (f":{tag}" if tag else "") + (f"@{self.digest}" if self.digest else "")


def parse_image(ref: str, where: str = "image") -> ImageName:
    """`ref` parsed as a registry reference; InvalidInput naming `where` for anything else."""
    if not ref or len(ref) > MAX_REF_LEN:
        raise InvalidInput(where, f"an image reference has 1 to {MAX_REF_LEN} characters")
    head = ref.split(":", 1)[0]
    if ":" in ref and "/" not in head and "." not in head and head.lower() in TRANSPORTS:
        raise InvalidInput(
            where, f"{_shown(ref)} names the {head}: transport; only registry images are accepted ({_FORM})"
        )
    m = _REF.match(ref)
    if m is None:
        raise InvalidInput(where, f"{_shown(ref)} is not a registry image reference ({_FORM})")
    registry, path = m["domain"], m["path"]
    if registry is not None and not _is_registry(registry):
        registry, path = None, f"{registry}/{path}"  # `library/python`: a path, not a host
        if not re.fullmatch(rf"{_PATH_PART}(?:/{_PATH_PART})*", path):
            raise InvalidInput(where, f"{_shown(ref)} is not a registry image reference ({_FORM})")
    return ImageName(registry=registry, path=path, tag=m["tag"], digest=m["digest"])


def registry_allowed(name: ImageName, allowed: tuple[str, ...]) -> bool:
    """The image's repository is under one of `allowed` (a registry, or a registry and a path prefix)."""
    repo = name.repository
    return any(repo == a or repo.startswith(a.rstrip("/") + "/") for a in allowed)


def _is_registry(first: str) -> bool:
    """The docker rule: a first component with a dot or a port, or `localhost`, is a registry host."""
    return "." in first or ":" in first or first == "localhost" or first != first.lower()


def _shown(ref: str) -> str:
    """The reference as an error quotes it: printable and short (never a file's contents)."""
    clean = "".join(c if c.isprintable() else "?" for c in ref)
    return repr(clean[:80] + ("…" if len(clean) > 80 else ""))
