"""Where the configuration file is and reading it: ``--config``, else ``$SERVECTL_CONFIG``,
else the user's or the system's file, never the working directory (a file planted there must
not configure a daemon); then the TOML decoded and the rules applied.

The manager receives the effective config as JSON in a memfd (never on its command line: it
holds API keys and model envs) with the absolute path it came from, and re-reads exactly that
file on reload (none if it was started without one).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from servectl import paths
from servectl.config.rules import apply_overrides, explain, finalize
from servectl.config.schema import Config, ConfigError, Overrides


SYSTEM_CONFIG = Path("/etc/servectl/servectl.toml")
CONFIG_ENV = "SERVECTL_CONFIG"


def user_config_path(env: dict[str, str] | os._Environ = os.environ) -> Path:
    """``$XDG_CONFIG_HOME/servectl/servectl.toml`` (a relative XDG_CONFIG_HOME is ignored, as the spec says)."""
    base = env.get("XDG_CONFIG_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(env.get("HOME") or os.path.expanduser("~"), ".config")
    return Path(base) / "servectl" / "servectl.toml"


def config_candidates(explicit: str | os.PathLike | None, system: bool,
                      env: dict[str, str] | os._Environ = os.environ) -> tuple[Path, bool]:
    """Which file to read, and whether it must exist. Pure but for ``env``.

    An explicit ``--config``, then ``$SERVECTL_CONFIG`` (both must exist); else
    the system daemon's ``/etc/servectl/servectl.toml`` or a user daemon's
    ``$XDG_CONFIG_HOME/servectl/servectl.toml`` (``~/.config``), if there.
    Never the current directory.
    """
    if explicit:
        return Path(explicit), True
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]), True
    return (SYSTEM_CONFIG if system else user_config_path(env)), False


def is_system_daemon(runtime_dir: str | os.PathLike | None = None) -> bool:
    """The daemon in question is the system one: its runtime directory (flag, env, lookup) is
    /run/servectl, or we run as the service user."""
    return Path(os.path.abspath(paths.resolve_runtime_dir(runtime_dir))) == paths.SYSTEM_RUNTIME_DIR or \
        paths.service_uid() == os.geteuid()


def find_config_file(explicit: str | os.PathLike | None, system: bool | None = None) -> Path | None:
    path, required = config_candidates(explicit, is_system_daemon() if system is None else system)
    return path if required or path.is_file() else None


def load_config(path: str | os.PathLike | None = None, search: bool = True,
                system: bool | None = None) -> tuple[Config, Path | None]:
    """Read ``path``, or the file the lookup finds (``search``; else none: the built-in defaults)."""
    found = find_config_file(path, system) if path or search else None
    if found is None:
        cfg = Config()
    else:
        try:
            raw = found.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read config {found}: {exc.strerror}") from None
        try:
            cfg = msgspec.toml.decode(raw, type=Config)
        except msgspec.ValidationError as exc:
            raise ConfigError(explain(exc, found)) from None
        except msgspec.DecodeError as exc:
            raise ConfigError(f"config error in {found}: not valid TOML ({exc})") from None
    return finalize(cfg, found), found


def effective_config(path: str | os.PathLike | None, ov: Overrides, search: bool = True,
                     system: bool | None = None) -> tuple[Config, Path | None]:
    cfg, found = load_config(path, search, system)
    return apply_overrides(cfg, ov), found
