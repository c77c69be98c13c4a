"""Schedule tables (interleaved 1F1B, ZB-H1, ZB-V, W actions, chunks) and the
`Schedule.program` arrays the runtime follows, in pure NumPy: closed forms for the slot
counts and idle fractions, independent counts of the in-flight stashes, every validation
error, and an interpreter that runs each program slot by slot on tagged buffers."""

import re

import numpy as np
import pytest

from blox.parallel import Action, Schedule, interleaved_schedule, zero_bubble_schedule
from blox.parallel._schedules import (
    BACKWARD,
    FORWARD,
    IDLE,
    WEIGHT,
    gpipe_schedule,
    one_f_one_b_schedule,
    schedule_from,
    zero_bubble_v_schedule,
)


def _cells(s):
    """``[(slot, lane, device, action)]`` read straight from the table."""
    out = []
    for t, row in enumerate(s.table):
        for d, c in enumerate(row):
            acts = () if c is None else (c,) if isinstance(c, Action) else c
            out += [(t, lane, d, a) for lane, a in enumerate(acts)]
    return out


def _vstage(s, d, c):
    """The virtual stage of chunk `c` on device `d`, from the placement's definition:
    ``'loop'``: c p + d; ``'v'``: chunk 0 runs down the devices, chunk 1 back up."""
    p = s.num_stages
    if s.placement == "v":
        return c * p + (p - 1 - d if c % 2 else d)
    return c * p + d


def _device(s, k):
    return next(d for d in range(s.num_stages) for c in range(s.virtual_stages)
                if _vstage(s, d, c) == k)  # fmt: skip


def _peak_in_flight(s, done):
    """Per device, the peak count of F's not yet matched by a `done` ('B' or 'W')."""
    live, peak = [0] * s.num_stages, [0] * s.num_stages
    for _, _, d, a in _cells(s):
        live[d] += (a.kind == "F") - (a.kind == done)
        peak[d] = max(peak[d], live[d])
    return peak


def _check_dependencies(s):
    """The dependency rules of the interface, checked on the cells themselves."""
    p, v, m = s.num_stages, s.virtual_stages, s.num_microbatches
    at = {(a.kind, _vstage(s, d, a.chunk), a.microbatch): (t, lane) for t, lane, d, a in _cells(s)}
    split = any(k[0] == "W" for k in at)
    assert len(at) == (3 if split else 2) * v * p * m
    for k in range(v * p):
        for i in range(m):
            if k:
                assert at["F", k - 1, i][0] < at["F", k, i][0]
            nxt = at["B", k + 1, i] if k < v * p - 1 else at["F", k, i]
            assert nxt[0] < at["B", k, i][0]
            if split:
                assert at["B", k, i] < at["W", k, i]


