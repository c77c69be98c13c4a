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
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Action", "Schedule", "gpipe_schedule", "one_f_one_b_schedule"]

IDLE, FORWARD, BACKWARD = 0, 1, 2


class Action(NamedTuple):
    """One cell of a schedule table: ``kind`` is ``'F'`` or ``'B'``, on `microbatch`."""

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def _intervals_fit(intervals: list[tuple[int, int, int]], k: int) -> bool:
    # intervals: (microbatch, written at slot a, last read at slot b), a < b.
    # Two entries sharing the slot ``microbatch % k`` must not be alive at the same time.
    by_slot: dict[int, list[tuple[int, int]]] = {}
    for i, a, b in intervals:
        by_slot.setdefault(i % k, []).append((a, b))
    for spans in by_slot.values():
        spans.sort()
        for (_, b0), (a1, _) in zip(spans, spans[1:], strict=False):
            if a1 < b0:
                return False
    return True


def _buffer_size(per_stage: list[list[tuple[int, int, int]]], m: int) -> int:
    for k in range(1, m + 1):
        if all(_intervals_fit(iv, k) for iv in per_stage):
            return k
    return m


def _normalize_cell(c: Any) -> Action | tuple[Action, ...] | None:
    """``None`` / ``()`` -> None; ``('F', 0)`` or an `Action` -> Action; a sequence of
    those -> a tuple of Actions (one -> that Action)."""
    if c is None:
        return None
    if isinstance(c, (tuple, list)) and c and isinstance(c[0], str):
        if len(c) != 2:
            raise ValueError("an action is a pair (kind, microbatch)")
        return Action(str(c[0]), int(c[1]))
    acts = tuple(_normalize_cell(a) for a in c)
    if any(not isinstance(a, Action) for a in acts):
        raise ValueError("a cell of several actions lists (kind, microbatch) pairs")
    return None if not acts else acts[0] if len(acts) == 1 else acts


def _cell_actions(c: Action | tuple[Action, ...] | None) -> tuple[Action, ...]:
    if c is None:
        return ()
    return (c,) if isinstance(c, Action) else c


