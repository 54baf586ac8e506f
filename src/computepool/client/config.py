"""Where the client finds its server, token and CA: flags > environment > the file `cpool login` writes."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from computepool.core.errors import InvalidInput
from computepool.core.servers import ServerArg, join_servers, split_servers

DEFAULT_SERVER = "http://127.0.0.1:8470"
ENV_SERVER = "CPOOL_SERVER"
ENV_TOKEN = "CPOOL_TOKEN"
ENV_CONFIG = "CPOOL_CONFIG"
ENV_CA = "CPOOL_CA"
_SAVED = ("server", "token", "ca")


@dataclass(frozen=True)
class ClientConfig:
    server: str  # one URL, or several comma-separated (replicas of one control plane)
    token: str | None
    ca: str | None = None  # PEM file of the CA (or the self-signed certificate) an https server must match

    @property
    def servers(self) -> tuple[str, ...]:
        return split_servers(self.server)


def config_path(env: Mapping[str, str] | None = None) -> Path:
    """`$CPOOL_CONFIG`, else `~/.config/computepool/config.json`."""
    env = os.environ if env is None else env
    explicit = env.get(ENV_CONFIG)
    if explicit:
        return Path(explicit).expanduser()
    return Path("~/.config/computepool/config.json").expanduser()


def load_config(path: Path) -> dict[str, str]:
    """The saved server and token; an absent file is an empty config, a corrupt one an error."""
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise InvalidInput(
            str(path), f"not valid JSON ({e.msg} at line {e.lineno}); run `cpool login`"
        ) from None
    if not isinstance(data, dict):
        raise InvalidInput(str(path), "expected a JSON object; run `cpool login`")
    return {k: v for k, v in data.items() if k in _SAVED and isinstance(v, str)}


def resolve_config(
    server: ServerArg = None,
    token: str | None = None,
    env: Mapping[str, str] | None = None,
    ca: str | None = None,
) -> ClientConfig:
    """Each setting from the first place that has it: the argument, the environment, the file.

    `server` (and $CPOOL_SERVER, and the saved one) may name several URLs, comma-separated or as a
    list: the replicas of one control plane. The saved CA only goes with the saved servers: a
    server named elsewhere needs its own CA.
    """
    env = os.environ if env is None else env
    server = join_servers(split_servers(server)) or None
    saved: dict[str, str] = {}
    if (
        not (server or env.get(ENV_SERVER))
        or not (token or env.get(ENV_TOKEN))
        or not (ca or env.get(ENV_CA))
    ):
        saved = load_config(config_path(env))
    chosen_server = join_servers(
        split_servers(server or env.get(ENV_SERVER) or saved.get("server") or DEFAULT_SERVER)
    )
    if not chosen_server:
        raise InvalidInput("server", "no control plane URL given")
    chosen_token = token or env.get(ENV_TOKEN) or saved.get("token") or None
    saved_ca = (
        saved.get("ca")
        if saved.get("server") and join_servers(split_servers(saved["server"])) == chosen_server
        else None
    )
    chosen_ca = ca or env.get(ENV_CA) or saved_ca or None
    if chosen_ca is not None:
        chosen_ca = str(Path(chosen_ca).expanduser().absolute())
    return ClientConfig(server=chosen_server, token=chosen_token, ca=chosen_ca)


def save_config(cfg: ClientConfig, env: Mapping[str, str] | None = None) -> Path:
    """Write server + token readable by the owner only (0600), in a 0700 folder when we create it.

    The file is created with its final mode (no window where the token is world-readable) and
    replaced atomically, so a crash never leaves half a config.
    """
    path = config_path(env)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)  # an existing tmp file keeps its mode otherwise
            doc = {"server": cfg.server, "token": cfg.token}
            if cfg.ca:
                doc["ca"] = cfg.ca
            json.dump(doc, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
