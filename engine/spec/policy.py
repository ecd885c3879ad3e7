"""The speculation policy: how many draft steps S' in 0..S the next decode iteration runs.

Speculation pays where verifying W = S'+1 tokens per request costs little more than decoding one (small
batches, a memory-bound step) and costs where the step is compute-bound (large batches, the CPU), so
no fixed depth is right for every batch. Before each iteration the policy picks the depth with the most
expected output tokens per second for the batch as it is: `bs · (1 + a_1 + … + a_S') / cost(bucket,
S')`, where a_j is the rate at which the j-th draft is accepted and cost is the measured wall time of
one iteration of that depth in the batch's size bucket (`size_bucket`).
- a_j is the product of conditional rates c_i = P(draft i accepted | draft i-1 accepted), i ≤ j, each
  an exponential average (about the last `1/acc_alpha` request-iterations that reached draft i) from
  the engine's own counts. Kept unconditional, a deep rate is measured only while the full depth runs
  and goes stale while a shallower one does (on the H200 a 5-step draft's a_4 stayed at the 0.14 of
  its first few iterations while a_3 rose to 0.68, and `auto` kept depth 3 where depth 5 made 4 % more);
  conditional, it moves with the shallow rates it is built on. A rate the running depth does not
  reach follows its long-run average (a tenth of the rate), not the value it had when the policy
  left the deeper depth, which was a low (that is when it leaves). A drafting depth whose rates rest on
  fewer than `min_evidence` request-iterations runs until they do, the deepest first, but only where
  it could win were those thin rates 1: on a CPU, where depth 5 costs twice depth 3, measuring a_4
  and a_5 buys nothing.
- cost is the median of a depth's last `window` samples in the bucket, so one iteration that met a
  stall (a page allocation, another process) does not move it, and never more than what the engine's
  warm-up timed there (`reset(keep_costs=True)` keeps those as a ceiling): a served iteration's clock
  also holds what arrivals cost the step around it, and a depth timed only in short looks under other
  traffic than the running one is not comparable to it (on the H200 at 32-64 requests that put depth 3
  of a 5-step draft above depth 5, 3.0-3.4 ms against 2.3-2.6).
- The ceiling alone would hide a host that slows under load: on one H200 host depth 5 of the 5-step
  draft at 64 requests cost 3.7-6.1 ms at the median served (6.2 ms on average) against 1.5-1.6 at
  warm-up, while a plain step barely moved, and speculation made 0.71-0.92x target-only with `auto`
  at depth 5 throughout. So where the drafting depth running in a bucket costs more than `slack` over
  its warm-up timing in most of a window and its served rate is below `1 + slack` times what depth 0
  makes at its warm-up cost, depth 0 is timed under the same traffic for `probe` iterations
  (`_plain_unserved`), and from then on the bucket's drafting depths are discounted by
  what their served rates show against depth 0's (`served_discount`: the window's mean with each
  sample cut to 4x the median, `_clipped_mean`, since a tail that many iterations share is what
  tokens a second pay). The discount scales every drafting depth alike: the order among them stays the
  warm-up's (served costs of depths timed at different moments put depth 3 above 5 on the CPU too).
Depth 0 is a plain decode step (whole-iteration graph
included), so the policy can never do worse than target-only by more than what it spends measuring:
a bucket's depths are each tried `min_samples` times before the policy trusts them (the full depth
first, which measures every a_j), the runner-up is tried again every `explore_every` iterations of a
bucket for `probe` iterations in a row (costs and acceptance drift with the traffic; a deeper one only
while its catch-up costs no more than `margin` of the time between such tries), and a new best depth
must beat the current one by `margin`, and a deeper one also by what its catch-up costs spread over `horizon` iterations (a
switch up makes the draft layers that fell behind catch up, see `SpecWorker`; its measured time is
fed back through `observe_catch_up`); after a switch a bucket keeps its depth for `dwell` iterations.
The same charge holds when the batch moves into a bucket whose own choice is deeper than the depth
running: the catch-up is the same whichever bucket asks for it.
A drafting depth is also charged the draft layers' pass over the prompts that arrive meanwhile: the
measured host time of a prefill step's draft prefill, times how many such steps come per output token
(requests end after so many tokens, whatever the depth), times the tokens an iteration of that depth
makes. Counted per iteration instead, the charge was measured mostly at depth 0, where an iteration
makes a third of the tokens, so a deep iteration that meets three times the arrivals was charged for
one (results/BENCH_POLICY.md, "The CPU at concurrency 4").
Under a heavy arrival rate the pass costs more than drafting saves, so the batch decodes plainly and
its prefills put the draft prefill off (a later catch-up does it, if drafting pays again).
`auto` chooses between depth 0 and S (`choices`) unless the engine's `spec_depths` (or, where the
engine names none, the draft's own `auto_depths`) adds depths in between: such a depth leaves the
layers past it behind, so every return to S pays a catch-up, and with
a 3-step draft it never beat both ends on the machines measured (results/BENCH_POLICY.md); a deeper
draft whose last steps pay only at small batches is where one helps. The worker runs any depth
(`cycle` exercises them all).

Modes: `auto` (the above), `always` (depth S, the fixed behaviour), `off` (depth 0, the draft never
runs; its layers are not even prefilled), and `cycle` (0, 1, …, S, 0, … one per iteration: for tests
that prove exactness through every switch). A constrained batch runs depth S in every mode but `off`
and `auto`; `auto` costs constrained batches apart (negative buckets, their own acceptance rates) and
chooses for them too: a greedy constrained iteration replays grammar-masked graphs at depth 0 and at S
(at S a chain of them, the host filling each draft step's masks between; `spec/masked_chain.py`), and
the two cost what they measure.

Under tensor parallelism every rank must pick the same depth, so a rank's own timings are not used:
rank 0's are queued (`take_published`) and reach every rank, rank 0 included, through the engine's
control channel (`apply_published`) between steps. The acceptance counts are equal on every rank.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

MODES: tuple[str, ...] = ("auto", "always", "off", "cycle")
# The depth field of a timing that is not an iteration's (a published timing is (bucket, depth, s)).
CATCH_UP, FILL = -1, -2


@dataclass(frozen=True)
class Decision:
    """One iteration's depth, why, and the predicted gain: expected tokens/s at this depth over depth
    0's (1.0: equal; 0.0: no prediction, e.g. a fixed mode or a measurement)."""

    depth: int
    reason: str
    predicted_gain: float = 0.0


