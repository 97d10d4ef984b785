"""The server's request handlers, one module per group of jobs: `generation` (submit, pause, resume, truncate, append, drop, events,
fetch; `submit` reads and checks a submit), `weights` (update_weights, update_weights_from_disk, flush),
`transport` (weights_group, update_weights_distributed, update_weights_ipc, memory), `logprobs`
(compute_logprobs), `admin` (stats, weights, health, shutdown).

An op group is a class built from the `ControlServer` (`Group(server)`) whose `handlers()` maps message types
to coroutines `handler(body, msg) -> (reply body, named buffers or None, raw frames or None)`. A handler reads
what it needs from the server's public parts (`server.records`, `server.engine`, `server.info`,
`server.engine_calls`, ...), checks the whole request first and raises `ProtocolError` before changing any
state; the dispatcher stamps and sends the reply.

Adding a group (e.g. a distributed weight transport, a prefill log-prob op):
1. its request body in `sglang_ext.protocol.BODIES` (and its type in `QUERY_TYPES` if it may run beside
   commands; otherwise it is a command: one at a time, in arrival order);
2. a module here with the group class;
3. one line: the class appended to `OP_GROUPS` in `sglang_ext/server.py`.
Every type in `BODIES` must have exactly one handler: the server refuses to start otherwise.
"""
