"""GEMM dimensions off the device's multiple for their dtype, traced back to their origin.

The multiple is device.multiple(dtype) (16 bytes, 128 bytes on A100-class parts; NVIDIA's
Matrix Multiplication Background guide). Weight dimensions are fixed in the config or the layer;
token dimensions (batch x seq) by padding the batch. Each fix is re-estimated: weight dims by
rewriting the trace (whatif.rewrite_dim), token dims and hidden sizes by re-tracing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from tilefit.advise.findings import MIN_RECOMMENDED_SPEEDUP, Finding, severity_of
from tilefit.advise.origins import TOKEN, WEIGHT, Origin, config_fields, nearest_aligned
from tilefit.advise.whatif import WhatIf
from tilefit.errors import TilefitError
from tilefit.estimator import Estimate
from tilefit.estimator.result import OpCost
from tilefit.gemm import analyze_gemm, round_up

# a misaligned dimension whose GEMMs take less than this share of the step is not worth a
# finding (its fix cannot gain more than the share itself)
MIN_TIME_SHARE = 0.001
HEAD_DIM_MULTIPLE = 8


@dataclass
class _Hit:
    value: int
    multiple: int
    dtype: str
    ops: list[OpCost]


def misaligned_dims(e: Estimate) -> dict[int, _Hit]:
    """Dimension value -> the steady-step GEMM ops that have it off the multiple."""
    hits: dict[int, _Hit] = {}
    for c, g, dt in e.gemms():
        mult = e.device.multiple(dt)
        for v in {g.m, g.n, g.k}:
            if v % mult:
                h = hits.setdefault(v, _Hit(v, mult, dt, []))
                h.multiple = max(h.multiple, mult)
                if c not in h.ops:
                    h.ops.append(c)
    return hits


def _factory_origin(w: WhatIf, value: int, ops: list[OpCost]) -> Origin:
    """For plain modules: the layer attribute (in_features, out_features, channels) holding it."""
    modules = _module_map(w)
    for c in ops:
        mod = modules.get(c.record.module)
        for attr in ("out_features", "in_features", "out_channels", "in_channels",
                     "num_embeddings", "embedding_dim"):
            if getattr(mod, attr, None) == value:
                return Origin(WEIGHT, attr, value)
    return Origin(WEIGHT, "dimension", value)


def _module_map(w: WhatIf) -> dict[str, Any]:
    cache = getattr(w, "_modules", None)
    if cache is None:
        cache = {}
        if w.workload is not None:
            import torch

            from tilefit.tracing.step import USER_CODE_ERRORS

            try:
                with torch.device("meta"):
                    model = w.workload.build()
                cache = dict(model.named_modules())
            except (TilefitError, *USER_CODE_ERRORS):
                # the trace built it on fake tensors; on the meta device a factory may still
                # fail (it reads a tensor's value), or a transformers model without SDPA
                # (traced with eager attention): no layer names then, the rest of the finding
                # stands
                cache = {}
        w._modules = cache  # type: ignore[attr-defined]
    return cache


def origin_of(w: WhatIf, value: int, ops: list[OpCost]) -> Origin:
    work = w.workload
    if work is not None and work.seq_len is not None:
        b = w.recipe.batch_size
        if value == b * work.seq_len:
            return Origin(TOKEN, "batch x seq", value)
        if value == work.seq_len:
            return Origin(TOKEN, "seq", value)
    if work is not None and work.task == "image-cls" and value % w.recipe.batch_size == 0:
        return Origin(TOKEN, "batch x patches", value)  # ViT: (B x patches+1) rows
    if work is not None and work.config is not None:
        for o in config_fields(work):
            if o.value == value:
                return o
        return Origin(WEIGHT, "dimension", value)
    return _factory_origin(w, value, ops)


def _modules(w: WhatIf, value: int, ops: list[OpCost], limit: int = 6) -> tuple[str, ...]:
    """The GEMMs' modules (slowest first), then other modules whose weights hold the value
    (a tied embedding)."""
    seen: list[str] = []
    for c in sorted(ops, key=lambda c: -c.time_s * c.repeats):
        m = c.record.module or "(loss, outside modules)"
        if m not in seen:
            seen.append(m)
    for r in w.trace.ops_of_step(1):
        if r.module and r.module not in seen and r.phase == "forward" and any(
                value in s for s in r.input_shapes):
            seen.append(r.module)
    return tuple(seen[:limit])


def _reason(w: WhatIf, hit: _Hit, after_step_s: float) -> str:
    by_phase: dict[str, float] = defaultdict(float)
    n_by_phase: dict[str, int] = defaultdict(int)
    for c in hit.ops:
        by_phase[c.record.phase] += c.time_s * c.repeats
        n_by_phase[c.record.phase] += 1
    top = max(hit.ops, key=lambda c: c.time_s)
    g = next(x for x in top.record.gemms if hit.value in (x.m, x.n, x.k))
    a = analyze_gemm(g.m, g.n, g.k, hit.dtype, w.device, batch=g.batch)
    phases = ", ".join(f"{n_by_phase[p]} in {p} ({by_phase[p] * 1e3:.2f} ms)"
                       for p in sorted(by_phase, key=lambda p: -by_phase[p]))
    total = sum(by_phase.values())
    return (f"{hit.value} is not a multiple of {hit.multiple} ({hit.dtype} on "
            f"{w.device.name}: {w.device.alignment_bytes}-byte rule); {len(hit.ops)} GEMM op(s) "
            f"hold it: {phases}, {total / w.estimate.step_time_s:.1%} of the step. "
            f"The largest, {g.m}x{g.n}x{g.k} ({top.record.module or 'loss'}, "
            f"{top.record.phase}), is {a.bound}-bound at {a.predicted_tflops:.0f} TFLOP/s "
            f"(alignment factor {a.alignment_efficiency:.2f}, tile efficiency "
            f"{a.tile_efficiency:.2f}, wave efficiency {a.wave_efficiency:.2f}).")


def _weight_fix(w: WhatIf, o: Origin, new: int, mult: int, modules: tuple[str, ...]) -> str:
    work = w.workload
    if o.dimension == "vocab_size":
        tied = bool(work.config.get("tie_word_embeddings", True)) if work.config else False
        return (f"model.resize_token_embeddings({o.value}, pad_to_multiple_of={mult}) (gives "
                f"{new}; from scratch: vocab_size={new} in the config). Token ids >= {o.value} "
                "are never produced by the tokenizer"
                + ("; the input embedding and the output head are tied, so this one change "
                   "pads both" if tied else ""))
    if o.config_field is not None and work is not None and work.config is not None:
        from tilefit.models import hf

        key = hf.canonical_field(work.config, o.config_field)
        extra = ""
        if o.dimension == "num_labels":
            extra = (f" and ignore logits {o.value}..{new - 1} (e.g. mask them to -inf before "
                     "the loss)")
        elif o.dimension != "num_labels":
            extra = " (changes the architecture: for training from scratch, not for pretrained "\
                    "weights)"
        if o.product:
            return (f"set {key}={o.field_value(new)} in the config (was "
                    f"{o.field_value(o.value)}; {o.dimension} = {new}){extra}")
        return f"set {key}={new} in the config (was {o.value}){extra}"
    lines = _layer_lines(w, o.value, new)
    if lines:
        return "; ".join(lines)
    return f"change the dimension {o.value} to {new} in the layers listed"


def _layer_lines(w: WhatIf, old: int, new: int) -> list[str]:
    """The constructor line of every layer that holds ``old``, with ``new`` in its place:
    `0: nn.Linear(1000, 4032)`, `2: nn.Linear(4032, 1000)` (a hidden width changes in the
    layer that makes it and the one that takes it)."""
    import torch.nn as nn

    out = []
    for path, mod in _module_map(w).items():
        if isinstance(mod, nn.Linear) and old in (mod.in_features, mod.out_features):
            i = new if mod.in_features == old else mod.in_features
            o = new if mod.out_features == old else mod.out_features
            bias = "" if mod.bias is not None else ", bias=False"
            out.append(f"{path or 'model'}: nn.Linear({i}, {o}{bias})")
        elif isinstance(mod, nn.Conv2d) and old in (mod.in_channels, mod.out_channels):
            i = new if mod.in_channels == old else mod.in_channels
            o = new if mod.out_channels == old else mod.out_channels
            out.append(f"{path or 'model'}: nn.Conv2d({i}, {o}, kernel_size="
                       f"{tuple(mod.kernel_size)}, ...)")
        elif isinstance(mod, nn.Embedding) and old in (mod.num_embeddings, mod.embedding_dim):
            n = new if mod.num_embeddings == old else mod.num_embeddings
            d = new if mod.embedding_dim == old else mod.embedding_dim
            out.append(f"{path or 'model'}: nn.Embedding({n}, {d})")
    return out


def _token_fix(w: WhatIf, o: Origin, mult: int) -> tuple[int, str, int]:
    """(new seq, fix text, pad_to_multiple_of): the sequence padded to the device's multiple
    (64 tokens for bf16 on A100-class parts, 8 elsewhere), so batch x seq is aligned for any
    batch size, the last partial batch included."""
    pad = mult
    seq = w.workload.seq_len
    new_seq = round_up(seq, pad)
    fix = (f"pad every batch to a multiple of {pad} tokens: DataCollatorWithPadding(tokenizer, "
           f"pad_to_multiple_of={pad}) (or tokenizer(..., padding='max_length', max_length="
           f"{new_seq})); the padding is masked out of the loss")
    return new_seq, fix, pad


def dimension_findings(w: WhatIf) -> list[Finding]:
    hits = misaligned_dims(w.estimate)
    step = w.estimate.step_time_s
    found: list[Finding] = []
    for value, hit in sorted(hits.items()):
        share = sum(c.time_s * c.repeats for c in hit.ops) / step
        if share < MIN_TIME_SHARE:
            continue
        if value == w.recipe.batch_size:
            continue  # one row per sample (pooler, classifier): the batch rules cover it
        o = origin_of(w, value, hit.ops)
        modules = _modules(w, value, hit.ops)
        if o.kind == TOKEN:
            if not w.can_retrace or w.workload.seq_len is None:
                continue  # image patches: fixed by the image and patch size, not padding
            new_seq, fix, _pad = _token_fix(w, o, hit.multiple)
            if new_seq == w.workload.seq_len:
                continue
            try:
                after = w.retrace(w.workload.with_seq_len(new_seq))
            except TilefitError:
                continue  # the padded length exceeds the model's positions
            rule, dim, cur, sug, method = ("sequence-length", o.dimension,
                                          w.workload.seq_len, new_seq, "retrace")
            dim = "seq" if o.dimension == "seq" else f"batch x seq ({w.recipe.batch_size} x "\
                f"{w.workload.seq_len})"
        else:
            new = nearest_aligned(value, hit.multiple, o.step)
            if o.dimension == "head_dim":
                # the fused attention kernels want a head_dim multiple of 8 (flash: <= 256;
                # tracing/attention.py); that, not the GEMM multiple, decides the kernel
                new = nearest_aligned(value, HEAD_DIM_MULTIPLE)
            if o.dimension == "hidden_size" or o.dimension.endswith("head_dim"):
                if not w.can_retrace or o.config_field is None:
                    continue
                try:
                    after = w.retrace(w.workload.with_config(
                        **{o.config_field: o.field_value(new)}))
                except TilefitError:
                    continue  # (e.g. hidden not divisible by heads): no what-if, no finding
                method = "retrace"
            else:
                after = w.with_dim(value, new)
                method = "rewrite"
            fix = _weight_fix(w, o, new, hit.multiple, modules)
            rule, dim, cur, sug = "weight-dim-alignment", o.dimension, value, new
        speedup = step / after.step_time_s
        recommended = speedup >= MIN_RECOMMENDED_SPEEDUP
        found.append(Finding(
            rule=rule, severity=severity_of(speedup) if recommended else "info",
            title=f"{dim} = {cur} is off the multiple of {hit.multiple} for {hit.dtype}",
            modules=modules, dimension=dim, current=cur, suggested=sug, fix=fix,
            reason=_reason(w, hit, after.step_time_s)
            + ("" if recommended else f" Not recommended: the fix predicts {speedup:.3f}x "
               "(the padding costs more than the alignment gains)."),
            step_time_before_s=step, step_time_after_s=after.step_time_s,
            peak_memory_before_bytes=w.estimate.peak_memory_bytes,
            peak_memory_after_bytes=(after.peak_memory_bytes if method == "retrace"
                                     else w.estimate.peak_memory_bytes),
            method=method, recommended=recommended))
    return found
