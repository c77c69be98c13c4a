"""Pipeline schedules as plain data: a table of time slot x stage -> action, that users
can print and check and that the pipeline runtime follows slot by slot.

Time is counted in *slots*; in one slot every stage runs its cell: nothing, one action
(the forward ``F`` or the backward ``B`` of one stage on one microbatch) or several
actions one after the other (e.g. two forwards), and the activations (or cotangents) it
sends reach the neighbouring stage at the end of the slot. The runtime is
slot-synchronous, so a slot lasts as long as its busiest stage: `Schedule.idle_fraction`
weighs the cells with the cost of a forward and of a backward.

* GPipe: all forwards, then all backwards. Each stage keeps the activations of all ``m``
  microbatches between its forward and its backward.
* 1F1B: stage ``s`` runs ``p - s - 1`` warm-up forwards, then alternates one forward and
  one backward, then runs the remaining backwards (cool-down). It keeps at most
  ``p - s <= p`` microbatches in flight.

Both take ``2 (m + p - 1)`` slots of which each stage is busy ``2 m``: an idle (bubble)
fraction of ``(p - 1) / (m + p - 1)`` when a forward and a backward cost the same.

* 1F1B with ``forwards_per_slot=k``: a slot holds one backward or up to ``k`` forwards
  (sized for a backward that costs ``k`` forwards, as it does: about 2). Where plain 1F1B
  pairs a forward on one stage with a backward on the next in the same slot (the forward's
  stage waits), these slots are full: at p = 4, m = 32 and a backward of two forwards the
  busy fraction is 0.889 against 0.706 (the textbook 0.914 needs stages that do not wait
  for each other); stage ``s`` keeps up to ``k (p - s)`` microbatches in flight.
* Interleaved 1F1B (``virtual_stages=v``): each device holds ``v`` stage chunks (chunk
  ``c`` of device ``s`` is virtual stage ``c p + s``), in Megatron-LM's order: ``2 (v m +
  p - 1)`` slots of chunk actions, an idle fraction of ``(p - 1) / (v m + p - 1)``, for up
  to ``1 + (p - 1) / (v p)`` times 1F1B's stash.
* ZB-H1 (zero bubble): the backward split into ``B`` (the input cotangent, which the
  previous stage waits for) and ``W`` (the weight gradient, which nothing waits for and
  which fills 1F1B's idle slots): ``3 m + p - 1`` slots of equal-cost actions, an idle
  fraction of ``(p - 1) / (3 m + p - 1)``, 1F1B's ``p`` microbatches in flight.
* ZB-V: two chunks per device placed in a V (``placement='v'``: device ``s`` holds
  virtual stages ``s`` and ``2 p - 1 - s``, so device 0 runs the first and the last),
  the backward split as in ZB-H1; the order of torchtitan's ``ScheduleZBVZeroBubble``.

`Schedule.program` turns a table into the arrays the runtime follows: per slot, device and
lane, the action and the buffer entries it reads, writes and sends to.
"""

from __future__ import annotations

import dataclasses
import heapq
import re
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "Action",
    "Program",
    "Schedule",
    "gpipe_schedule",
    "interleaved_schedule",
    "one_f_one_b_schedule",
    "zero_bubble_schedule",
    "zero_bubble_v_schedule",
]

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
_CODE = {"F": FORWARD, "B": BACKWARD, "W": WEIGHT}


