"""A RequestOutput in TOKENS wire form (TokenOutput.wire_row): one row per stream per step.

WorkerLoop._emit (worker/process.py) writes the usual row (a stream's next tokens, nothing
optional) itself, in wire_row's order, and leaves the rest to to_wire; the checks below
fail at import if either order changes.
"""

from __future__ import annotations

from zeroserve.common.protocol import TokenOutput
from zeroserve.worker.outputs import RequestOutput


def to_wire(out: RequestOutput, attempt: int) -> list:
    """A TokenOutput in wire form (TokenOutput.wire_row): one per stream per step."""
    logprobs = out.logprobs
    if logprobs is not None:
        logprobs = [[lp, [[tid, tlp] for tid, tlp in top]] for lp, top in logprobs]
    prompt_logprobs = out.prompt_logprobs
    if prompt_logprobs is not None:
        prompt_logprobs = [[lp, [[tid, tlp] for tid, tlp in top]] for lp, top in prompt_logprobs]
    reason = out.finish_reason
    timings = out.timings
    return _wire_row(
        out.request_id, out.new_token_ids, None if reason is None else reason.value,
        out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens, logprobs,
        out.error, None if timings is None else list(timings), prompt_logprobs, attempt,
        out.error_code)


_wire_row = TokenOutput.wire_row

# WorkerLoop._emit unpacks every RequestOutput and writes most rows itself, in wire_row's
# order: both must stay as they are here.
if RequestOutput._fields != ("request_id", "new_token_ids", "finish_reason",
                             "num_prompt_tokens", "num_output_tokens", "num_cached_tokens",
                             "logprobs", "prompt_logprobs", "error", "timings", "error_code"):
    raise TypeError("RequestOutput's fields changed: update worker/process.py WorkerLoop._emit")
if _wire_row("r", [1], "stop", 2, 3, 4, None, "e", None, None, 5) != [
        "r", [1], "stop", 2, 3, 4, None, "e", None, None, 5]:
    raise TypeError("TokenOutput.wire_row's order changed: update worker/process.py WorkerLoop._emit")
