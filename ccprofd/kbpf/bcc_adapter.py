"""The only module of ccprofd that imports ``bcc``; used by the compile worker
(:mod:`ccprofd.kbpf.compile_worker`, which turns a compiled module into a
:class:`~ccprofd.kbpf.objcache.CompiledObject` for the raw loader) and by tests that compare the two
paths, never in the tracer's or the daemon's own process.

A thin typed layer over bcc 0.26's Python API: compile BPF C with cflags, load programs by name and
type (including ``attach_type=48`` for uprobe_multi), attach tracepoints / raw tracepoints / perf
events / single uprobes, access maps and poll ring buffers.  bcc raises bare ``Exception`` with
messages of varying shape; everything here turns them into one-line :class:`BPFError`.  bcc is
imported lazily so that ``import ccprofd`` works on machines without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType, TracebackType
from typing import Any, Literal

from ccprofd.kbpf.bpfmap import MapValues
from ccprofd.kbpf.errors import BPFError, MissingFeature
from ccprofd.kbpf.objcache import CompiledObject, FunctionSpec, MapSpec, split_relocations

ProgType = Literal["kprobe", "tracepoint", "raw_tracepoint", "perf_event"]

# enum bpf_prog_type values for the names above.
PROG_TYPES: dict[str, int] = {"kprobe": 2, "tracepoint": 5, "perf_event": 7, "raw_tracepoint": 17}

# perf_event_open constants for software sampling (there is no hardware PMU in the target VMs).
PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_CPU_CLOCK = 0
PERF_COUNT_SW_TASK_CLOCK = 1

# Map type ids (enum bpf_map_type) the map wrapper distinguishes.
_MAP_HASH, _MAP_ARRAY, _MAP_PERCPU_HASH, _MAP_PERCPU_ARRAY, _MAP_LRU_HASH = 1, 2, 5, 6, 9
_MAP_QUEUE, _MAP_STACK, _MAP_RINGBUF = 22, 23, 27

_bcc_module: ModuleType | None = None


def import_bcc() -> ModuleType:
    """Import bcc on first use; a failure is reported as a missing feature, not a traceback."""
    global _bcc_module
    if _bcc_module is None:
        try:
            import bcc
        except Exception as exc:  # ImportError, or OSError from libbcc.so loading
            raise MissingFeature("bcc (python3-bpfcc)", f"import bcc failed: {exc}") from None
        _bcc_module = bcc
    return _bcc_module


def _libbcc() -> Any:
    """libbcc's ctypes handle with the table-enumeration functions bcc's Python binding does not
    declare (``bcc_common.h``)."""
    import_bcc()
    from bcc.libbcc import lib

    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for name, restype in (("bpf_num_tables", sz), ("bpf_table_name", ctypes.c_char_p),
                          ("bpf_table_fd_id", ctypes.c_int), ("bpf_table_type_id", ctypes.c_int),
                          ("bpf_table_max_entries_id", sz), ("bpf_table_flags_id", ctypes.c_int),
                          ("bpf_table_key_desc_id", ctypes.c_char_p),
                          ("bpf_table_leaf_desc_id", ctypes.c_char_p),
                          ("bpf_table_key_size_id", sz), ("bpf_table_leaf_size_id", sz)):
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = [vp] if name == "bpf_num_tables" else [vp, sz]
    return lib


def bcc_available() -> str | None:
    """None when bcc imports, else the reason it does not."""
    try:
        import_bcc()
    except MissingFeature as exc:
        return exc.detail
    return None


@contextlib.contextmanager
def _capture_stderr() -> Iterator[list[str]]:
    """Capture fd 2 while libbcc compiles: clang's diagnostics go there, and the first error line
    is what makes a compile failure's one-line message useful."""
    out: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.extend(tmp.read().decode(errors="replace").splitlines())


def _first_error(lines: Sequence[str]) -> str:
    for line in lines:
        if "error:" in line:
            return line.strip()
    for line in lines:
        if line.strip():
            return line.strip()
    return ""