class Action(NamedTuple):
    """One action of a schedule table: ``kind`` on `microbatch` (and stage `chunk`).

    Attributes:
      kind: ``'F'`` (forward), ``'B'`` (backward; in a table with ``'W'`` actions only the
        input-gradient part, the cotangent the previous stage waits for) or ``'W'`` (the
        weight-gradient part of a split backward).
      microbatch: the microbatch index in ``[0, m)``.
      chunk: which of the device's ``v`` stage chunks runs (0 unless the schedule has
        ``virtual_stages`` v > 1): chunk ``c`` on device ``s`` is virtual stage
        ``c * p + s`` of the model.

    Example:
      >>> str(Action("F", 3)), str(Action("B", 3, chunk=1))
      ('F3', 'B3.1')
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


class Program(NamedTuple):
    """The static per-action arrays a runtime follows (from `Schedule.program`).

    Every array is int32 of shape ``(T, p, L)``: slot, device, lane (a cell's actions run
    lane 0 first); 0 where unused. Entries index per-device buffers whose lengths are
    `sizes`; they are given out first-fit in time order, so a buffer holds exactly the
    peak number of entries live at once. Timing model: in slot ``t`` the lanes run in
    order; an action reads its entries, then writes its own ``stash`` / ``kept`` entry;
    everything sent in slot ``t`` is written into the receiving inbox at the end of the
    slot, after all lanes.

    Attributes:
      kind: ``IDLE`` 0, ``FORWARD`` 1, ``BACKWARD`` 2, ``WEIGHT`` 3.
      microbatch: the microbatch of the action.
      chunk: its stage chunk (0 when v == 1).
      stash: F: the stash entry it writes (what its backward needs); B and W: the entry they
        read. Live from the F to the B, or to the W in a split table.
      inbox_f: F of virtual stage > 0: the forward-inbox entry it reads.
      inbox_b: B: the backward-inbox entry it reads.
      send_f: F of virtual stage < v p - 1: the forward-inbox entry on the receiving device
        (the ``inbox_f`` of the next virtual stage's F of that microbatch).
      send_b: B of virtual stage > 0: the backward-inbox entry on the receiving device (the
        ``inbox_b`` of the previous virtual stage's B); F of the last virtual stage: the
        backward-inbox entry where it files the cotangent of its own output.
      kept: split tables: B: the entry it writes (what its W needs of the cotangents it
        computed and the stash entry has no free array for); W: the entry it reads.
      sizes: entries per buffer, ``{'stash', 'inbox_f', 'inbox_b', 'kept'}`` (each >= 1;
        the most any device needs).

    Example:
      >>> prog = one_f_one_b_schedule(2, 2).program()
      >>> prog.kind.shape, prog.sizes
      ((6, 2, 1), {'stash': 2, 'inbox_f': 1, 'inbox_b': 1, 'kept': 1})
    """

    kind: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    stash: np.ndarray
    inbox_f: np.ndarray
    inbox_b: np.ndarray
    send_f: np.ndarray
    send_b: np.ndarray
    kept: np.ndarray
    sizes: dict[str, int]


def _first_fit(intervals: list[tuple[int, int, Any]]) -> tuple[dict[Any, int], int]:
    """Entries for ``(written at, last read at, key)`` intervals, first-fit in order of
    writing (an entry read at time x may be written again at x): ``({key: entry}, size)``;
    the size is the peak number of live intervals (greedy colouring of an interval graph
    in order of left ends is optimal)."""
    out: dict[Any, int] = {}
    live: list[tuple[int, int]] = []  # (last read, entry), a heap
    free: list[int] = []  # a heap of released entries
    size = 0
    for a, b, key in sorted(intervals, key=lambda iv: (iv[0], iv[1])):
        while live and live[0][0] <= a:
            heapq.heappush(free, heapq.heappop(live)[1])
        if free:
            e = heapq.heappop(free)
        else:
            e, size = size, size + 1
        out[key] = e
        heapq.heappush(live, (b, e))
    return out, size


def _normalize_cell(c: Any) -> Action | tuple[Action, ...] | None:
    """``None`` / ``()`` -> None; ``('F', 0)``, ``('F', 0, chunk)`` or an `Action` ->
    Action; a sequence of those -> a tuple of Actions (one -> that Action)."""
    if c is None:
        return None
    if isinstance(c, (tuple, list)) and c and isinstance(c[0], str):
        if len(c) not in (2, 3):
            raise ValueError("an action is (kind, microbatch) or (kind, microbatch, chunk)")
        return Action(str(c[0]), *(int(x) for x in c[1:]))
    acts = tuple(_normalize_cell(a) for a in c)
    if any(not isinstance(a, Action) for a in acts):
        raise ValueError("a cell of several actions lists (kind, microbatch) pairs")
    return None if not acts else acts[0] if len(acts) == 1 else acts


def _cell_actions(c: Action | tuple[Action, ...] | None) -> tuple[Action, ...]:
    if c is None:
        return ()
    return (c,) if isinstance(c, Action) else c


PLACEMENTS = ("loop", "v")
SYNCS = ("slot", "pairs")  # how `Schedule.idle_fraction` lines up the devices' slots


def _virtual_stage(placement: str, p: int, device: int, chunk: int) -> int:
    """The virtual stage of `chunk` on `device`: ``'loop'``, ``chunk p + device``;
    ``'v'``, the same for even chunks and ``chunk p + p - 1 - device`` for odd ones."""
    if placement == "v" and chunk % 2:
        return chunk * p + p - 1 - device
    return chunk * p + device


def _per_stage(
    value: float | Any, p: int, v: int, name: str, placement: str = "loop"
) -> list[float]:
    """One cost per virtual stage (``v p``) from one number, ``p`` (one per device, every
    chunk alike) or ``v p`` numbers."""
    if isinstance(value, (int, float, np.integer, np.floating)):
        return [float(value)] * (v * p)
    vals = [float(x) for x in value]
    if len(vals) == p:
        out = [0.0] * (v * p)
        for c in range(v):
            for d in range(p):
                out[_virtual_stage(placement, p, d, c)] = vals[d]
        return out
    if len(vals) != v * p:
        per_virtual = f", or one per virtual stage ({v * p})" if v > 1 else ""
        raise ValueError(
            f"Schedule.idle_fraction: {name} has {len(vals)} entries; pass one number, or one "
            f"per stage ({p}){per_virtual}."
        )
    return vals


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A static pipeline schedule: ``table[t][s]`` is what device (stage) ``s`` runs in
    time slot ``t``: an `Action`, a tuple of Actions run one after the other (e.g. two
    forwards), or ``None`` (idle).

    Build one with `gpipe_schedule`, `one_f_one_b_schedule`, `interleaved_schedule`,
    `zero_bubble_schedule` or `zero_bubble_v_schedule`, or pass your own table (cells as
    Actions, ``('F', i)`` / ``('F', i, chunk)`` tuples, or tuples of them). With
    ``virtual_stages`` v > 1 each device holds v stage chunks: with ``placement='loop'``
    chunk ``c`` of device ``s`` is virtual stage ``c * p + s`` of the model's ``v p``
    stages; with ``placement='v'`` odd chunks run the other way, ``c * p + p - 1 - s``
    (`virtual_stage`). A table with ``'W'`` actions splits the backward: ``B`` computes
    the cotangent of the stage input, ``W`` the weight gradient.

    The constructor validates the table and raises ``ValueError`` naming the slot, the
    device, the action and the dependency it breaks: every (virtual stage, microbatch)
    runs F and B once (and W once in a split table, and none otherwise); F of virtual stage
    ``k`` runs in a later slot than F of ``k - 1`` (activations arrive at the end of the
    slot that sends them), B of ``k`` in a later slot than B of ``k + 1`` (the last
    virtual stage: than its own F), and W after its B on the same device (a later slot,
    or a later lane of the same slot). ``str(schedule)`` prints the table, one row per
    device (``F3.1``: microbatch 3 on chunk 1).

    Attributes:
      name: a label (``'gpipe'``, ``'1f1b'``, ``'1f1b-2f'``, ``'interleaved'``,
        ``'zb-h1'``, or yours).
      num_stages: ``p``, the number of devices along the pipeline axis.
      num_microbatches: ``m``.
      table: ``T`` rows (time slots) of ``p`` cells.
      virtual_stages: ``v``, stage chunks per device (1: one stage per device).
      placement: how the chunks map to virtual stages: ``'loop'`` (interleaved 1F1B) or
        ``'v'`` (ZB-V); stack the params in `stacking_order`.

    Example:
      >>> s = Schedule("mine", 2, 1, ((("F", 0), None), (None, ("F", 0)),
      ...                              (None, ("B", 0)), (("B", 0), None)))
      >>> s.num_slots, s.in_flight(), s.idle_fraction()
      (4, [1, 1], 0.5)
    """

    name: str
    num_stages: int
    num_microbatches: int
    table: tuple[tuple[Action | tuple[Action, ...] | None, ...], ...]
    virtual_stages: int = 1
    placement: str = "loop"

    def __post_init__(self) -> None:
        where = f"Schedule {self.name!r}"
        rows = []
        for t, row in enumerate(self.table):
            cells = []
            for s, c in enumerate(row):
                try:
                    cells.append(_normalize_cell(c))
                except (TypeError, ValueError) as e:
                    raise ValueError(
                        f"{where}: slot {t}, stage {s}: {c!r} is not a cell (None, "
                        f"('F'|'B'|'W', microbatch[, chunk]), or a tuple of those): {e}"
                    ) from None
            rows.append(tuple(cells))
        object.__setattr__(self, "table", tuple(rows))
        self._validate()

    # -- queries ---------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """``T``, the number of time slots."""
        return len(self.table)

    @property
    def lanes(self) -> int:
        """The most actions one cell holds (1 for GPipe and 1F1B; the runtime runs that
        many cells per slot, in turn)."""
        return max((len(_cell_actions(c)) for row in self.table for c in row), default=1) or 1

    @property
    def split_backward(self) -> bool:
        """Whether the table has ``'W'`` actions (B is then the input-gradient part only)."""
        return any(a.kind == "W" for row in self.table for c in row for a in _cell_actions(c))

    def virtual_stage(self, device: int, chunk: int) -> int:
        """The model stage that `chunk` of `device` runs (`placement`)."""
        return _virtual_stage(self.placement, self.num_stages, device, chunk)

    def device_of(self, virtual_stage: int) -> tuple[int, int]:
        """``(device, chunk)`` that runs model stage `virtual_stage`."""
        p = self.num_stages
        c, d = divmod(virtual_stage, p)
        return (p - 1 - d if self.placement == "v" and c % 2 else d), c

    @property
    def stacking_order(self) -> tuple[int, ...]:
        """The model stages in the order `stack_stages` takes them (entry ``c p + s``:
        chunk ``c`` of device ``s``): ``0 .. v p - 1`` with ``placement='loop'``; with
        ``'v'`` at v = 2, ``0 .. p - 1`` then ``2 p - 1`` down to ``p``. Stack with
        ``stack_stages([stages[k] for k in order], virtual_stages=v)``; entry ``j`` of
        `unstack_stages`' list is model stage ``order[j]``."""
        p, v = self.num_stages, self.virtual_stages
        return tuple(self.virtual_stage(j % p, j // p) for j in range(v * p))

    def actions(self, slot: int, stage: int) -> tuple[Action, ...]:
        """The actions of ``table[slot][stage]`` as a tuple (empty when idle)."""
        return _cell_actions(self.table[slot][stage])

    def times(self) -> dict[tuple[str, int, int], int]:
        """``{(kind, virtual stage, microbatch): slot}`` for every action in the table
        (the virtual stage of chunk ``c`` on device ``s``: `virtual_stage`, the device
        itself when v == 1)."""
        return {k: t for k, (t, _) in self._lane_times().items()}

    def _lane_times(self) -> dict[tuple[str, int, int], tuple[int, int]]:
        out = {}
        for t, row in enumerate(self.table):
            for s, c in enumerate(row):
                for lane, a in enumerate(_cell_actions(c)):
                    out[(a.kind, self.virtual_stage(s, a.chunk), a.microbatch)] = (t, lane)
        return out

    def idle_slots(self) -> int:
        """The number of idle cells (stage x slot) in the table."""
        return sum(c is None for row in self.table for c in row)

    def _busy_span(
        self, forward: Any, backward: Any, weight: Any, sync: str = "slot"
    ) -> tuple[float, float]:
        if sync not in SYNCS:
            raise ValueError(f"sync={sync!r}: use one of {SYNCS}")
        p, v = self.num_stages, self.virtual_stages
        cost = {
            "F": _per_stage(forward, p, v, "forward", self.placement),
            "B": _per_stage(backward, p, v, "backward", self.placement),
            "W": _per_stage(weight, p, v, "weight", self.placement),
        }
        busy = span = 0.0
        start = np.zeros(p)  # sync='pairs': when each device starts the slot
        for row in self.table:
            loads = [
                sum(cost[a.kind][self.virtual_stage(s, a.chunk)] for a in _cell_actions(c))
                for s, c in enumerate(row)
            ]
            busy += sum(loads)
            span += max(loads)
            end = start + np.asarray(loads)
            start = end.copy()
            for a, b in self._transfers(row):  # both ends of a transfer wait for each other
                start[a] = max(start[a], end[b])
                start[b] = max(start[b], end[a])
        return busy, (span if sync == "slot" else float(start.max()))

    def _transfers(self, row: tuple) -> list[tuple[int, int]]:
        """The ``(src, dst)`` devices of one slot's sends (F: to the next virtual stage's
        device, B: to the previous one's)."""
        last = self.num_stages * self.virtual_stages - 1
        out = []
        for s, c in enumerate(row):
            for a in _cell_actions(c):
                vs = self.virtual_stage(s, a.chunk)
                if a.kind == "F" and vs < last:
                    out.append((s, self.device_of(vs + 1)[0]))
                elif a.kind == "B" and vs > 0:
                    out.append((s, self.device_of(vs - 1)[0]))
        return out

    def idle_fraction(
        self,
        forward: float | Any = 1.0,
        backward: float | Any = 1.0,
        weight: float | Any = 1.0,
        *,
        sync: str = "slot",
    ) -> float:
        """The idle fraction of the runtime following this table with the given cell
        costs: idle = 1 - sum of the busy times / (p x the step's length).

        Args:
          forward: the cost of an F: one number, one per stage (device; every chunk of a
            device alike), or one per virtual stage (``v p``, in model order).
          backward: the cost of a B (the whole backward, or in a split table its
            input-gradient part), as `forward`.
          weight: the cost of a W (split tables), as `forward`.
          sync: how the slots of the devices line up. ``'slot'`` (the bound): every slot
            lasts as long as its busiest device, as if each ended with a barrier.
            ``'pairs'``: each slot's transfers hold only the two devices of each send
            (a ``ppermute`` pair waits for both ends, as the runtime's do); a device
            without a transfer in a slot goes straight on. The two agree when every
            cell costs the same.

        Returns:
          A float in [0, 1); with the default equal costs and one action per cell, the
          idle cells over all cells: ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B,
          ``(p - 1) / (v m + p - 1)`` for interleaved 1F1B, ``(p - 1) / (3 m + p - 1)`` for
          ZB-H1.

        Example:
          >>> round(one_f_one_b_schedule(4, 32).idle_fraction(1.0, 2.0), 3)
          0.294
          >>> round(one_f_one_b_schedule(4, 32).idle_fraction(1.0, 2.0, sync="pairs"), 3)
          0.086
          >>> round(one_f_one_b_schedule(4, 32, forwards_per_slot=2).idle_fraction(1.0, 2.0), 3)
          0.111
          >>> round(zero_bubble_schedule(4, 8).idle_fraction(1.0, 1.0, 1.0), 3)
          0.111
        """
        busy, span = self._busy_span(forward, backward, weight, sync)
        return 1.0 - busy / (self.num_stages * span) if span else 0.0

    def idle_time(
        self,
        forward: float | Any = 1.0,
        backward: float | Any = 1.0,
        weight: float | Any = 1.0,
        *,
        sync: str = "slot",
    ) -> float:
        """The bubble in cost units summed over the stages: ``p`` x the step's length -
        the busy time (arguments as in `idle_fraction`).

        Returns:
          A float >= 0: ``2 p (p - 1)`` for GPipe and 1F1B at the default equal costs;
          with a backward of two forwards the slot-synchronous 1F1B idles more, as a B on
          one stage stretches the slot of an F on the next.

        Example:
          >>> one_f_one_b_schedule(4, 8).idle_time(), one_f_one_b_schedule(4, 8).idle_time(1.0, 2.0)
          (24.0, 64.0)
          >>> zero_bubble_schedule(4, 8).idle_time(1.0, 1.0, 1.0)  # B + W = one backward of 2
          12.0
        """
        busy, span = self._busy_span(forward, backward, weight, sync)
        return self.num_stages * span - busy

    def in_flight(self) -> list[int]:
        """Per device, the most microbatches forwarded but not yet done at once (the
        stashes the device holds): counted from F to B, or from F to W in a split table,
        over all the device's chunks (chunk-microbatches when v > 1). ``m`` for GPipe,
        ``p - s`` for 1F1B (``k (p - s)`` with ``forwards_per_slot=k``), ``p`` for ZB-H1.

        Returns:
          A list of ``p`` ints.
        """
        done = "W" if self.split_backward else "B"
        out = []
        for s in range(self.num_stages):
            live = peak = 0
            for row in self.table:
                for a in _cell_actions(row[s]):
                    live += 1 if a.kind == "F" else -1 if a.kind == done else 0
                    peak = max(peak, live)
            out.append(peak)
        return out

    def program(self) -> Program:
        """The per-action arrays the pipeline runtime follows: kinds, microbatches, chunks,
        and the buffer entries every action reads, writes and sends to (see `Program` for
        the timing model); entries given out first-fit, so each buffer is as small as the
        table allows.

        Returns:
          A `Program` of int32 arrays of shape ``(T, p, lanes)`` and the buffer sizes.

        Example:
          >>> prog = one_f_one_b_schedule(2, 2).program()
          >>> prog.kind[:, 0, 0].tolist(), prog.stash[:, 0, 0].tolist()
          ([1, 1, 0, 2, 0, 2], [0, 1, 0, 0, 0, 1])
        """
        p, v, L = self.num_stages, self.virtual_stages, self.lanes
        nv, split, lt = v * p, self.split_backward, self._lane_times()
        run = lambda key: 2 * (lt[key][0] * L + lt[key][1])  # noqa: E731
        arrive = lambda key: 2 * (lt[key][0] + 1) * L - 1  # noqa: E731
        ivs: dict[str, list[list[tuple[int, int, Any]]]] = {
            b: [[] for _ in range(p)] for b in ("stash", "inbox_f", "inbox_b", "kept")
        }
        for kind, k, i in lt:
            if kind != "F":
                continue
            d = self.device_of(k)[0]
            ivs["stash"][d].append((run(("F", k, i)), run(("W" if split else "B", k, i)), (k, i)))
            if k:
                ivs["inbox_f"][d].append((arrive(("F", k - 1, i)), run(("F", k, i)), (k, i)))
            src = ("B", k + 1, i) if k < nv - 1 else ("F", k, i)
            ivs["inbox_b"][d].append((arrive(src), run(("B", k, i)), (k, i)))
            if split:
                ivs["kept"][d].append((run(("B", k, i)), run(("W", k, i)), (k, i)))
        entry: dict[str, dict[tuple[int, int], int]] = {}
        sizes: dict[str, int] = {}
        for b, per_dev in ivs.items():
            entry[b], sizes[b] = {}, 1
            for iv in per_dev:
                e, n = _first_fit(iv)
                entry[b].update(e)
                sizes[b] = max(sizes[b], n)
        arr = {
            f: np.zeros((self.num_slots, p, L), np.int32) for f in Program._fields if f != "sizes"
        }
        for (kind, k, i), (t, lane) in lt.items():
            d, chunk = self.device_of(k)
            at = (t, d, lane)
            arr["kind"][at], arr["microbatch"][at], arr["chunk"][at] = _CODE[kind], i, chunk
            arr["stash"][at] = entry["stash"][k, i]
            if kind == "F":
                if k:
                    arr["inbox_f"][at] = entry["inbox_f"][k, i]
                if k < nv - 1:
                    arr["send_f"][at] = entry["inbox_f"][k + 1, i]
                else:
                    arr["send_b"][at] = entry["inbox_b"][k, i]
            elif kind == "B":
                arr["inbox_b"][at] = entry["inbox_b"][k, i]
                if k:
                    arr["send_b"][at] = entry["inbox_b"][k - 1, i]
            if split and kind != "F":
                arr["kept"][at] = entry["kept"][k, i]
        return Program(**arr, sizes=sizes)

    def as_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(kinds, microbatches)``, int32 arrays of shape ``(T, p, lanes)``; kinds are
        0 idle, 1 forward, 2 backward, 3 weight gradient (idle cells have microbatch 0).
        `program` adds the chunks and buffer entries."""
        prog = self.program()
        return prog.kind, prog.microbatch

    def __str__(self) -> str:
        p, m, v = self.num_stages, self.num_microbatches, self.virtual_stages

        def label(a: Action) -> str:
            return f"{a.kind}{a.microbatch}" + (f".{a.chunk}" if v > 1 else "")

        def text(c):
            return "+".join(label(a) for a in _cell_actions(c)) or "."

        width = max(3, *(len(text(c)) + 1 for row in self.table for c in row))
        k = self.lanes
        idle = (
            f"idle {self.idle_slots()}/{self.num_slots * p} = {self.idle_fraction():.1%}"
            if k == 1
            else f"idle {self.idle_fraction(1.0, float(k)):.1%} with B = {k} F"
        )
        chunks = (f" x {v} chunks" if v > 1 else "") + (" (V)" if self.placement == "v" else "")
        flight = "max in flight (F to W)" if self.split_backward else "max in flight"
        head = (
            f"{self.name}: {p} stages{chunks} x {m} microbatches, {self.num_slots} slots, "
            f"{idle}, {flight} per stage {self.in_flight()}"
        )
        axis = "slot    " + "".join(f"{t:>{width}}" for t in range(self.num_slots))
        rows = [f"stage {s:<2}" + "".join(f"{text(r[s]):>{width}}" for r in self.table)
                for s in range(p)]  # fmt: skip
        return "\n".join([head, axis, *rows])

    # -- validation ------------------------------------------------------------------
    def _validate(self) -> None:
        p, m, v = self.num_stages, self.num_microbatches, self.virtual_stages
        where = f"Schedule {self.name!r}"
        for name, n in (("num_stages", p), ("num_microbatches", m), ("virtual_stages", v)):
            if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{where}: {name} must be a positive int, got {n!r}.")
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"{where}: placement must be 'loop' (chunk c of device s is virtual stage "
                f"c p + s) or 'v' (odd chunks run the other way), got {self.placement!r}."
            )
        seen = self._cells_seen()
        split = any(k[0] == "W" for k in seen)
        self._validate_complete(seen, split)
        self._validate_order(seen, split)

    def _cells_seen(self) -> dict[tuple[str, int, int], tuple[int, int]]:
        """``{(kind, virtual stage, microbatch): (slot, lane)}``, checking each cell."""
        p, m, v = self.num_stages, self.num_microbatches, self.virtual_stages
        where = f"Schedule {self.name!r}"
        seen: dict[tuple[str, int, int], tuple[int, int]] = {}
        for t, row in enumerate(self.table):
            if len(row) != p:
                raise ValueError(
                    f"{where}: slot {t} has {len(row)} cells; every slot needs "
                    f"one per stage ({p}), None for idle."
                )
            for s, cell in enumerate(row):
                for lane, c in enumerate(_cell_actions(cell)):
                    if c.kind not in ("F", "B", "W") or not (
                        0 <= c.microbatch < m and 0 <= c.chunk < v
                    ):
                        raise ValueError(
                            f"{where}: slot {t}, stage {s}: {c!r} is not a cell of this table: "
                            f"an action is ('F'|'B'|'W', microbatch in [0, {m}), chunk in "
                            f"[0, {v})) (chunk > 0 needs virtual_stages > 1)."
                        )
                    key = (c.kind, self.virtual_stage(s, c.chunk), c.microbatch)
                    if key in seen:
                        raise ValueError(
                            f"{where}: {self._label(c)} runs twice on stage {s} (slots "
                            f"{seen[key][0]} and {t}); each runs exactly once."
                        )
                    seen[key] = (t, lane)
        return seen

    def _validate_complete(self, seen: dict, split: bool) -> None:
        """Every (virtual stage, microbatch) runs F and B (and W in a split table)."""
        where, kinds = f"Schedule {self.name!r}", "FBW" if split else "FB"
        for k in range(self.num_stages * self.virtual_stages):
            dev, c = self._where(k), self.device_of(k)[1]
            for i in range(self.num_microbatches):
                for kind in kinds:
                    if (kind, k, i) not in seen:
                        raise ValueError(
                            f"{where}: {dev} never runs {self._label(Action(kind, i, c))}; "
                            + (
                                "a table with W actions (a split backward) runs F, B and W of "
                                "every microbatch on every stage."
                                if split
                                else "every stage runs F and B of every microbatch."
                            )
                        )

    def _validate_order(self, seen: dict, split: bool) -> None:
        """The dependencies: F after its forward input, B after its F and the next
        stage's B, W after its B."""
        where, nv = f"Schedule {self.name!r}", self.num_stages * self.virtual_stages
        for k in range(nv):
            dev, c = self._where(k), self.device_of(k)[1]
            for i in range(self.num_microbatches):
                f, b = seen["F", k, i][0], seen["B", k, i][0]
                F, B = self._label(Action("F", i, c)), self._label(Action("B", i, c))
                if b <= f:
                    raise ValueError(
                        f"{where}: {dev} runs {B} (slot {b}) before or with "
                        f"{F} (slot {f}); a backward needs its forward first."
                    )
                if k and f <= seen["F", k - 1, i][0]:
                    raise ValueError(
                        f"{where}: {dev} runs {F} at slot {f}, not after "
                        f"{self._where(k - 1)} (slot {seen['F', k - 1, i][0]}) sends its "
                        "activation; a forward needs the previous stage's forward in an "
                        "earlier slot."
                    )
                if k < nv - 1 and b <= seen["B", k + 1, i][0]:
                    raise ValueError(
                        f"{where}: {dev} runs {B} at slot {b}, not after "
                        f"{self._where(k + 1)} (slot {seen['B', k + 1, i][0]}) sends its "
                        "cotangent; a backward needs the next stage's backward in an "
                        "earlier slot."
                    )
                if split and seen["W", k, i] <= seen["B", k, i]:
                    (tw, lw), (tb, lb) = seen["W", k, i], seen["B", k, i]
                    raise ValueError(
                        f"{where}: {dev} runs {self._label(Action('W', i, c))} at slot {tw} "
                        f"(lane {lw}), not after its {B} (slot {tb}, lane {lb}); the weight "
                        "gradient needs the input-gradient backward's cotangent first (a "
                        "later slot, or a later lane of the same slot)."
                    )

    def _label(self, a: Action) -> str:
        return f"{a.kind}{a.microbatch}" + (f".{a.chunk}" if self.virtual_stages > 1 else "")

    def _where(self, k: int) -> str:
        if self.virtual_stages == 1:
            return f"stage {k}"
        d, c = self.device_of(k)
        return f"device {d} (chunk {c}, virtual stage {k})"


def _check_counts(fn: str, num_stages: int, num_microbatches: int) -> None:
    for name, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{fn}: {name} must be a positive int, got {v!r}.")


def gpipe_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs the forwards of all microbatches, then their backwards.

    Stage ``s`` runs ``F i`` in slot ``s + i`` and ``B i`` in slot
    ``(m + p - 1) + (p - 1 - s) + i``; ``2 (m + p - 1)`` slots, ``m`` microbatches in
    flight per stage.

    Args:
      num_stages: ``p >= 1``.
      num_microbatches: ``m >= 1``.

    Returns:
      The validated `Schedule`.

    Example:
      >>> print(gpipe_schedule(2, 2))  # doctest: +NORMALIZE_WHITESPACE
      gpipe: 2 stages x 2 microbatches, 6 slots, idle 4/12 = 33.3%, max in flight per stage [2, 2]
      slot      0  1  2  3  4  5
      stage 0  F0 F1  .  . B0 B1
      stage 1   . F0 F1 B0 B1  .
    """
    _check_counts("gpipe_schedule", num_stages, num_microbatches)
    p, m = int(num_stages), int(num_microbatches)
    n = m + p - 1
    table: list[list[Action | None]] = [[None] * p for _ in range(2 * n)]
    for s in range(p):
        for i in range(m):
            table[s + i][s] = Action("F", i)
            table[n + (p - 1 - s) + i][s] = Action("B", i)
    return Schedule("gpipe", p, m, tuple(tuple(r) for r in table))


def one_f_one_b_schedule(
    num_stages: int, num_microbatches: int, *, forwards_per_slot: int = 1
) -> Schedule:
    """1F1B: warm-up forwards, then one forward / one backward, then the cool-down.

    Stage ``s`` runs its actions in the order ``F0 .. F(w-1)``, then ``F w, B0, F(w+1),
    B1, ...``, then the remaining backwards, with ``w = p - s - 1`` warm-up forwards; each
    action runs in the first slot after its inputs arrived (the previous stage's forward,
    the next stage's backward). So stage ``s`` holds at most ``p - s`` microbatches'
    activations, against ``m`` under GPipe, in the same ``2 (m + p - 1)`` slots.

    With ``forwards_per_slot=k > 1`` a slot holds one backward or up to ``k`` forwards
    (named ``'1f1b-kf'``): in every slot each stage runs its next backward if its inputs
    arrived, else up to ``k`` forwards whose inputs arrived, keeping at most ``k (p - s)``
    microbatches in flight on stage ``s``. Since a backward costs about two forwards, with
    ``k = 2`` every steady-state slot is full on every stage, where plain 1F1B lets a
    forward wait for a backward on the next stage in each slot: the busy fraction
    (`Schedule.idle_fraction` with a backward of 2 forwards) at p = 4, m = 32 rises from
    0.706 to 0.889, for twice the stash (still flat in ``m``).

    Args:
      num_stages: ``p >= 1``.
      num_microbatches: ``m >= p`` (with fewer microbatches the steady phase is empty;
        use `gpipe_schedule`).
      forwards_per_slot: ``k >= 1``, the forwards a slot may hold (the cost of a
        backward in forwards).

    Returns:
      The validated `Schedule`.

    Raises:
      ValueError: ``m < p``; ``k < 1``.

    Example:
      >>> print(one_f_one_b_schedule(2, 2))  # doctest: +NORMALIZE_WHITESPACE
      1f1b: 2 stages x 2 microbatches, 6 slots, idle 4/12 = 33.3%, max in flight per stage [2, 1]
      slot      0  1  2  3  4  5
      stage 0  F0 F1  . B0  . B1
      stage 1   . F0 B0 F1 B1  .
    """
    _check_counts("one_f_one_b_schedule", num_stages, num_microbatches)
    p, m = int(num_stages), int(num_microbatches)
    if m < p:
        raise ValueError(
            f"one_f_one_b_schedule: num_microbatches={m} < num_stages={p}; 1F1B needs at "
            f"least as many microbatches as stages (use num_microbatches >= {p}, or "
            "gpipe_schedule)."
        )
    if not isinstance(forwards_per_slot, (int, np.integer)) or forwards_per_slot < 1:
        raise ValueError(
            f"one_f_one_b_schedule: forwards_per_slot must be an int >= 1 (1: plain 1F1B, "
            f"2: a slot holds one backward or two forwards), got {forwards_per_slot!r}."
        )
    if forwards_per_slot > 1:
        return _packed_one_f_one_b(p, m, int(forwards_per_slot))
    orders: list[list[Action]] = []
    for s in range(p):
        w = min(p - s - 1, m)
        order = [Action("F", i) for i in range(w)]
        for i in range(w, m):
            order += [Action("F", i), Action("B", i - w)]
        order += [Action("B", i) for i in range(m - w, m)]
        orders.append(order)
    return _place_in_order("1f1b", p, m, 1, orders)


def _place_in_order(
    name: str, p: int, m: int, v: int, orders: list[list[Action]], placement: str = "loop"
) -> Schedule:
    """Each device runs its actions in the given order, one per slot, each in the first
    slot after its input arrived (F: the previous virtual stage's F; B: the next one's B,
    or on the last virtual stage its own F; W: its own B)."""
    nv = v * p
    done: dict[tuple[str, int, int], int] = {}
    nxt = [0] * p
    table: list[list[Action | None]] = []
    t = 0
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        row: list[Action | None] = [None] * p
        for s in range(p):
            if nxt[s] == len(orders[s]):
                continue
            a = orders[s][nxt[s]]
            k, i = _virtual_stage(placement, p, s, a.chunk), a.microbatch
            if a.kind == "F":
                dep = ("F", k - 1, i) if k else None
            elif a.kind == "B":
                dep = ("B", k + 1, i) if k < nv - 1 else ("F", k, i)
            else:
                dep = ("B", k, i)
            if dep is None or done.get(dep, t) < t:
                row[s] = a
        if all(a is None for a in row):  # a wrong order: no device can go on
            raise RuntimeError(f"{name}: the per-device orders deadlock at slot {t}.")
        for s, a in enumerate(row):
            if a is not None:
                done[(a.kind, _virtual_stage(placement, p, s, a.chunk), a.microbatch)] = t
                nxt[s] += 1
        table.append(row)
        t += 1
    return Schedule(name, p, m, tuple(tuple(r) for r in table), v, placement)


def _packed_one_f_one_b(p: int, m: int, k: int) -> Schedule:
    """1F1B whose slots hold one backward or up to `k` forwards (see
    `one_f_one_b_schedule`): greedy, backwards first, at most ``k (p - s)`` in flight."""
    done: dict[tuple[str, int, int], int] = {}
    nf, nb = [0] * p, [0] * p
    table: list[tuple[Action | tuple[Action, ...] | None, ...]] = []

    def ready(key: tuple[str, int, int], t: int) -> bool:
        return key in done and done[key] < t

    t = 0
    while any(n < m for n in nb):
        row: list[Action | tuple[Action, ...] | None] = []
        for s in range(p):
            i = nb[s]
            back_dep = ("B", s + 1, i) if s < p - 1 else ("F", s, i)
            if i < m and ready(("F", s, i), t) and ready(back_dep, t):
                row.append(Action("B", i))
                continue
            fwd = []
            while (
                len(fwd) < k
                and (j := nf[s] + len(fwd)) < m
                and j - nb[s] < k * (p - s)
                and (s == 0 or ready(("F", s - 1, j), t))
            ):
                fwd.append(Action("F", j))
            row.append(None if not fwd else fwd[0] if len(fwd) == 1 else tuple(fwd))
        for s, c in enumerate(row):
            for a in _cell_actions(c):
                done[(a.kind, s, a.microbatch)] = t
                if a.kind == "F":
                    nf[s] += 1
                else:
                    nb[s] += 1
        table.append(tuple(row))
        t += 1
    return Schedule(f"1f1b-{k}f", p, m, tuple(table))


def interleaved_schedule(num_stages: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM's order): each device holds ``v`` stage chunks, chunk
    ``c`` of device ``s`` being virtual stage ``c p + s`` of the model's ``v p`` stages.

    Device ``s`` runs ``n = v m`` forwards and ``n`` backwards. Forward ``k`` is microbatch
    ``(k // (p v)) p + k % p`` on chunk ``(k // p) % v``: groups of ``p`` microbatches go
    through chunk 0, then chunk 1, ...; backward ``k`` the same microbatch on chunk
    ``v - 1 - (k // p) % v``. It runs ``w = min(2 (p - s - 1) + (v - 1) p, n)`` warm-up
    forwards, then alternates one forward and one backward, then the remaining backwards,
    each action in the first slot after its input arrived. ``2 (v m + p - 1)`` slots of
    chunk actions (each ``1 / v`` of a stage's work), so an idle fraction of
    ``(p - 1) / (v m + p - 1)``; the price is more microbatches in flight: device ``s``
    holds up to ``w + 1`` chunk stashes (at p = 4, v = 2: 11 on device 0, 5.5 stages'
    worth, against 1F1B's 4: a factor ``1 + (p - 1) / (v p)`` over 1F1B in the worst
    device's stash).

    Args:
      num_stages: ``p >= 1``, the devices along the pipeline axis.
      num_microbatches: ``m``, a multiple of ``p`` (and ``>= p``).
      virtual_stages: ``v >= 2``, chunks per device (for one, `one_f_one_b_schedule`).

    Returns:
      The validated `Schedule` (named ``'interleaved'``, ``virtual_stages=v``).

    Raises:
      ValueError: ``m`` not a multiple of ``p``; ``v < 2``.

    Example:
      >>> print(interleaved_schedule(2, 2, 2))  # doctest: +NORMALIZE_WHITESPACE
      interleaved: 2 stages x 2 chunks x 2 microbatches, 10 slots, idle 4/20 = 20.0%,
      max in flight per stage [4, 3]
      slot        0    1    2    3    4    5    6    7    8    9
      stage 0  F0.0 F1.0 F0.1 F1.1    . B0.1    . B1.1 B0.0 B1.0
      stage 1     . F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0    .
    """
    fn = "interleaved_schedule"
    _check_counts(fn, num_stages, num_microbatches)
    p, m = int(num_stages), int(num_microbatches)
    v = virtual_stages
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 2:
        raise ValueError(
            f"{fn}: virtual_stages must be an int >= 2 (stage chunks per device), got {v!r}; "
            "for one stage per device use one_f_one_b_schedule."
        )
    v = int(v)
    if m % p or m < p:
        raise ValueError(
            f"{fn}: num_microbatches={m} must be a multiple of num_stages={p} (the order "
            f"sends groups of {p} microbatches through each chunk); use num_microbatches="
            f"{max(p, -(-m // p) * p)}."
        )
    n = v * m
    orders: list[list[Action]] = []
    for s in range(p):
        fwd = [Action("F", (k // (p * v)) * p + k % p, (k // p) % v) for k in range(n)]
        bwd = [Action("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v) for k in range(n)]
        w = min((p - s - 1) * 2 + (v - 1) * p, n)
        order = fwd[:w]
        for j in range(n - w):
            order += [fwd[w + j], bwd[j]]
        order += bwd[n - w :]
        orders.append(order)
    return _place_in_order("interleaved", p, m, v, orders)


def zero_bubble_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (zero bubble, 1F1B's memory): the backward is split into B, the cotangent of
    the stage input that the previous stage waits for, and W, the weight gradient, which
    nothing waits for and which fills the slots 1F1B leaves idle.

    Device ``s`` runs 1F1B's order with ``w = p - s - 1`` warm-up forwards, then for
    ``i = 0 .. m - 1``: ``F(w + i)`` (while ``w + i < m``), ``B i`` and ``W(i - s)`` (W
    delayed by ``s`` microbatches, from ``i = s`` on), then the remaining W's; each action
    in the first slot after its input arrived. With F, B and W of equal cost it takes
    ``3 m + p - 1`` slots (idle fraction ``(p - 1) / (3 m + p - 1)``, against 1F1B's
    ``2 (p - 1)`` slots of a whole backward per stage), and every device keeps at most
    ``p`` microbatches from F to W in flight (1F1B: ``p`` on device 0).

    Args:
      num_stages: ``p >= 1``.
      num_microbatches: ``m >= p``.

    Returns:
      The validated `Schedule` (named ``'zb-h1'``, with W actions).

    Raises:
      ValueError: ``m < p``.

    Example:
      >>> print(zero_bubble_schedule(2, 2))  # doctest: +NORMALIZE_WHITESPACE
      zb-h1: 2 stages x 2 microbatches, 7 slots, idle 2/14 = 14.3%,
      max in flight (F to W) per stage [2, 2]
      slot      0  1  2  3  4  5  6
      stage 0  F0 F1  . B0 W0 B1 W1
      stage 1   . F0 B0 F1 B1 W0 W1
    """
    fn = "zero_bubble_schedule"
    _check_counts(fn, num_stages, num_microbatches)
    p, m = int(num_stages), int(num_microbatches)
    if m < p:
        raise ValueError(
            f"{fn}: num_microbatches={m} < num_stages={p}; ZB-H1 needs at least as many "
            f"microbatches as stages (use num_microbatches >= {p}, or gpipe_schedule)."
        )
    orders: list[list[Action]] = []
    for s in range(p):
        w = p - s - 1
        order = [Action("F", i) for i in range(w)]
        for i in range(m):
            if w + i < m:
                order.append(Action("F", w + i))
            order.append(Action("B", i))
            if i - s >= 0:
                order.append(Action("W", i - s))
        order += [Action("W", i) for i in range(max(m - s, 0), m)]
        orders.append(order)
    return _place_in_order("zb-h1", p, m, 1, orders)


def zero_bubble_v_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-V (zero bubble in a V, torchtitan's ``ScheduleZBVZeroBubble``): two stage
    chunks per device, placed in a V (``placement='v'``: device ``s`` runs model stages
    ``s`` and ``2 p - 1 - s``, so device 0 runs the first and the last, and the activation
    turns around on device ``p - 1`` without a transfer), the backward split into B and
    W as in ZB-H1.

    Device ``s`` runs, in order (``F0 i``: forward of microbatch ``i`` on chunk 0):
    ``2 (p - s) - 1`` forwards on chunk 0; ``s`` pairs ``F1, F0``; ``p - s`` triples
    ``F1, B1, W1``; then, while forwards remain, ``F0, B0, W0, F1, B1, W1``; then ``s``
    pairs ``B0, B1``, ``p - s`` pairs ``B0, W0`` and the remaining W's (chunk 1's first).
    The order is written for ``max(m, 2 p - 1)`` microbatches and the actions of
    microbatches ``>= m`` are dropped; each action runs in the first slot after its input
    arrived. A chunk action is half a stage's work; with F = B = W its idle fraction is
    below ZB-H1's at the same ``m`` (the fill and drain are chunk actions), and a device
    keeps at most about ``2 p`` chunk-microbatches (``p`` stages' worth, 1F1B's) in
    flight.

    Args:
      num_stages: ``p >= 1``.
      num_microbatches: ``m >= 1``.

    Returns:
      The validated `Schedule` (named ``'zb-v'``, ``virtual_stages=2``,
      ``placement='v'``, with W actions). Stack the ``2 p`` stages' params in its
      `Schedule.stacking_order`.

    Example:
      >>> s = zero_bubble_v_schedule(2, 2)
      >>> s.stacking_order  # device 0 holds model stages 0 and 3, device 1 stages 1 and 2
      (0, 1, 3, 2)
      >>> print(s)  # doctest: +NORMALIZE_WHITESPACE
      zb-v: 2 stages x 2 chunks (V) x 2 microbatches, 14 slots, idle 4/28 = 14.3%,
      max in flight (F to W) per stage [3, 4]
      slot        0    1    2    3    4    5    6    7    8    9   10   11   12   13
      stage 0  F0.0 F1.0    . F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 B0.0 W0.0    . B1.0 W1.0
      stage 1     . F0.0 F0.1 F1.0 F1.1 B0.1 W0.1 B0.0 W0.0 B1.1 W1.1 B1.0 W1.0    .
    """
    fn = "zero_bubble_v_schedule"
    _check_counts(fn, num_stages, num_microbatches)
    p, m = int(num_stages), int(num_microbatches)
    n = max(m, 2 * p - 1)
    orders = [[a for a in _zbv_order(p, n, s) if a.microbatch < m] for s in range(p)]
    return _place_in_order("zb-v", p, m, 2, orders, "v")


def _zbv_order(p: int, n: int, s: int) -> list[Action]:
    """Device `s`'s actions under ZB-V for `n` microbatches (`zero_bubble_v_schedule`)."""
    order: list[Action] = []
    count = {(kind, c): 0 for kind in "FBW" for c in (0, 1)}

    def run(*acts: tuple[str, int]) -> None:
        for kind, c in acts:
            order.append(Action(kind, count[kind, c], c))
            count[kind, c] += 1

    for _ in range(2 * (p - s) - 1):
        run(("F", 0))
    for _ in range(s):
        run(("F", 1), ("F", 0))
    for _ in range(p - s):
        run(("F", 1), ("B", 1), ("W", 1))
    while count["F", 1] < count["F", 0] or count["F", 0] < n:
        if count["F", 0] < n:
            run(("F", 0))
        run(("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
    for _ in range(s):
        run(("B", 0), ("B", 1))
    for _ in range(p - s):
        run(("B", 0), ("W", 0))
    while count["W", 1] < count["B", 1]:
        run(("W", 1))
    while count["W", 0] < count["B", 0]:
        run(("W", 0))
    return order


def schedule_from(
    name: str | Schedule,
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int | None = None,
) -> Schedule:
    """`Schedule` by name, or `name` itself after checking it matches the counts.

    Names: ``'gpipe'``, ``'1f1b'``, ``'1f1b-kf'`` (1F1B with ``forwards_per_slot=k``),
    ``'interleaved'`` (needs ``virtual_stages >= 2``), ``'zb'`` / ``'zb-h1'``, ``'zbv'`` /
    ``'zb-v'`` (two chunks per device in a V).
    ``virtual_stages=None`` means 1 (or a given Schedule's own).
    """
    v = virtual_stages
    if isinstance(name, Schedule):
        if (name.num_stages, name.num_microbatches) != (num_stages, num_microbatches) or (
            v is not None and v != name.virtual_stages
        ):
            want = "" if v is None else f" x {v} virtual stages"
            raise ValueError(
                f"schedule {name.name!r} is for {name.num_stages} stages x "
                f"{name.num_microbatches} microbatches x {name.virtual_stages} virtual stages, "
                f"but the pipeline has {num_stages} stages x {num_microbatches} microbatches"
                f"{want}; build it with those counts."
            )
        return name
    if v is not None and (not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1):
        raise ValueError(f"virtual_stages must be a positive int or None, got {v!r}.")
    if name == "interleaved":
        if v is None or v < 2:
            raise ValueError(
                f"schedule 'interleaved' needs virtual_stages >= 2 (stage chunks per device), "
                f"got {v!r}; pass virtual_stages=2 or more, or use schedule='1f1b'."
            )
        return interleaved_schedule(num_stages, num_microbatches, int(v))
    if name in ("zbv", "zb-v"):
        if v not in (None, 2):
            raise ValueError(
                f"schedule {name!r} (ZB-V) runs two stage chunks per device, got "
                f"virtual_stages={v}; leave virtual_stages out or pass 2."
            )
        return zero_bubble_v_schedule(num_stages, num_microbatches)
    if v not in (None, 1):
        raise ValueError(
            f"virtual_stages={v} needs schedule='interleaved' (or a Schedule built with "
            f"virtual_stages={v}); schedule {name!r} runs one stage per device."
        )
    makers = {
        "gpipe": gpipe_schedule,
        "1f1b": one_f_one_b_schedule,
        "zb": zero_bubble_schedule,
        "zb-h1": zero_bubble_schedule,
    }
    packed = re.fullmatch(r"1f1b-([1-9][0-9]*)f", name) if isinstance(name, str) else None
    if packed:
        k = int(packed.group(1))
        return one_f_one_b_schedule(num_stages, num_microbatches, forwards_per_slot=k)
    if name not in makers:
        raise ValueError(
            f"unknown schedule {name!r}; use 'gpipe', '1f1b', '1f1b-2f' (a slot holds one "
            "backward or two forwards), 'interleaved' (with virtual_stages >= 2), 'zb' "
            "(ZB-H1, a split backward), 'zbv' (ZB-V: two chunks per device in a V) or a "
            "Schedule."
        )
    return makers[name](num_stages, num_microbatches)