# -- closed forms -------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [4, 8, 16])
@pytest.mark.parametrize("v", [2, 4])
def test_interleaved_slots_idle_fraction_and_memory(m, v):
    """Megatron's interleaved 1F1B at p = 4: 2 (v m + p - 1) slots, idle fraction
    (p - 1) / (v m + p - 1) (counted from the idle cells), and at most
    (1 + (p - 1) / (v p)) x 1F1B's p stages' worth of stashes on any device (a chunk
    stash is 1 / v of a stage's)."""
    p = 4
    s = interleaved_schedule(p, m, v)
    _check_dependencies(s)
    assert s.name == "interleaved" and s.virtual_stages == v and s.lanes == 1
    assert s.num_slots == 2 * (v * m + p - 1)
    idle = sum(c is None for row in s.table for c in row) / (p * s.num_slots)
    assert idle == pytest.approx((p - 1) / (v * m + p - 1))
    assert s.idle_fraction() == pytest.approx((p - 1) / (v * m + p - 1))
    peak = _peak_in_flight(s, "B")
    assert s.in_flight() == peak
    # device d holds up to its warm-up forwards + 1 chunk stashes: 2 (p - d - 1) + (v - 1) p + 1
    assert peak == [min(2 * (p - d - 1) + (v - 1) * p + 1, v * m) for d in range(p)]
    assert max(peak) / v <= p * (1 + (p - 1) / (v * p)) + 1e-9
    # Megatron's order on every device: groups of p microbatches through chunk 0, 1, ...
    for d in range(p):
        fwd = [(a.microbatch, a.chunk) for _, _, dd, a in _cells(s) if dd == d and a.kind == "F"]
        assert fwd == [((k // (p * v)) * p + k % p, (k // p) % v) for k in range(v * m)]


def test_interleaved_in_flight_at_p4_m8_v2():
    assert _peak_in_flight(interleaved_schedule(4, 8, 2), "B") == [11, 9, 7, 5]
    assert _peak_in_flight(one_f_one_b_schedule(4, 8), "B") == [4, 3, 2, 1]


@pytest.mark.parametrize("p,m", [(4, 4), (4, 8), (4, 16), (2, 5), (3, 7)])
def test_zero_bubble_h1_slots_idle_and_memory(p, m):
    """ZB-H1: 3 m + p - 1 slots, idle fraction (p - 1) / (3 m + p - 1) at F = B = W = 1,
    every device keeps at most p microbatches from F to W (1F1B's peak, on device 0)."""
    s = zero_bubble_schedule(p, m)
    _check_dependencies(s)
    assert s.name == "zb-h1" and s.split_backward and s.lanes == 1
    assert s.num_slots == 3 * m + p - 1
    idle = sum(c is None for row in s.table for c in row) / (p * s.num_slots)
    assert idle == pytest.approx((p - 1) / (3 * m + p - 1))
    assert s.idle_fraction(1.0, 1.0, 1.0) == pytest.approx(idle)
    assert s.in_flight() == _peak_in_flight(s, "W") == [p] * p
    assert max(_peak_in_flight(one_f_one_b_schedule(p, m), "B")) == p


@pytest.mark.parametrize("m", [4, 8, 16])
def test_zero_bubble_idle_at_most_a_third_of_1f1b(m):
    """With B and W each half of a backward that costs two forwards (1F1B: B = 2), ZB-H1's
    bubble (idle time summed over the stages) is at most a third of 1F1B's. The idle
    fraction is too for m >= 8; at m = p it cannot be: even the textbook (unsynchronized)
    fractions are (p - 1) / (3 m + p - 1) = 0.2 against 1F1B's 0.429 / 3 = 0.143."""
    p = 4
    zb, ofob = zero_bubble_schedule(p, m), one_f_one_b_schedule(p, m)
    # 1F1B's slot-synchronous bubble, recounted: a slot lasts its longest cell
    cost = {"F": 1.0, "B": 2.0}
    span = sum(max(cost[c.kind] if c else 0.0 for c in row) for row in ofob.table)
    ofob_idle = p * span - p * m * 3.0
    assert ofob.idle_time(1.0, 2.0) == pytest.approx(ofob_idle)
    assert zb.idle_time(1.0, 1.0, 1.0) == pytest.approx(p * (p - 1))  # p (3m + p - 1) - 3 p m
    assert zb.idle_time(1.0, 1.0, 1.0) <= ofob_idle / 3
    if m >= 8:
        assert zb.idle_fraction(1.0, 1.0, 1.0) <= ofob.idle_fraction(1.0, 2.0) / 3


@pytest.mark.parametrize("p,m", [(4, 4), (4, 8), (4, 16), (2, 5), (3, 7), (1, 3)])
def test_zero_bubble_v_table(p, m):
    """ZB-V: two chunks per device in a V (device d runs model stages d and 2 p - 1 - d,
    device 0 the first and the last); every dependency holds; at most 2 p
    chunk-microbatches (p stages' worth, 1F1B's peak) from F to W on any device; with
    F = B = W its idle fraction is below ZB-H1's once m > p (equal at m = p = 4: the
    order is written for 2 p - 1 microbatches and the missing ones leave holes)."""
    s = zero_bubble_v_schedule(p, m)
    _check_dependencies(s)
    assert (s.name, s.virtual_stages, s.placement, s.split_backward) == ("zb-v", 2, "v", True)
    assert s.stacking_order == (*range(p), *range(2 * p - 1, p - 1, -1))
    for k in range(2 * p):
        d, c = s.device_of(k)
        assert _vstage(s, d, c) == k == s.virtual_stage(d, c)
    assert s.in_flight() == _peak_in_flight(s, "W")
    assert max(s.in_flight()) <= 2 * p
    if p > 1 and m >= p:
        zb = zero_bubble_schedule(p, m).idle_fraction(1.0, 1.0, 1.0)
        assert s.idle_fraction(1.0, 1.0, 1.0) <= zb
        if m > p:
            assert s.idle_fraction(1.0, 1.0, 1.0) < zb


def test_zero_bubble_v_order_and_errors():
    """Device 0 at p = 4, m = 8 runs torchtitan's order: 7 forwards on chunk 0, then F,
    B, W on chunk 1 (it holds the last model stage: its B follows its own F)."""
    s = zero_bubble_v_schedule(4, 8)
    first = [str(a) for row in s.table for a in s.actions(s.table.index(row), 0)][:13]
    assert first == ["F0", "F1", "F2", "F3", "F4", "F5", "F6", "F0.1", "B0.1", "W0.1",
                     "F1.1", "B1.1", "W1.1"]  # fmt: skip
    assert str(s).startswith("zb-v: 4 stages x 2 chunks (V) x 8 microbatches")
    # device 3's chunk 1 (model stage 4) in the slot of its chunk 0's F (model stage 3)
    table = _table(s)
    t3 = next(t for t, row in enumerate(table) if row[3] == Action("F", 0, 0))
    t4 = next(t for t, row in enumerate(table) if row[3] == Action("F", 0, 1))
    table[t3][3], table[t4][3] = (Action("F", 0, 0), Action("F", 0, 1)), None
    want = r"device 3 \(chunk 1, virtual stage 4\) runs F0.1 at slot \d+, not after device 3 "
    with pytest.raises(ValueError, match=want + r"\(chunk 0, virtual stage 3\)"):
        Schedule("mine", 4, 8, tuple(map(tuple, table)), 2, "v")
    with pytest.raises(ValueError, match=r"placement must be 'loop'.*or 'v'.*got 'w'"):
        Schedule("mine", 4, 8, s.table, 2, "w")
    with pytest.raises(ValueError, match=r"zero_bubble_v_schedule: num_microbatches must be"):
        zero_bubble_v_schedule(4, 0)


def test_idle_fraction_and_time_weigh_w():
    """ZB-H1 p = 2, m = 2 (slots: F0|., F1|F0, .|B0, B0|F1, W0|B1, B1|W0, W1|W1) with
    F = 1, B = 2, W = 3: slot lengths 1, 1, 2, 2, 3, 3, 3 (15), busy 2 (2 + 4 + 6) = 24."""
    s = zero_bubble_schedule(2, 2)
    kinds = [[c.kind if c else "." for c in row] for row in s.table]
    assert kinds == [["F", "."], ["F", "F"], [".", "B"], ["B", "F"], ["W", "B"], ["B", "W"],
                     ["W", "W"]]  # fmt: skip
    assert s.idle_fraction(1.0, 2.0, 3.0) == pytest.approx(1 - 24 / 30)
    assert s.idle_time(1.0, 2.0, 3.0) == pytest.approx(6.0)
    # W of 3 on device 0, 1 on device 1: slot lengths 1, 1, 2, 2, 3, 2, 3; busy 12 + 8
    assert s.idle_time(1.0, 2.0, [3.0, 1.0]) == pytest.approx(2 * 14 - 20)
    with pytest.raises(ValueError, match="weight has 3 entries.*one per stage"):
        s.idle_fraction(weight=[1.0, 1.0, 1.0])


def test_costs_per_virtual_stage():
    """Costs may be given per virtual stage (v p, model order): recounted from the cells,
    each slot as long as its busiest device."""
    s = interleaved_schedule(4, 8, 2)
    f, b = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5], [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    loads = {}
    for t, _, d, a in _cells(s):
        loads.setdefault(t, [0.0] * 4)[d] += (f if a.kind == "F" else b)[a.chunk * 4 + d]
    span = sum(max(x) for x in loads.values())
    busy = 8 * (sum(f) + sum(b))
    assert s.idle_time(f, b) == pytest.approx(4 * span - busy)
    assert s.idle_fraction(f, b) == pytest.approx(1 - busy / (4 * span))
    # one cost per device stands for all its chunks
    assert s.idle_time([1.0, 2.0, 3.0, 4.0], 2.0) == pytest.approx(
        s.idle_time([1.0, 2.0, 3.0, 4.0] * 2, 2.0)
    )
    with pytest.raises(ValueError, match=r"forward has 3 entries.*one per stage \(4\), or one "
                       r"per virtual stage \(8\)"):  # fmt: skip
        s.idle_fraction([1.0, 1.0, 1.0])


def test_printing_shows_chunks_idle_and_in_flight():
    s = interleaved_schedule(4, 8, 2)
    lines = str(s).splitlines()
    assert lines[0].startswith("interleaved: 4 stages x 2 chunks x 8 microbatches, 38 slots")
    assert "idle 24/152 = 15.8%" in lines[0] and "[11, 9, 7, 5]" in lines[0]
    for d in range(4):
        tokens = lines[2 + d].split()[2:]
        assert tokens == [f"{c.kind}{c.microbatch}.{c.chunk}" if c else "." for c in
                          (row[d] for row in s.table)]  # fmt: skip
    z = str(zero_bubble_schedule(4, 8)).splitlines()
    assert "max in flight (F to W) per stage [4, 4, 4, 4]" in z[0] and "idle 12/108" in z[0]
    assert z[2].split()[2:12] == ["F0", "F1", "F2", "F3", ".", ".", ".", "B0", "W0", "F4"]
    assert z[5].split()[2:9] == [".", ".", ".", "F0", "B0", "F1", "B1"]  # W0 after B3


# -- validation -----------------------------------------------------------------------------
def _table(s):
    return [list(row) for row in s.table]


def _rebuild(s, table):
    return Schedule("mine", s.num_stages, s.num_microbatches, tuple(map(tuple, table)),
                    s.virtual_stages)  # fmt: skip


def test_error_w_before_its_b():
    s = zero_bubble_schedule(2, 2)  # device 0: F0 F1 . B0 W0 B1 W1
    t = _table(s)
    t[2][0], t[4][0] = t[4][0], None  # W0 to slot 2, before B0 at slot 3
    with pytest.raises(ValueError, match=r"stage 0 runs W0 at slot 2 \(lane 0\), not after its "
                       r"B0 \(slot 3, lane 0\)"):  # fmt: skip
        _rebuild(s, t)
    # W in the same cell as its B but in an earlier lane
    t = _table(s)
    t[3][0], t[4][0] = (Action("W", 0), Action("B", 0)), None
    with pytest.raises(ValueError, match=r"runs W0 at slot 3 \(lane 0\), not after its B0 "
                       r"\(slot 3, lane 1\).*later lane"):  # fmt: skip
        _rebuild(s, t)
    # ... and in a later lane it is fine
    t[3][0] = (Action("B", 0), Action("W", 0))
    assert _rebuild(s, t).lanes == 2


def test_error_missing_or_stray_w():
    s = zero_bubble_schedule(2, 2)
    t = _table(s)
    t[6][1] = None  # stage 1's W1
    with pytest.raises(ValueError, match=r"stage 1 never runs W1; a table with W actions"):
        _rebuild(s, t)
    t = _table(one_f_one_b_schedule(2, 2))
    t.append([Action("W", 0), None])  # a W in a table where stage 1 has none
    with pytest.raises(ValueError, match=r"stage 0 never runs W1; a table with W actions"):
        _rebuild(s, t)


def _two_chunks(f1=2, b0=6):
    """p = 2, v = 2, m = 1, one action a slot: virtual stages 0..3 on devices 0, 1, 0, 1;
    device 0 runs F0.1 at slot `f1` (valid: 2) and device 1 runs B0.0 at `b0` (valid: 6)."""
    t = [[None, None] for _ in range(8)]
    t[0][0], t[1][1], t[f1][0], t[3][1] = (Action("F", 0, c) for c in (0, 0, 1, 1))
    t[4][1], t[5][0], t[b0][1], t[7][0] = (Action("B", 0, c) for c in (1, 1, 0, 0))
    return Schedule("mine", 2, 1, tuple(map(tuple, t)), 2)


def test_error_f_on_chunk_1_before_chunk_0_of_the_last_device():
    """Device 0's chunk 1 (virtual stage p) waits for device p - 1's chunk 0."""
    assert _two_chunks().times()["F", 2, 0] == 2
    with pytest.raises(ValueError, match=r"device 0 \(chunk 1, virtual stage 2\) runs F0\.1 at "
                       r"slot 1, not after device 1 \(chunk 0, virtual stage 1\) \(slot 1\) "
                       r"sends its activation"):  # fmt: skip
        _two_chunks(f1=1)


def test_error_b_before_the_next_stage_b_across_the_chunk_boundary():
    """Device p - 1's chunk 0 (virtual stage p - 1) waits for device 0's chunk 1."""
    with pytest.raises(ValueError, match=r"device 1 \(chunk 0, virtual stage 1\) runs B0\.0 "
                       r"at slot 5, not after device 0 \(chunk 1, virtual stage 2\) \(slot 5\) "
                       r"sends its cotangent"):  # fmt: skip
        _two_chunks(b0=5)


def test_error_chunks_and_counts():
    with pytest.raises(ValueError, match=r"slot 0, stage 0: .*chunk=1.* is not a cell of this "
                       r"table.*chunk in \[0, 1\).*virtual_stages > 1"):  # fmt: skip
        Schedule("mine", 1, 1, (((("F", 0, 1)),), (("B", 0, 1),)))
    with pytest.raises(ValueError, match=r"virtual_stages must be a positive int, got 0"):
        Schedule("mine", 1, 1, ((("F", 0),), (("B", 0),)), 0)
    # a v = 2 table that never runs chunk 1
    with pytest.raises(ValueError, match=r"device 0 \(chunk 1, virtual stage 1\) never runs F0\.1"):
        Schedule("mine", 1, 1, ((("F", 0),), (("B", 0),)), 2)
    t = _table(interleaved_schedule(2, 2, 2))
    assert t[4][0] is None and t[9][0] == Action("B", 1, 0)
    t[4][0] = Action("B", 1, 0)
    with pytest.raises(ValueError, match=r"B1\.0 runs twice on stage 0 \(slots 4 and 9\)"):
        Schedule("mine", 2, 2, tuple(map(tuple, t)), 2)


def test_builder_errors():
    with pytest.raises(ValueError, match=r"num_microbatches=6 must be a multiple of "
                       r"num_stages=4.*num_microbatches=8"):  # fmt: skip
        interleaved_schedule(4, 6, 2)
    with pytest.raises(ValueError, match=r"num_microbatches=2 must be a multiple of "
                       r"num_stages=4.*num_microbatches=4"):  # fmt: skip
        interleaved_schedule(4, 2, 2)
    with pytest.raises(ValueError, match=r"virtual_stages must be an int >= 2"):
        interleaved_schedule(4, 8, 0)
    with pytest.raises(ValueError, match=r"num_microbatches=3 < num_stages=4.*ZB-H1"):
        zero_bubble_schedule(4, 3)
    with pytest.raises(ValueError, match=r"virtual_stages must be an int >= 2.*got 1.*"
                       r"one_f_one_b_schedule"):  # fmt: skip
        interleaved_schedule(4, 8, 1)


def test_schedule_from_names_and_virtual_stages():
    assert schedule_from("interleaved", 4, 8, 2).virtual_stages == 2
    assert schedule_from("zb", 4, 8).name == schedule_from("zb-h1", 4, 8).name == "zb-h1"
    assert schedule_from("1f1b", 4, 8, 1).name == "1f1b"
    with pytest.raises(ValueError, match=r"'interleaved' needs virtual_stages >= 2.*got None"):
        schedule_from("interleaved", 4, 8)
    with pytest.raises(ValueError, match=r"virtual_stages=2 needs schedule='interleaved'"):
        schedule_from("zb", 4, 8, 2)
    s = interleaved_schedule(4, 8, 2)
    assert schedule_from(s, 4, 8) is s and schedule_from(s, 4, 8, 2) is s
    with pytest.raises(ValueError, match=r"x 2 virtual stages, but the pipeline has 4 stages "
                       r"x 8 microbatches x 4 virtual stages"):  # fmt: skip
        schedule_from(s, 4, 8, 4)
    assert schedule_from("zbv", 4, 8).name == schedule_from("zb-v", 4, 8, 2).name == "zb-v"
    with pytest.raises(ValueError, match=r"'zbv' \(ZB-V\) runs two stage chunks.*got "
                       r"virtual_stages=3"):  # fmt: skip
        schedule_from("zbv", 4, 8, 3)
    with pytest.raises(ValueError, match=r"unknown schedule 'zb-w'.*'interleaved'.*'zbv'"):
        schedule_from("zb-w", 4, 8)


# -- the program, run by an independent interpreter ---------------------------------------------
def _hand_written():
    """p = 2, m = 2, split backward with B and W sharing cells (two lanes)."""
    F, B, W = (lambda i, k=k: Action(k, i) for k in "FBW")
    rows = [
        (F(0), None),
        (F(1), F(0)),
        (None, (B(0), W(0))),
        (B(0), F(1)),
        (W(0), (B(1), W(1))),
        ((B(1), W(1)), None),
    ]
    return Schedule("hand", 2, 2, tuple(rows))


SCHEDULES = {
    "gpipe": lambda: gpipe_schedule(4, 8),
    "1f1b": lambda: one_f_one_b_schedule(4, 8),
    "1f1b-2f": lambda: one_f_one_b_schedule(4, 8, forwards_per_slot=2),
    "interleaved-v2": lambda: interleaved_schedule(4, 8, 2),
    "interleaved-v4": lambda: interleaved_schedule(4, 8, 4),
    "interleaved-p2": lambda: interleaved_schedule(2, 4, 3),
    "zb-h1": lambda: zero_bubble_schedule(4, 8),
    "zb-v": lambda: zero_bubble_v_schedule(4, 8),
    "zb-v-m3": lambda: zero_bubble_v_schedule(3, 4),
    "hand": _hand_written,
}


def _interpret(s):
    """Run `s.program()` slot by slot on per-device buffers of the stated sizes, filled
    with tags; every read must find the tag its action needs. Returns the peak number of
    live values per buffer (max over devices)."""
    prog, p, v = s.program(), s.num_stages, s.virtual_stages
    nv, split, T, L = v * p, s.split_backward, *prog.kind.shape[::2]
    names = ("stash", "inbox_f", "inbox_b", "kept")
    buf = {b: [[None] * prog.sizes[b] for _ in range(p)] for b in names}
    live = {b: [0] * p for b in names}
    peak = {b: 0 for b in names}

    def write(b, d, e, tag):
        assert 0 <= e < prog.sizes[b], (b, d, e)
        assert buf[b][d][e] is None, f"{b}[{d}][{e}] overwritten while live: {buf[b][d][e]}"
        buf[b][d][e] = tag
        live[b][d] += 1
        peak[b] = max(peak[b], live[b][d])

    def read(b, d, e, tag, last=True):
        assert 0 <= e < prog.sizes[b], (b, d, e)
        assert buf[b][d][e] == tag, f"{b}[{d}][{e}] holds {buf[b][d][e]}, needs {tag}"
        if last:
            buf[b][d][e] = None
            live[b][d] -= 1

    want = {(t, d, lane): a for t, lane, d, a in _cells(s)}
    for t in range(T):
        sends = []
        for lane in range(L):
            for d in range(p):
                at = (t, d, lane)
                a = want.get(at)
                kind = int(prog.kind[at])
                assert (
                    kind == {None: IDLE, "F": FORWARD, "B": BACKWARD, "W": WEIGHT}[a and a.kind]
                ), at
                if a is None:
                    continue
                assert (prog.microbatch[at], prog.chunk[at]) == (a.microbatch, a.chunk), at
                k, i = _vstage(s, d, a.chunk), a.microbatch
                if a.kind == "F":
                    if k:
                        read("inbox_f", d, prog.inbox_f[at], ("act", k, i))
                    write("stash", d, prog.stash[at], ("res", k, i))
                    if k < nv - 1:
                        dst = _device(s, k + 1)
                        sends.append(("inbox_f", dst, prog.send_f[at], ("act", k + 1, i)))
                    else:
                        sends.append(("inbox_b", d, prog.send_b[at], ("cot", k, i)))
                elif a.kind == "B":
                    read("stash", d, prog.stash[at], ("res", k, i), last=not split)
                    read("inbox_b", d, prog.inbox_b[at], ("cot", k, i))
                    if k:
                        dst = _device(s, k - 1)
                        sends.append(("inbox_b", dst, prog.send_b[at], ("cot", k - 1, i)))
                    if split:
                        write("kept", d, prog.kept[at], ("wg", k, i))
                else:
                    read("stash", d, prog.stash[at], ("res", k, i))
                    read("kept", d, prog.kept[at], ("wg", k, i))
        for b, d, e, tag in sends:  # at the end of the slot, after all lanes
            write(b, d, e, tag)
    assert all(x is None for b in names for dev in buf[b] for x in dev)
    return {b: max(1, n) for b, n in peak.items()}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_program_runs_on_buffers_of_its_sizes(name):
    s = SCHEDULES[name]()
    prog = s.program()
    assert all(a.dtype == np.int32 and a.shape == (s.num_slots, s.num_stages, s.lanes)
               for a in prog[:-1])  # fmt: skip
    # every entry holds the value its reader needs, and the sizes are the peak live counts
    assert _interpret(s) == prog.sizes


def test_program_sizes():
    """The stash holds what is in flight: all m for GPipe, p for 1F1B and ZB-H1 (whose
    entry lives until the W), 2 p chunk entries for ZB-V at m = 8; a table without W
    keeps nothing from B to W (one unused entry)."""
    assert gpipe_schedule(4, 8).program().sizes["stash"] == 8
    assert one_f_one_b_schedule(4, 8).program().sizes["stash"] == 4
    assert one_f_one_b_schedule(4, 8).program().sizes["kept"] == 1
    assert zero_bubble_schedule(4, 8).program().sizes["stash"] == 4
    assert zero_bubble_v_schedule(4, 8).program().sizes["stash"] == 8


def test_program_catches_overlapping_entries():
    """The interpreter is not vacuous: a program with two live stashes in one entry fails."""
    s = one_f_one_b_schedule(4, 8)
    prog = s.program()
    bad = prog._replace(stash=np.zeros_like(prog.stash))

    class Fake:
        def __getattr__(self, name):
            return getattr(s, name)

        def program(self):
            return bad

    with pytest.raises(AssertionError, match=re.escape("stash[0][0] overwritten while live")):
        _interpret(Fake())
