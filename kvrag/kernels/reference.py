"""PyTorch references of kvrag's kernels: the CPU path and the test oracle of the Triton kernels.

Conventions: heads first, ``x [heads, T, D]``; positions are int64 tensors; RoPE pairs dimension
``i`` with ``i + D/2`` (the split-halves pairing of Llama, Mistral and Qwen2 in transformers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "rope_rotate_ref",
    "rope_rotate_into_ref",
    "signed_sin",
    "contiguous_tail",
    "attention_ref",
    "tail_attention",
    "aligned_attention",
    "kv_deviation_ref",
    "topk_ref",
    "QUERY_BLOCK",
]

#: Selected queries are attended in position-ordered blocks of this many rows, each block against
#: the key prefix it can see (keys up to its last position) instead of the whole sequence.
QUERY_BLOCK = 64
#: Rows that cover much of the sequence are cheaper as one causal pass over every position up to
#: the last row (the other queries zero, their outputs dropped): SDPA's causal path skips the
#: masked half without reading a mask. Taken when that pass's query-key pairs (n^2/2) are at most
#: this many times the blocks' (rows x keys each block reads). Measured here (bf16, 2 cores, 3.9K
#: keys, rows in 16-token runs): equal at 71% of the positions (ratio 1.4); one causal pass 1.5x
#: faster at 86% (a blend with one chunk cached of six), the blocks 3.7x faster at 18% (a 15% blend).
CAUSAL_PAIRS_FACTOR = 1.4
#: :func:`aligned_attention`: PyTorch's CPU flash attention's block of keys; and the keys from
#: which rows take it (below, padding to a whole block costs more: a 274-token full prefill 1.08x).
KEY_BLOCK = 512
ALIGNED_MIN_KEYS = 1024


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``[-sin1, sin2]`` of sin ``[..., D]`` split in halves."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope_rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [heads, T, D] by the angles whose cos/sin [T, D] are given.

    Applied to keys stored without RoPE (kvrag's store), this places them at the positions of
    ``cos``/``sin``.

    transformers' ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``, computed
    as ``x * cos + [x2, x1] * [-sin1, sin2]``: the same products (a sign moves from one factor to
    the other) summed in the same order, so the same bits, with the sign flipped on the [T, D]
    table instead of on x and ``[x2, x1]`` a roll of x's last dimension.
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin(sin)


def rope_rotate_into_ref(
    out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, signed: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[...] = rope_rotate_ref(x, cos, sin)``, bit for bit, written into ``out`` (a view of a
    KV buffer, say): one temporary of x's size instead of four and a copy. ``signed``:
    ``[-sin1, sin2]`` made once for many calls (:func:`signed_sin`), else made here."""
    torch.mul(x, cos, out=out)
    return out.add_(x.roll(x.shape[-1] // 2, -1).mul_(signed_sin(sin) if signed is None else signed))


def positions_span(q_pos: torch.Tensor) -> tuple[int, int]:
    """The first and last of positions ``q_pos`` [T>0] as Python ints (read from the device)."""
    return int(q_pos[0]), int(q_pos[-1])


def contiguous_tail(first: int, last: int, rows: int, keys: int) -> bool:
    """Whether query rows at positions ``first``..``last`` (increasing) are the last ``rows`` of
    ``keys`` positions: a prefill's or a decode step's rows, not rows scattered through the keys."""
    return last - first + 1 == rows and last == keys - 1


def attention_ref(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    block: int = QUERY_BLOCK,
    masks: dict[int, tuple[int, torch.Tensor]] | None = None,
    window: int | None = None,
    span: tuple[int, int] | None = None,
    split_tail: bool = False,
    decode: bool = False,
) -> torch.Tensor:
    """Causal attention of query rows at given positions over a full KV sequence.

    Args:
        q: [H, Tq, D] queries (RoPE applied), rows sorted by position.
        q_pos: [Tq] int64 positions of the rows, strictly increasing.
        k: [Hkv, S, D] keys of positions 0..S-1 (RoPE applied); H a multiple of Hkv.
        v: [Hkv, S, D] values.
        scale: softmax scale.
        block: query rows per block.
        masks: a cache of the blocks' masks, filled on first use: pass the same dict to calls with
            the same ``q_pos``, ``block`` and ``window`` (every layer of a kind in a pass) and a new
            one when they change.
        window: sliding-window attention: row i sees only keys (q_pos[i] - window, q_pos[i]]
            (each block then reads at most ``window + block`` keys); None for global attention.
        span: ``(q_pos[0], q_pos[-1])`` as Python ints when the caller knows them (not read from
            ``q_pos``: on a GPU that read waits for the queued kernels).
        split_tail: rows at the end of the keys after cached ones go through :func:`tail_attention`
            on a CPU (a deterministic prefill's slices); otherwise they take the paths that give one
            pass's bits where those apply (ratio 1.0 and a prefix hit equal the full prefill).
        decode: a decode step's row (one row over its sequence: no padding); a prefill's rows from
            :data:`ALIGNED_MIN_KEYS` keys on a CPU, one row too, take :func:`aligned_attention`.

    Returns:
        [H, Tq, D]; row i attends to keys 0..q_pos[i] (the last ``window`` of them with a window).
    """
    tq, s = q.shape[1], k.shape[1]
    if tq == 0:
        return q.new_empty(q.shape)
    gqa = q.shape[0] != k.shape[0]
    first, last = span if span is not None else positions_span(q_pos)
    if window is not None and last < window:
        window = None  # every row sees all the keys before it anyway
    if window is None and contiguous_tail(first, last, tq, s):  # plain causal attention
        if not decode and s >= ALIGNED_MIN_KEYS and not split_tail and q.device.type == "cpu":
            return aligned_attention(q, k, v, scale, masks)
        if tq == s:
            return F.scaled_dot_product_attention(
                q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=gqa
            )[0]
        if tq == 1:
            return one_row(q, k, v, scale)
        if split_tail and q.device.type == "cpu":
            return tail_attention(q, k, v, scale)
        if first <= tq:  # a short cached prefix before the rows: pad the queries to a square causal
            # call (its fast path skips masked blocks); wastes first^2/2 of work, less than masking
            padded = torch.cat((q.new_zeros(q.shape[0], first, q.shape[2]), q), dim=1)
            return F.scaled_dot_product_attention(
                padded[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=gqa
            )[0, :, first:]
    if window is not None and tq == 1:  # decoding on a sliding-window layer: the last keys only
        lo = max(0, first - window + 1)
        return one_row(q, k[:, lo : first + 1], v[:, lo : first + 1], scale)
    if window is None and _one_causal_pass(q_pos, first, last, block):
        n = last + 1
        padded = q.new_zeros(q.shape[0], n, q.shape[2])
        padded[:, q_pos] = q
        return F.scaled_dot_product_attention(
            padded[None], k[None, :, :n], v[None, :, :n], is_causal=True, scale=scale, enable_gqa=gqa
        )[0, :, q_pos]
    masks = {} if masks is None else masks
    out = torch.empty_like(q)
    consecutive = last - first + 1 == tq
    for start in range(0, tq, block):
        cached = masks.get(start)
        if cached is None or cached[1].dtype != q.dtype:  # additive: SDPA would convert a bool mask on every call
            pos = q_pos[start : start + block]
            if consecutive:  # the block's first and last position without a read from the device
                low, high = first + start, first + start + pos.numel() - 1
            else:
                low, high = int(pos[0]), int(pos[-1])
            lo = 0 if window is None else max(0, low - window + 1)
            keys = torch.arange(lo, high + 1, device=q.device)
            hidden = keys[None, :] > pos[:, None]
            if window is not None:
                hidden |= keys[None, :] <= pos[:, None] - window
            mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
            cached = masks[start] = (lo, mask)
        lo, mask = cached
        end = lo + mask.shape[1]
        out[:, start : start + block] = F.scaled_dot_product_attention(
            q[None, :, start : start + block],
            k[None, :, lo:end],
            v[None, :, lo:end],
            attn_mask=mask,
            scale=scale,
            enable_gqa=gqa,
        )[0]
    return out


def aligned_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, masks: dict | None = None
) -> torch.Tensor:
    """The last ``T`` positions' rows q [H, T, D] over all of k/v [Hkv, S, D] (S >= T), causal, with
    every row's bits a function of its position and the keys before it only: a prompt's full
    prefill, the same prompt's rows after an exact prefix computed by another, longer or shorter,
    prompt, and the rows of any other split give the same bits (the default engine's exact reuse is
    identical to the full prefill; ``deterministic`` slices are the other way).

    PyTorch's CPU flash attention walks the keys in blocks of :data:`KEY_BLOCK`, the last of them cut
    at the sequence's end, and multiplies a block of queries at a time, a block of one to three rows
    rounding unlike a larger one; both make a row's result depend on the prompt's length. Here the
    keys are zero-padded to a whole block (masked for every row: they add exact zeros) and the
    queries by up to 3 rows (:func:`whole_row_blocks`; their outputs dropped). Rows from the start
    (a full prefill; a short cached prefix pads the queries at the front) take one causal call;
    rows after a longer cached prefix one call with a mask, which takes the same blocks.

    :func:`attention_ref` takes it on a CPU from :data:`ALIGNED_MIN_KEYS` keys: RAG prompts. Measured
    on a 2-core AMD EPYC (bf16, bundled SmolLM2, a full prefill paired with one plain causal call):
    1.012x at 3,552 tokens, 1.017x at 1,154; 1.08x at 274 and 590 (not taken there); a new question's
    ~20 rows after cached documents +4 to +12 ms (1.06-1.13x: they read the padded keys). Bits identical
    to the prefix of a longer pass and to the rows after any cached prefix (random inputs, bf16 and
    float32); the linear layers' rows are the same bits in any row count there (measured).
    """
    tq, s = q.shape[1], k.shape[1]
    first = s - tq
    gqa = q.shape[0] != k.shape[0]
    n = -(-s // KEY_BLOCK) * KEY_BLOCK
    if n > s:
        k, v = F.pad(k, (0, 0, 0, n - s)), F.pad(v, (0, 0, 0, n - s))
    if first <= tq:  # one causal call from position 0: wastes first^2/2 of work, less than a mask
        rows = whole_row_blocks(s)
        padded = F.pad(q, (0, 0, first, rows - s)) if rows > tq else q  # a full prefill seldom needs a copy
        out = F.scaled_dot_product_attention(
            padded[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=gqa
        )
        return out[0, :, first:s]
    rows = whole_row_blocks(tq)
    masks = {} if masks is None else masks
    mask = masks.get("aligned")
    if mask is None or mask.dtype != q.dtype or mask.shape != (rows, n):
        pos = torch.arange(first, first + rows, device=q.device).clamp_(max=s - 1)[:, None]
        hidden = torch.arange(n, device=q.device)[None, :] > pos
        mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
        masks["aligned"] = mask
    padded = F.pad(q, (0, 0, 0, rows - tq)) if rows > tq else q
    out = F.scaled_dot_product_attention(padded[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0, :, :tq]


def whole_row_blocks(rows: int) -> int:
    """``rows`` or a few more, so that PyTorch's CPU flash attention cuts no block of 1-3 query rows
    (its row blocks: 32 rows under 192 queries, 64 under 768, else 256): such a block's products round
    unlike a larger block's (measured, bf16 and float32)."""
    while (rows % (32 if rows < 192 else 64 if rows < 768 else 256)) in (1, 2, 3):
        rows += 1
    return rows


def tail_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The last ``T`` positions' rows q [H, T, D] over all of k/v [Hkv, S, D] (S > T), causal: no mask.

    Two fused calls of PyTorch's CPU flash attention, each returning its rows' log-sum-exp: one
    without a mask over the ``S - T`` keys before the rows, one causal (``is_causal``: the kernel
    skips the masked half) over the rows' own ``T`` keys; the two outputs are weighed by their shares
    of the softmax's mass, in float32. Rows after cached KV (an exact prefix, a deterministic
    prefill's slice: :mod:`kvrag.engine.reuse.slices`) otherwise took blocks of rows with a mask
    materialised per block over every key before them. Measured on a 2-core AMD EPYC (bf16, one
    thread's CPU time, shared): the attention of a 3,720-token prompt's 256-row slices (SmolLM2's
    heads, random inputs) 1.07x one causal pass over it, against 1.23x for the masked blocks; the
    whole sliced prefill 1.08x one pass, against 1.16x (docs/journal/exact-reuse.md). The result is
    within a rounding of the output's dtype of one pass (two outputs rounded, then merged), and a
    function of the inputs and their shapes only (a slice computes the same bits in any prompt).
    """
    first = k.shape[1] - q.shape[1]
    attend = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    before, lse_before = attend(q[None], k[None, :, :first], v[None, :, :first], 0.0, False, scale=scale)
    own, lse_own = attend(q[None], k[None, :, first:], v[None, :, first:], 0.0, True, scale=scale)
    lse = torch.logaddexp(lse_before, lse_own)  # [1, H, T]
    out = before[0].float().mul_((lse_before - lse)[0, :, :, None].exp_())
    out.addcmul_(own[0].float(), (lse_own - lse)[0, :, :, None].exp_())
    return out.to(q.dtype)


def one_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row q [H, 1, D] over all of k/v [Hkv, S, D] (a decode step's row: no mask).

    Each KV head's G = H / Hkv queries go in as G query rows of one head (``[1, Hkv, G, D]``), so
    PyTorch's fused attention reads each key and value once for the G queries, in the buffer's own
    dtype (its CPU kernel takes a bfloat16 row's scores and softmax in float32). Measured on a 2-core AMD
    EPYC with AVX512-BF16 and no AMX, 3.6K keys, all layers of a step, one thread's CPU time: the
    Qwen2.5-1.5B's shapes 26.7 ms against 39.7 ms for float32 products over a float32 copy of the
    keys (the decoder's former path, which also kept that copy: twice the sequence's KV) and 267 ms
    for ``enable_gqa`` with one query row per head; SmolLM2's 22.3 against 20.9 ms; the error against
    a float64 reference that of the output's rounding (docs/journal/real-models.md, "The decode step").
    """
    heads, kv_heads, d = q.shape[0], k.shape[0], q.shape[-1]
    # a row sliced from a step's rows (a draft's) is a strided view: made contiguous, as a lone row is
    folded = q.contiguous().view(kv_heads, heads // kv_heads, d)  # query head h reads KV head h // G
    return F.scaled_dot_product_attention(folded[None], k[None], v[None], scale=scale)[0].view(heads, 1, d)


def block_ends(q_pos: torch.Tensor, first: int, last: int, block: int) -> list[int]:
    """The last position of each block of ``block`` rows; consecutive rows' without a read."""
    if last - first + 1 == q_pos.numel():
        ends = list(range(first + block - 1, last, block))
    else:
        ends = q_pos[block - 1 :: block].tolist()
    if len(ends) * block < q_pos.numel():
        ends.append(last)
    return ends


def _one_causal_pass(q_pos: torch.Tensor, first: int, last: int, block: int) -> bool:
    """Whether one causal pass over positions [0, last] reads fewer query-key pairs, weighed by
    :data:`CAUSAL_PAIRS_FACTOR`, than the blocks of ``block`` rows each against its key prefix."""
    ends = block_ends(q_pos, first, last, block)
    blocks = sum(min(block, q_pos.numel() - i * block) * (end + 1) for i, end in enumerate(ends))
    return (last + 1) * (last + 2) / 2 <= CAUSAL_PAIRS_FACTOR * blocks


def kv_deviation_ref(
    k_new: torch.Tensor, k_old: torch.Tensor, v_new: torch.Tensor, v_old: torch.Tensor, what: str = "kv"
) -> torch.Tensor:
    """Per-token squared L2 deviation between fresh and cached KV.

    Args:
        k_new, k_old, v_new, v_old: [Hkv, T, D].
        what: ``k``, ``v`` or ``kv`` (the sum of both).

    Returns:
        [T] float32.
    """
    dev = None
    if what in ("k", "kv"):
        dev = (k_new.float() - k_old.float()).pow(2).sum(dim=(0, 2))
    if what in ("v", "kv"):
        dv = (v_new.float() - v_old.float()).pow(2).sum(dim=(0, 2))
        dev = dv if dev is None else dev + dv
    if dev is None:
        raise ValueError(f"unknown deviation {what!r}")
    return dev


def topk_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, in increasing index order (ties: lower index first)."""
    k = max(0, min(int(k), scores.shape[0]))
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    return torch.sort(torch.topk(scores, k, sorted=False).indices).values