def _per_stage(value: float | Any, p: int, name: str) -> list[float]:
    if isinstance(value, (int, float, np.integer, np.floating)):
        return [float(value)] * p
    vals = [float(v) for v in value]
    if len(vals) != p:
        raise ValueError(
            f"Schedule.idle_fraction: {name} has {len(vals)} entries; pass one number, or one "
            f"per stage ({p})."
        )
    return vals


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A static pipeline schedule: ``table[t][s]`` is what stage ``s`` runs in time slot
    ``t``: an `Action`, a tuple of Actions run one after the other (e.g. two forwards), or
    ``None`` (idle).

    Build one with `gpipe_schedule` or `one_f_one_b_schedule`, or pass your own table
    (cells as Actions, ``('F', i)`` pairs or tuples of them); the constructor validates it
    (every microbatch runs forward then backward once on every stage; stage ``s`` runs the
    forward of microbatch ``i`` in a later slot than stage ``s - 1`` and its backward in a
    later slot than stage ``s + 1``) and raises ``ValueError`` naming the first violation.
    ``str(schedule)`` prints the table, one row per stage.

    Attributes:
      name: a label (``'gpipe'``, ``'1f1b'``, ``'1f1b-2f'``, or yours).
      num_stages: ``p``.
      num_microbatches: ``m``.
      table: ``T`` rows (time slots) of ``p`` cells.
    """

    name: str
    num_stages: int
    num_microbatches: int
    table: tuple[tuple[Action | tuple[Action, ...] | None, ...], ...]

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
                        f"('F'|'B', microbatch), or a tuple of those): {e}"
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

    def actions(self, slot: int, stage: int) -> tuple[Action, ...]:
        """The actions of ``table[slot][stage]`` as a tuple (empty when idle)."""
        return _cell_actions(self.table[slot][stage])

    def times(self) -> dict[tuple[str, int, int], int]:
        """``{(kind, stage, microbatch): slot}`` for every action in the table."""
        return {k: t for k, (t, _) in self._lane_times().items()}

    def _lane_times(self) -> dict[tuple[str, int, int], tuple[int, int]]:
        out = {}
        for t, row in enumerate(self.table):
            for s, c in enumerate(row):
                for lane, a in enumerate(_cell_actions(c)):
                    out[(a.kind, s, a.microbatch)] = (t, lane)
        return out

    def idle_slots(self) -> int:
        """The number of idle cells (stage x slot) in the table."""
        return sum(c is None for row in self.table for c in row)

    def idle_fraction(self, forward: float | Any = 1.0, backward: float | Any = 1.0) -> float:
        """The idle fraction of the slot-synchronous runtime: every slot lasts as long as
        its busiest stage (the sum of its cell's action costs), and idle = 1 - sum of the
        busy times / (p x sum of the slot lengths).

        Args:
          forward: the cost of a forward, one number or one per stage.
          backward: the cost of a backward, one number or one per stage.

        Returns:
          A float in [0, 1); with the default equal costs and one action per cell, the
          idle cells over all cells: ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B.

        Example:
          >>> round(one_f_one_b_schedule(4, 32).idle_fraction(1.0, 2.0), 3)
          0.294
          >>> round(one_f_one_b_schedule(4, 32, forwards_per_slot=2).idle_fraction(1.0, 2.0), 3)
          0.111
        """
        p = self.num_stages
        cost = {"F": _per_stage(forward, p, "forward"), "B": _per_stage(backward, p, "backward")}
        busy = span = 0.0
        for row in self.table:
            loads = [sum(cost[a.kind][s] for a in _cell_actions(c)) for s, c in enumerate(row)]
            busy += sum(loads)
            span += max(loads)
        return 1.0 - busy / (p * span) if span else 0.0

    def in_flight(self) -> list[int]:
        """Per stage, the most microbatches forwarded but not yet backwarded at once
        (the stashed activations the stage holds): ``m`` for GPipe, ``p - s`` for 1F1B
        (``k (p - s)`` with ``forwards_per_slot=k``)."""
        out = []
        for s in range(self.num_stages):
            live = peak = 0
            for row in self.table:
                for a in _cell_actions(row[s]):
                    live += 1 if a.kind == "F" else -1
                    peak = max(peak, live)
            out.append(peak)
        return out

    def buffer_sizes(self) -> dict[str, int]:
        """Ring-buffer lengths the runtime allocates, indexed by ``microbatch % size``:
        ``'stash'`` (activations kept from a forward to its backward), ``'fwd_inbox'``
        and ``'bwd_inbox'`` (activations / cotangents received and not yet used; on the
        last stage, the cotangents of its own outputs)."""
        p, m, lt = self.num_stages, self.num_microbatches, self._lane_times()
        k = self.lanes
        # Event times within the step: the cell in (slot t, lane l) reads and writes at
        # 2 (t k + l); what arrives at the end of slot t is written at 2 (t + 1) k - 1.
        run = lambda key: 2 * (lt[key][0] * k + lt[key][1])  # noqa: E731
        arrive = lambda key: 2 * (lt[key][0] + 1) * k - 1  # noqa: E731
        stash = [[(i, run(("F", s, i)), run(("B", s, i))) for i in range(m)] for s in range(p)]
        fwd = [
            [(i, arrive(("F", s - 1, i)), run(("F", s, i))) for i in range(m)] if s else []
            for s in range(p)
        ]
        # The last stage keeps its own output cotangents (from last_fn, computed in its
        # forward slot) in its backward inbox until its backward.
        bwd = [
            [(i, arrive(("F" if s == p - 1 else "B", min(s + 1, p - 1), i)), run(("B", s, i)))
             for i in range(m)]
            for s in range(p)
        ]  # fmt: skip
        return {
            "stash": _buffer_size(stash, m),
            "fwd_inbox": _buffer_size(fwd, m),
            "bwd_inbox": _buffer_size(bwd, m),
        }

    def as_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(kinds, microbatches)``, int32 arrays of shape ``(T, p, lanes)``; kinds are
        0 idle, 1 forward, 2 backward (idle cells have microbatch 0)."""
        kinds = np.zeros((self.num_slots, self.num_stages, self.lanes), np.int32)
        mbs = np.zeros_like(kinds)
        for t, row in enumerate(self.table):
            for s, c in enumerate(row):
                for lane, a in enumerate(_cell_actions(c)):
                    kinds[t, s, lane] = FORWARD if a.kind == "F" else BACKWARD
                    mbs[t, s, lane] = a.microbatch
        return kinds, mbs

    def __str__(self) -> str:
        p, m = self.num_stages, self.num_microbatches

        def text(c):
            return "+".join(str(a) for a in _cell_actions(c)) or "."

        width = max(3, *(len(text(c)) + 1 for row in self.table for c in row))
        k = self.lanes
        idle = (
            f"idle {self.idle_slots()}/{self.num_slots * p} = {self.idle_fraction():.1%}"
            if k == 1
            else f"idle {self.idle_fraction(1.0, float(k)):.1%} with B = {k} F"
        )
        head = (
            f"{self.name}: {p} stages x {m} microbatches, {self.num_slots} slots, {idle}, "
            f"max in flight per stage {self.in_flight()}"
        )
        axis = "slot    " + "".join(f"{t:>{width}}" for t in range(self.num_slots))
        rows = [f"stage {s:<2}" + "".join(f"{text(r[s]):>{width}}" for r in self.table)
                for s in range(p)]  # fmt: skip
        return "\n".join([head, axis, *rows])

    # -- validation ------------------------------------------------------------------
    def _validate(self) -> None:
        p, m = self.num_stages, self.num_microbatches
        where = f"Schedule {self.name!r}"
        if not (isinstance(p, int) and p >= 1 and isinstance(m, int) and m >= 1):
            raise ValueError(
                f"{where}: num_stages ({p!r}) and num_microbatches ({m!r}) must be positive ints."
            )
        seen: dict[tuple[str, int, int], int] = {}
        for t, row in enumerate(self.table):
            if len(row) != p:
                raise ValueError(
                    f"{where}: slot {t} has {len(row)} cells; every slot needs "
                    f"one per stage ({p}), None for idle."
                )
            for s, cell in enumerate(row):
                for c in _cell_actions(cell):
                    if c.kind not in ("F", "B") or not 0 <= c.microbatch < m:
                        raise ValueError(
                            f"{where}: slot {t}, stage {s}: {c!r} is not ('F'|'B', "
                            f"microbatch in [0, {m}))."
                        )
                    key = (c.kind, s, c.microbatch)
                    if key in seen:
                        raise ValueError(
                            f"{where}: {c} runs twice on stage {s} (slots "
                            f"{seen[key]} and {t}); each runs exactly once."
                        )
                    seen[key] = t
        for s in range(p):
            for i in range(m):
                for kind in "FB":
                    if (kind, s, i) not in seen:
                        raise ValueError(
                            f"{where}: stage {s} never runs {kind}{i}; every "
                            "stage runs F and B of every microbatch."
                        )
                f, b = seen["F", s, i], seen["B", s, i]
                if b <= f:
                    raise ValueError(
                        f"{where}: stage {s} runs B{i} (slot {b}) before or with "
                        f"F{i} (slot {f}); a backward needs its forward first."
                    )
                if s and f <= seen["F", s - 1, i]:
                    raise ValueError(
                        f"{where}: stage {s} runs F{i} at slot {f}, not after stage "
                        f"{s - 1} (slot {seen['F', s - 1, i]}) sends its activation."
                    )
                if s < p - 1 and b <= seen["B", s + 1, i]:
                    raise ValueError(
                        f"{where}: stage {s} runs B{i} at slot {b}, not after stage "
                        f"{s + 1} (slot {seen['B', s + 1, i]}) sends its cotangent."
                    )


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
            if a.kind == "F":
                dep = ("F", s - 1, a.microbatch) if s else None
            else:
                dep = ("B", s + 1, a.microbatch) if s < p - 1 else ("F", s, a.microbatch)
            if dep is None or done.get(dep, t) < t:
                row[s] = a
        for s, a in enumerate(row):
            if a is not None:
                done[(a.kind, s, a.microbatch)] = t
                nxt[s] += 1
        table.append(row)
        t += 1
    return Schedule("1f1b", p, m, tuple(tuple(r) for r in table))


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


def schedule_from(name: str | Schedule, num_stages: int, num_microbatches: int) -> Schedule:
    """`Schedule` by name (``'gpipe'``, ``'1f1b'``, ``'1f1b-kf'``: 1F1B with
    ``forwards_per_slot=k``), or `name` itself after checking it
    matches the counts."""
    if isinstance(name, Schedule):
        if (name.num_stages, name.num_microbatches) != (num_stages, num_microbatches):
            raise ValueError(
                f"schedule {name.name!r} is for {name.num_stages} stages x "
                f"{name.num_microbatches} microbatches, but the pipeline has {num_stages} "
                f"stages x {num_microbatches} microbatches; build it with those counts."
            )
        return name
    makers = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}
    packed = re.fullmatch(r"1f1b-([1-9][0-9]*)f", name) if isinstance(name, str) else None
    if packed:
        k = int(packed.group(1))
        return one_f_one_b_schedule(num_stages, num_microbatches, forwards_per_slot=k)
    if name not in makers:
        raise ValueError(
            f"unknown schedule {name!r}; use 'gpipe', '1f1b', '1f1b-2f' (a slot holds one "
            "backward or two forwards) or a Schedule."
        )
    return makers[name](num_stages, num_microbatches)