def _median(q: deque[float]) -> float:
    """`statistics.median` at a fraction of its host time (it runs once an iteration)."""
    v = sorted(q)
    m = len(v) // 2
    return v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2


def _clipped_mean(q: deque[float], clip: float = 4.0) -> float:
    """The mean of `q` with each sample cut to `clip` times the median: one stall (a page allocation,
    another process) moves it by at most that, while a tail that many iterations share counts, as it
    does for the tokens a second (`served_discount`). A median alone hid one: on an H200 host whose
    depth-5 iterations at 64 requests took 3.7 ms at the median but 6.2 ms on average, depth 5 would
    have looked about 1.2x better than depth 0 where it made 0.89x target-only."""
    cap = clip * _median(q)
    return sum(min(x, cap) for x in q) / len(q)


def size_bucket(bs: int) -> int:
    """The batch sizes whose iterations are costed together: 1, 2, 4, then steps of about 1.5x (6, 8,
    12, 16, 24, 32, 48, ...). Every bucket is measured at each depth before it is trusted, and
    measuring depth 0 costs a catch-up on the way back, so buckets are few; sizes in one bucket cost
    about the same per iteration (a CUDA graph's padded size, a CPU step's rows within a third)."""
    b = 1
    while b < bs:
        b = b * 2 if b < 4 else b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3
    return b