def _verifier_reason(log: Sequence[str]) -> str:
    """The verifier's reason from the log bcc prints on a failed load: the line before the final
    "processed N insns" summary, plus bcc's HINT when it gives one."""
    lines = [ln.strip() for ln in log if ln.strip()]
    hints = [ln for ln in lines if ln.startswith("HINT:")]
    body = [ln for ln in lines if not ln.startswith("HINT:")]
    for i in range(len(body) - 1, -1, -1):
        if body[i].startswith("processed ") and i > 0:
            return "; ".join([body[i - 1], *hints[:1]])
    return "; ".join(body[-1:] + hints[:1])


class BpfMap(MapValues):
    """One BPF map of a loaded module.  Keys and values are ints when the C type is a scalar, else
    the ctypes structure bcc derived from the C declaration (``key_type`` / ``leaf_type``)."""

    def __init__(self, module: BccModule, name: str, table: Any) -> None:
        self._module = module
        self.name = name
        self._t = table
        self.map_type: int = int(table.ttype)
        self.key_type: Any = table.Key
        self.leaf_type: Any = getattr(table, "sLeaf", table.Leaf)

    @property
    def fd(self) -> int:
        return int(self._t.get_fd())

    @property
    def max_entries(self) -> int:
        return int(self._t.max_entries)

    @property
    def percpu(self) -> bool:
        return self.map_type in (_MAP_PERCPU_ARRAY, _MAP_PERCPU_HASH)

    def get(self, key: Any, default: Any = None) -> Any:
        """Value at ``key`` (summed over CPUs for per-CPU maps), or ``default`` when absent."""
        try:
            if self.percpu:
                return self.sum_percpu(key)
            return self._out(self._t[self._key(key)])
        except KeyError:
            return default

    def get_percpu(self, key: Any) -> list[Any]:
        """Per-CPU values of a per-CPU map."""
        try:
            vals = self._t.getvalue(self._key(key))
        except KeyError:
            return []
        return [self._out(v) for v in vals]

    def set(self, key: Any, value: Any) -> None:
        """Insert or overwrite.  Raises BPFError when the kernel refuses (e.g. hash map full)."""
        try:
            self._t[self._key(key)] = self._leaf(value)
        except Exception as exc:
            raise BPFError(f"map {self.name}: update failed: {exc}") from None

    def update_many(self, items: Sequence[tuple[Any, Any]]) -> None:
        """Set many entries (per-site tables of tens of thousands of entries); uses one batch
        syscall where the kernel supports it, else element by element."""
        if not items:
            return
        n = len(items)
        keys = (self.key_type * n)(*(self._key(k) for k, _ in items))
        vals = (self.leaf_type * n)(*(self._leaf(v) for _, v in items))
        try:
            self._t.items_update_batch(keys, vals)
        except Exception:
            for k, v in items:
                self.set(k, v)

    def delete(self, key: Any) -> bool:
        """Remove ``key``; False when it was absent (array maps: zero the slot)."""
        try:
            del self._t[self._key(key)]
        except KeyError:
            return False
        return True

    def clear(self) -> None:
        """Delete all entries (arrays: zero all slots)."""
        if self.map_type == _MAP_ARRAY and isinstance(self.leaf_type(), ctypes._SimpleCData):
            self.update_many([(i, 0) for i in range(self.max_entries)])
        elif self.map_type in (_MAP_ARRAY, _MAP_PERCPU_ARRAY):
            for i in range(self.max_entries):
                self._t.clearitem(self._key(i))
        else:
            self._t.clear()

    def items(self) -> list[tuple[Any, Any]]:
        """All entries as (key, value); per-CPU values summed."""
        out: list[tuple[Any, Any]] = []
        for k in list(self._t.keys()):
            v = self.get(k)
            if v is not None:
                out.append((self._out(k), v))
        return out

    def items_batch(self) -> list[tuple[Any, Any]]:
        """All entries of a (non-per-CPU) hash map through BPF_MAP_LOOKUP_BATCH: a few syscalls for
        the whole map instead of two per entry (read periodically by the daemon); falls back to
        :meth:`items` where the kernel or map type lacks it."""
        if self.percpu:
            return self.items()
        try:
            return [(self._out(k), self._out(v)) for k, v in self._t.items_lookup_batch()]
        except Exception:
            return self.items()

    def __len__(self) -> int:
        return sum(1 for _ in self._t)


