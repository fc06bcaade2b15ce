"""The dispatch mode that records every aten op and every tensor storage of a step."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from tilefit.compat.distributed import storage_resizes
from tilefit.compat.fake import (
    DataDependentOutputException,
    TorchDispatchMode,
    as_kernels_return,
    write_only_args,
)
from tilefit.compat.modules import ModulePath
from tilefit.compat.torchao import holds_float8, unwrap_float8
from tilefit.tracing.collectives import ENGINE_COPY_NAMESPACE, collective_of
from tilefit.tracing.inductor_fusion import NodePlan
from tilefit.tracing.ones import KnownOnes
from tilefit.tracing.records import Collective, GemmShape, OpRecord, StorageRecord
from tilefit.tracing.replay import Replays
from tilefit.tracing.shapes import (
    CUDNN_RNN_OPS,
    GROUPED_NAMES,
    ExpertCounts,
    classify,
    gemm_shapes,
    op_flops,
    packet_name,
)
from tilefit.tracing.traffic import multi_tensor, op_tensors, traffic, written_in_place
from tilefit.vocab import OPTIMIZER_PHASES, Phase

_DETACH = "aten.detach.default"
_SKIP = {"prim.device.default", "profiler._record_function_enter_new.default",
         "profiler._record_function_exit._RecordFunction"}


# the bytes of the buffers an op allocates and frees inside itself, beside its outputs, which
# a dispatch mode does not see (bitsandbytes' gemm_4bit: its dequantized weight), given the op,
# its args and kwargs
Transients = Callable[[Any, tuple[Any, ...], dict[str, Any]], tuple[int, ...]]


@dataclass(frozen=True)
class StepMarks:
    """Event indices that bound the phases of one traced step."""

    forward: int  # the first forward op
    optimizer: int  # the first op of the optimizer step (after every micro-batch)
    zero_grad: int  # the first op after the optimizer step
    end: int  # the event index after the step


# failing_module's name for the model's own forward (the root module's code)
ROOT_CODE = "(the model's own forward)"


class Recorder(Replays, TorchDispatchMode):
    """Records ops (shapes, FLOPs, bytes, module, phase) and storage lifetimes."""

    def __init__(self, tracker: ModulePath, root_name: str,
                 transients: Transients | None = None) -> None:
        super().__init__()
        self._transients = transients
        self.tracker = tracker
        self.set_root(root_name)
        self._phase: str = "setup"
        self._step = 0
        self._micro = 0
        self._events = 0
        self.ops: list[OpRecord] = []
        self._uid_of: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._next_uid = 0
        self.ones = KnownOnes(self.uid)  # storages that hold only ones (masks)
        self._nbytes: dict[int, int] = {}
        self._alloc_at: dict[int, int] = {}
        self._free_at: dict[int, int] = {}
        self._alloc_phase: dict[int, str] = {}
        self._alloc_module: dict[int, str] = {}
        self.category: dict[int, str] = {}
        self._attention_backend: str | None = None  # the router's choice for the current call
        self.raised_in: str | None = None  # the module whose op raised (failing_module)
        self._attn_by_uid: dict[int, dict[str, Any]] = {}
        self._host_uids: set[int] = set()  # storages that live in host memory on the target
        self._recording = True
        self._node: NodePlan | None = None  # the compiled-graph node running now
        self._node_module = ""  # the module that node came from
        self._default_category: str | None = None  # for storages tracked now (allocations_as)
        self._detached: dict[int, int | None] = {}  # backward detach events: their storage
        self.micro_runs = 0  # micro-batches run, not replayed (tracing.step)
        self.stand_in_reads = 0  # .item() calls in the optimizer answered with a stand-in
        # a MoE layer's tokens per expert under the recipe's routing (tracing.moe)
        self.expert_counts: ExpertCounts | None = None

    # ---- where the step is --------------------------------------------------------------
    @property
    def phase(self) -> str:
        return self._phase

    @property
    def events(self) -> int:
        """Ops recorded so far: the index of the next event."""
        return self._events

    def enter_phase(self, phase: Phase) -> None:
        self._phase = phase

    def begin_step(self, step: int) -> None:
        """Step 0 creates the optimizer state lazily; step 1 is the steady state."""
        self._step, self._micro = step, 0

    def begin_micro(self, micro: int) -> None:
        self._micro = micro

    @contextlib.contextmanager
    def attention_backend(self, backend: str) -> Iterator[None]:
        """The SDPA kernel the attention router chose for the ops recorded inside."""
        self._attention_backend = backend
        try:
            yield
        finally:
            self._attention_backend = None

    @contextlib.contextmanager
    def compiled_node(self, plan: NodePlan, module: str = "") -> Iterator[None]:
        """The ops recorded inside are one node of a compiled graph, run as ``plan`` says
        (tilefit.tracing.inductor_fusion): fused or extern, and whether its value is allocated;
        ``module``: the module whose code made the node (no module runs in a graph)."""
        self._node, self._node_module = plan, module
        try:
            yield
        finally:
            self._node, self._node_module = None, ""

    @property
    def in_compiled_node(self) -> bool:  # the ops now recorded run in a compiled graph
        return self._node is not None

    def _compiled_fields(self, first_uid: int) -> dict[str, Any]:
        """The OpRecord fields of an op of a compiled graph; a value Inductor keeps in
        registers allocates nothing (its storages count 0 bytes)."""
        plan = self._node
        if plan is None:
            return {}
        fields: dict[str, Any] = {"compiled": True, "fused": plan.fused, "kernel": plan.kernel}
        if not plan.materialized:
            for uid in range(first_uid, self._next_uid):
                self._nbytes[uid] = 0
            fields["alloc_bytes"] = ()
        if plan.kernel is not None:  # the kernel is costed once, on its first op
            self._node = dataclasses.replace(plan, kernel=None)
        return fields

    def set_root(self, root_name: str) -> None:
        """The root module's class name, which ModuleTracker puts before every path."""
        self.root_name = root_name
        self.root_prefix = root_name + "."

    # ---- storages ---------------------------------------------------------------------
    def _track(self, t: torch.Tensor, at: int, category: str | None = None,
               module: str | None = None) -> int:
        st = t.untyped_storage()
        uid = self._uid_of.get(st)
        if uid is not None:
            return uid
        return self._track_storage(st, at, category, module)

    def _track_storage(self, st: Any, at: int, category: str | None = None,
                       module: str | None = None) -> int:
        uid = self._next_uid
        self._next_uid += 1
        self._uid_of[st] = uid
        self._nbytes[uid] = st.nbytes()
        self._alloc_at[uid] = at
        self._alloc_phase[uid] = self.phase
        self._alloc_module[uid] = self.module if module is None else module
        category = category or self._default_category
        if category is not None:
            self.category[uid] = category
        weakref.finalize(st, self._on_free, uid)
        return uid

    def _book_transient(self, nbytes: int, at: int, module: str) -> None:
        """A buffer that op ``at`` allocates before its outputs and frees before it returns:
        live with them, gone before the next op."""
        uid = self._next_uid
        self._next_uid += 1
        self._nbytes[uid], self._alloc_at[uid], self._free_at[uid] = nbytes, at, at + 1
        self._alloc_phase[uid], self._alloc_module[uid] = self.phase, module
        self.category[uid] = "temporaries"

    def _on_free(self, uid: int) -> None:
        self._free_at.setdefault(uid, self._events)  # a resize may have freed it earlier

    @contextlib.contextmanager
    def allocations_as(self, category: str) -> Iterator[None]:
        """Storages first seen inside get ``category`` (DDP's buckets at construction)."""
        self._default_category = category
        try:
            yield
        finally:
            self._default_category = None

    @contextlib.contextmanager
    def watching_resizes(self) -> Iterator[None]:
        """Track ``UntypedStorage.resize_``: FSDP2 frees its unsharded parameters by resizing
        their storage to 0 and allocates them again by resizing it back."""
        with storage_resizes(self._on_resize):
            yield

    def _on_resize(self, st: Any, nbytes: int) -> None:
        """A resized storage ends its old lifetime and, unless emptied, starts a new one;
        only a data-parallel engine resizes storages: its buffers are "communication"."""
        if not self._recording:
            return
        uid = self._uid_of.get(st)
        if uid is not None:
            if uid not in self._free_at and self._nbytes[uid] == nbytes:
                return
            self._free_at.setdefault(uid, self._events)
            if self.category.get(uid) is None:
                self.category[uid] = "communication"
            del self._uid_of[st]
        if nbytes > 0:
            self._track_storage(st, self._events, "communication")

    def register_existing(self, tree: Any, category: str) -> None:
        """Storages alive before the step (parameters, buffers, inputs)."""
        for t in op_tensors(tree):
            uid = self._track(t, -1, category)
            self.category.setdefault(uid, category)

    def label(self, tree: Any, category: str) -> None:
        """Give the storages of these tensors a category (gradients, optimizer state)."""
        for t in op_tensors(tree):
            uid = self._uid_of.get(t.untyped_storage())
            if uid is not None and uid not in self.category:
                self.category[uid] = category

    def mark_host(self, tensors: Any) -> None:
        """These tensors live in host memory on the target (torch.optim's step counters
        beside CUDA parameters): ops on them alone run on the host."""
        for t in op_tensors(tensors):
            self._host_uids.add(self._track(t, self._events))

    def unmark_host(self, tensors: Any) -> None:
        """These tensors live in device memory (a host-to-device copy's result)."""
        for t in op_tensors(tensors):
            self._host_uids.discard(self._track(t, self._events))

    def is_host(self, t: torch.Tensor) -> bool:
        """Whether this tensor's storage lives in host memory on the target."""
        uid = self.uid(t)
        return uid is not None and uid in self._host_uids

    def _runs_on_host(self, name: str, inputs: list[torch.Tensor]) -> bool:
        """An op runs on the host when it reads host tensors and nothing larger than a
        scalar from the device; constants made in the optimizer step are host tensors."""
        if not self._host_uids:
            return False
        if name.startswith("aten.lift_fresh"):
            return self._phase in OPTIMIZER_PHASES
        on_host = [self.uid(t) in self._host_uids for t in inputs]
        return any(on_host) and all(h or t.numel() <= 1 for h, t in zip(on_host, inputs,
                                                                         strict=True))

    def uid(self, t: torch.Tensor) -> int | None:
        return self._uid_of.get(t.untyped_storage())

    def storages(self) -> tuple[StorageRecord, ...]:  # in the target's memory (not host's)
        out = []
        for uid, nbytes in self._nbytes.items():
            if uid in self._host_uids:
                continue
            phase = self._alloc_phase[uid]
            category = self.category.get(uid) or (
                "activations" if phase in ("forward", "recompute") else "temporaries")
            out.append(StorageRecord(
                uid=uid, nbytes=nbytes, alloc_at=self._alloc_at[uid],
                free_at=self._free_at.get(uid), category=category, phase=phase,
                module=self._alloc_module[uid]))
        return tuple(out)

    # ---- values the optimizer reads ---------------------------------------------------------
    def _stand_in_scalar(self, func: Any, args: tuple[Any, ...]) -> Any:
        """A value for .item() in the optimizer step. Optimizers that scale their update by
        a norm read it on the host (torch.optim.Adafactor: param.norm().item()); on fake
        tensors there is no value, but it only scales the update and no shape depends on it,
        so 1 stands in. Anywhere else a value can steer control flow: the error stands."""
        if self._phase not in (*OPTIMIZER_PHASES, "loss_check") or \
                packet_name(func) != "aten._local_scalar_dense":
            raise
        t = args[0]
        if self._phase == "loss_check":  # the loop's non-finite check: the loss is finite
            return False
        if self._phase != "scaler":  # GradScaler's found_inf read is expected, not a guess
            self.stand_in_reads += 1
        if t.dtype == torch.bool:
            return True
        return 1.0 if t.is_floating_point() else 1

    # ---- context ----------------------------------------------------------------------
    @property
    def module(self) -> str:
        """The module whose forward or backward issues the op now (compat.modules.ModulePath),
        its path below the root; "" for the root's own code and outside every module."""
        current = self.tracker.current
        if current == self.root_name:
            return ""
        return current.removeprefix(self.root_prefix)

    @property
    def failing_module(self) -> str:
        """The module whose code ran the op that raised (caught as it raised: the
        exception unwinds the module stack before it is reported); else the module running
        now, or else the last one entered."""
        if self.raised_in is not None:
            return self.raised_in
        if self.module:
            return self.module
        last = getattr(self.tracker, "last_entered", "")
        if last == self.root_name:
            return ""
        return last.removeprefix(self.root_prefix)

    @property
    def effective_phase(self) -> str:
        if self._phase == "backward" and self.tracker.recomputing:
            return "recompute"
        return self._phase

    # ---- the mode ---------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except DataDependentOutputException:
            out = self._stand_in_scalar(func, args)
        except Exception:
            # the module whose code ran the op, before the exception unwinds the modules
            if self.raised_in is None:
                self.raised_in = self.module or (
                    ROOT_CODE if self.tracker.current == self.root_name else "")
            raise
        out = as_kernels_return(func, out)
        if not self._recording or str(func) in _SKIP:
            return out
        self._record(func, args, kwargs, out, self._node_module or self.module,
                     self.effective_phase)
        return out

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
                module: str, phase: str) -> None:
        """Record op ``func`` (already run: ``out``) as the next event, issued by
        ``module`` in ``phase``: its cost, its new storages."""
        name = str(func)
        at = self._events
        inputs = list(op_tensors((args, kwargs)))
        outputs = list(op_tensors(out))
        before = self._next_uid
        for nbytes in self._transients(func, args, kwargs) if self._transients else ():
            self._book_transient(nbytes, at, module)
        kind = classify(func)
        float8 = holds_float8(args)
        if float8 and kind != "gemm":  # torchao's metadata ops on its float8 tensors
            kind = "view"
        engine = kind == "collective" or name.startswith(ENGINE_COPY_NAMESPACE)
        for t in outputs:
            self._track(t, at, "communication" if engine else None, module=module)
        self.ones.observe(func, args, kwargs, inputs, outputs)
        alloc = tuple(self._nbytes[u] for u in range(before, self._next_uid))
        collective: Collective | None = None
        if kind == "collective":
            collective = collective_of(packet_name(func), args, kwargs, out)
        attention = None
        if kind == "attention":
            attention = self._attention_info(func, args, kwargs, out)
        flops, flops_error, gemms = self._work(func, args, kwargs, out, kind, float8,
                                               attention)
        nbytes = 0 if kind == "view" else traffic(
            inputs, outputs, written_in_place(name, func, args, kwargs),
            write_only_args(func, args, kwargs))
        on_host = self._runs_on_host(name, inputs)
        if on_host:
            self._host_uids.update(self.uid(t) for t in outputs)
        ref = outputs[0] if outputs else (inputs[0] if inputs else None)
        compiled = self._compiled_fields(before)
        if "alloc_bytes" in compiled:
            alloc = compiled.pop("alloc_bytes")
        self.ops.append(OpRecord(
            op=name, phase=phase, module=module,
            input_shapes=tuple(tuple(t.shape) for t in inputs),
            output_shapes=tuple(tuple(t.shape) for t in outputs),
            dtype=str(ref.dtype).removeprefix("torch.") if ref is not None else "",
            flops=int(flops), bytes=int(nbytes), kind=kind, step=self._step, micro=self._micro,
            gemms=gemms, attention=attention, alloc_bytes=alloc,
            multi_tensor=multi_tensor(name, args, out), on_host=on_host, **compiled,
            collective=collective, flops_error=flops_error,
        ))
        if name == _DETACH and phase == "backward" and outputs:
            self._detached[at] = self.uid(outputs[0])  # AccumulateGrad's, maybe (replay)
        self._events += 1

    def _work(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
              kind: str, float8: bool, attention: dict[str, Any] | None
              ) -> tuple[int, str | None, tuple[GemmShape, ...]]:
        """The op's FLOPs (and why there is no formula, if so) and its GEMMs."""
        flops, flops_error = op_flops(func, args, kwargs, out, attention)
        gemms: tuple[GemmShape, ...] = gemm_shapes(
            func, unwrap_float8(args) if float8 else args, kwargs, out, kind,
            self.expert_counts) if kind in ("gemm", "conv") else ()
        if packet_name(func) in GROUPED_NAMES or packet_name(func) in CUDNN_RNN_OPS:
            # one GEMM per expert, or per step of cuDNN's RNN: no torch formula
            flops = sum(2 * g.batch * g.m * g.n * g.k for g in gemms)
        return flops, flops_error, gemms

    def _attention_info(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                        out: Any) -> dict[str, Any]:
        backward = "backward" in str(func)
        # forward: (query, key, value, dropout_p, is_causal, ...);
        # backward: (grad_out, query, key, value, out, logsumexp, ...)
        q, k = (args[1], args[2]) if backward else (args[0], args[1])
        b, hq, sq, d = q.shape
        info: dict[str, Any] = {
            "backend": self._attention_backend or "flash", "causal": False, "b": b, "hq": hq,
            "hkv": k.shape[1], "sq": sq, "sk": k.shape[2], "d": d,
            "dtype": str(q.dtype).removeprefix("torch."),
        }
        if backward:
            fwd_out = args[4] if len(args) > 4 else None
            uid = self.uid(fwd_out) if isinstance(fwd_out, torch.Tensor) else None
            info.update(self._attn_by_uid.get(uid, {}) if uid is not None else {})
            info["direction"] = "backward"
            return info
        info["causal"] = bool(kwargs.get("is_causal", args[4] if len(args) > 4 else False))
        info["direction"] = "forward"
        first = out[0] if isinstance(out, tuple | list) else out
        uid = self.uid(first)
        if uid is not None:
            self._attn_by_uid[uid] = dict(info)
        return info