@dataclass
class PolicyStats:
    """What the policy did, for state events, metrics and benchmarks."""

    iterations_by_depth: list[int] = field(default_factory=list)
    # The same per size bucket ("4" or, constrained, "-4"): which depth each batch size really ran.
    iterations_by_bucket: dict[str, list[int]] = field(default_factory=dict)
    tokens_gained: int = 0  # accepted drafts: tokens beyond one per request-iteration
    explore_iterations: int = 0
    # The same by why they explored (the reason after "explore: "): a look at the runner-up, a depth
    # not measured yet, the served check's look at depth 0 ...
    explore_by_reason: dict[str, int] = field(default_factory=dict)
    switches: int = 0
    catch_ups: int = 0
    catch_up_positions: int = 0
    catch_up_s: float = 0.0
    catch_up_max_s: float = 0.0
    fills: int = 0  # prefill steps whose draft prefill ran (not put off), their host time, the longest
    fill_s: float = 0.0
    fill_max_s: float = 0.0
    choose_s: float = 0.0  # host time spent choosing
    choose_calls: int = 0
    # Per depth: request-iterations, the output tokens they made, and the wall time of the iterations
    # that were timed (and how many): what each depth really made a second, against what it was chosen on.
    rows_by_depth: list[int] = field(default_factory=list)
    tokens_by_depth: list[int] = field(default_factory=list)
    seconds_by_depth: list[float] = field(default_factory=list)
    timed_by_depth: list[int] = field(default_factory=list)


