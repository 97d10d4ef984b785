"""Log-prob op: compute_logprobs, the engine side of verification (`algo.verify_on: engine`).

After a weight update, the controller asks for the log-probs of the responses it carries over under the new
weights, while they wait (paused, or held while the rest of the server generates). Each response is prefilled
(prompt + its cached tokens, nothing sampled) and the log-probs of its tokens come back; its KV stays in SGLang's
prefix cache, so resuming it from any kept prefix prefills only what follows (the weight update flushed the
cache, so that prefill is the one resuming needs anyway). It changes no response.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from sglang_ext.dispatch import Handler, Reply
from sglang_ext.engine import PrefillRequest
from sglang_ext.protocol import ComputeLogprobsBody, ErrorCode, Message, ProtocolError

if TYPE_CHECKING:
    from sglang_ext.server import ControlServer

# SGLang's input log-probs are log_softmax(logits): they equal the sampled tokens' log-probs only for these
UNTEMPERED = (0.0, 1.0)


class LogprobHandlers:
    def __init__(self, server: ControlServer):
        self.server = server
        self.records = server.records
        self._calls = 0  # engine request ids carry it: unique per call, never a generation's

    def handlers(self) -> dict[str, Handler]:
        return {"compute_logprobs": self.compute_logprobs}

    async def compute_logprobs(self, body: ComputeLogprobsBody, msg: Message) -> Reply:
        """Log-probs of every token of each named response under the served weights (docs/protocol.md)."""
        recs = self.records
        recs.require_whole_weights("compute_logprobs")
        if body.expect_version is not None and body.expect_version != recs.version:
            raise ProtocolError(
                ErrorCode.VERSION_MISMATCH,
                f"compute_logprobs expects weights version {body.expect_version} but the server serves "
                f"{recs.version}",
            )
        if len(set(body.rids)) != len(body.rids):
            dup = sorted(r for r, n in Counter(body.rids).items() if n > 1)
            raise ProtocolError(ErrorCode.INVALID, f"compute_logprobs names response(s) {dup[:10]} more than once")
        targets = recs.lookup(body.rids)
        recs.require_not_running(targets, "compute_logprobs")
        tempered = [(r.rid, r.sampling.temperature) for r in targets if r.sampling.temperature not in UNTEMPERED]
        if tempered:
            rid, t = tempered[0]
            raise ProtocolError(
                ErrorCode.INVALID,
                f"response {rid} was sampled at temperature {t} ({len(tempered)} such): SGLang's input log-probs "
                "are untempered, so only responses sampled at temperature 1 or 0 (greedy) can be verified on the "
                "engine; compute theirs on the trainer. Nothing was computed",
                {"rids": [r for r, _ in tempered[:100]]},
            )
        t0 = time.perf_counter()
        self._calls += 1
        requests = [
            PrefillRequest(f"{r.rid}#lp{self._calls}", np.concatenate([r.prompt, r.tokens]).tolist(), len(r.prompt))
            for r in targets
        ]
        async with self.server.engine_calls.call():
            try:
                lps = await self.server.engine.input_logprobs(requests)
            except (RuntimeError, ValueError) as e:
                raise ProtocolError(ErrorCode.ENGINE_ERROR, f"compute_logprobs failed: {e}") from e
        counts = np.fromiter((len(x) for x in lps), np.int32, len(lps))
        reply = {
            "rids": list(body.rids),
            "version": recs.version,
            "tokens": int(counts.sum()),
            "engine_s": time.perf_counter() - t0,
        }
        flat = np.concatenate(lps) if lps else np.zeros(0, np.float32)
        return reply, {"counts": counts, "logprobs": flat.astype(np.float32, copy=False)}, None
