"""servectl: an LLM serving daemon whose manager owns and supervises every process.

Library use (see docs/library.md)::

    import servectl
    with servectl.Server(model="default") as srv:
        print(srv.generate(["def "], max_tokens=16))
"""

__version__ = "0.1.0"


def __getattr__(name):
    # The library API loads lazily so `python -m engine_core` etc. stay light.
    if name in ("Server", "connect", "ServerError"):
        from servectl import library

        return getattr(library, name)
    raise AttributeError(name)
