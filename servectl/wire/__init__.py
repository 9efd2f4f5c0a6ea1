"""Every message that crosses a process boundary, in one neutral package.

- ``control``: children and the CLI ⇄ the manager (control ROUTER);
- ``status``: the tree's state as the manager tells it: the parts of a status
  reply, and the events (PUB) that say each change;
- ``engine``: gateways ⇄ an engine (DEALER/ROUTER), one step's output per
  message;
- ``spawn``: what the manager hands a child at exec (``EngineSpec``,
  ``GatewaySpec``, a standby's ``Role``), descriptor references, and the
  component and socket-identity names, built and parsed here only;
- ``worker``: a worker's reply to a step that holds only sampled tokens
  (``TokensReply``).

This package depends on msgspec and ``servectl.config`` alone, so every
process kind imports it without importing another process's package (a unit
test enforces that boundary). The engine ⇄ worker hop is the one exception to
msgspec: signed pickles of vLLM's own objects (``engine_core/workers/signing.py``), for
every call and every reply but a ``TokensReply``.
"""