class SpecPolicy:
    def __init__(self, mode: str, steps: int, *, explore_every: int = 256, acc_alpha: float = 0.01,
                 margin: float = 0.03, min_samples: int = 3, window: int = 9, horizon: int = 64,
                 dwell: int = 16, choices: list[int] | None = None, publish: bool = False,
                 min_evidence: int = 16, probe: int = 8, slack: float = 0.25):
        if mode not in MODES:
            raise ValueError(f"spec policy {mode!r}: choose one of {', '.join(MODES)}")
        self.mode, self.steps = mode, steps
        self.explore_every, self.acc_alpha, self.margin = explore_every, acc_alpha, margin
        self.min_samples, self.window, self.horizon, self.dwell = min_samples, window, horizon, dwell
        self.min_evidence, self.probe, self.slack = min_evidence, probe, slack
        # bucket -> (the depth looked at, iterations left, why): a look goes on for `probe` iterations
        self._probing: dict[int, tuple[int, int, str]] = {}
        # The depths `auto` chooses from: none and all by default (each depth in between would make the
        # layers past it fall behind and catch up on every switch; `cycle` runs every depth).
        self.choices = sorted(set(choices)) if choices is not None else sorted({0, steps})
        self._first = sorted(self.choices, key=lambda d: (d != steps, d))  # the order depths are timed in
        self._drafting = sorted((d for d in self.choices if d), reverse=True)
        self._since: Counter[int] = Counter()  # bucket -> visits since its last switch
        self.publish = publish  # tensor parallelism: timings travel through the control channel
        self.cost: dict[tuple[int, int], float] = {}  # (bucket, depth) -> seconds per iteration
        self.primed: dict[tuple[int, int], float] = {}  # what the warm-up timed: a ceiling on `cost`
        self.samples: Counter[tuple[int, int]] = Counter()
        # Timings taken under traffic (not while priming), and the buckets where drafting cost more than
        # `slack` over its warm-up timing (`_plain_unserved`): there served rates may discount drafting.
        self.served: Counter[tuple[int, int]] = Counter()
        self.slow: set[int] = set()
        self._recent: dict[tuple[int, int], deque[float]] = {}
        self.catch_up_cost = 0.0  # seconds per catch-up (rolling), charged to a switch up
        # Drafting also costs the draft layers' pass over every prompt (a draft prefill, or the catch-up
        # that does it later): seconds per prefill step that completes a prompt (rolling), times such
        # steps per output token (the arrival load, counted at every depth: rolling sums of both over
        # about the last 50 iterations).
        self.fill_cost = 0.0
        self._fill_sum = 0.0
        self._token_sum = 0.0
        self._fills = 0
        self.acc = [0.0] * steps  # a_j: the rate at which draft j+1 is accepted (the product of `cond`)
        self.cond = [0.0] * steps  # c_j: the rate at which draft j+1 is accepted once draft j was
        self.acc_seen = [0] * steps  # request-iterations behind each c_j (those that reached draft j+1)
        # The same for constrained batches, which are costed apart too (their buckets are negative):
        # grammars raise acceptance and change what an iteration costs at either depth.
        self.acc_c = [0.0] * steps
        self.cond_c = [0.0] * steps
        # The long-run c_j (a tenth of `acc_alpha`): what a rate the running depth does not measure
        # falls back to (see `observe`).
        self.cond_slow = [0.0] * steps
        self.cond_c_slow = [0.0] * steps
        self.acc_c_seen = [0] * steps
        # Request-iterations run at each depth (plain, constrained): the evidence behind `_thin`.
        self.ran = [[0] * (steps + 1) for _ in range(2)]
        self.current: dict[int, int] = {}  # bucket -> the depth it runs now
        self.visits: Counter[int] = Counter()
        n = steps + 1
        self.stats = PolicyStats(iterations_by_depth=[0] * n, rows_by_depth=[0] * n, tokens_by_depth=[0] * n,
                                 seconds_by_depth=[0.0] * n, timed_by_depth=[0] * n)
        self.last = Decision(steps if mode != "off" else 0, mode)
        self._cycle = 0
        self.warming = False  # the engine's warm-up: `auto` alternates its choices (see `Engine.warm_up`)
        # The engine's timing of each bucket's depths before traffic (`Engine._prime_policy`): `window`
        # samples each, not `min_samples`, since those timings then cap what served iterations measure
        # (`cost_of`) and decide alone wherever arrivals make every served iteration dearer: on the H200 a
        # median of 3 put depth 5 at 1.23x depth 3 in the bucket of 32 at one start, 1.12x at another.
        self.priming = False
        self._unpublished: list[tuple[int, int, float]] = []
        # The last finished iteration's measured gain: its tokens per second over depth 0's measured
        # rate in its bucket (0.0 until depth 0 has been measured there).
        self.measured_gain = 0.0

    # --- choosing ------------------------------------------------------------------------------
    def tokens(self, depth: int, constrained: bool = False) -> float:
        """Expected tokens per request from one iteration of `depth`: 1 + a_1 + … + a_depth."""
        return 1.0 + sum((self.acc_c if constrained else self.acc)[:depth])

    @property
    def fills_per_token(self) -> float:
        """Prefill steps that complete prompts, per output token (rolling)."""
        return self._fill_sum / self._token_sum if self._token_sum > 0 else 0.0

    def rate(self, b: int, depth: int, bs: int) -> float:
        """Expected tokens per second of depth `depth` in bucket `b` (per request of the bucket; a
        negative bucket is constrained batches') for a batch of `bs`: a drafting depth also pays the
        draft layers' pass over the prompts that arrive while it makes its tokens."""
        return self._per_second(b, depth, bs, self.tokens(depth, b < 0))

    def _per_second(self, b: int, depth: int, bs: int, t: float, cost: float | None = None) -> float:
        """`rate` for `t` expected tokens per request an iteration (at `cost` seconds an iteration, where
        given, instead of `cost_of`)."""
        extra = self.fill_cost * self.fills_per_token * bs * t if depth else 0.0
        return t / ((self.cost_of(b, depth) if cost is None else cost) + extra)

    def _served_rate(self, b: int, depth: int, bs: int) -> float:
        """`rate` at what served iterations measured, uncapped, as the window's clipped mean."""
        return self._per_second(b, depth, bs, self.tokens(depth, b < 0), _clipped_mean(self._recent[(b, depth)]))

    def cost_of(self, b: int, depth: int) -> float:
        """Seconds per iteration of `depth` in bucket `b`: the served median, at most the warm-up's."""
        c = self.cost[(b, depth)]
        p = self.primed.get((b, depth))
        return min(c, p) if p else c

    def _plain_unserved(self, b: int, bs: int) -> bool:
        """Should depth 0 be timed under traffic now? Where the drafting depth bucket `b` runs has cost
        more than `slack` over its warm-up timing in most of a window of served iterations, depth 0
        has not been timed served there yet, it is a choice (it needs no catch-up to run), and it
        could win: drafting's served rate (the clipped mean, with the draft prefill charge) is below
        what depth 0 makes at its warm-up cost with `slack` to spare. A plain step costs at least that
        under traffic too, so where drafting makes more, the look would only cost (at 32-64 requests on
        the H200 every bucket's served costs exceed the warm-up's by that much)."""
        cur = self.current.get(b, 0)
        if not cur or 0 not in self.choices or self.served[(b, 0)] >= self.probe:
            return False
        p = self.primed.get((b, cur))
        if p is None or self.served[(b, cur)] < self.window:
            return False
        if _median(self._recent[(b, cur)]) <= p * (1 + self.slack):  # most of the window, not a stall
            return False
        return self._served_rate(b, cur, bs) < (1 + self.slack) / self.primed.get((b, 0), self.cost[(b, 0)])

    def served_discounts(self) -> dict[str, float]:
        """Per bucket where drafting cost more served than at warm-up (`_plain_unserved`), the discount
        served rates put on drafting there (`served_discount`: 1.0 where they confirm the prediction)."""
        return {str(b): round(self.served_discount(b, abs(b), {d: self.rate(b, d, abs(b)) for d in self.choices}), 3)
                for b in sorted(self.slow) if all((b, d) in self.cost for d in self.choices)}

    def served_discount(self, b: int, bs: int, rates: dict[int, float]) -> float:
        """What drafting really gains over plain steps under traffic, as a share of what the capped
        costs predict (1.0 where it gains at least that, or where nothing says otherwise): in a bucket
        flagged slow (`_plain_unserved` looked at depth 0 there) with depth 0 and a drafting depth
        each timed `probe` times served, their served rates (the clipped means, uncapped, with the
        draft prefill charge) against the capped ones. Every drafting depth is scaled by it alike, so
        the order among them stays the warm-up's and only drafting against not drafting moves."""
        if b not in self.slow or self.served[(b, 0)] < self.probe:
            return 1.0
        d = max((d for d in self._drafting if self.served[(b, d)] >= self.probe), key=lambda d: self.served[(b, d)],
                default=0)
        if not d or not rates.get(0) or not rates.get(d):
            return 1.0
        return min(1.0, self._served_rate(b, d, bs) / self._served_rate(b, 0, bs) / (rates[d] / rates[0]))

    @staticmethod
    def key(bs: int, constrained: bool) -> int:
        """The bucket a batch is costed in: `size_bucket`, negated for constrained batches."""
        b = size_bucket(bs)
        return -b if constrained else b

    def choose(self, bs: int, constrained: bool = False) -> Decision:
        t0 = time.perf_counter()
        d = self._choose(bs, constrained)
        self.stats.choose_s += time.perf_counter() - t0
        self.stats.choose_calls += 1
        if d.depth != self.last.depth:
            self.stats.switches += 1
        if d.reason.startswith("explore: "):
            self.stats.explore_iterations += 1
            why = d.reason.removeprefix("explore: ")
            self.stats.explore_by_reason[why] = self.stats.explore_by_reason.get(why, 0) + 1
        self.last = d
        return d

    def _choose(self, bs: int, constrained: bool) -> Decision:
        s = self.steps
        if self.mode == "off":
            return Decision(0, "off")
        if constrained and self.mode != "auto":
            return Decision(s, "constrained")
        if self.mode == "always":
            return Decision(s, "always")
        if self.mode == "cycle":
            self._cycle += 1
            return Decision((self._cycle - 1) % (s + 1), "cycle")
        if self.warming:  # meet every depth `auto` may choose, and the catch-ups between them
            self._cycle += 1
            return Decision(self.choices[(self._cycle - 1) % len(self.choices)], "warm-up")
        b = self.key(bs, constrained)
        self.visits[b] += 1
        self._since[b] += 1
        for d in self._first:  # the deepest first: it measures every acceptance rate
            if self.samples[(b, d)] < self.needed:
                return Decision(d, "explore: not measured yet")
        # Timed but never seen accepting (the warm-up timed this bucket on its own prompts and forgot
        # their acceptance): with every a_j at 0 a drafting depth would look like one token an
        # iteration, and depth 0 would win without ever measuring what drafting makes.
        rates = {d: self.rate(b, d, bs) for d in self.choices}
        x = self._to_measure(b, bs, rates)
        if x is not None:
            return Decision(x, "explore: acceptance not measured yet")
        probing = self._probing.pop(b, None)
        if probing is None and self._plain_unserved(b, bs):
            # Drafting costs more under traffic than at warm-up: time depth 0 under the same traffic
            # (`probe` iterations), so that the two compare on served costs from now on.
            self.slow.add(b)
            why = "explore: drafting costs more served than at warm-up"
            self._probing[b] = (0, self.probe - 1, why)
            return Decision(0, why, 1.0)
        f = self.served_discount(b, bs, rates)
        if f < 1.0:
            rates = {d: r * f if d else r for d, r in rates.items()}
        if probing is not None and probing[1] > 0:  # a look goes on for `probe` iterations
            d, left, why = probing
            self._probing[b] = (d, left - 1, why)
            return Decision(d, why, rates[d] / rates[0] if 0 in rates else 0.0)
        best = max(rates, key=lambda d: rates[d])
        cur = self.current.get(b, best)
        # A switch within the bucket needs a clear gain, and none within `dwell` visits of the last:
        # noise must not flip it each step.
        if best != cur and (rates[best] < rates[cur] * (1 + self.margin) or self._since[b] < self.dwell):
            best = cur
        # Deeper than the draft layers are current to (the depth running now, whichever bucket chose
        # it: a batch whose size crosses buckets must not flip depth with them) pays a catch-up first:
        # worth it only if it saves more over `horizon` iterations than the catch-up costs.
        live = self.last.depth if self.last.depth in rates else cur
        up = self.catch_up_cost / (self.horizon * self.cost_of(b, best))  # the catch-up, per iteration
        if best > live and rates[best] < rates[live] * (1 + self.margin + up):
            best = live
        reason = "best" if best == cur else "switch"
        if best != cur:
            self._since[b] = 0
        self.current[b] = best
        second = max((d for d in rates if d != best), key=lambda d: rates[d])
        # Costs and acceptance drift with the traffic: now and then try the runner-up again, where it
        # is close enough to overtake (a distant one would not, and a switch back costs a catch-up).
        # A look deeper than the layers are current pays a whole catch-up for one iteration: only where
        # that is within the margin of the time between looks (on the H200 a served catch-up took 22-32 ms
        # on average, 8-17 iterations of a batch of 32).
        look = second <= live or self.catch_up_cost <= self.margin * self.explore_every * self.cost_of(b, best)
        if look and self.visits[b] % self.explore_every == 0 and rates[second] * 1.25 > rates[best]:
            # `probe` iterations in a row: a deeper look pays its catch-up once for all of them, and its
            # last drafts' rates get more than the one request-iteration a batch of 1 gives per look.
            self._probing[b] = (second, self.probe - 1, "explore: runner-up")
            return Decision(second, "explore: runner-up", rates[second] / rates[0] if 0 in rates else 0.0)
        return Decision(best, reason, rates[best] / rates[0] if 0 in rates else 0.0)

    def _to_measure(self, b: int, bs: int, rates: dict[int, float]) -> int | None:
        """The drafting depth to run because its acceptance is too thinly measured to choose by, if
        any: the deepest whose rates are thin (`_thin`) and that could beat every other choice in
        bucket `b` were each conditional rate resting on fewer than `min_evidence` request-iterations
        1. Where it could not, measuring buys nothing: on a 2-core CPU a 5-step draft's depth 5 costs
        about twice its depth 3 at a batch of 1, so even with every draft accepted it makes fewer
        tokens a second, and the 64 iterations it had run to measure a_4 and a_5 cost about 9 % of a
        16-request run."""
        con = b < 0
        cond, seen = (self.cond_c, self.acc_c_seen) if con else (self.cond, self.acc_seen)
        for d in self._drafting:  # the deepest first: it measures the most
            if not self._thin(d, con):
                continue
            others = max((v for e, v in rates.items() if e != d), default=0.0)
            t, r = 1.0, 1.0
            for j in range(d):
                r *= cond[j] if seen[j] >= self.min_evidence else 1.0
                t += r
            if self._per_second(b, d, bs, t) > others:
                return d
        return None

    def _thin(self, depth: int, constrained: bool) -> bool:
        """Is the acceptance up to draft `depth` too thinly measured to choose by? Until `min_samples`
        request-iterations have run at least that deep, and `min_evidence` have reached draft `depth`,
        or four times as many have run that deep (a draft whose deep steps are rarely reached has
        shown that well enough)."""
        ran = sum(self.ran[int(constrained)][depth:])
        seen = (self.acc_c_seen if constrained else self.acc_seen)[depth - 1]
        return ran < self.min_samples or (seen < self.min_evidence and ran < 4 * self.min_evidence)

    # --- learning ------------------------------------------------------------------------------
    def note_fill(self) -> None:
        """A prefill step completed prompts (their draft prefill ran now or was put off)."""
        self._fills += 1

    def observe_fill(self, seconds: float) -> None:
        """The host time of one prefill step's draft prefill."""
        st = self.stats
        st.fills += 1
        st.fill_s += seconds
        st.fill_max_s = max(st.fill_max_s, seconds)
        self._report(0, FILL, seconds)

    def plain_now(self) -> bool:
        """Does the batch decode without drafts now (the last choice was depth 0 on its merits, not a
        measurement)? A prefill then puts its draft prefill off."""
        return self.last.depth == 0 and not self.last.reason.startswith("explore")

    def observe(self, bs: int, depth: int, accepted: list[int], seconds: float | None,
                constrained: bool = False) -> None:
        """One finished iteration: its depth, each request's accepted drafts, its wall time (None where
        it was not measurable: after a prefill or a catch-up, the interval holds them too), and whether
        the batch was constrained."""
        b = self.key(bs, constrained)
        self.stats.iterations_by_depth[depth] += 1
        self.stats.iterations_by_bucket.setdefault(str(b), [0] * (self.steps + 1))[depth] += 1
        gained = sum(accepted)
        self.stats.tokens_gained += gained
        rows = len(accepted) if accepted else bs  # request-iterations that made tokens
        made = gained + rows  # this iteration's output tokens
        st = self.stats
        st.rows_by_depth[depth] += rows
        st.tokens_by_depth[depth] += made
        if seconds:
            st.seconds_by_depth[depth] += seconds
            st.timed_by_depth[depth] += 1
        self._fill_sum = 0.98 * self._fill_sum + 0.02 * self._fills  # about the last 50 iterations
        self._token_sum = 0.98 * self._token_sum + 0.02 * made
        self._fills = 0
        base = self.cost.get((b, 0))
        if seconds and base and (accepted or not depth):
            self.measured_gain = (1 + gained / max(len(accepted), 1)) * base / seconds
        if accepted:
            self.ran[int(constrained)][depth] += len(accepted)
        if accepted and depth:
            acc, cond, slow, seen = (self.acc_c, self.cond_c, self.cond_c_slow, self.acc_c_seen) if constrained \
                else (self.acc, self.cond, self.cond_slow, self.acc_seen)
            reach = [0] * (depth + 2)  # reach[j]: the request-iterations that reached draft j+1
            for a in accepted:
                reach[a] += 1
            for j in range(depth - 1, -1, -1):
                reach[j] += reach[j + 1]
            for j in range(depth):
                n = reach[j]
                if not n:
                    break
                x = reach[j + 1] / n
                # The plain mean until there are about 1/alpha observations, then the rolling average
                # (n request-iterations of evidence, exponentially).
                w = max(n / (seen[j] + n), 1 - (1 - self.acc_alpha) ** n)
                cond[j] += w * (x - cond[j])
                w = max(n / (seen[j] + n), 1 - (1 - self.acc_alpha / 10) ** n)
                slow[j] += w * (x - slow[j])
                seen[j] += n
            # A rate this depth does not measure follows its long-run value: frozen, it would keep the
            # dip that made the policy leave the deeper depth (acceptance comes in bursts, and a switch
            # down happens at a low), so the way back up would wait on probes. (It did not change how
            # often a 5-step draft ran depth 3 at a batch of 1 on the H200, 45-49 % of iterations:
            # results/gpu/round12.)
            cond[depth:] = slow[depth:]
            r = 1.0
            for j, c in enumerate(cond):
                r *= c
                acc[j] = r
        if seconds is not None and seconds > 0:
            self._report(b, depth, seconds)

    def observe_catch_up(self, seconds: float) -> None:
        """One catch-up's wall time."""
        self.stats.catch_up_max_s = max(self.stats.catch_up_max_s, seconds)
        self._report(0, CATCH_UP, seconds)

    def _report(self, b: int, depth: int, seconds: float) -> None:
        """A timing: applied here, or under tensor parallelism queued for rank 0 to publish to all."""
        if self.publish:
            self._unpublished.append((b, depth, seconds))
        else:
            self._time(b, depth, seconds)

    def _time(self, b: int, depth: int, seconds: float) -> None:
        if depth == CATCH_UP:
            self.catch_up_cost = seconds if not self.catch_up_cost else 0.8 * self.catch_up_cost + 0.2 * seconds
            return
        if depth == FILL:
            self.fill_cost = seconds if not self.fill_cost else 0.8 * self.fill_cost + 0.2 * seconds
            return
        key = (b, depth)
        q = self._recent.setdefault(key, deque(maxlen=self.window))
        q.append(seconds)
        self.cost[key] = _median(q)
        self.samples[key] += 1
        if not self.priming:
            self.served[key] += 1

    def take_published(self) -> list[tuple[int, int, float]]:
        """Rank 0: the timings measured since the last call, for every rank's `apply_published`."""
        out, self._unpublished = self._unpublished, []
        return out

    def apply_published(self, timings: list[tuple[int, int, float]]) -> None:
        for b, d, sec in timings:
            self._time(int(b), int(d), float(sec))

    def reset(self, keep_costs: bool = False) -> None:
        """Forget everything learned (the engine's warm-up runs prompts that are not the traffic), or
        everything but the timings (`keep_costs`: what an iteration of each depth costs in each bucket,
        a catch-up and a draft fill cost the same whatever the prompts)."""
        kept = (self.cost, self.samples, self._recent, self.catch_up_cost, self.fill_cost)
        primed = {**self.primed, **self.cost}
        self.__init__(self.mode, self.steps, explore_every=self.explore_every,  # type: ignore[misc]
                      acc_alpha=self.acc_alpha, margin=self.margin, min_samples=self.min_samples,
                      window=self.window, horizon=self.horizon, dwell=self.dwell, choices=self.choices,
                      publish=self.publish, min_evidence=self.min_evidence, probe=self.probe,
                      slack=self.slack)
        if keep_costs:
            self.cost, self.samples, self._recent, self.catch_up_cost, self.fill_cost = kept
            self.primed = primed  # the warm-up's timings: a ceiling on what served iterations measure

    @property
    def needed(self) -> int:
        """Timings of a (bucket, depth) before the policy trusts it: `window` while priming."""
        return self.window if self.priming else self.min_samples

    def timed(self, b: int) -> bool:
        """Every depth `auto` chooses from has been timed in bucket `b` as often as it needs."""
        return all(self.samples[(b, d)] >= self.needed for d in self.choices)

    def snapshot(self) -> dict[str, object]:
        """Host values for events and `/debug`: the mode, the last decision, the rates and costs."""
        return {
            "mode": self.mode, "choices": list(self.choices), "depth": self.last.depth, "reason": self.last.reason,
            "predicted_gain": self.last.predicted_gain, "measured_gain": self.measured_gain,
            "acceptance": list(self.acc), "acceptance_seen": list(self.acc_seen),
            "acceptance_constrained": list(self.acc_c), "catch_up_cost_ms": round(self.catch_up_cost * 1e3, 3),
            "fill_cost_ms": round(self.fill_cost * 1e3, 3), "fills_per_token": round(self.fills_per_token, 5),
            "cost_ms": {f"{b}:{d}": round(c * 1e3, 3) for (b, d), c in sorted(self.cost.items())},
            "primed_ms": {f"{b}:{d}": round(c * 1e3, 3) for (b, d), c in sorted(self.primed.items())},
            "served_discount": self.served_discounts(),
            **{k: v for k, v in vars(self.stats).items()},
        }
