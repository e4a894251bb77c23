"""Verifying speculative drafts: which rows a chunk with drafts samples, and which drafts stay.

A chunk with k drafts computes 1 + k rows: its last token's and each draft's. Row i predicts
the token after drafts[:i], so it is sampled as a chunk of its own whose outputs are the
sequence's outputs followed by drafts[:i] (`expand`): penalties, min_tokens, logprobs and the
seeded draw's position (worker/sampler.py: (seed, number of outputs)) are exactly what plain
decoding would use at that position. `accept` keeps drafts while each equals the token its
row sampled, and ends with the first row's token that differs (or the token after the last
draft when all were kept).

Why that is the standard rejection rule. An n-gram draft is a point mass on d. The rule:
accept d with probability p(d), where p is the row's processed target distribution (after
penalties, temperature, top-k/top-p/min-p), and on rejection sample from p with d removed,
renormalized; after all k accepted, sample the bonus token from p. Sampling t from p with
the row's uniform u and accepting iff t == d is that rule: P(accept) = P(t = d) = p(d), and
given t != d, t is distributed as p restricted to tokens other than d, renormalized. So the
output distribution is the target's, and since every row is drawn exactly as plain decoding
draws that position (greedy: the argmax; seeded: the uniform of (seed, position)), the
tokens are the same as without speculation for greedy and for seeded requests: a failover
continuation stays exact however a position was produced.
"""

from __future__ import annotations

from zeroserve.worker.plan import SampledToken, ScheduledChunk


def expand(chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[int]]:
    """The chunks to sample, one per row: each chunk as it is, or a chunk with k drafts as
    1 + k row chunks; and how many rows each chunk took (1 + its number of drafts)."""
    rows: list[ScheduledChunk] = []
    counts: list[int] = []
    for chunk in chunks:
        drafts = chunk.draft_token_ids
        if not drafts:
            rows.append(chunk)
            counts.append(1)
            continue
        outputs = chunk.output_token_ids
        for i in range(len(drafts) + 1):
            # Only the fields the sampler reads: params, request id and the token history.
            rows.append(ScheduledChunk(chunk.request_id, [], chunk.start_pos + i, [], True,
                                       chunk.params, chunk.prompt_token_ids,
                                       outputs + drafts[:i] if i else outputs))
        counts.append(len(drafts) + 1)
    return rows, counts


def accept(chunks: list[ScheduledChunk], counts: list[int],
           sampled: list[SampledToken]) -> list[SampledToken]:
    """One SampledToken per chunk from the rows' tokens (in `expand`'s order): a chunk with
    drafts gets the drafts its rows agreed with as accepted_token_ids, and the token of the
    first row that disagreed (or of the last row) as its token."""
    out: list[SampledToken] = []
    row = 0
    for chunk, count in zip(chunks, counts, strict=True):
        if count == 1:
            out.append(sampled[row])
            row += 1
            continue
        drafts = chunk.draft_token_ids or []
        num_accepted = 0
        while num_accepted < len(drafts) and \
                sampled[row + num_accepted].token_id == drafts[num_accepted]:
            num_accepted += 1
        kept = sampled[row:row + num_accepted]
        final = sampled[row + num_accepted]
        final.accepted_token_ids = [s.token_id for s in kept]
        if final.logprob is not None:
            final.accepted_logprobs = [(s.logprob, list(s.top_logprobs or [])) for s in kept]
        out.append(final)
        row += count
    return out
