"""Builders the unit tests share: the engine's messages as a test writes them, with defaults.

One home for each builder, so a change of a message's fields is made once.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

from servectl import config as C
from servectl.wire import engine as EP


def delta(text: str = "", tokens: Iterable[int] = (), finish: str | None = None, *, rid: str = "r",
          index: int = 0, first: bool = False, echo: str | None = None, prompt: EP.PromptInfo | int | None = None,
          message: dict | None = None, reasoning_tokens: int | None = None, logprobs: list | None = None,
          stop_reason: str | int | None = None) -> EP.Delta:
    """One step's output for one choice (``index``) of request ``rid``.

    ``prompt``: the prompt's info (an int: that many prompt tokens); ``first``: this is the
    request's first delta, which carries a prompt of one token (and ``echo`` as its echoed text).
    """
    if first:
        prompt = EP.PromptInfo(tokens=1, echo_text=echo)
    elif isinstance(prompt, int):
        prompt = EP.PromptInfo(tokens=prompt)
    return EP.Delta(request_id=rid, index=index, text=text, token_ids=list(tokens), finish_reason=finish,
                    stop_reason=stop_reason, prompt=prompt, message=message, reasoning_tokens=reasoning_tokens,
                    logprobs=logprobs)


def config_file(tmp_path: Path, text: str) -> Path:
    """``text`` as a config file (servectl.toml) in ``tmp_path``."""
    path = tmp_path / "servectl.toml"
    path.write_text(text)
    return path


def config_from(tmp_path: Path, text: str) -> C.Config:
    """The config ``text`` loads to (as a file, as the CLI reads it)."""
    return C.load_config(config_file(tmp_path, text))[0]


def config_error(tmp_path: Path, text: str) -> str:
    """The error the config ``text`` is refused with (it must be refused)."""
    with pytest.raises(C.ConfigError) as exc:
        config_from(tmp_path, text)
    return str(exc.value)
