"""Which failures of an engine's start a restart cannot fix (docs/decisions.md).

An engine (or one of its workers) that cannot load its model because of a file
that is missing, an engine argument vLLM rejects, an architecture vLLM does not
support, or too little memory for the weights would fail the same way on every
restart. The engine tells the manager so (``EngineFailed`` with the one-line
reason from ``permanent_reason``, then exit ``ExitCode.PERMANENT``) and the group
fails at once. Anything else (a worker that died or hung, a network or device
error, an unknown RuntimeError) is a crash like any other: restarted with
backoff until the crash loop says ``failed``.

No vLLM or torch here: exceptions are judged by the names of their classes,
so a worker's exception is judged in the worker and travels as ``RemoteFailure``.
"""

from __future__ import annotations

from servectl.messages import one_line

# Classes (anywhere in the exception's MRO) whose instances at load time mean
# "fix the files, the arguments or the machine first".
PERMANENT_TYPES = frozenset({
    # missing or unreadable files, a hub id that is not there (offline: not cached)
    "FileNotFoundError", "NotADirectoryError", "IsADirectoryError", "PermissionError",
    "EntryNotFoundError", "LocalEntryNotFoundError", "RepositoryNotFoundError", "RevisionNotFoundError",
    "GatedRepoError", "SafetensorError",
    # invalid engine arguments and configs (pydantic's ValidationError and
    # huggingface_hub's HFValidationError are ValueErrors), unsupported
    # architectures ("Model architectures [...] are not supported"), a KV cache
    # that does not fit ("No available memory for the cache blocks")
    "ValueError", "TypeError", "NotImplementedError",
    # not enough memory for the weights
    "OutOfMemoryError", "MemoryError",
})
# Messages of otherwise generic errors (RuntimeError, OSError) that mean the same.
PERMANENT_PHRASES = (
    "cannot find any model weights",  # vLLM's default loader: no *.safetensors / *.bin
    "does not appear to have a file named",  # transformers: config or tokenizer file missing
    "is not a local folder and is not a valid model identifier",
    "out of memory",  # CUDA / torch allocators
    "can't allocate memory", "cannot allocate memory",  # torch's CPU allocator
    "reasoning parser could not locate",  # a reasoning parser whose tags the tokenizer lacks (vLLM's config)
)


def _chain(exc: BaseException):
    """The exception and what caused it (explicitly or while it was being handled)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def describe(exc: BaseException) -> str:
    """One line: the exception's class and the informative line of its message."""
    # vLLM lists every architecture it supports after saying which one it does not.
    text = one_line(str(exc).split(" Supported architectures:")[0])
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def permanent_reason(exc: BaseException) -> str | None:
    """The one-line reason if ``exc`` (raised while the engine starts) is one a
    restart cannot fix; None if it is a crash like any other."""
    for e in _chain(exc):
        if hasattr(e, "permanent"):
            # A worker's failure, judged where it happened (its text holds a traceback).
            if e.permanent:
                return e.permanent
            continue
        names = {cls.__name__ for cls in type(e).__mro__}
        text = str(e).lower()
        if names & PERMANENT_TYPES or any(phrase in text for phrase in PERMANENT_PHRASES):
            return describe(e)
    return None


class RemoteFailure(str):
    """A worker's error reply: its text (class, message, traceback) and,
    if a restart cannot fix it, the one-line reason judged in the worker."""

    permanent: str | None

    def __new__(cls, text: str, permanent: str | None = None) -> "RemoteFailure":
        obj = super().__new__(cls, text)
        obj.permanent = permanent
        return obj

    def __reduce__(self):
        return (RemoteFailure, (str(self), self.permanent))