class BccModule:
    """One compiled BPF C translation unit and everything attached from it.  ``cleanup()`` (or the
    context manager) detaches and frees it all."""

    def __init__(self, text: str, cflags: Sequence[str] = (), *, debug: int = 0) -> None:
        bcc = import_bcc()
        self._bcc = bcc
        self._closed = False
        self._shadowed_tp_fds: list[int] = []
        self._ringbuf_errors: list[BaseException] = []
        self._ringbuf_cbs: list[Any] = []
        self._ringbuf_left: int | None = None  # records the current poll may still deliver
        self._ringbuf_delivered = 0
        err: Exception | None = None
        with _capture_stderr() as diag:
            try:
                self._b = bcc.BPF(text=text.encode(), cflags=list(cflags), debug=debug)
            except Exception as exc:
                err = exc
        if err is not None:
            detail = _first_error(diag) or str(err)
            raise BPFError(f"BPF compile/load failed: {detail}")

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], cflags: Sequence[str] = (), *, prelude: str = ""
    ) -> BccModule:
        """Compile a C source file, with ``prelude`` (e.g. ``#define``s) placed before it."""
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise BPFError(f"cannot read BPF source {os.fspath(path)}: {exc.strerror}") from None
        return cls(prelude + text, cflags)


    def compiled_object(self) -> CompiledObject:
        """Everything a raw loader needs to load this module again without bcc (see
        :mod:`ccprofd.kbpf.objcache`): each function's instructions before loading with map fds
        turned into relocations, each map's parameters and key/value type descriptions."""
        lib = _libbcc()
        mod = self._b.module
        maps: list[MapSpec] = []
        fd_names: dict[int, str] = {}
        for i in range(int(lib.bpf_num_tables(mod))):
            name = lib.bpf_table_name(mod, i).decode()
            mtype = int(lib.bpf_table_type_id(mod, i))
            keyless = mtype in (_MAP_QUEUE, _MAP_STACK, _MAP_RINGBUF)
            key_desc = lib.bpf_table_key_desc_id(mod, i)
            leaf_desc = lib.bpf_table_leaf_desc_id(mod, i)
            maps.append(MapSpec(
                name=name, map_type=mtype,
                key_size=0 if keyless else int(lib.bpf_table_key_size_id(mod, i)),
                value_size=0 if mtype == _MAP_RINGBUF else int(lib.bpf_table_leaf_size_id(mod, i)),
                max_entries=int(lib.bpf_table_max_entries_id(mod, i)),
                flags=int(lib.bpf_table_flags_id(mod, i)),
                key_desc=None if keyless or not key_desc else json.loads(key_desc),
                leaf_desc=None if mtype == _MAP_RINGBUF or not leaf_desc else json.loads(leaf_desc)))
            fd_names[int(lib.bpf_table_fd_id(mod, i))] = name
        funcs: list[FunctionSpec] = []
        for i in range(int(lib.bpf_num_functions(mod))):
            name = lib.bpf_function_name(mod, i).decode()
            insns, relocs = split_relocations(self.function_bytes(name), fd_names)
            funcs.append(FunctionSpec(name, insns, relocs))
        license_ = lib.bpf_module_license(mod)
        return CompiledObject(license_.decode() if license_ else "GPL", tuple(maps), tuple(funcs))

    # -- programs ---------------------------------------------------------------------------------
    def function_bytes(self, name: str) -> bytes:
        """The compiled (not yet loaded) instructions of function ``name``, for loaders that must
        patch them before loading (e.g. ``bpf_loop`` callbacks bcc cannot relocate)."""
        try:
            return bytes(self._b.dump_func(name.encode()))
        except Exception as exc:
            raise BPFError(f"no compiled BPF function {name}: {exc}") from None

    def load_func(self, name: str, prog_type: ProgType | int, *, attach_type: int = -1) -> int:
        """Load (verify) program ``name``; return its fd.  ``attach_type=48`` prepares a kprobe-type
        program for uprobe_multi links.  Loading twice returns the same fd."""
        ptype = PROG_TYPES[prog_type] if isinstance(prog_type, str) else prog_type
        with _capture_stderr() as diag:
            try:
                fn = self._b.load_func(name.encode(), ptype, attach_type=attach_type)
            except Exception as exc:
                err: Exception | None = exc
            else:
                err = None
        if err is not None:
            cause = str(err).rsplit(": ", 1)[-1]  # bcc: "Failed to load BPF program b'f': <strerror>"
            why = _verifier_reason(diag)
            raise BPFError(f"loading BPF program {name} failed: {cause}" + (f" [{why}]" if why else ""))
        return int(fn.fd)

    def attach_tracepoint(self, tp: str, fn_name: str) -> None:
        """Attach ``fn_name`` to ``category:event`` (bcc derives the args struct from the format)."""
        # bcc keeps one fd per tracepoint name: a second program of this module on the same
        # tracepoint would orphan the first one's fd, which cleanup() then never closes (it stayed
        # attached until the process exited; 64 programs per tracepoint is the kernel's limit).
        previous = self._b.tracepoint_fds.pop(tp.encode(), None)
        if previous is not None:
            self._shadowed_tp_fds.append(int(previous))
        self._call(
            f"attaching {fn_name} to tracepoint {tp}",
            self._b.attach_tracepoint,
            tp=tp.encode(),
            fn_name=fn_name.encode(),
        )

    def attach_raw_tracepoint(self, tp: str, fn_name: str) -> None:
        """Attach ``fn_name`` to raw tracepoint ``tp`` (e.g. ``sys_enter``)."""
        self._call(
            f"attaching {fn_name} to raw tracepoint {tp}",
            self._b.attach_raw_tracepoint,
            tp=tp.encode(),
            fn_name=fn_name.encode(),
        )

    def detach_raw_tracepoint(self, tp: str) -> None:
        """Detach the program attached to raw tracepoint ``tp``."""
        self._call(f"detaching raw tracepoint {tp}", self._b.detach_raw_tracepoint, tp=tp.encode())

    def attach_uprobe(
        self, path: str, fn_name: str, *, sym: str, sym_off: int = 0, pid: int = -1, retprobe: bool = False
    ) -> None:
        """One classic uprobe (perf-event based) on ``sym+sym_off`` of ``path``.  Fine for a few
        probes; detaching costs ~0.1 s each, so use uprobe_multi links for many sites."""
        if retprobe:
            self._call(
                f"attaching uretprobe {fn_name} to {path}:{sym}",
                self._b.attach_uretprobe,
                name=path.encode(),
                sym=sym.encode(),
                fn_name=fn_name.encode(),
                pid=pid,
            )
        else:
            self._call(
                f"attaching uprobe {fn_name} to {path}:{sym}+{sym_off}",
                self._b.attach_uprobe,
                name=path.encode(),
                sym=sym.encode(),
                sym_off=sym_off,
                fn_name=fn_name.encode(),
                pid=pid,
            )

    def attach_perf_event(
        self,
        fn_name: str,
        *,
        ev_type: int = PERF_TYPE_SOFTWARE,
        ev_config: int = PERF_COUNT_SW_CPU_CLOCK,
        sample_freq: int = 0,
        sample_period: int = 0,
        pid: int = -1,
        cpu: int = -1,
    ) -> None:
        """Sampling perf event running ``fn_name``: by default software CPU_CLOCK.  ``pid`` is one
        *thread* (perf semantics, no inheritance); pid=-1 samples every task on each CPU — filter
        by tgid inside the program to follow whole processes and their children."""
        if (sample_freq > 0) == (sample_period > 0):
            raise BPFError("attach_perf_event: give exactly one of sample_freq and sample_period")
        self._call(
            f"attaching {fn_name} to perf event {ev_type}:{ev_config}",
            self._b.attach_perf_event,
            ev_type=ev_type,
            ev_config=ev_config,
            fn_name=fn_name.encode(),
            sample_period=sample_period,
            sample_freq=sample_freq,
            pid=pid,
            cpu=cpu,
        )

    def _call(self, what: str, fn: Callable[..., Any], **kwargs: Any) -> None:
        with _capture_stderr() as diag:
            try:
                fn(**kwargs)
            except Exception as exc:
                err: Exception | None = exc
            else:
                err = None
        if err is not None:
            hint = _first_error(diag)
            raise BPFError(f"{what} failed: {err}" + (f" [{hint}]" if hint else ""))

    # -- maps -------------------------------------------------------------------------------------
    def map(self, name: str) -> BpfMap:
        """The map called ``name`` in the C source."""
        try:
            table = self._b.get_table(name.encode())
        except Exception as exc:
            raise BPFError(f"no BPF map {name}: {exc}") from None
        return BpfMap(self, name, table)

    def open_ring_buffer(self, name: str, callback: Callable[[bytes], None]) -> None:
        """Deliver each record of ring buffer ``name`` to ``callback`` as bytes during
        ``ring_buffer_poll``.  An exception in the callback is re-raised from the poll."""
        table = self._b.get_table(name.encode())
        if int(table.ttype) != _MAP_RINGBUF:
            raise BPFError(f"map {name} is not a ring buffer")

        def cb(_ctx: Any, data: Any, size: int) -> int:
            try:
                callback(ctypes.string_at(data, size))
            except BaseException as exc:
                self._ringbuf_errors.append(exc)
                return -1  # stops this poll round (libbpf has consumed the record)
            self._ringbuf_delivered += 1
            if self._ringbuf_left is not None:
                self._ringbuf_left -= 1
                if self._ringbuf_left <= 0:
                    return -1  # the budget is spent: stop this round the same way
            return 0

        # bcc keeps the ctypes callback only inside the table object, and get_table returns a new
        # one each call: hold both, or the callback is freed while libbcc still calls it.
        self._ringbuf_cbs.append((table, cb))
        try:
            table.open_ring_buffer(cb)
        except Exception as exc:
            raise BPFError(f"opening ring buffer {name} failed: {exc}") from None

    def ring_buffer_poll(self, timeout_ms: int = -1, budget: int | None = None) -> int:
        """Wait up to ``timeout_ms`` (-1: forever) for records and dispatch them (at most ``budget``,
        as :meth:`RawModule.ring_buffer_poll <ccprofd.kbpf.rawmodule.RawModule.ring_buffer_poll>`)."""
        return self._dispatch(lambda: self._b.ring_buffer_poll(timeout_ms), budget)

    def ring_buffer_consume(self, budget: int | None = None) -> int:
        """Dispatch the records available now (at most ``budget``), without waiting."""
        return self._dispatch(self._b.ring_buffer_consume, budget)

    def _dispatch(self, run: Callable[[], Any], budget: int | None) -> int:
        self._ringbuf_left, self._ringbuf_delivered = budget, 0
        try:
            run()
        finally:
            self._ringbuf_left = None
        self._raise_ringbuf_error()
        return self._ringbuf_delivered

    def _raise_ringbuf_error(self) -> None:
        if self._ringbuf_errors:
            exc = self._ringbuf_errors.pop(0)
            self._ringbuf_errors.clear()
            raise exc

    # -- lifetime ---------------------------------------------------------------------------------
    def cleanup(self) -> None:
        """Detach everything attached through this module and free it (idempotent)."""
        if not self._closed:
            self._closed = True
            from bcc.libbcc import lib  # the library bcc's own detach uses

            for fd in self._shadowed_tp_fds:
                lib.bpf_close_perf_event_fd(fd)
            self._shadowed_tp_fds.clear()
            self._b.cleanup()

    def __enter__(self) -> BccModule:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
