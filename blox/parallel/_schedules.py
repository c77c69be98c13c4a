"""Pipeline schedules as plain data: a table of time slot x stage -> action, that users
can print and check and that the pipeline runtime follows slot by slot.

Time is counted in *slots*; in one slot every stage runs at most one action, the
forward (``F``) or the backward (``B``) of one stage on one microbatch, and the
activation (or cotangent) it sends reaches the neighbouring stage at the end of the
slot. A forward and a backward are assumed to take one slot each.

* GPipe: all forwards, then all backwards. Each stage keeps the activations of all ``m``
  microbatches between its forward and its backward.
* 1F1B: stage ``s`` runs ``p - s - 1`` warm-up forwards, then alternates one forward and
  one backward, then runs the remaining backwards (cool-down). It keeps at most
  ``p - s <= p`` microbatches in flight.

Both take ``2 (m + p - 1)`` slots of which each stage is busy ``2 m``: an idle (bubble)
fraction of ``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

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


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A static pipeline schedule: ``table[t][s]`` is the `Action` of stage ``s`` in time
    slot ``t``, or ``None`` (idle).

    Build one with `gpipe_schedule` or `one_f_one_b_schedule`, or pass your own table;
    the constructor validates it (every microbatch runs forward then backward once on
    every stage; stage ``s`` runs the forward of microbatch ``i`` after stage ``s - 1``
    and its backward after stage ``s + 1``) and raises ``ValueError`` naming the first
    violation. ``str(schedule)`` prints the table, one row per stage.

    Attributes:
      name: a label (``'gpipe'``, ``'1f1b'``, or yours).
      num_stages: ``p``.
      num_microbatches: ``m``.
      table: ``T`` rows (time slots) of ``p`` cells.
    """

    name: str
    num_stages: int
    num_microbatches: int
    table: tuple[tuple[Action | None, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "table",
            tuple(
                tuple(None if c is None else Action(str(c[0]), int(c[1])) for c in row)
                for row in self.table
            ),
        )
        self._validate()

    # -- queries ---------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """``T``, the number of time slots."""
        return len(self.table)

    def times(self) -> dict[tuple[str, int, int], int]:
        """``{(kind, stage, microbatch): slot}`` for every action in the table."""
        out = {}
        for t, row in enumerate(self.table):
            for s, c in enumerate(row):
                if c is not None:
                    out[(c.kind, s, c.microbatch)] = t
        return out

    def idle_slots(self) -> int:
        """The number of idle cells (stage x slot) in the table."""
        return sum(c is None for row in self.table for c in row)

    def idle_fraction(self) -> float:
        """Idle cells over all cells; ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B."""
        return self.idle_slots() / (self.num_slots * self.num_stages)

    def in_flight(self) -> list[int]:
        """Per stage, the most microbatches forwarded but not yet backwarded at once
        (the stashed activations the stage holds): ``m`` for GPipe, ``p - s`` for 1F1B."""
        out = []
        for s in range(self.num_stages):
            live = peak = 0
            for row in self.table:
                c = row[s]
                if c is not None:
                    live += 1 if c.kind == "F" else -1
                    peak = max(peak, live)
            out.append(peak)
        return out

    def buffer_sizes(self) -> dict[str, int]:
        """Ring-buffer lengths the runtime allocates, indexed by ``microbatch % size``:
        ``'stash'`` (activations kept from a forward to its backward), ``'fwd_inbox'``
        and ``'bwd_inbox'`` (activations / cotangents received and not yet used; on the
        last stage, the cotangents of its own outputs)."""
        p, m, times = self.num_stages, self.num_microbatches, self.times()
        stash = [[(i, times["F", s, i], times["B", s, i]) for i in range(m)] for s in range(p)]
        fwd = [
            [(i, times["F", s - 1, i], times["F", s, i]) for i in range(m)] if s else []
            for s in range(p)
        ]
        # The last stage keeps its own output cotangents (from last_fn, computed in its
        # forward slot) in its backward inbox until its backward.
        bwd = [
            [(i, times[("F" if s == p - 1 else "B", min(s + 1, p - 1), i)], times["B", s, i])
             for i in range(m)]
            for s in range(p)
        ]  # fmt: skip
        return {
            "stash": _buffer_size(stash, m),
            "fwd_inbox": _buffer_size(fwd, m),
            "bwd_inbox": _buffer_size(bwd, m),
        }

    def as_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(kinds, microbatches)``, int32 arrays of shape ``(T, p)``; kinds are 0 idle,
        1 forward, 2 backward (idle cells have microbatch 0)."""
        kinds = np.zeros((self.num_slots, self.num_stages), np.int32)
        mbs = np.zeros_like(kinds)
        for t, row in enumerate(self.table):
            for s, c in enumerate(row):
                if c is not None:
                    kinds[t, s] = FORWARD if c.kind == "F" else BACKWARD
                    mbs[t, s] = c.microbatch
        return kinds, mbs

    def __str__(self) -> str:
        p, m = self.num_stages, self.num_microbatches
        width = max(3, len(f"B{m - 1}") + 1)
        head = (
            f"{self.name}: {p} stages x {m} microbatches, {self.num_slots} slots, "
            f"idle {self.idle_slots()}/{self.num_slots * p} = {self.idle_fraction():.1%}, "
            f"max in flight per stage {self.in_flight()}"
        )
        axis = "slot    " + "".join(f"{t:>{width}}" for t in range(self.num_slots))
        rows = [
            f"stage {s:<2}" + "".join(f"{str(r[s]) if r[s] else '.':>{width}}" for r in self.table)
            for s in range(p)
        ]
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
            for s, c in enumerate(row):
                if c is None:
                    continue
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


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B: warm-up forwards, then one forward / one backward, then the cool-down.

    Stage ``s`` runs its actions in the order ``F0 .. F(w-1)``, then ``F w, B0, F(w+1),
    B1, ...``, then the remaining backwards, with ``w = p - s - 1`` warm-up forwards; each
    action runs in the first slot after its inputs arrived (the previous stage's forward,
    the next stage's backward). So stage ``s`` holds at most ``p - s`` microbatches'
    activations, against ``m`` under GPipe, in the same ``2 (m + p - 1)`` slots.

    Args:
      num_stages: ``p >= 1``.
      num_microbatches: ``m >= p`` (with fewer microbatches the steady phase is empty;
        use `gpipe_schedule`).

    Returns:
      The validated `Schedule`.

    Raises:
      ValueError: ``m < p``.

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


def schedule_from(name: str | Schedule, num_stages: int, num_microbatches: int) -> Schedule:
    """`Schedule` by name (``'gpipe'``, ``'1f1b'``), or `name` itself after checking it
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
    if name not in makers:
        raise ValueError(f"unknown schedule {name!r}; use 'gpipe', '1f1b' or a Schedule.")
    return makers[name](num_stages, num_microbatches)
